"""The LUT layout: the only place that knows its names, keys, shapes and dtypes.

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

import re
from pathlib import Path

VERSION = "1.0"
LUT_DIR = "lut"
META_FILE = "metadata.json"
SUFFIX = ".lut.safetensors"
REQUIRED_KEYS = ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias",
                 "precomputed_products", "bias_product")
BIAS_KEY = "target_bias"
DTYPES = ("float16", "bfloat16")  # lut.dtype: the tables' dtype, by its torch name
SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16"}


def lut_file(module_path: str) -> str:
    return f"{module_path}{SUFFIX}"


def expected_shapes(num_basis: int, input_dim: int, output_dim: int) -> dict[str, tuple[int, ...]]:
    return {"encoder_weight": (num_basis, input_dim), "encoder_bias": (num_basis,),
            "decoder_weight": (num_basis, input_dim), "decoder_bias": (input_dim,),
            "precomputed_products": (num_basis, output_dim), "bias_product": (output_dim,),
            BIAS_KEY: (output_dim,)}


def lut_dir(path: str | Path) -> Path:
    """Accept either the lut/ directory itself or the directory above it."""
    path = Path(path)
    return path if (path / META_FILE).is_file() or not (path / LUT_DIR).is_dir() else path / LUT_DIR


def layer_index(module_path: str) -> int | None:
    """The block index in a module path ('encoder.layer.3.attention.self.query' -> 3)."""
    match = re.search(r"\.(\d+)(?:\.|$)", module_path)
    return int(match.group(1)) if match else None
