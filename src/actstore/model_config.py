"""A local HF model's config.json: where the folder is, what kind of model, its sizes. No torch: the
workflow's parse (common.smk, resources.py) and the writer jobs read these, and importing torch
costs each of them ~2 s and ~150 MB (on Slurm every job parses the workflow again); only a sub-model's
config saved without its class's default sizes imports transformers (_fill_class_defaults)."""
from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

from actstore.errors import ConfigError
from actstore.integrity import whole_number
from actstore.model_identity import WEIGHTS_KEY, inside_folder, read_model_json

PACKAGE_PREFIX = "package:"
VISION_TYPES = ("dinov2", "dinov2_with_registers", "dinov3_vit", "clip", "clip_vision_model", "metaclip_2", "siglip",
                "siglip_vision_model", "aimv2", "aimv2_vision_model", "vit", "deit", "beit", "data2vec-vision", "ijepa",
                "vit_msn")
# DeiTModel puts a distillation token between CLS and the patches, whatever the checkpoint: only the
# distilled ones (facebook/deit-*-distilled-*) are model_type deit; the others are saved as ViTs.
DISTILLATION_TYPES = ("deit",)
# SigLIP 2's NaFlex towers cut each image into as many patches as its aspect ratio gives (padded to
# max_num_patches): a store holds one patch count for every image. Its fixed-resolution checkpoints
# (siglip2-*-patch16-224 ...) are model_type siglip and run as SigLIP.
NAFLEX = ("(NaFlex) model gives each image its own patch count, and a store needs one for all; use a "
          "fixed-resolution checkpoint (model_type siglip)")
# Families no store can take, refused by name from config.json (model_kind), before any weight loads:
# Reformer to Gemma 3n were refused, or failed naming nothing, once their weights had loaded (a GPU job).
# {model_type (top level or text_scope): why, after "a <model_type> "}
REFUSED_TYPES = {
    "siglip2": NAFLEX, "siglip2_vision_model": NAFLEX,
    "reformer": ("model's LSH attention hashes with random rotations drawn anew each forward (its checkpoints' "
                 "hash_seed is null) and buckets a text's tokens with its batch's padding, so a stored vector could "
                 "not be reproduced"),
    "squeezebert": ("model's encoder calls its blocks' forward directly, past any hook, on (batch, hidden, tokens): "
                    "no block's output can be captured"),
    "fsmt": ("model's encoder runs its blocks on (tokens, batch, hidden) and has no config of its own, which "
             "extraction reads"),
    "gemma3n_text": ("model's blocks carry altup_num_inputs predictions of the stream, (altup, batch, tokens, hidden), "
                     "where a store holds one (batch, tokens, hidden) output a block"),
    "canine": ("model's blocks run on its characters downsampled by downsampling_rate (a row per 4 characters), "
               "where a store holds a vector per token"),
    "funnel": ("model's encoder pools its tokens between its block groups (block_sizes), halving them after each "
               "group, so later blocks output fewer vectors than the text has tokens, where a store holds a "
               "vector per token"),
    "perceiver": ("model's blocks run on its num_latents latent vectors, which cross-attention reads the input "
                  "into, not on the text's tokens, and its one list of blocks runs num_blocks times a forward"),
    "pegasus_x": ("model's encoder pads its input to a multiple of its block_size (512 in its checkpoints) and its "
                  "blocks output that many tokens, where a store holds each text's own"),
}
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
# A vision-language model (Gemma 3 from 4B, Qwen3.5, LLaVA, Mistral 3...): its checkpoint holds a
# language model, run on text, beside a vision tower that text never reaches.
MULTIMODAL_SUFFIX = "ForConditionalGeneration"
VISION_TOWER_OF = "vision_tower_of"  # run_config's mark: the checkpoint whose vision tower this config is


def resolve_model_path(spec: str) -> Path:
    """`package:<module>` -> <module>.get_model_path(); anything else is a local folder."""
    if spec.startswith(PACKAGE_PREFIX):
        module_name = spec[len(PACKAGE_PREFIX):]
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise ConfigError(f"model.path {spec!r}: package module {module_name!r} is not installed") from None
        if not hasattr(module, "get_model_path"):
            raise ConfigError(f"model.path {spec!r}: {module_name} has no get_model_path()")
        path = Path(module.get_model_path())
    else:
        path = Path(spec)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path {spec!r}: no model folder with config.json at {path}")
    return path.resolve()


NESTED_CONFIGS = ("text_config", "vision_config")  # a composite checkpoint's sub-models' settings


def read_model_config(path: str | Path) -> dict[str, Any]:
    """The model folder's config.json as a dict; ConfigError naming it when a sub-model's settings
    (NESTED_CONFIGS) are there but no object (every size lookup reads them as one), or the names of its
    classes or weights file are of no use (check_class_names, check_weights_name)."""
    file = Path(path) / "config.json"
    config = read_model_json(file)
    check_class_names(file, config)
    check_weights_name(file, config)
    for key in NESTED_CONFIGS:
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise ConfigError(f"model.path: {file} holds {key} {config[key]!r:.60}, not an object of settings")
        if config.get(key) is not None:
            _fill_class_defaults(key, config[key])
    return config


def check_class_names(file: Path, config: dict[str, Any]) -> None:
    """ConfigError naming config.json and the field when model_type is no string or architectures no
    list of class names: model_kind reads them (architectures 5 was a TypeError traceback, and a bare
    string was read as its letters, a causal LM run as an encoder)."""
    model_type, architectures = config.get("model_type"), config.get("architectures")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"model.path: {file} holds model_type {model_type!r:.60}, not a string")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(name, str) for name in architectures)):
        raise ConfigError(f"model.path: {file} holds architectures {architectures!r:.60}, not a list of class names")


def check_weights_name(file: Path, config: dict[str, Any]) -> None:
    """ConfigError naming config.json's WEIGHTS_KEY when it is no relative path, inside the folder, of a
    safetensors file or shard index, the only names from_pretrained reads there: any other was its
    ValueError (or AttributeError, for a number) traceback, after the parse-time checks had passed."""
    name = config.get(WEIGHTS_KEY)
    if name is not None and not (inside_folder(name) and name.endswith((".safetensors", ".safetensors.index.json"))):
        raise ConfigError(f"model.path: {file} holds {WEIGHTS_KEY} {name!r:.60}, not the name of a .safetensors "
                          "file or .safetensors.index.json inside its folder")


# A sub-model's settings taken from its class where config.json leaves them out: the sizes, layer
# checks and resources read these; the first of each kind (what a store cannot be made without) is
# what makes a config.json worth the import.
CLASS_DEFAULT_SETTINGS = {"text_config": ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"),
                          "vision_config": ("num_hidden_layers", "hidden_size", "patch_size", "image_size",
                                            "num_attention_heads", "intermediate_size")}
NEEDED_SETTINGS = {"text_config": 2, "vision_config": 3}  # image_size: a dynamic-resolution tower has none


def _fill_class_defaults(key: str, nested: dict[str, Any]) -> None:
    """Fill a sub-model's missing CLASS_DEFAULT_SETTINGS from its model_type's config class, as
    from_pretrained does: transformers 4 saved a composite's sub-configs without the values equal to
    their class's defaults (llava-hf/llava-1.5-7b-hf: a Llama text_config with no num_hidden_layers or
    hidden_size, whose text extraction was refused as naming no block count; a CLIP vision_config
    without patch_size). Imports transformers (and torch, seconds) only where a needed one is missing."""
    settings = CLASS_DEFAULT_SETTINGS[key]
    missing = [setting for setting in settings
               if not any(isinstance(nested.get(name), int) for name in CONFIG_ALIASES.get(setting, (setting,)))]
    if set(missing) & set(settings[:NEEDED_SETTINGS[key]]) and isinstance(nested.get("model_type"), str):
        defaults = _class_defaults(nested["model_type"], settings)
        nested.update((setting, defaults[setting]) for setting in missing if setting in defaults)


@functools.lru_cache(maxsize=8)
def _class_defaults(model_type: str, settings: tuple[str, ...]) -> dict[str, int]:
    """`settings` of transformers' config class for `model_type`, where whole numbers (none for a type
    it lacks)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return {}
    defaults = CONFIG_MAPPING[model_type]()
    return {setting: value for setting in settings if isinstance(value := getattr(defaults, setting, None), int)}


def model_kind(config: dict[str, Any]) -> str:
    """'vision', 'causal' or 'encoder' from a config.json dict (a vision-language model is 'causal':
    its language model runs)."""
    check_refused_type(config)
    if config.get("model_type") in VISION_TYPES:
        return "vision"
    if any(a.endswith(CAUSAL_SUFFIXES) for a in config.get("architectures") or []) or is_vision_language(config):
        return "causal"
    return "encoder"


def check_refused_type(config: dict[str, Any]) -> None:
    """ConfigError naming a REFUSED_TYPES model_type, of the checkpoint or of its text_scope (Gemma 3n's
    language model, model_type gemma3n_text inside a gemma3n), and why no store can hold its blocks."""
    refused = [kind for kind in (config.get("model_type"), text_scope(config).get("model_type"))
               if isinstance(kind, str) and kind in REFUSED_TYPES]
    if refused:
        raise ConfigError(f"model.path: a {refused[0]} {REFUSED_TYPES[refused[0]]}; actstore does not extract "
                          "this family")
    landmarks, segment = config.get("num_landmarks"), config.get("segment_means_seq_len")
    if config.get("model_type") == "nystromformer" and landmarks != segment:
        # Landmark attention reshapes by segment_means_seq_len, not the batch's width: a reshape error,
        # or, where a batch's texts x tokens equal it, landmarks averaged across the batch's texts.
        raise ConfigError(f"model.path: a nystromformer model's landmark attention (num_landmarks {landmarks}, "
                          f"segment_means_seq_len {segment}) expects inputs padded to {segment} tokens, which "
                          "extraction does not pad to; actstore does not extract this family so configured (its "
                          "released checkpoints set the two equal)")


def run_config(model: dict[str, Any]) -> dict[str, Any]:
    """config.json as extraction runs the config's `model` section: with `model.tower: vision`, a
    vision-language checkpoint's vision tower (vision_tower_config), which everything downstream then
    reads as an image model's config.json; else config.json as it is."""
    folder = resolve_model_path(model["path"])
    config = read_model_config(folder)
    check_tower(config, model.get("tower"), model["path"])
    check_remote_code(folder, trusted(model), model["path"])
    return vision_tower_config(config) if model.get("tower") == "vision" else config


def trusted(model: dict[str, Any]) -> bool:
    """model.trust_remote_code of a config's model section (absent in a config made before the key: false)."""
    return bool(model.get("trust_remote_code"))


# The files whose `auto_map` can send a class to Python in the model folder: the model's, its
# tokenizer's (a custom tokenizer beside a standard model: InternLM, ChatGLM) and its processors'.
CODE_MAPS = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")


def check_remote_code(folder: str | Path, trust_remote_code: bool, spec: str | Path | None = None) -> None:
    """ConfigError before anything runs when a config file of the model folder maps a class to Python
    files there (`auto_map`: nomic-embed, jina, gte-v1.5 and other custom-code checkpoints) and
    model.trust_remote_code is not set: loading it executes that code. `spec`: model.path as the
    config gives it (default: the folder), for the message."""
    if trust_remote_code:
        return
    for name in CODE_MAPS:
        path = Path(folder) / name
        custom = read_model_json(path).get("auto_map") if path.is_file() else None
        if isinstance(custom, list) and name == TOKENIZER_CONFIG:  # the legacy [slow, fast], still run as code
            custom = {"AutoTokenizer": custom}
        if isinstance(custom, dict) and custom:
            first = next(iter(custom.items()))
            raise ConfigError(f"model.path {spec or folder}: its {name} maps {first[0]} to {first[1]!r}, Python in "
                              "the model folder; set model.trust_remote_code: true to run it (it executes that code)")


def check_tower(config: dict[str, Any], tower: str | None, spec: str | Path) -> None:
    """ConfigError naming model.tower when the checkpoint has no such tower, or one no store can hold."""
    if tower == "vision" and not is_vision_language(config):
        raise ConfigError(f"model.tower: vision runs a vision-language checkpoint's vision tower; {spec} "
                          f"(model_type {config.get('model_type')}) is not one")
    if tower == "vision" and vision_tower_config(config).get("model_type") not in VISION_TYPES:
        raise ConfigError(f"model.tower: vision: {spec}'s vision tower (model_type "
                          f"{config['vision_config'].get('model_type')}) is not one actstore runs (model_type "
                          f"{', '.join(VISION_TYPES)}); a tower that cuts each image into its own number of "
                          "patches (Qwen2.5-VL's, Pixtral's, Idefics3's tiles) cannot fill a store")
    if tower == "language" and model_kind(config) == "vision":
        raise ConfigError(f"model.tower: language: {spec} (model_type {config.get('model_type')}) is an image model")


def vision_tower_config(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's vision_config as its own config.json (a SigLIP's, a CLIP's...),
    with the checkpoint's saved dtype and its model_type under VISION_TOWER_OF."""
    dtype = {key: config[key] for key in ("dtype", "torch_dtype") if config.get(key)}
    return {**dtype, **config["vision_config"], VISION_TOWER_OF: config.get("model_type")}


def is_vision_language(config: dict[str, Any]) -> bool:
    """A vision-language model's checkpoint: a language model (its sizes in text_config, or at the top
    level as Qwen2.5-VL's saved by transformers 4) and a vision tower, generating text."""
    return (isinstance(config.get("vision_config"), dict)
            and any(a.endswith(MULTIMODAL_SUFFIX) for a in config.get("architectures") or []))


def modality_hint(config: dict[str, Any]) -> str:
    """Why a model does not take the data's modality, for the error that says so."""
    if is_vision_language(config):
        return ("; a vision-language checkpoint runs its language model, on text, or its vision tower, on "
                "images, with model.tower: vision")
    if model_kind(config) != "vision":
        return f"; the image models actstore runs are model_type {', '.join(VISION_TYPES)}"
    return ""


def config_patches(config: dict[str, Any]) -> int:
    """Patches per image config.json implies, (image_size // patch_size)**2 of the image tower (its
    vision_config, else the top level); 0 when it names no whole-number sizes."""
    tower = config.get("vision_config") or config
    size, patch = tower.get("image_size"), tower.get("patch_size")
    return (size // patch) ** 2 if isinstance(size, int) and isinstance(patch, int) and patch > 0 else 0


def register_tokens(config: dict[str, Any]) -> int:
    """How many tokens an image model puts between its CLS and its patches, none of them a patch of
    pixels: registers (DINOv2 with registers, DINOv3) or DeiT's distillation token."""
    return int(config.get("num_register_tokens") or 0) + int(config.get("model_type") in DISTILLATION_TYPES)


def tower_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of config.json that sizes the tower extraction runs: a composite checkpoint's
    vision_config (a vision model) or text_scope (a vision-language model's text_config, a T5Gemma's
    encoder), else the whole."""
    nested = config.get("vision_config") if model_kind(config) == "vision" else text_scope(config)
    return nested if isinstance(nested, dict) and nested else config


# Encoder-decoders whose config.json keeps each side's settings in `encoder` and `decoder`, none of
# the encoder's at the top level (T5Gemma; EncoderDecoderModel, as bert2bert): extraction runs the encoder.
SPLIT_ENCODER_TYPES = ("t5gemma", "encoder-decoder")


def text_scope(config: dict[str, Any]) -> dict[str, Any]:
    """The sub-config of the part of a composite checkpoint text runs through: a vision-language
    model's text_config, a SPLIT_ENCODER_TYPES checkpoint's encoder; {} for a checkpoint that keeps
    its settings at the top level."""
    nested = config.get("encoder" if config.get("model_type") in SPLIT_ENCODER_TYPES else "text_config")
    return nested if isinstance(nested, dict) else {}


# The names one size setting goes by across model families' config.json (GPT-2: n_embd, n_layer;
# DistilBERT: dim, n_layers, n_heads; MPT: d_model, n_layers, n_heads; ProphetNet: num_encoder_layers,
# num_encoder_attention_heads, where it was refused as naming no block count), in the order they are tried.
CONFIG_ALIASES = {"hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
                  "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers",
                                        "num_encoder_layers"),
                  "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads",
                                          "encoder_attention_heads", "num_encoder_attention_heads"),
                  "vocab_size": ("vocab_size",)}


def config_int(config: dict[str, Any], setting: str) -> int | None:
    """An integer size setting (a CONFIG_ALIASES key) from config.json under any of its names: a vision
    model's from the top level, else its vision_config, else its text_config (an image-text checkpoint's
    vocab_size); a text model's from its text_scope (a vision-language model's language model, an
    encoder-decoder's encoder), else the top level; None when no scope has it."""
    found = config_setting(config, setting)
    return found[1] if found else None


def config_setting(config: dict[str, Any], setting: str) -> tuple[str, int] | None:
    """config_int's setting with the name config.json gives it (JSON's true and false are ints here too)."""
    if model_kind(config) == "vision":
        scopes = (config, config.get("vision_config") or {}, config.get("text_config") or {})
    else:
        scopes = (text_scope(config), config)
    return next(((name, scope[name]) for scope in scopes for name in CONFIG_ALIASES[setting]
                 if isinstance(scope.get(name), int)), None)


# No released model has 1,000 blocks; a count past this is a damaged config.json, whose weightless
# model alone would take hours to build (10**12 blocks were taken, extract.layers checked against them).
MAX_BLOCKS = 10_000


def num_blocks(config: dict[str, Any]) -> int:
    """Number of transformer blocks, from config.json (vision towers nest it in vision_config); ConfigError
    naming the setting when it is no count of blocks (true was read as 1 block, 0 gave "blocks 0..-1")."""
    found = config_setting(config, "num_hidden_layers")
    if found is None:
        names = ", ".join(CONFIG_ALIASES["num_hidden_layers"])
        raise ConfigError(f"model config.json names no block count (looked for {names})")
    name, blocks = found
    if not (whole_number(blocks, 1) and blocks <= MAX_BLOCKS):
        raise ConfigError(f"model config.json {name} {blocks!r} is no block count (a whole number from 1 to "
                          f"{MAX_BLOCKS})")
    return blocks


def model_params(config: dict[str, Any]) -> dict[str, int | None]:
    """hidden_size, num_hidden_layers, num_attention_heads, vocab_size from a config.json dict
    (None where the model has none, e.g. a vision tower's vocab_size)."""
    return {setting: config_int(config, setting) for setting in CONFIG_ALIASES}


RUN_DTYPES = ("float32", "float16", "bfloat16")


def saved_dtype(config: dict[str, Any]) -> str:
    """The dtype a checkpoint was saved in: config.json's dtype or torch_dtype (a vision-language
    model's language model's), float32 where it names none of RUN_DTYPES."""
    saved = next((scope[key] for scope in (tower_config(config), config) for key in ("dtype", "torch_dtype")
                  if scope.get(key)), None)
    return saved if saved in RUN_DTYPES else "float32"


def run_dtype(model: dict[str, Any]) -> str:
    """The config's model.torch_dtype resolved: `auto` = the checkpoint's saved_dtype."""
    dtype = model.get("torch_dtype", "float32")
    return saved_dtype(read_model_config(resolve_model_path(model["path"]))) if dtype == "auto" else dtype


def storage_dtype(config: dict[str, Any]) -> str:
    """extract.storage_dtype resolved: `auto` stores what the model computes in (model.torch_dtype)."""
    dtype = config["extract"]["storage_dtype"]
    return run_dtype(config["model"]) if dtype == "auto" else dtype


def check_layers(layers: list[int], config: dict[str, Any]) -> None:
    """extract.layers within the blocks 0..n-1 of the model `config` (run_config's) describes, none of
    them a block its forward skips on the data (checked at parse time by common.smk)."""
    n_blocks = num_blocks(config)
    bad = [layer for layer in layers if not 0 <= layer < n_blocks]
    if bad:
        raise ConfigError(f"extract.layers: {bad} out of range; the model has blocks 0..{n_blocks - 1}")
    skipped = sorted(set(layers) & set(image_only_blocks(config)))
    if skipped:
        raise ConfigError(f"extract.layers: {skipped} are cross-attention blocks of {config.get('model_type')}'s "
                          f"language model ({image_only_blocks(config)}), which run only with an image: on text "
                          "its forward skips them, and the stream after each is the block before's output")


def check_logits_topk(logits_topk: int, config: dict[str, Any]) -> None:
    """extract.logits_topk within a causal LM's vocabulary (config.json's vocab_size, where stated):
    more failed the first batch's top-k after the weights loaded, naming no key."""
    vocab = config_int(config, "vocab_size") if model_kind(config) == "causal" else None
    if vocab is not None and logits_topk > vocab:
        raise ConfigError(f"extract.logits_topk {logits_topk}: the model's vocabulary has {vocab} tokens "
                          f"(config.json vocab_size); set it to at most {vocab}")


# Text models whose positions are a learned table (BERT's family, GPT-2, OPT...): a longer input
# indexes past it, a shape error on the CPU and a device-side assert on a GPU, after the weights load.
# Rotary, relative and ALiBi positions extend past the trained length instead. BART's family (its
# encoder, which extraction runs), Longformer and ESM-1 (ESM-2's position_embedding_type is rotary)
# learn theirs too, and LiLT: a longer text was an IndexError out of the first batch. ProphetNet's clamps
# the positions past its table to the last, and gave those tokens vectors of a position they are not at.
# Megatron-BERT to X-MOD, and Marian's and Pegasus's sinusoidal tables, are as long
# (tests/test_models_learned_positions_auto_map.py).
ABSOLUTE_POSITION_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "albert", "distilbert",
                           "ernie", "data2vec-text", "mpnet", "gpt2", "gpt_neo", "gpt_bigcode", "opt", "biogpt",
                           "xglm", "bart", "mbart", "plbart", "blenderbot", "longformer", "esm", "lilt",
                           "prophetnet", "megatron-bert", "rembert", "xlm-roberta-xl", "roberta-prelayernorm", "ibert",
                           "splinter", "luke", "markuplm", "layoutlm", "roc_bert", "mra", "marian", "pegasus", "mvp",
                           "blenderbot-small", "bert-generation", "nystromformer", "yoso", "xmod")
# Of those, the ones that number a text's positions from their padding id + 1 (RoBERTa's family:
# config.json's pad_token_id, its class default 1 where left out; MPNet's is always 1), so a table of
# max_position_embeddings holds that many fewer tokens (514: 512). Their tokenizer's model_max_length
# says so where the folder states it; where not, a text of the table's length passed the parse.
PADDED_POSITION_TYPES = ("roberta", "xlm-roberta", "camembert", "data2vec-text", "mpnet", "xlm-roberta-xl",
                         "roberta-prelayernorm", "ibert", "luke", "markuplm", "xmod", "longformer", "esm", "lilt")
TOKENIZER_CONFIG = "tokenizer_config.json"
# Text models whose blocks compute on (tokens, batch, hidden), the model transposing its input to that
# and its output back (XLNet): a block's output, and a hook on any module inside the blocks' holder
# (capture.tokens_first_modules), is captured with its first two axes swapped back. Read
# as (batch, tokens), the shape check refused it, except on a batch of as many samples as tokens, whose
# vectors were stored laid over the wrong samples and tokens.
TOKENS_FIRST_TYPES = ("xlnet",)
# Text models whose real tokens' outputs change with the padding after them, which the attention mask
# does not stop: MobileBERT's trigram embedding reads the next token's (a pad's at a text's end), FNet's
# Fourier transform mixes the whole padded sequence, ConvBERT's span convolution runs over it, YOSO's
# attention takes pad keys in (its mask, cast to integers, keeps them). BigBird's and BigBird-Pegasus's
# block-sparse attention (their checkpoints' default) runs only on a batch wider than its global,
# sliding and random blocks (full attention on a narrower one) and makes the batch's last block global.
# Nystromformer's attention adds a depthwise convolution (conv_kernel_size 65) over the values, pads'
# too. A stored vector then depended on the texts that shared its batch (0.15 to 1.6 of the block
# output's largest value on tiny models): their batches each hold one length (length_batches), so none
# is padded.
PADDING_SENSITIVE_TYPES = ("mobilebert", "fnet", "convbert", "yoso", "big_bird", "bigbird_pegasus", "nystromformer")


def check_sequence_length(max_seq_length: int, config: dict[str, Any], model_path: str | Path) -> None:
    """ConfigError when extract.max_seq_length passes the positions a learned-position text model
    has: config.json's n_positions / max_position_embeddings less its first_position, or its tokenizer's
    model_max_length where smaller."""
    text = text_scope(config) or config
    learned = text.get("position_embedding_type", "absolute") == "absolute"
    if text.get("model_type") not in ABSOLUTE_POSITION_TYPES or not learned:
        return
    limits = [table] if (table := position_table(text)) else []
    tokenizer_config = Path(model_path) / TOKENIZER_CONFIG
    if tokenizer_config.is_file():
        stated = read_model_json(tokenizer_config).get("model_max_length")
        if isinstance(stated, int) and stated < 1 << 30:  # transformers writes ~1e30 for "not stated"
            limits.append((stated, f"{TOKENIZER_CONFIG} model_max_length"))
    if limits and max_seq_length > min(limits)[0]:
        limit, where = min(limits)
        raise ConfigError(f"extract.max_seq_length {max_seq_length}: {model_path} (model_type {text['model_type']}) "
                          f"has learned positions for {limit} tokens ({where}); a longer text would index past them. "
                          f"Set extract.max_seq_length to at most {limit}")


def position_table(text: dict[str, Any]) -> tuple[int, str] | None:
    """The tokens a text model's position table (n_positions, else max_position_embeddings) holds and
    where config.json says so; None where it names neither."""
    key = next((key for key in ("n_positions", "max_position_embeddings") if isinstance(text.get(key), int)), None)
    if key is None:
        return None
    first = first_position(text)
    return text[key] - first, f"config.json {key}" + (f" {text[key]}, counted from position {first}" if first else "")


def first_position(text: dict[str, Any]) -> int:
    """The position a PADDED_POSITION_TYPES text model gives a text's first token (0 for the others)."""
    if text.get("model_type") not in PADDED_POSITION_TYPES:
        return 0
    pad = text.get("pad_token_id", 1)
    return 2 if text["model_type"] == "mpnet" or not whole_number(pad) else pad + 1


def image_only_blocks(config: dict[str, Any]) -> list[int]:
    """Blocks of a vision-language model's language model that run only with an image: Llama 3.2
    Vision's (Mllama) cross-attention blocks, which its forward skips when given text alone."""
    if model_kind(config) != "causal":
        return []
    return sorted((config.get("text_config") or {}).get("cross_attention_layers") or [])
