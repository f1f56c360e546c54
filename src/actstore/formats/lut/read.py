"""Read a LUT: metadata.json checked field by field, each table checked before it is loaded."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from actstore.errors import FormatError
from actstore.formats.lut.check import read_metadata, table_problems
from actstore.formats.lut.check import verify as check_store
from actstore.formats.lut.layout import BIAS_KEY, META_FILE, REQUIRED_KEYS, lut_dir
from actstore.integrity import inside, refuse

if TYPE_CHECKING:  # load() imports it: opening or checking a store never loads torch
    import torch


class LutStore:
    """An opened lut/ directory: metadata plus validated per-layer tables."""

    def __init__(self, path: str | Path):
        self.dir = lut_dir(path)
        self.meta = read_metadata(self.dir)

    @property
    def layers(self) -> dict[str, dict[str, Any]]:
        return self.meta["layers"]

    @property
    def layers_source(self) -> str:
        """Where the layers' module paths come from, for an error naming one the model lacks."""
        return f"{self.dir / META_FILE} layers"

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
        file_path = inside(self.dir, entry["file"], f"{self.dir / META_FILE} layers.{module_path}.file")
        if not file_path.is_file():
            raise FormatError(f"{file_path}: missing (listed in metadata.json layers.{module_path})")
        problems = table_problems(file_path, self.meta, entry)
        if problems:
            raise FormatError("; ".join(problems))
        tables = load_file(str(file_path))
        refuse(non_finite(file_path, tables))
        return tables


def non_finite(file_path: Path, tables: dict[str, torch.Tensor]) -> list[str]:
    """A problem for each spec key (or target_bias) holding inf or NaN: products of a finite SAE and
    layer weight never do (precompute refuses an overflow), and one such row makes every token that
    selects it NaN, even at weight 0. By each tensor's max and min (NaN propagates; no temporary of
    a table's size); the count only for the message."""
    import torch

    problems = []
    for key in (*REQUIRED_KEYS, BIAS_KEY):
        value = tables.get(key)
        if value is not None and not torch.stack([value.amax(), value.amin()]).isfinite().all():
            problems.append(f"{file_path}: key {key!r} holds {int((~value.isfinite()).sum())} inf or NaN values")
    return problems


def open_lut(path: str | Path, verify: bool = False) -> LutStore:
    """Open a lut/ directory (or its parent). verify=True first checks every table's size, sha256
    (when recorded), keys, shapes, dtypes and values (no inf or NaN); by default each table is checked
    when it loads."""
    if verify:
        from actstore.hashing import stage_problems
        refuse(check_store(path) + stage_problems(path))
    return LutStore(path)
