"""Load a local HF model for extraction and locate its transformer blocks and hook targets."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from actstore.errors import ConfigError

PACKAGE_PREFIX = "package:"
VISION_TYPES = ("dinov2", "dinov2_with_registers", "clip", "clip_vision_model", "siglip",
                "siglip_vision_model", "vit")
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


def read_model_config(path: str | Path) -> dict[str, Any]:
    """The model folder's config.json as a dict."""
    return json.loads((Path(path) / "config.json").read_text())


def model_kind(config: dict[str, Any]) -> str:
    """'vision', 'causal' or 'encoder' from a config.json dict."""
    if config.get("model_type") in VISION_TYPES:
        return "vision"
    if any(a.endswith(CAUSAL_SUFFIXES) for a in config.get("architectures") or []):
        return "causal"
    return "encoder"


# The names one size setting goes by across model families' config.json (GPT-2: n_embd, n_layer...).
CONFIG_ALIASES = {"hidden_size": ("hidden_size", "n_embd", "d_model"),
                  "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
                  "num_attention_heads": ("num_attention_heads", "n_head"),
                  "vocab_size": ("vocab_size",)}


def config_int(config: dict[str, Any], setting: str) -> int | None:
    """An integer size setting (a CONFIG_ALIASES key) from config.json under any of its names, else
    from the nested vision_config (vision towers) or text_config; None when no scope has it."""
    scopes = (config, config.get("vision_config") or {}, config.get("text_config") or {})
    return next((scope[name] for scope in scopes for name in CONFIG_ALIASES[setting]
                 if isinstance(scope.get(name), int)), None)


def num_blocks(config: dict[str, Any]) -> int:
    """Number of transformer blocks, from config.json (vision towers nest it in vision_config)."""
    blocks = config_int(config, "num_hidden_layers")
    if blocks is None:
        raise ConfigError("model config.json names no num_hidden_layers / n_layer")
    return blocks


def model_params(config: dict[str, Any]) -> dict[str, int | None]:
    """hidden_size, num_hidden_layers, num_attention_heads, vocab_size from a config.json dict
    (None where the model has none, e.g. a vision tower's vocab_size)."""
    return {setting: config_int(config, setting) for setting in CONFIG_ALIASES}


def find_blocks(model: nn.Module, n_blocks: int) -> tuple[str, nn.ModuleList]:
    """The ModuleList of transformer blocks: the shallowest ModuleList of length n_blocks."""
    candidates = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == n_blocks
    ]
    if not candidates:
        raise ConfigError(f"{type(model).__name__}: no ModuleList of {n_blocks} transformer blocks")
    return min(candidates, key=lambda item: item[0].count("."))


def get_module(model: nn.Module, module_path: str) -> nn.Module:
    """Resolve a module path on the model, or on its base model (AutoModel naming)."""
    for root in (model, getattr(model, "base_model", model)):
        try:
            return root.get_submodule(module_path)
        except AttributeError:
            continue
    raise ConfigError(f"extract.hooks: module {module_path!r} does not exist in {type(model).__name__}")


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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _from_pretrained(kind: str, path: Path, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM

    cls = AutoModelForCausalLM if kind == "causal" else AutoModel
    return _vision_tower(kind, cls.from_pretrained(path, dtype=dtype, local_files_only=True))


def _vision_tower(kind: str, model: nn.Module) -> nn.Module:
    """Composite image-text checkpoints: keep the vision tower only."""
    if kind == "vision" and hasattr(model, "vision_model") and hasattr(model, "text_model"):
        return model.vision_model
    return model


def model_skeleton(path: str | Path) -> nn.Module:
    """The model's module tree with no weights (meta device, seconds even for large models), so
    module paths (hooks, LUT targets) are checked before any weight is loaded."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    kind = model_kind(read_model_config(path))
    cls = AutoModelForCausalLM if kind == "causal" else AutoModel
    with torch.device("meta"):
        return _vision_tower(kind, cls.from_config(AutoConfig.from_pretrained(Path(path), local_files_only=True)))


def load_image_processor(path: str | Path) -> Any:
    """The model folder's image processor (the one extraction uses, so masks can follow its geometry)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(Path(path), local_files_only=True)


def load_model(path: str | Path, torch_dtype: str = "float32", device: str = "auto") -> LoadedModel:
    """Load weights and preprocessor from a local folder; never touches a hub."""
    from transformers import AutoTokenizer

    path = Path(path)
    config = read_model_config(path)
    kind = model_kind(config)
    dev = pick_device(device)
    model = _from_pretrained(kind, path, TORCH_DTYPES[torch_dtype]).to(dev).eval()
    blocks_path, blocks = find_blocks(model, num_blocks(config))
    if kind == "vision":
        preprocessor = load_image_processor(path)
    else:
        preprocessor = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if preprocessor.pad_token_id is None:
            # Right padding only; pad positions are never stored, so any id works.
            preprocessor.pad_token = preprocessor.eos_token or preprocessor.unk_token
    return LoadedModel(model, path, config, kind, blocks, blocks_path, preprocessor, dev)


def first_tensor(value: Any) -> torch.Tensor:
    """A block/module output or input as one tensor (HF blocks may return tuples)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    if hasattr(value, "last_hidden_state"):
        return value.last_hidden_state
    raise TypeError(f"cannot take a tensor from {type(value).__name__}")
