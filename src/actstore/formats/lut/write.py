"""Write a LUT: the spec tensors from an SAE and a target weight, then the lut/ directory atomically."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actstore.errors import ConfigError, FormatError
from actstore.formats.lut.check import metadata_problems, non_finite_problems, table_problems
from actstore.formats.lut.layout import (BIAS_KEY, DTYPES, LUT_DIR, META_FILE, REQUIRED_KEYS, SUFFIX, VERSION,
                                         lut_file)
from actstore.integrity import file_record, whole_number
from actstore.io_utils import atomic_path, utc_now
from actstore.safetensors_io import save_safetensors

if TYPE_CHECKING:
    import torch


def precompute(sae_state: dict[str, torch.Tensor], w_target: torch.Tensor, bias: torch.Tensor | None,
               dtype: str = "float16", name: str = "the LUT") -> dict[str, torch.Tensor]:
    """The six spec tensors (+ target_bias): products in float32, then everything cast to `dtype`.

    `w_target` is [input_dim, output_dim] (an nn.Linear's weight transposed). ConfigError naming
    `name` and the tensor when the cast would turn finite values into +-inf (float16's +-65504): a
    table that silently holds inf would make every lookup through it inf.
    """
    import torch  # here, not at the top: opening or checking a store never loads torch

    if dtype not in DTYPES:
        raise ConfigError(f"{name}: lut.dtype {dtype!r}, expected one of {', '.join(DTYPES)}")
    w = w_target.float()
    tensors = {key: sae_state[key].float() for key in REQUIRED_KEYS[:4]}
    tensors["precomputed_products"] = tensors["decoder_weight"] @ w
    tensors["bias_product"] = tensors["decoder_bias"] @ w
    if bias is not None:
        tensors[BIAS_KEY] = bias.float()
    cast = {key: value.to(getattr(torch, dtype)).contiguous() for key, value in tensors.items()}
    for key, value in cast.items():
        overflow = int((value.isinf() & tensors[key].isfinite()).sum())
        if overflow:
            raise ConfigError(f"{name} {key}: {overflow} values exceed {dtype}'s range (largest "
                              f"{tensors[key].abs().max().item():.4g}); use lut.dtype: bfloat16")
    return cast


def write_lut(root: str | Path, tables: dict[str, dict[str, torch.Tensor]], k_active: int,
              model_config: dict[str, Any] | None = None, creation_info: dict[str, Any] | None = None) -> Path:
    """Write `<root>/lut/` (metadata.json + one file per module path) atomically; return the lut dir.

    `tables` maps module path -> the tensors from precompute(); every table must share num_basis.
    """
    final = Path(root) / LUT_DIR
    for module_path, tensors in tables.items():  # named here, not a KeyError below
        if missing := [key for key in REQUIRED_KEYS if key not in tensors]:
            raise FormatError(f"{final}: the tables of {module_path!r} lack {missing}")
    if not tables:
        raise FormatError(f"{final}: no tables to write (a LUT lists at least one layer)")
    num_basis = {t["encoder_weight"].shape[0] for t in tables.values()}
    if len(num_basis) != 1:
        raise FormatError(f"{final}: tables disagree on num_basis {sorted(num_basis)}")
    if not whole_number(k_active):  # int() made 2.5 a k_active of 2, True one of 1, "3" one of 3
        raise FormatError(f"{final}: k_active {k_active!r} is not a whole number")
    if not 1 <= k_active <= min(num_basis):  # a store its own verify would refuse
        raise FormatError(f"{final}: k_active {k_active} is not within 1..num_basis {min(num_basis)}")
    for module_path in tables:  # the file is saved under lut/ by this name: a '/' would lead elsewhere
        if Path(lut_file(module_path)).name != lut_file(module_path):
            raise FormatError(f"{final}: module path {module_path!r} gives no bare file name "
                              f"({lut_file(module_path)!r}), as the spec's '{{layer_path}}{SUFFIX}' needs")
    layers = {}
    with atomic_path(final) as tmp:
        tmp.mkdir()
        for module_path, tensors in tables.items():
            file = lut_file(module_path)
            save_safetensors(tensors, tmp / file, {"format": "lut", "version": VERSION})
            in_dim, out_dim = tensors["decoder_weight"].shape[1], tensors["precomputed_products"].shape[1]
            record = file_record(tmp / file)
            layers[module_path] = {"input_dim": int(in_dim), "output_dim": int(out_dim), "file": file,
                                   "sha256": record["sha256"], "bytes": record["bytes"],
                                   "dtype": str(tensors["precomputed_products"].dtype).removeprefix("torch."),
                                   "has_bias": BIAS_KEY in tensors}
            # Checked as verify checks it, before the store is published: a table of another width or
            # dtype, or holding a NaN or inf (a model weight holding one), would make a store its own verify refuses.
            if problems := table_problems(tmp / file, {"sae_config": {"num_basis": min(num_basis)}},
                                          layers[module_path]) or non_finite_problems(tmp / file):
                raise FormatError(f"{final / file}: not written, " + "; ".join(
                    problem.removeprefix(f"{tmp / file}: ") for problem in problems))
        info = {"created_at": utc_now().strftime("%Y-%m-%dT%H:%M:%SZ"),
                **(creation_info or {})}
        meta = {"version": VERSION, "sae_config": {"num_basis": num_basis.pop(), "k_active": int(k_active)},
                "model_config": model_config or {}, "layers": layers, "creation_info": info}
        if problems := metadata_problems(meta, final / META_FILE):  # the caller's model_config, creation_info
            raise FormatError(f"{problems[0]} (not written)")
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return final
