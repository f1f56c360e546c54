"""Read a LUT: metadata.json checked field by field, each table checked before it is loaded."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from actstore.errors import FormatError
from actstore.formats.lut.check import non_finite_problems, read_metadata, table_problems
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
        """One layer's spec tensors (and target_bias) after checking keys, shapes, dtypes and values (no
        inf or NaN: check.non_finite_problems, as verify checks them); FormatError names file and key.
        Another key is never read: extra keys are never interpreted, and one of a dtype torch lacks (F6_E2M3)
        failed the whole load naming no file."""
        from safetensors import safe_open

        if module_path not in self.layers:
            raise FormatError(f"{self.dir / META_FILE}: no layer {module_path!r}; has {sorted(self.layers)}")
        entry = self.layers[module_path]
        file_path = inside(self.dir, entry["file"], f"{self.dir / META_FILE} layers.{module_path}.file")
        if not file_path.is_file():
            raise FormatError(f"{file_path}: missing (listed in metadata.json layers.{module_path})")
        refuse(table_problems(file_path, self.meta, entry) or non_finite_problems(file_path))
        with safe_open(str(file_path), framework="pt") as fh:
            keys = set(fh.keys())
            return {key: fh.get_tensor(key) for key in (*REQUIRED_KEYS, BIAS_KEY) if key in keys}


def open_lut(path: str | Path, verify: bool = False) -> LutStore:
    """Open a lut/ directory (or its parent). verify=True first checks every table's size, sha256
    (when recorded), keys, shapes, dtypes and values (no inf or NaN); by default each table is checked
    when it loads."""
    if verify:
        from actstore.hashing import stage_problems
        refuse(check_store(path) + stage_problems(path))
    return LutStore(path)
