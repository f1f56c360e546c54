"""Tiny real models and data for tests: built from transformers configs with a fixed seed,
saved with save_pretrained and reloaded from the folder, exactly like a user's local checkpoint."""
from __future__ import annotations

import copy
import json
import tracemalloc
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "data" / "stdlib_docs.jsonl"
TEXT_KINDS = ("bert", "gpt2", "llama", "gemma3", "qwen3_5", "qwen2_5_vl", "t5")  # gemma3 .. qwen2_5_vl: vision-language
VISION_KINDS = ("dinov2", "dinov2_registers", "dinov3", "clip", "metaclip_2", "siglip", "aimv2", "vit", "deit", "beit",
                "data2vec_vision", "ijepa", "vit_msn")
IMAGE_SIZE = 32
PATCH = 8
REGISTERS = 4  # dinov2_registers, dinov3: tokens 1..4 after CLS
VISION_TOWER_WIDTH = 48  # a vision-language model's vision tower: wider than its language model (32)


T = TypeVar("T")


def rerecord(part_dir: Path, name: str) -> None:
    """part.json's record of its file `name` made of the file as it is now, as if it had been extracted so:
    for a test that writes values into a part (a NaN, an inf) to see a format store them; a writer refuses
    a part file that differs from its record."""
    from actstore.io_utils import sha256_tree_file

    meta = json.loads((part_dir / "part.json").read_text())
    meta["files"][name]["sha256_tree"] = sha256_tree_file(part_dir / name)
    (part_dir / "part.json").write_text(json.dumps(meta))


def damaged_copy(extract_dir: Path, root: Path, file: str, flip_at: int | None = None) -> Path:
    """A copy of the extraction under `root` with one bit of `file` (relative) flipped, in its middle or at
    byte `flip_at`: same size, its .npy header intact, so only its sha256 tells (verify names it)."""
    import shutil

    from actstore.formats import extract as ex

    copy = root / extract_dir.name
    shutil.copytree(extract_dir, copy)
    data = bytearray((copy / file).read_bytes())
    data[len(data) // 2 if flip_at is None else flip_at] ^= 0x01
    (copy / file).write_bytes(data)
    assert any(file in problem for problem in ex.verify(copy))
    return copy


def traced_peak(run: Callable[[], T]) -> tuple[T, int]:
    """run()'s result and the most memory Python and numpy held at once while it ran."""
    tracemalloc.start()
    try:
        return run(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def corpus_rows(n: int) -> list[dict]:
    with CORPUS.open() as fh:
        rows = [json.loads(line) for _, line in zip(range(n), fh)]
    return rows


def write_jsonl(path: Path, n: int) -> Path:
    """First n rows of the shipped stdlib corpus (label = stdlib chapter), cut to varied lengths
    (whole words) so samples span a range of token counts."""
    rows = corpus_rows(n)
    for i, row in enumerate(rows):
        words = row["text"].split()
        row["text"] = " ".join(words[:3 + (i * 7) % 40])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_tokenizer(out: Path, causal: bool):
    """A WordPiece (BERT-style) or byte-level BPE (GPT-style) tokenizer trained offline on the corpus.
    The WordPiece one differs from process to process (its ## pieces get other ids, and so its merges,
    with torch's and Python's hash seeds fixed): runs compared byte for byte read one saved model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [r["text"] for r in corpus_rows(400)]
    if causal:
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                       bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        tok.train_from_iterator(texts, trainer)
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                       cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(out)
    return fast


def build_model(kind: str, out: Path) -> Path:
    """Save a tiny seeded model of `kind` (and its tokenizer or image processor) into `out`."""
    import transformers as tf

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64)
    if kind == "bert":
        train_tokenizer(out, causal=False)
        model = tf.BertModel(tf.BertConfig(vocab_size=300, max_position_embeddings=128, **common))
    elif kind == "gpt2":
        train_tokenizer(out, causal=True)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=300, n_positions=128, n_embd=32, n_layer=3,
                                                 n_head=4, bos_token_id=0, eos_token_id=0))
    elif kind == "llama":
        train_tokenizer(out, causal=True)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=300, max_position_embeddings=128,
                                                   num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                                                   pad_token_id=0, **common))
    elif kind == "t5":  # an encoder-decoder: text runs its encoder
        train_tokenizer(out, causal=False)
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=300, d_model=32, num_layers=3, num_heads=4,
                                                          d_ff=64, d_kv=8, pad_token_id=0, decoder_start_token_id=0))
    elif kind == "gemma3":  # Gemma 3 from 4B on: a SigLIP tower (2 blocks) beside the language model
        train_tokenizer(out, causal=True)
        tf.Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            text_config=dict(vocab_size=300, max_position_embeddings=128, num_key_value_heads=2, head_dim=8,
                             bos_token_id=0, eos_token_id=0, pad_token_id=0, **common),
            vision_config=dict(common, hidden_size=VISION_TOWER_WIDTH, num_hidden_layers=2, image_size=IMAGE_SIZE,
                               patch_size=PATCH), mm_tokens_per_image=4))
    elif kind == "llava":  # LLaVA 1.5: a CLIP tower (2 blocks, CLS first) beside a Llama
        train_tokenizer(out, causal=True)
        tf.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(
            text_config=dict(model_type="llama", vocab_size=300, max_position_embeddings=128, num_key_value_heads=2,
                             bos_token_id=0, eos_token_id=0, pad_token_id=0, **common),
            vision_config=dict(common, model_type="clip_vision_model", hidden_size=VISION_TOWER_WIDTH,
                               num_hidden_layers=2, image_size=IMAGE_SIZE, patch_size=PATCH),
            image_token_index=299))
    elif kind == "paligemma":  # PaliGemma: a SigLIP tower (2 blocks) beside a Gemma
        train_tokenizer(out, causal=True)
        tf.SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.PaliGemmaForConditionalGeneration(tf.PaliGemmaConfig(
            text_config=dict(model_type="gemma", vocab_size=300, max_position_embeddings=128, num_key_value_heads=2,
                             head_dim=8, bos_token_id=0, eos_token_id=0, pad_token_id=0, **common),
            vision_config=dict(common, model_type="siglip_vision_model", hidden_size=VISION_TOWER_WIDTH,
                               num_hidden_layers=2, image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32),
            image_token_index=299, projection_dim=32))
    elif kind == "mllama":  # Llama 3.2 Vision: block 1 of its language model is a cross-attention block
        train_tokenizer(out, causal=True)
        model = tf.MllamaForConditionalGeneration(tf.MllamaConfig(
            text_config=dict(vocab_size=300, max_position_embeddings=128, num_key_value_heads=2, bos_token_id=0,
                             eos_token_id=0, pad_token_id=0, cross_attention_layers=[1], **common),
            vision_config=dict(hidden_size=VISION_TOWER_WIDTH, num_hidden_layers=2, num_global_layers=1,
                               attention_heads=4, intermediate_size=64, image_size=IMAGE_SIZE, patch_size=PATCH,
                               vision_output_dim=96, intermediate_layers_indices=[0])))
    elif kind == "qwen3_5":  # Qwen3.5: its vision tower has as many blocks as the language model, as shallow
        train_tokenizer(out, causal=True)
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config=dict(vocab_size=300, max_position_embeddings=128, num_key_value_heads=2, head_dim=8,
                             bos_token_id=0, eos_token_id=0, pad_token_id=0,
                             layer_types=["linear_attention", "full_attention", "linear_attention"], **common),
            vision_config=dict(depth=3, hidden_size=VISION_TOWER_WIDTH, num_heads=4, intermediate_size=64,
                               out_hidden_size=32, patch_size=PATCH)))
    elif kind == "qwen2_5_vl":  # Qwen2.5-VL as the Hub has it: the language model's sizes at the top level
        train_tokenizer(out, causal=True)
        model = tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(
            text_config=dict(vocab_size=300, max_position_embeddings=128, num_key_value_heads=2, bos_token_id=0,
                             eos_token_id=0, pad_token_id=0, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                             **common),
            vision_config=dict(depth=3, hidden_size=VISION_TOWER_WIDTH, num_heads=4, intermediate_size=64,
                               out_hidden_size=32, patch_size=PATCH)))
    elif kind == "dinov2":
        tf.BitImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                             do_center_crop=True).save_pretrained(out)
        model = tf.Dinov2Model(tf.Dinov2Config(image_size=IMAGE_SIZE, patch_size=PATCH, mlp_ratio=2, **{
            k: v for k, v in common.items() if k != "intermediate_size"}))
    elif kind == "dinov2_registers":
        tf.BitImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                             do_center_crop=True).save_pretrained(out)
        model = tf.Dinov2WithRegistersModel(tf.Dinov2WithRegistersConfig(
            image_size=IMAGE_SIZE, patch_size=PATCH, mlp_ratio=2, num_register_tokens=REGISTERS,
            **{k: v for k, v in common.items() if k != "intermediate_size"}))
    elif kind == "dinov3":  # the checkpoints' own processor is torchvision-only: a Bit one of the same steps
        tf.BitImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                             do_center_crop=True).save_pretrained(out)
        model = tf.DINOv3ViTModel(tf.DINOv3ViTConfig(image_size=IMAGE_SIZE, patch_size=PATCH,
                                                     num_register_tokens=REGISTERS, **common))
    elif kind == "metaclip_2":
        tf.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        # MetaCLIP 2's checkpoints are image-text pairs: extraction keeps the vision tower.
        model = tf.MetaClip2Model(tf.MetaClip2Config(
            text_config=dict(common, vocab_size=300, max_position_embeddings=32),
            vision_config=dict(common, image_size=IMAGE_SIZE, patch_size=PATCH)))
    elif kind == "aimv2":
        tf.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.Aimv2VisionModel(tf.Aimv2VisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH, **common))
    elif kind == "vit":  # google/vit-*: a CLS token first, as CLIP
        tf.ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.ViTModel(tf.ViTConfig(image_size=IMAGE_SIZE, patch_size=PATCH, **common))
    elif kind == "deit":  # a distilled DeiT (facebook/deit-*-distilled-*): CLS, a distillation token, the patches
        tf.DeiTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.DeiTModel(tf.DeiTConfig(image_size=IMAGE_SIZE, patch_size=PATCH, **common))
    elif kind == "beit":  # a mask token and one relative position bias for all blocks: neither adds a token
        tf.BeitImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                              do_center_crop=False).save_pretrained(out)
        model = tf.BeitModel(tf.BeitConfig(image_size=IMAGE_SIZE, patch_size=PATCH, use_mask_token=True,
                                           use_shared_relative_position_bias=True, **common))
    elif kind == "data2vec_vision":  # a BEiT with BEiT's processor; here a relative position bias in every block
        tf.BeitImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                              do_center_crop=False).save_pretrained(out)
        model = tf.Data2VecVisionModel(tf.Data2VecVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH,
                                                               use_relative_position_bias=True, **common))
    elif kind == "ijepa":  # no CLS token
        tf.ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.IJepaModel(tf.IJepaConfig(image_size=IMAGE_SIZE, patch_size=PATCH, **common))
    elif kind == "vit_msn":
        tf.ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.ViTMSNModel(tf.ViTMSNConfig(image_size=IMAGE_SIZE, patch_size=PATCH, **common))
    elif kind == "clip":
        tf.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.CLIPVisionModel(tf.CLIPVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH, **common))
    elif kind == "siglip":
        tf.SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
        model = tf.SiglipVisionModel(tf.SiglipVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH, **common))
    elif kind == "custom_code":  # its classes are Python in its folder (config.json auto_map), as nomic-embed's
        custom_code_tokenizer(out)
        model = custom_code_model(out, common)
    else:
        raise ValueError(kind)
    model.eval().save_pretrained(out)
    if kind == "qwen2_5_vl":  # saved by transformers 4: no text_config, its keys at the top level
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config.pop("text_config"), **config}))
    return out



# Families users extract from, each a tiny seeded model built by AutoConfig.for_model(model_type, ...)
# on top of FAMILY_COMMON: {model_type: (auto class, its own settings)}. "causal" loads with
# AutoModelForCausalLM (extraction runs it whole), "encoder" with AutoModel (an encoder-decoder's
# encoder runs). Each name's sizes are its config's own (DistilBERT's dim / n_layers, MPT's d_model...).
FAMILY_COMMON = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                     vocab_size=300, max_position_embeddings=128)
_KV = dict(num_key_value_heads=2)
_MOE = dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
FAMILIES = {
    "mistral": ("causal", _KV), "mixtral": ("causal", dict(_KV, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("causal", _KV), "qwen2_moe": ("causal", dict(_MOE, shared_expert_intermediate_size=16)),
    "qwen3": ("causal", dict(_KV, head_dim=8)), "qwen3_moe": ("causal", dict(_MOE, head_dim=8)),
    "qwen3_next": ("causal", dict(_MOE, head_dim=8, shared_expert_intermediate_size=16, linear_num_value_heads=4,
                                  linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                  layer_types=["linear_attention", "full_attention", "linear_attention"])),
    "gemma": ("causal", dict(_KV, head_dim=8)), "gemma2": ("causal", dict(_KV, head_dim=8, sliding_window=4)),
    "gemma3_text": ("causal", dict(_KV, head_dim=8, sliding_window=4)),
    "recurrent_gemma": ("causal", dict(_KV, head_dim=8, lru_width=32, attention_window_size=8,
                                       block_types=["recurrent", "attention"])),
    "phi": ("causal", {}), "phi3": ("causal", _KV), "olmo": ("causal", {}), "olmo2": ("causal", _KV),
    "olmoe": ("causal", dict(_KV, num_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("causal", dict(_KV, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)),
    "deepseek_v3": ("causal", dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=16, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                                   qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1)),
    "llama4_text": ("causal", dict(_KV, head_dim=8, num_local_experts=2, intermediate_size_mlp=64)),
    "gpt_neox": ("causal", {}),  # Pythia
    "gpt_neo": ("causal", dict(num_layers=3, attention_types=[[["global", "local", "global"], 1]], window_size=4)),
    "gptj": ("causal", dict(n_embd=32, n_layer=3, n_head=4, rotary_dim=4)),
    "gpt_bigcode": ("causal", dict(n_embd=32, n_layer=3, n_head=4)),
    "mpt": ("causal", dict(d_model=32, n_layers=3, n_heads=4)),
    "falcon": ("causal", {}), "bloom": ("causal", dict(n_layer=3, n_head=4)),
    "opt": ("causal", dict(ffn_dim=64, word_embed_proj_dim=32)), "stablelm": ("causal", _KV),
    "starcoder2": ("causal", _KV), "cohere": ("causal", _KV), "granite": ("causal", _KV), "smollm3": ("causal", _KV),
    "mamba": ("causal", dict(state_size=4, expand=2, conv_kernel=4)),
    "mamba2": ("causal", dict(state_size=4, expand=2, conv_kernel=4, num_heads=8, head_dim=8, n_groups=1)),
    "jamba": ("causal", dict(_KV, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                             expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4)),
    "falcon_h1": ("causal", dict(_KV, mamba_d_state=4, mamba_n_heads=4, mamba_d_head=8, mamba_d_ssm=32)),
    "lfm2": ("causal", dict(_KV, layer_types=["conv", "full_attention", "conv"])),
    "roberta": ("encoder", {}), "xlm-roberta": ("encoder", {}), "modernbert": ("encoder", {}),
    "distilbert": ("encoder", dict(dim=32, n_layers=3, n_heads=4, hidden_dim=64)), "deberta-v2": ("encoder", {}),
    "electra": ("encoder", dict(embedding_size=32)), "mpnet": ("encoder", {}), "esm": ("encoder", {}),
    "longformer": ("encoder", dict(attention_window=4)),  # pads its input to a window multiple inside
    "bart": ("encoder", dict(d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)),
    "mt5": ("encoder", dict(d_model=32, num_layers=3, num_heads=4, d_ff=64, d_kv=8, decoder_start_token_id=0)),
}


def build_family(model_type: str, out: Path) -> Path:
    """Save a tiny seeded model of a FAMILIES model_type, with a tokenizer trained on the corpus. Its
    matrices are drawn at std 0.2 (the configs' 0.02 leaves the residual stream near its embedding)."""
    import transformers as tf

    kind, settings = FAMILIES[model_type]
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, causal=kind == "causal")
    config = tf.AutoConfig.for_model(model_type, **{**FAMILY_COMMON, **settings})
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    model = (tf.AutoModelForCausalLM if kind == "causal" else tf.AutoModel).from_config(config).eval()
    for param in model.parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.2)
    model.save_pretrained(out)
    return out

CUSTOM_CONFIG = """from transformers import PretrainedConfig


class TinyCustomConfig(PretrainedConfig):
    model_type = "tiny_custom"

    def __init__(self, vocab_size=300, hidden_size=32, num_hidden_layers=3, intermediate_size=64,
                 max_position_embeddings=128, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.intermediate_size, self.max_position_embeddings = intermediate_size, max_position_embeddings
"""
CUSTOM_MODEL = """import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from .configuration_tiny_custom import TinyCustomConfig


class MixBlock(nn.Module):
    # Each token plus the masked mean of the text's tokens: padding never changes a real token.
    def __init__(self, config):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)
        self.ff = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, x, mask):
        weights = mask[..., None].to(x.dtype)
        context = (x * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True)
        x = x + self.mix(self.norm(x) + context)
        return x + self.ff(x)


class TinyCustomModel(PreTrainedModel):
    config_class = TinyCustomConfig
    base_model_prefix = "tiny"

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(MixBlock(config) for _ in range(config.num_hidden_layers))
        self.post_init()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        x = self.embed(input_ids) + self.position(torch.arange(input_ids.shape[1], device=input_ids.device))[None]
        for block in self.blocks:
            x = block(x, mask)
        return BaseModelOutput(last_hidden_state=x)
"""


CUSTOM_TOKENIZER = """from transformers import PreTrainedTokenizerFast


class TinyCustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


def custom_code_tokenizer(out: Path) -> None:
    """A WordPiece tokenizer whose class is Python in the folder too (tokenizer_config.json auto_map,
    as jina's and others' are): transformers loads it only with trust_remote_code."""
    train_tokenizer(out, causal=False)
    (out / "tokenization_tiny_custom.py").write_text(CUSTOM_TOKENIZER)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="TinyCustomTokenizer",
                  auto_map={"AutoTokenizer": [None, "tokenization_tiny_custom.TinyCustomTokenizer"]})
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def custom_code_model(out: Path, common: dict):
    """A model whose config and classes are Python files in its folder (auto_map), built from them."""
    from transformers import AutoConfig, AutoModel

    (out / "configuration_tiny_custom.py").write_text(CUSTOM_CONFIG)
    (out / "modeling_tiny_custom.py").write_text(CUSTOM_MODEL)
    sizes = {k: v for k, v in common.items() if k != "num_attention_heads"}
    (out / "config.json").write_text(json.dumps({
        "model_type": "tiny_custom", "architectures": ["TinyCustomModel"], "vocab_size": 300, **sizes,
        "auto_map": {"AutoConfig": "configuration_tiny_custom.TinyCustomConfig",
                     "AutoModel": "modeling_tiny_custom.TinyCustomModel"}}))
    return AutoModel.from_config(AutoConfig.from_pretrained(out, trust_remote_code=True), trust_remote_code=True)


def write_image_folder(root: Path, per_class: int = 4) -> Path:
    """Real photographs from scikit-image, cropped into two classes (ImageFolder layout)."""
    from PIL import Image
    from skimage import data

    photos = {"animal": [data.chelsea(), data.cat()], "object": [data.coffee(), data.rocket(), data.astronaut()]}
    for label, images in photos.items():
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = images[i % len(images)]
            y, x = (i * 37) % (img.shape[0] // 2), (i * 53) % (img.shape[1] // 2)
            crop = img[y:y + img.shape[0] // 2, x:x + img.shape[1] // 2]
            Image.fromarray(np.ascontiguousarray(crop)).save(root / label / f"img_{i:02d}.png")
    return root


def make_config(tmp: Path, model_path: Path | str, data_path: Path | str, **sections) -> dict:
    """A resolved config for tests: dump_to under tmp, tiny defaults, sections merged on top."""
    from actstore.config import validate_config

    config = {"dump_to": str(tmp / "dump"), "model": {"path": str(model_path)},
              "dataset": {"path": str(data_path)},
              "extract": {"layers": [0, 2], "max_seq_length": 24, "batch_size": 4, "parts": 2}}
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    return validate_config(copy.deepcopy(config))


def run_saev_stage(tmp_path: Path, config: dict, name: str) -> Path:
    """`snakemake saev` on `config` (saved as <name>.yaml in tmp_path); the store its pointer names."""
    import subprocess
    import sys

    from actstore.formats import saev
    configfile = save_config(config, tmp_path / f"{name}.yaml")
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-s", str(REPO / "Snakefile"), "-d",
           str(tmp_path), "--configfile", str(configfile), "--cores", "2", "saev"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return saev.resolve(next((Path(config["dump_to"]) / "saev").glob("*/saev.json")))


def save_config(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def write_segmentation_folder(root: Path, coarse_hw: tuple[int, int], factor: tuple[int, int],
                              n_images: int = 6) -> tuple[Path, Path, list[np.ndarray]]:
    """Real photographs with pixel masks, laid out like ADE20K (images/<rel>.png, masks/<rel>.png).

    Each mask is a coarse (h, w) label map of its photo (4 grey-level classes, plus class 9 in one
    corner) blown up by an integer `factor`, and the photo is resized to the same size, so a
    nearest-neighbour resize back down by `factor` recovers the coarse map exactly whichever pixel
    of a block it picks. Returns (images dir, masks dir, coarse maps in sample_idx order)."""
    from PIL import Image
    from skimage import data

    photos = [data.chelsea(), data.coffee(), data.astronaut(), data.rocket(), data.cat(), data.immunohistochemistry()]
    h, w = coarse_hw
    images, masks, coarse = root / "images", root / "masks", []
    for i in range(n_images):
        rel = f"{'ab'[i % 2]}/img_{i:02d}"
        photo = Image.fromarray(photos[i % len(photos)]).resize((w * factor[1], h * factor[0]))
        grey = np.asarray(Image.fromarray(photos[i % len(photos)]).convert("L").resize((w, h)), dtype=np.float64)
        labels = np.digitize(grey, np.quantile(grey, [0.25, 0.5, 0.75])).astype(np.uint8)
        labels[: h // 3, : w // 3] = 9
        coarse.append(labels)
        for folder, img in ((images, photo), (masks, Image.fromarray(np.kron(labels, np.ones(factor, np.uint8))))):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            img.save((folder / rel).with_suffix(".png"))
    return images, masks, coarse


# --- The datasets users already have: Parquet, Arrow, CSV, save_to_disk folders, image tables. ---

def write_parquet(path: Path, table, shards: int = 1, row_group_size: int = 64) -> Path:
    """`table` (a pyarrow Table) as `shards` Parquet files train-0000N-of-0000S.parquet under `path`
    (a folder, as the Hub lays them out), small row groups so reading crosses them."""
    import pyarrow.parquet as pq

    path.mkdir(parents=True, exist_ok=True)
    per = -(-table.num_rows // shards)
    for i in range(shards):
        pq.write_table(table.slice(i * per, per), path / f"train-{i:05d}-of-{shards:05d}.parquet",
                       row_group_size=row_group_size)
    return path


def write_arrow_stream(path: Path, table, batch_rows: int = 64) -> Path:
    """An Arrow IPC stream file, as `datasets.save_to_disk` writes its data files."""
    import pyarrow as pa

    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    return path


def write_hf_disk(root: Path, splits: dict, features: dict) -> Path:
    """A save_to_disk DatasetDict folder, as `datasets` 2.x-4.x writes it: dataset_dict.json, and per
    split state.json, dataset_info.json (the features) and data-0000N-of-0000S.arrow streams."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for split, table in splits.items():
        folder = root / split
        folder.mkdir()
        half = table.num_rows // 2
        names = [f"data-0000{i}-of-00002.arrow" for i in range(2)]
        for name, part in zip(names, (table.slice(0, half), table.slice(half))):
            write_arrow_stream(folder / name, part, batch_rows=32)
        (folder / "state.json").write_text(json.dumps({
            "_data_files": [{"filename": n} for n in names], "_split": split, "_format_type": None}))
        (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    return root


def image_table(folder: Path, class_names: list[str], with_paths: bool = True):
    """The images of an image folder as a Hub-style table: `image` = {bytes, path} structs (the
    Image feature; path = the image's path in the folder) or plain bytes, `label` = ClassLabel ids,
    and the features in the `huggingface` schema metadata, in the folder's sorted order."""
    import pyarrow as pa

    files = sorted(p for p in folder.rglob("*.png"))
    rels = [p.relative_to(folder).as_posix() for p in files]
    images = [{"bytes": p.read_bytes(), "path": rel} for p, rel in zip(files, rels)]
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": class_names}}
    table = pa.table({"image": images if with_paths else [i["bytes"] for i in images],
                      "label": pa.array([class_names.index(r.split("/")[0]) for r in rels], pa.int64())})
    return table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})


CHAT_TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|endoftext|>assistant:{% endif %}")


def add_chat_template(model: Path, out: Path) -> Path:
    """A copy of a tiny causal model whose tokenizer has a chat template and, like Llama's, adds a
    BOS token when asked for special tokens (so a template's own BOS must not be doubled)."""
    import shutil

    from tokenizers import processors
    from transformers import AutoTokenizer

    shutil.copytree(model, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.convert_tokens_to_ids("<|endoftext|>"))])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out
