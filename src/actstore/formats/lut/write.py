"""Write a LUT: the spec tensors from an SAE and a target weight, then the lut/ directory atomically."""
from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actstore.errors import ConfigError, FormatError
from actstore.formats.lut.check import metadata_problems, non_finite_problems, optional_field_problems, table_problems
from actstore.formats.lut.layout import (BIAS_KEY, DTYPES, LUT_DIR, META_FILE, REQUIRED_KEYS, SUFFIX, VERSION,
                                         lut_file)
from actstore.integrity import file_record, whole_number
from actstore.io_utils import atomic_path, utc_now
from actstore.safetensors_io import save_safetensors

if TYPE_CHECKING:
    import torch

Tables = dict[str, "torch.Tensor"]  # one target's tensors, by key (precompute)


def precompute(sae_state: dict[str, torch.Tensor], w_target: torch.Tensor, bias: torch.Tensor | None,
               dtype: str = "float16", name: str = "the LUT") -> dict[str, torch.Tensor]:
    """The six spec tensors (+ target_bias): products in float32, then everything cast to `dtype`.

    `w_target` is [input_dim, output_dim] (an nn.Linear's weight transposed, a transformers Conv1D's as
    stored). ConfigError naming `name` and the tensor when the cast would turn finite values into +-inf
    (float16's +-65504): a table that silently holds inf would make every lookup through it inf.
    """
    import torch  # here, not at the top: opening or checking a store never loads torch

    if dtype not in DTYPES:
        raise ConfigError(f"{name}: lut.dtype {dtype!r}, expected one of {', '.join(DTYPES)}")
    if w_target.ndim != 2 or w_target.shape[0] != sae_state["decoder_weight"].shape[1]:  # torch's error names no target
        raise ConfigError(f"{name}: w_target {list(w_target.shape)} is not [input_dim, output_dim] of the SAE's "
                          f"input_dim {sae_state['decoder_weight'].shape[1]} (an nn.Linear's weight transposed, a "
                          "Conv1D's as stored)")
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


def write_lut(root: str | Path, tables: Mapping[str, Tables] | Iterable[tuple[str, Tables]], k_active: int,
              model_config: dict[str, Any] | None = None, creation_info: dict[str, Any] | None = None) -> Path:
    """Write `<root>/lut/` (metadata.json + one file per module path) atomically; return the lut dir.

    `tables`: (module path, the tensors from precompute()) pairs, or a dict of them; every table must share
    num_basis. Each pair is checked, written and let go before the next is taken, so pairs made as they are
    asked for (lut.build_tables) hold one target's tables at a time, not every target's (GBs each). A
    pair refused leaves nothing under `<root>/lut/`: the directory is published whole, metadata.json last.
    """
    final = Path(root) / LUT_DIR
    if not whole_number(k_active):  # int() made 2.5 a k_active of 2, True one of 1, "3" one of 3
        raise FormatError(f"{final}: k_active {k_active!r} is not a whole number")
    info = {"created_at": utc_now().strftime("%Y-%m-%dT%H:%M:%SZ"), **(creation_info or {})}
    given = {"model_config": model_config or {}, "creation_info": info}
    if problems := optional_field_problems(given, final / META_FILE):  # named before any table is made
        raise FormatError(f"{problems[0]} (not written)")
    pairs = iter(tables.items() if isinstance(tables, Mapping) else tables)
    first = [next(pairs, None)]  # checked before atomic_path makes `root`: refused, it leaves nothing behind
    if first[0] is None:
        raise FormatError(f"{final}: no tables to write (a LUT lists at least one layer)")
    checked_num_basis(final, *first[0], 0, k_active, {})
    layers: dict[str, dict[str, Any]] = {}
    num_basis = 0
    with atomic_path(final) as tmp:
        tmp.mkdir()
        for module_path, tensors in itertools.chain(drained(first), pairs):
            num_basis = checked_num_basis(final, module_path, tensors, num_basis, k_active, layers)
            layers[module_path] = write_table(tmp, final, module_path, tensors, num_basis)
            del tensors  # the next pair is made while this name still holds the last: one target's tables at a time
        meta = {"version": VERSION, "sae_config": {"num_basis": num_basis, "k_active": int(k_active)},
                "model_config": given["model_config"], "layers": layers, "creation_info": info}
        if problems := metadata_problems(meta, final / META_FILE):  # as verify will read it
            raise FormatError(f"{problems[0]} (not written)")
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return final


def drained(held: list[Any]) -> Iterator[Any]:
    """`held`'s items, each taken out of it as it is given: a list (or chain's arguments) still holding the
    first target's tables would keep them alive through every later target's."""
    while held:
        yield held.pop(0)


def checked_num_basis(final: Path, module_path: str, tensors: dict[str, torch.Tensor], num_basis: int,
                      k_active: int, layers: dict[str, Any]) -> int:
    """The num_basis of `tensors`, FormatError naming the store and `module_path` when they lack a key,
    its name gives no bare file name or was given before, or their num_basis is not the earlier tables'
    (`num_basis`; 0 for the first, then checked against k_active)."""
    if missing := [key for key in REQUIRED_KEYS if key not in tensors]:  # named here, not a KeyError below
        raise FormatError(f"{final}: the tables of {module_path!r} lack {missing}")
    if Path(lut_file(module_path)).name != lut_file(module_path):  # saved under lut/ by this name: a '/' leads out
        raise FormatError(f"{final}: module path {module_path!r} gives no bare file name "
                          f"({lut_file(module_path)!r}), as the spec's '{{layer_path}}{SUFFIX}' needs")
    if module_path in layers:  # its file would replace the first one's, and metadata.json list one of them
        raise FormatError(f"{final}: the tables of {module_path!r} are given twice")
    basis = int(tensors["encoder_weight"].shape[0])
    if num_basis and basis != num_basis:
        raise FormatError(f"{final}: tables disagree on num_basis {sorted({num_basis, basis})} "
                          f"({module_path!r} has {basis})")
    if not 1 <= k_active <= basis:  # a store its own verify would refuse
        raise FormatError(f"{final}: k_active {k_active} is not within 1..num_basis {basis}")
    return basis


def write_table(tmp: Path, final: Path, module_path: str, tensors: dict[str, torch.Tensor],
                num_basis: int) -> dict[str, Any]:
    """One target's file saved in the store being written (`tmp`, published as `final`) and checked as
    verify checks it; its metadata.json layers entry."""
    file = lut_file(module_path)
    save_safetensors(tensors, tmp / file, {"format": "lut", "version": VERSION})
    record = file_record(tmp / file)
    entry = {"input_dim": int(tensors["decoder_weight"].shape[1]),
             "output_dim": int(tensors["precomputed_products"].shape[1]), "file": file,
             "sha256": record["sha256"], "bytes": record["bytes"],
             "dtype": str(tensors["precomputed_products"].dtype).removeprefix("torch."),
             "has_bias": BIAS_KEY in tensors}
    # Checked before the store is published: a table of another width or dtype, or holding a NaN or inf
    # (a model weight holding one), would make a store its own verify refuses.
    if problems := (table_problems(tmp / file, {"sae_config": {"num_basis": num_basis}}, entry)
                    or non_finite_problems(tmp / file)):
        raise FormatError(f"{final / file}: not written, " + "; ".join(
            problem.removeprefix(f"{tmp / file}: ") for problem in problems))
    return entry
