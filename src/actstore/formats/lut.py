"""SAE lookup tables (LUTs), exactly per ../shared/specs/lut-format.zh.md v1.0.

Layout (`<root>/lut/`, `<root>` = the lut stage directory):
  metadata.json                      version, sae_config {num_basis, k_active}, model_config, layers
                                     {path: {input_dim, output_dim, file}}, creation_info
  {module_path}.lut.safetensors      encoder_weight [B, in], encoder_bias [B], decoder_weight [B, in],
                                     decoder_bias [in], precomputed_products [B, out], bias_product [out]
                                     (B = num_basis), all float16 (or bfloat16)
Optional keys (extensions, never changed meanings):
  safetensors  target_bias [out]     the linear layer's own bias, when it has one (the spec's formula
                                     omits it: output = Step B + target_bias)
  metadata.json layers.{path}.sha256 / .bytes / .dtype / .has_bias; creation_info.hook / .format_writer
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actstore.errors import FormatError
from actstore.io_utils import atomic_path, sha256_file, utc_now

VERSION = "1.0"
LUT_DIR = "lut"
META_FILE = "metadata.json"
SUFFIX = ".lut.safetensors"
REQUIRED_KEYS = ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias",
                 "precomputed_products", "bias_product")
BIAS_KEY = "target_bias"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16"}


def lut_file(module_path: str) -> str:
    return f"{module_path}{SUFFIX}"


def expected_shapes(num_basis: int, input_dim: int, output_dim: int) -> dict[str, tuple[int, ...]]:
    return {"encoder_weight": (num_basis, input_dim), "encoder_bias": (num_basis,),
            "decoder_weight": (num_basis, input_dim), "decoder_bias": (input_dim,),
            "precomputed_products": (num_basis, output_dim), "bias_product": (output_dim,),
            BIAS_KEY: (output_dim,)}


def precompute(sae_state: dict[str, torch.Tensor], w_target: torch.Tensor, bias: torch.Tensor | None,
               dtype: str = "float16") -> dict[str, torch.Tensor]:
    """The six spec tensors (+ target_bias): products in float32, then everything cast to `dtype`.

    `w_target` is [input_dim, output_dim] (an nn.Linear's weight transposed).
    """
    w = w_target.float()
    tensors = {key: sae_state[key].float() for key in REQUIRED_KEYS[:4]}
    tensors["precomputed_products"] = tensors["decoder_weight"] @ w
    tensors["bias_product"] = tensors["decoder_bias"] @ w
    if bias is not None:
        tensors[BIAS_KEY] = bias.float()
    return {key: value.to(DTYPES[dtype]).contiguous() for key, value in tensors.items()}


def write_lut(root: str | Path, tables: dict[str, dict[str, torch.Tensor]], k_active: int,
              model_config: dict[str, Any] | None = None, creation_info: dict[str, Any] | None = None) -> Path:
    """Write `<root>/lut/` (metadata.json + one file per module path) atomically; return the lut dir.

    `tables` maps module path -> the tensors from precompute(); every table must share num_basis.
    """
    from safetensors.torch import save_file

    final = Path(root) / LUT_DIR
    num_basis = {t["encoder_weight"].shape[0] for t in tables.values()}
    if len(num_basis) != 1:
        raise FormatError(f"{final}: tables disagree on num_basis {sorted(num_basis)}")
    layers = {}
    with atomic_path(final) as tmp:
        tmp.mkdir()
        for module_path, tensors in tables.items():
            file = lut_file(module_path)
            save_file(tensors, str(tmp / file), metadata={"format": "lut", "version": VERSION})
            in_dim, out_dim = tensors["decoder_weight"].shape[1], tensors["precomputed_products"].shape[1]
            layers[module_path] = {"input_dim": int(in_dim), "output_dim": int(out_dim), "file": file,
                                   "sha256": sha256_file(tmp / file), "bytes": (tmp / file).stat().st_size,
                                   "dtype": str(tensors["precomputed_products"].dtype).removeprefix("torch."),
                                   "has_bias": BIAS_KEY in tensors}
        info = {"created_at": utc_now().strftime("%Y-%m-%dT%H:%M:%SZ"),
                **(creation_info or {})}
        meta = {"version": VERSION, "sae_config": {"num_basis": num_basis.pop(), "k_active": int(k_active)},
                "model_config": model_config or {}, "layers": layers, "creation_info": info}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return final


def lut_dir(path: str | Path) -> Path:
    """Accept either the lut/ directory itself or the directory above it."""
    path = Path(path)
    return path if (path / META_FILE).is_file() or not (path / LUT_DIR).is_dir() else path / LUT_DIR


def read_metadata(path: str | Path) -> dict[str, Any]:
    """metadata.json with every spec-required field checked; FormatError names the field."""
    meta_path = lut_dir(path) / META_FILE
    if not meta_path.is_file():
        raise FormatError(f"{meta_path}: missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{meta_path}: not JSON ({exc})") from None
    problems = metadata_problems(meta, meta_path)
    if problems:
        raise FormatError(problems[0])
    return meta


def metadata_problems(meta: Any, meta_path: Path) -> list[str]:
    if not isinstance(meta, dict):
        return [f"{meta_path}: top level is not an object"]
    problems = []
    if not isinstance(meta.get("version"), str):
        problems.append(f"{meta_path}: field 'version' missing or not a string")
    sae_config = meta.get("sae_config")
    for key in ("num_basis", "k_active"):
        if not isinstance(sae_config, dict) or not _is_int(sae_config.get(key)) or sae_config[key] < 1:
            problems.append(f"{meta_path}: field 'sae_config.{key}' missing or not a positive int")
    if not problems and meta["sae_config"]["k_active"] > meta["sae_config"]["num_basis"]:
        problems.append(f"{meta_path}: sae_config.k_active > sae_config.num_basis")
    for key in ("model_config", "creation_info"):
        if key in meta and not isinstance(meta[key], dict):
            problems.append(f"{meta_path}: field '{key}' is not an object")
    layers = meta.get("layers")
    if not isinstance(layers, dict) or not layers:
        return problems + [f"{meta_path}: field 'layers' missing, empty or not an object"]
    for name, entry in layers.items():
        for key in ("input_dim", "output_dim"):
            if not isinstance(entry, dict) or not _is_int(entry.get(key)) or entry[key] < 1:
                problems.append(f"{meta_path}: field 'layers.{name}.{key}' missing or not a positive int")
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            problems.append(f"{meta_path}: field 'layers.{name}.file' missing or not a string")
        elif Path(entry["file"]).name != entry["file"] or not entry["file"].endswith(SUFFIX):
            problems.append(f"{meta_path}: layers.{name}.file {entry['file']!r} must be a bare '*{SUFFIX}' name")
    return problems


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def table_problems(file_path: Path, meta: dict[str, Any], entry: dict[str, Any]) -> list[str]:
    """Keys, shapes and dtypes of one LUT file, read from its safetensors header (no tensor data)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file_path), framework="pt") as fh:
            infos = {key: (tuple(fh.get_slice(key).get_shape()), fh.get_slice(key).get_dtype()) for key in fh.keys()}
    except Exception as exc:  # a truncated or garbled header: safetensors raises its own errors
        return [f"{file_path}: unreadable safetensors ({exc})"]
    shapes = expected_shapes(meta["sae_config"]["num_basis"], entry["input_dim"], entry["output_dim"])
    problems = [f"{file_path}: missing key {key!r}" for key in REQUIRED_KEYS if key not in infos]
    dtypes = set()
    for key, (shape, dtype) in infos.items():
        if key not in shapes:
            continue  # unknown extra keys are allowed, never interpreted
        if shape != shapes[key]:
            problems.append(f"{file_path}: key {key!r} has shape {list(shape)}, expected {list(shapes[key])}")
        if dtype not in SAFETENSORS_DTYPES:
            problems.append(f"{file_path}: key {key!r} has dtype {dtype}, expected F16 or BF16")
        dtypes.add(dtype)
    if len(dtypes) > 1:
        problems.append(f"{file_path}: mixed dtypes {sorted(dtypes)}")
    return problems


class LutStore:
    """An opened lut/ directory: metadata plus validated per-layer tables."""

    def __init__(self, path: str | Path):
        self.dir = lut_dir(path)
        self.meta = read_metadata(self.dir)

    @property
    def layers(self) -> dict[str, dict[str, Any]]:
        return self.meta["layers"]

    @property
    def k_active(self) -> int:
        return self.meta["sae_config"]["k_active"]

    @property
    def num_basis(self) -> int:
        return self.meta["sae_config"]["num_basis"]

    def load(self, module_path: str) -> dict[str, torch.Tensor]:
        """One layer's tensors after checking keys, shapes and dtypes; FormatError names file and key."""
        from safetensors.torch import load_file

        if module_path not in self.layers:
            raise FormatError(f"{self.dir / META_FILE}: no layer {module_path!r}; has {sorted(self.layers)}")
        entry = self.layers[module_path]
        file_path = self.dir / entry["file"]
        if not file_path.is_file():
            raise FormatError(f"{file_path}: missing (listed in metadata.json layers.{module_path})")
        problems = table_problems(file_path, self.meta, entry)
        if problems:
            raise FormatError("; ".join(problems))
        return load_file(str(file_path))


def open_lut(path: str | Path) -> LutStore:
    return LutStore(path)


# ---------------------------------------------------------------- CLI / validate-stage interface

def detect(path: str | Path) -> bool:
    """A lut/ directory (or its parent) with a metadata.json naming sae_config and layers."""
    meta_path = lut_dir(path) / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "sae_config" in meta and "layers" in meta


def layer_index(module_path: str) -> int | None:
    """The block index in a module path ('encoder.layer.3.attention.self.query' -> 3)."""
    match = re.search(r"\.(\d+)(?:\.|$)", module_path)
    return int(match.group(1)) if match else None


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary for `actstore inspect`: a LUT stores tables, not activations (n_examples is None)."""
    store = LutStore(path)
    files = [store.dir / entry["file"] for entry in store.layers.values()]
    indices = sorted({i for i in (layer_index(p) for p in store.layers) if i is not None})
    first = next(iter(store.layers.values()))
    return {
        "format": "lut", "version": store.meta["version"],
        "model": store.meta.get("creation_info", {}).get("source_model"),
        "layers": indices, "targets": sorted(store.layers), "n_examples": None, "n_tokens": None,
        "d_model": store.meta.get("model_config", {}).get("hidden_size", first["input_dim"]),
        "dtype": first.get("dtype", "float16"), "n_shards": len(files),
        "bytes": sum(f.stat().st_size for f in files if f.is_file()) + (store.dir / META_FILE).stat().st_size,
        "num_basis": store.num_basis, "k_active": store.k_active,
        "input_dims": {p: e["input_dim"] for p, e in store.layers.items()},
        "output_dims": {p: e["output_dim"] for p, e in store.layers.items()},
    }


def verify(path: str | Path) -> list[str]:
    """Every required field, every file's size, sha256 (when recorded), keys, shapes and dtypes."""
    root = lut_dir(path)
    meta_path = root / META_FILE
    if not meta_path.is_file():
        return [f"{meta_path}: missing"]
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return [f"{meta_path}: not JSON ({exc})"]
    problems = metadata_problems(meta, meta_path)
    if problems:
        return problems
    for name, entry in meta["layers"].items():
        file_path = root / entry["file"]
        if not file_path.is_file():
            problems.append(f"{file_path}: missing (listed in metadata.json layers.{name})")
            continue
        if "bytes" in entry and file_path.stat().st_size != entry["bytes"]:
            problems.append(f"{file_path}: {file_path.stat().st_size} bytes, metadata.json says {entry['bytes']}")
            continue
        if "sha256" in entry and sha256_file(file_path) != entry["sha256"]:
            problems.append(f"{file_path}: sha256 mismatch with metadata.json")
            continue
        problems.extend(table_problems(file_path, meta, entry))
    listed = {entry["file"] for entry in meta["layers"].values()}
    problems += [f"{f}: LUT file not listed in metadata.json" for f in sorted(root.glob(f"*{SUFFIX}"))
                 if f.name not in listed]
    return problems


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """A LUT holds lookup tables, not activations: no (sample, layer, token) vector is stored."""
    return None
