"""Load a local HF model for extraction and locate its transformer blocks and hook targets."""
from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from actstore.checkpoint import check_checkpoint_files, load_weights
from actstore.errors import ConfigError
from actstore.model_config import (check_remote_code, check_tower, is_vision_language, model_kind, num_blocks,
                                   read_model_config, read_model_json, vision_tower_config)

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# Families whose blocks are parallel lists (refused by find_blocks), and the list whose module i's output
# is block i's (XLM's and post-norm Flaubert's blocks end with layer_norm2), for the refusal to name.
BLOCK_OUTPUT_LISTS = {"xlm": "layer_norm2", "flaubert": "layer_norm2"}


def find_blocks(model: nn.Module, n_blocks: int, within: nn.Module | None = None,
                ends_with: str | None = None) -> tuple[str, nn.ModuleList]:
    """The ModuleList of transformer blocks: the shallowest ModuleList of length n_blocks (inside
    `within` when given: a vision-language model's vision tower may have as many blocks). Several
    as shallow are refused: a model whose block is no one module (XLM's attentions, ffns and norms,
    each a list of n_blocks) has no module whose output is "layer i", and the first list's would be
    stored as it. `ends_with`: the name of such a list whose module i ends block i, for the error
    to name (BLOCK_OUTPUT_LISTS)."""
    inside = {id(module) for module in (within or model).modules()}
    candidates = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == n_blocks and id(module) in inside
    ]
    if not candidates:
        raise ConfigError(f"{type(within or model).__name__}: no ModuleList of {n_blocks} transformer blocks")
    depth = min(name.count(".") for name in candidates)
    shallowest = [name for name in candidates if name.count(".") == depth]
    if len(shallowest) > 1:
        last = [name for name in shallowest if name.rsplit(".", 1)[-1] == ends_with]
        # Not extract.hooks: the model is refused whole, hooks and all.
        advice = (f" (block i's output is {last[0]}.i's, which ends each block: a forward hook of your own "
                  "there reads it)" if last else "")
        raise ConfigError(f"{type(within or model).__name__}: its {n_blocks} blocks are no one ModuleList but "
                          f"{len(shallowest)} ({', '.join(shallowest)}), so no module's output is a block's: actstore "
                          f"does not extract this architecture's layers{advice}")
    return shallowest[0], model.get_submodule(shallowest[0])


def find_model_blocks(model: nn.Module, config: dict[str, Any]) -> tuple[str, nn.ModuleList]:
    """find_blocks for the model `config` (its config.json, or run_config's) describes: text never
    reaches a vision-language model's vision tower, so "layer i" is its language model's block i."""
    check_unshared_blocks(config)
    language_model = model.get_decoder() if is_vision_language(config) else None
    # A pre-norm Flaubert's layer_norm2 normalizes its feed-forward's input: no list's output is its block's.
    ends_with = None if config.get("pre_norm") else BLOCK_OUTPUT_LISTS.get(config.get("model_type"))
    return find_blocks(model, num_blocks(config), within=language_model, ends_with=ends_with)


def check_unshared_blocks(config: dict[str, Any]) -> None:
    """ALBERT runs its num_hidden_layers blocks as num_hidden_groups layer groups, each called in turn
    for num_hidden_layers / num_hidden_groups blocks. With fewer groups than blocks no module's output
    is block i's alone: refused, where a ModuleList that happens to hold num_hidden_layers layers (a
    group's `inner_group_num` of them) would be taken for the blocks and keep each one's last call."""
    groups, blocks = config.get("num_hidden_groups"), num_blocks(config)
    if isinstance(groups, int) and groups < blocks:
        raise ConfigError(f"model config.json: num_hidden_groups {groups} < num_hidden_layers {blocks}: its "
                          f"{blocks} blocks share {groups} layer group(s), each run several times in one forward "
                          "(ALBERT), so no module's output is block i's: actstore does not extract this model's "
                          "layers")


def get_module(model: nn.Module, module_path: str, where: str = "extract.hooks") -> nn.Module:
    """Resolve a module path on the model, or on its base model (AutoModel naming); ConfigError
    naming `where` (the config key or file that gave the path: lut.targets, a LUT's metadata.json)."""
    roots = (model, getattr(model, "base_model", model))
    # A path in the whole checkpoint (a causal LM's LUT key, `model.layers.1...`) on its bare base model
    # (AutoModel's LlamaModel), whose own path it starts with.
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    paths = (module_path, module_path.removeprefix(prefix)) if module_path.startswith(prefix) else (module_path,)
    for root in roots:
        for path in paths:
            try:
                return root.get_submodule(path)
            except AttributeError:
                continue
    _, holds = max((_nearest(root, module_path) for root in roots), key=lambda found: found[0])
    raise ConfigError(f"{where}: module {module_path!r} does not exist in {type(model).__name__}; {holds}")


def module_full_path(model: nn.Module, module_path: str, where: str = "extract.hooks") -> str:
    """The dotted path in `model` (what `model.get_submodule` finds) of the module get_module resolves
    `module_path` to: `layers.1.self_attn.q_proj` in a LlamaForCausalLM gains its base model's path
    (`model.layers.1.self_attn.q_proj`), `bert.encoder...` in a bare BertModel loses it; ConfigError
    (get_module's) when neither holds it."""
    module = get_module(model, module_path, where)
    return next(name for name, held in model.named_modules() if held is module)


def _nearest(root: nn.Module, module_path: str) -> tuple[int, str]:
    """How far `module_path` goes into `root`, and what the module it stops at holds: a misspelt hook
    (`mlp.downproj`) named the path alone, and the right name was a search of the model's code."""
    module, depth = root, 0
    for name in module_path.split("."):
        if name not in module._modules:
            break
        module, depth = module._modules[name], depth + 1
    held = list(module._modules)
    where = ".".join(module_path.split(".")[:depth]) or "the model"
    if not held:
        return depth, f"{where} holds no module"
    return depth, f"{where} holds {', '.join(held[:12])}" + (f" and {len(held) - 12} more" if len(held) > 12 else "")


@dataclass
class LoadedModel:
    model: nn.Module
    path: Path
    config: dict[str, Any]
    kind: str  # vision | causal | encoder
    blocks: nn.ModuleList
    blocks_path: str
    preprocessor: Any  # tokenizer or image processor
    device: torch.device

    @property
    def modality(self) -> str:
        return "image" if self.kind == "vision" else "text"

    @functools.cached_property
    def takes_logits_to_keep(self) -> bool:
        """The forward can run its LM head at given positions only (HF causal LMs' `logits_to_keep`)."""
        return "logits_to_keep" in inspect.signature(self.model.forward).parameters


def pick_device(name: str, key: str = "device") -> torch.device:
    """`auto`: the GPU when torch sees one, else the CPU, except in a Slurm job given GPUs that
    torch cannot see (a CPU-only torch, a driver it cannot use): that job is refused, where it
    would run on the CPU for many times as long. `key`: the config key `name` came from. A name torch
    does not know, or a GPU where torch sees none (a CPU-only torch, a job on a CPU node), is a
    ConfigError naming the key, where torch's own (Torch not compiled with CUDA enabled) named neither."""
    if name != "auto":
        return named_device(name, key)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if error := unseen_gpus_error(os.environ, torch.__version__, torch.version.cuda, key):
        raise ConfigError(error)
    return torch.device("cpu")


def named_device(name: str, key: str) -> torch.device:
    """The device `name` (cpu, cuda, cuda:N) of config key `key`; ConfigError unless torch can use it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{key} {name!r} is no device: auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = ("a CPU-only build" if torch.version.cuda is None
               else f"built for CUDA {torch.version.cuda}, it found no usable GPU (check nvidia-smi)")
        raise ConfigError(f"{key} {name}: torch {torch.__version__} sees no GPU here, being {why}; run on a GPU "
                          f"node, or set {key}: cpu")
    if device.type == "cuda" and device.index is not None and device.index >= (seen := torch.cuda.device_count()):
        # CUDA's own "invalid device ordinal" came from the first tensor moved, naming no key
        raise ConfigError(f"{key} {name}: torch sees {seen} GPU(s) here, cuda:0 to cuda:{seen - 1} (a Slurm job's "
                          f"GPUs are numbered from 0 whichever the node's they are); set {key}: cuda or auto")
    return device


def unseen_gpus_error(env: Mapping[str, str], torch_version: str, cuda_version: str | None,
                      key: str = "device") -> str | None:
    """The error for a Slurm job given GPUs (SLURM_JOB_GPUS, SLURM_GPUS_ON_NODE) when torch sees none."""
    given = env.get("SLURM_JOB_GPUS") or (env.get("SLURM_GPUS_ON_NODE", "0") not in ("", "0") and
                                          f"{env['SLURM_GPUS_ON_NODE']} on this node")
    if not given:
        return None
    why = ("a CPU-only build: install a CUDA build of torch" if cuda_version is None
           else f"built for CUDA {cuda_version}, it found no usable GPU: check the node's driver (nvidia-smi)")
    return (f"{key} auto: this Slurm job was given GPUs ({given}) but torch {torch_version} sees none, being "
            f"{why}; or set {key}: cpu to run on the CPU anyway")


def gpu_precision_warning(requested: str, run: str, saved: str, gpu: str, capability: tuple[int, int]) -> str | None:
    """What the part's log says of the dtype a GPU runs the model in: a float32 run of a 16-bit
    checkpoint, or bfloat16 on a GPU without bfloat16 arithmetic (compute capability below 8.0:
    V100, P100, T4), where torch emulates it op by op."""
    if run == "bfloat16" and capability < (8, 0):
        return (f"model.torch_dtype {requested} runs bfloat16 on {gpu} (compute capability {capability[0]}."
                f"{capability[1]}), which has no bfloat16 arithmetic: torch emulates it, slower than float32. "
                "model.torch_dtype: float32 holds every bfloat16 weight exactly (twice the memory); float16 uses "
                "this GPU's tensor cores but overflows past +-65504, which bfloat16-trained models can reach")
    if requested == "float32" != saved:
        return (f"model.torch_dtype float32 runs a checkpoint saved in {saved} at twice its memory and without "
                "its tensor-core speed (model.torch_dtype: auto runs it as saved)")
    return None


def weight_bytes(module: nn.Module, dtype: str | None = None) -> int:
    """Bytes a module's parameters and buffers take once loaded in `dtype` (floating tensors cast to
    it, as from_pretrained casts them; None: each in its own dtype, as loaded; a tied tensor counted
    once). Works on a meta-device skeleton."""
    tensors = {id(t): t for t in module.state_dict(keep_vars=True).values()}.values()
    size = TORCH_DTYPES[dtype].itemsize if dtype else None
    return sum(t.numel() * (size if size and t.is_floating_point() else t.element_size()) for t in tensors)


def gpu_memory_error(path: Path, need: int, dtype: str, free: int, total: int, gpu: str) -> str | None:
    """The error for weights that cannot fit in the GPU's free memory: said before they load (minutes
    for a large checkpoint) instead of a CUDA out-of-memory error after."""
    if need <= free:
        return None
    halve = " A 16-bit model.torch_dtype halves that (auto runs the checkpoint as saved)." if dtype == "float32" else ""
    return (f"model.path {path}: its weights take {need / 1e9:.1f} GB in {dtype} (model.torch_dtype), more than the "
            f"{free / 1e9:.1f} GB free of {total / 1e9:.1f} GB on {gpu}; extraction runs the model on one GPU.{halve}")


def bytes_to_load(path: Path, skeleton: nn.Module, dtype: str) -> int | None:
    """Bytes of the weights that run (a tower alone, an encoder alone), sized on the module's
    meta-device skeleton (model_skeleton of `path`); None for a quantized checkpoint (config.json
    `quantization_config`), whose weights from_pretrained keeps in the quantizer's own layout, which
    the skeleton does not have."""
    if "quantization_config" in read_model_config(path):
        return None
    return weight_bytes(skeleton, dtype)


def check_fits_on_gpu(path: Path, skeleton: nn.Module, dtype: str, device: torch.device) -> None:
    """Weights larger than the GPU's free memory are refused before any is read (bytes_to_load)."""
    need = bytes_to_load(path, skeleton, dtype)
    if need is None:
        return
    free, total = torch.cuda.mem_get_info(device)
    if error := gpu_memory_error(path, need, dtype, free, total, gpu_label(device)):
        raise ConfigError(error)


def gpu_label(device: torch.device) -> str:
    """A CUDA device as errors name it: `cuda:0 (NVIDIA H100 80GB HBM3)`."""
    return f"{device} ({torch.cuda.get_device_name(device)})"


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (input ids, indices) on `device` without making the host wait: to a GPU through
    pinned memory, a copy queued behind the stream's work. From pageable memory CUDA first finishes
    all the work queued, so the host could not queue the next step while the GPU runs this one."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


STAGING_BYTES = 64 << 20  # each of the two pinned slots a model's weights go through to a GPU
# Smaller models take `.to`: a job allocates the slots' pinned memory once, ~0.05 s (H100 node, session
# 44: a 0.17 GB ViT's weights moved in 0.076 s through new slots against 0.030 by `.to`; a 2.2 GB
# Llama's in 0.124 against 0.256, and 0.083 once the slots existed), so below ~0.6 GB they cost more
# than they save.
SLOTS_MIN_BYTES = 1 << 30


def weights_to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to(device)`. To a GPU, each dense tensor goes through two pinned slots in turn: torch's
    copy (on all its CPU threads) fills one from the checkpoint's memory-mapped pages while the GPU
    copies the other out. `.to` copies from pageable memory: the driver stages it on one thread,
    page faults included (the model load of a 2.5 GB checkpoint, that copy and the CUDA context
    with it, took 0.46-0.51 s on the H100 machine, session 40). A quantized model keeps
    transformers' `.to`, which moves its quantizer's own modules; a model under SLOTS_MIN_BYTES too."""
    if (device.type != "cuda" or getattr(model, "quantization_method", None) is not None
            or weight_bytes(model) < SLOTS_MIN_BYTES):
        return model.to(device)
    slots = _PinnedSlots(device)
    model._apply(lambda tensor: slots.copy(tensor) if tensor.device.type == "cpu" else tensor)  # as .to does
    slots.finish()
    return model


class _PinnedSlots:
    """Host-to-GPU copies through two pinned slots used in turn, each refilled once the GPU's copy
    out of it (an event) is done."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the GPU (its copies queued on the current stream): a plain contiguous tensor
        through the slots, anything else (a quantizer's own tensor type) by its own `.to`."""
        if (type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.layout != torch.strided or tensor.is_quantized
                or not tensor.is_contiguous()):
            return tensor.to(self.device)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        source = tensor.detach().reshape(-1).view(torch.uint8)
        target = out.reshape(-1).view(torch.uint8)
        for start in range(0, source.numel(), STAGING_BYTES):
            slot, n = self.turn % 2, min(STAGING_BYTES, source.numel() - start)
            if self.copied[slot] is not None:
                self.copied[slot].synchronize()
            self.slots[slot][:n].copy_(source[start:start + n])
            target[start:start + n].copy_(self.slots[slot][:n], non_blocking=True)
            self.copied[slot] = torch.cuda.Event()
            self.copied[slot].record()
            self.turn += 1
        return out

    def finish(self) -> None:
        """Wait for the last copies: the slots are freed (to torch's pinned cache) after this."""
        for event in self.copied:
            if event is not None:
                event.synchronize()


def _auto_class(config: dict[str, Any]) -> Any:
    """The transformers Auto class that loads the checkpoint whole: a vision-language model as the
    image-text-to-text model it was saved as (its language model's weights under their own names); an
    EncoderDecoderModel of two checkpoints (bert2bert), which AutoModel does not map, as the seq2seq LM
    it is."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    if is_vision_language(config):
        return AutoModelForImageTextToText
    if config.get("model_type") == "encoder-decoder":
        return AutoModelForSeq2SeqLM
    return AutoModelForCausalLM if model_kind(config) == "causal" else AutoModel


def _tower(config: dict[str, Any], model: nn.Module, tower: str | None) -> nn.Module:
    """The part of the checkpoint extraction runs: with `tower` vision, a vision-language checkpoint's
    vision tower; an image-text checkpoint's vision tower, an encoder-decoder's encoder (T5, BART: text
    goes in there, "layer i" = encoder block i), else all."""
    if tower == "vision":
        found = getattr(getattr(model, "model", None), "vision_tower", None) or getattr(model, "vision_tower", None)
        if not isinstance(found, nn.Module):
            raise ConfigError(f"model.tower: vision: {type(model).__name__} has no vision_tower module")
        return found
    if model_kind(config) == "vision" and hasattr(model, "vision_model") and hasattr(model, "text_model"):
        return model.vision_model
    if config.get("is_encoder_decoder") is True and not is_vision_language(config):
        return model.get_encoder()
    return model


def model_skeleton(path: str | Path, tower: str | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The model's module tree with no weights (meta device, seconds even for large models), so
    module paths (hooks, LUT targets) are checked before any weight is loaded. `tower`: model.tower;
    `trust_remote_code`: model.trust_remote_code (checked: model_config.check_remote_code)."""
    from transformers import AutoConfig

    config = read_model_config(path)
    check_tower(config, tower, path)
    check_remote_code(path, trust_remote_code)
    with torch.device("meta"):
        return _tower(config, _auto_class(config).from_config(
            AutoConfig.from_pretrained(Path(path), local_files_only=True, trust_remote_code=trust_remote_code),
            trust_remote_code=trust_remote_code), tower)


def _vision_tower(path: Path, skeleton: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A vision-language checkpoint's vision tower, reading only its own weights (Gemma 3 27B's is
    ~0.8 GB of a 54 GB checkpoint): its class and config are the whole model's skeleton's, built on
    the CPU with no random init (its non-persistent buffers, position ids, as its __init__ makes
    them), in `dtype`, then filled from the checkpoint's tensors for it (checkpoint.load_weights).
    `skeleton`: model_skeleton of `path`'s vision tower."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = type(skeleton)._from_config(skeleton.config, dtype=dtype)
    load_weights(model, path, "vision tower")
    return model


def load_image_processor(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The model folder's image processor (the one extraction uses, so masks can follow its geometry);
    one that is the folder's own code is refused by name unless `trust_remote_code`."""
    from transformers import AutoImageProcessor

    check_remote_code(path, trust_remote_code)
    try:
        return AutoImageProcessor.from_pretrained(Path(path), local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except ImportError as exc:  # DINOv3's processor exists only with the torchvision backend
        raise ConfigError(f"model.path {path}: its image processor (preprocessor_config.json) cannot load here: "
                          f"{str(exc).strip().splitlines()[0]}") from None


def check_takes_inputs(skeleton: nn.Module, kind: str) -> None:
    """ConfigError, before any weight loads, when the part of the checkpoint extraction runs (`skeleton`)
    takes no input_ids (text) or pixel_values (images): an audio model's encoder (Whisper's takes
    input_features) was a TypeError out of its first batch once its weights had loaded."""
    wanted = "pixel_values" if kind == "vision" else "input_ids"
    takes = inspect.signature(skeleton.forward).parameters  # transformers 5's all take **kwargs: not enough
    if wanted in takes:
        return
    raise ConfigError(f"{type(skeleton).__name__}'s forward takes {next(iter(takes), 'nothing')}, not {wanted} "
                      f"({'images' if kind == 'vision' else 'text'}): actstore runs text and image models only")


def load_model(path: str | Path, torch_dtype: str = "float32", device: str = "auto",
               tower: str | None = None, trust_remote_code: bool = False, preprocessor: Any = None,
               fix_mistral_regex: bool | None = None) -> LoadedModel:
    """Load weights and preprocessor from a local folder; never touches a hub. `tower`: model.tower
    (vision: a vision-language checkpoint's vision tower runs, on images; its config is run_config's);
    `trust_remote_code`: model.trust_remote_code, needed by a checkpoint whose classes are its own code;
    `preprocessor`: the folder's tokenizer or image processor when the caller already loaded it;
    `fix_mistral_regex`: model.fix_mistral_regex, for the tokenizer loaded here (load_tokenizer)."""
    path = Path(path)
    checkpoint = read_model_config(path)
    check_tower(checkpoint, tower, path)
    check_remote_code(path, trust_remote_code)
    config = vision_tower_config(checkpoint) if tower == "vision" else checkpoint
    kind = model_kind(config)
    dev = pick_device(device)
    skeleton = model_skeleton(path, tower, trust_remote_code)  # built once: blocks, size, a tower's class
    # Refused on the weightless skeleton: a model whose blocks cannot be found loads no weights first.
    blocks_path, _ = find_model_blocks(skeleton, config)
    check_takes_inputs(skeleton, kind)
    if dev.type == "cuda":
        check_fits_on_gpu(path, skeleton, torch_dtype, dev)
    if tower == "vision":
        model = _vision_tower(path, skeleton, TORCH_DTYPES[torch_dtype])
    else:
        check_checkpoint_files(path)  # the tower's loader checks the files it reads
        model = _tower(checkpoint, _auto_class(checkpoint).from_pretrained(
            path, dtype=TORCH_DTYPES[torch_dtype], local_files_only=True, trust_remote_code=trust_remote_code), tower)
    model = weights_to_device(model, dev).eval()
    blocks = model.get_submodule(blocks_path)
    if preprocessor is None:
        preprocessor = (load_image_processor(path, trust_remote_code) if kind == "vision"
                        else load_tokenizer(path, trust_remote_code, fix_mistral_regex))
    return LoadedModel(model, path, config, kind, blocks, blocks_path, preprocessor, dev)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, fix_mistral_regex: bool | None = None) -> Any:
    """The model folder's tokenizer, with a pad token: right padding only, and pad positions are never
    stored, so any id works (id 0's token for a tokenizer with no eos or unk token either, as some
    byte-level BPEs are saved). It truncates on the right, whatever side the folder's
    tokenizer_config.json names (some name "left"): a text keeps its first tokens, as given token ids
    are cut and as part.json's n_truncated_samples says. One that is the folder's own code is refused
    by name unless `trust_remote_code` (transformers would prompt for it, or fail).
    `fix_mistral_regex`: model.fix_mistral_regex (None: transformers' default)."""
    from transformers import AutoTokenizer

    check_remote_code(path, trust_remote_code)
    if fix_mistral_regex:
        check_regex_split(Path(path))
    options = {} if fix_mistral_regex is None else {"fix_mistral_regex": fix_mistral_regex}
    tokenizer = AutoTokenizer.from_pretrained(Path(path), local_files_only=True, trust_remote_code=trust_remote_code,
                                              **options)
    if fix_mistral_regex is None and mistral_regex_fixed(tokenizer) is False:
        log.warning("model.path %s: transformers flags this Mistral-family tokenizer (saved before transformers 5) "
                    "as possibly splitting text with an incorrect regex and runs it as saved. Set "
                    "model.fix_mistral_regex: true for a tekken tokenizer (Mistral Small 3.1, Ministral, Magistral, "
                    "Devstral) to apply the corrected regex, or false to keep the saved one and silence this", path)
    tokenizer.truncation_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token or tokenizer.convert_ids_to_tokens(0)
    return tokenizer


def mistral_regex_fixed(tokenizer: Any) -> bool | None:
    """Whether transformers applied its corrected regex to a Mistral-family tokenizer it flagged
    (the flag lives on the tokenizers backend); None for a tokenizer it did not flag."""
    return getattr(getattr(tokenizer, "backend_tokenizer", None), "fix_mistral_regex", None)


def check_regex_split(path: Path) -> None:
    """model.fix_mistral_regex: true replaces the regex of a Split pre-tokenizer (a tekken tokenizer's);
    given a sentencepiece tokenizer (Metaspace, as Mistral 7B's) transformers swaps in a byte-level
    pre-tokenizer instead, and every token changes: refused, naming the key and the file."""
    file = path / "tokenizer.json"
    saved = read_model_json(file).get("pre_tokenizer") if file.is_file() else None
    kinds = [step.get("type") for step in (saved or {}).get("pretokenizers", [saved])] if saved else []
    if "Split" not in kinds:
        raise ConfigError(f"model.fix_mistral_regex: true, but {file} splits text with {kinds or 'no pre-tokenizer'}, "
                          "not the regex the fix replaces (a sentencepiece tokenizer, as Mistral 7B's, would have "
                          "every token changed): leave it unset or false")


def first_tensor(value: Any) -> torch.Tensor:
    """A block/module output or input as one tensor (HF blocks may return tuples)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    if hasattr(value, "last_hidden_state"):
        return value.last_hidden_state
    raise TypeError(f"cannot take a tensor from {type(value).__name__}")
