"""The store formats actstore writes and reads, behind one interface and one registry.

Every list of formats or stages in the package (config, hashing, verify, the `actstore` command)
is read from REGISTRY. A sixth format: one module with the Format functions, one line here.
"""
from __future__ import annotations

import fnmatch
import importlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np


class Format(Protocol):
    """What every format module provides (`actstore inspect / verify`, the validate stage)."""

    def detect(self, path: str | Path) -> bool: ...
    def inspect(self, path: str | Path) -> dict[str, Any]: ...
    def verify(self, path: str | Path) -> list[str]: ...
    def read_vector(self, path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None: ...


@dataclass(frozen=True)
class FormatEntry:
    name: str           # the stage name, and what `actstore inspect` reports
    module: str         # the module implementing Format
    stage: bool         # a format stage built from the extraction (target `<name>`)
    # Globs that claim a directory for the format by its file names alone (any one group, every glob
    # in it matching), so a store whose metadata no longer parses is still verified, and named.
    markers: tuple[tuple[str, ...], ...] = ()
    # Names (fnmatch) of the format's metadata documents that are not *.json, which a workflow stage
    # seals in its stage config with the JSON ones (is_metadata_name).
    metadata: tuple[str, ...] = ()

    def claims(self, path: Path) -> bool:
        return any(all(_named(path, glob) for glob in group) for group in self.markers)


def _named(root: Path, glob: str) -> bool:
    """Whether an entry under `root` is named by `glob` ('/'-separated fnmatch parts), by names
    alone: a link is never followed, nor its target looked at. A link named by a folder part is
    taken to hold the rest (it may lead outside, where nothing is read; verify names it)."""
    if not root.is_dir():
        return False
    folders, parts = [root], glob.split("/")
    for depth, part in enumerate(parts):
        found = []
        for folder in folders:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if not fnmatch.fnmatchcase(entry.name, part):
                        continue
                    if depth == len(parts) - 1 or entry.is_symlink():
                        return True
                    if entry.is_dir(follow_symlinks=False):
                        found.append(entry.path)
        folders = found
    return False


# Detection order: more specific layouts first. Format stages run in this order too.
REGISTRY = (
    FormatEntry("lut", "actstore.formats.lut", stage=False,
                markers=(("lut/metadata.json",), ("lut/*.lut.safetensors",), ("*.lut.safetensors",))),
    FormatEntry("saev", "actstore.formats.saev", stage=True,
                markers=(("shards.json",), ("metadata.json", "acts*.bin"), ("saev.json",))),
    FormatEntry("pickle", "actstore.formats.pickle", stage=True,
                markers=(("shard_*.pkl*",), ("machine-*/metadata.json",), ("machine-*/shard_*.pkl*",))),
    FormatEntry("lmprobe", "actstore.formats.lmprobe", stage=True,
                markers=(("index/*.parquet", "tensors"), ("dataset/index/*.parquet", "dataset/tensors"),
                         ("SHA256SUMS", "tensors"), ("dataset/SHA256SUMS", "dataset/tensors")),
                metadata=("SHA256SUMS",)),
    FormatEntry("zarr", "actstore.formats.zarr", stage=True,
                markers=(("manifest.json",), ("shards/*.zarr",), (".zattrs", "arrays"),
                         ("meta/files.json", "arrays")),
                metadata=(".zarray", ".zattrs", ".zgroup", ".zmetadata")),
    FormatEntry("extract", "actstore.formats.extract", stage=False,
                markers=(("part.json",), ("part-0000/part.json",), ("extract.json",), ("samples.jsonl", "offsets.npy"))),
)
FORMAT_NAMES = tuple(entry.name for entry in REGISTRY)
FORMAT_STAGES = tuple(entry.name for entry in REGISTRY if entry.stage)
METADATA_NAMES = ("*.json", *(glob for entry in REGISTRY for glob in entry.metadata))
_METADATA_NAME = re.compile("|".join(fnmatch.translate(glob) for glob in METADATA_NAMES))


def is_metadata_name(name: str) -> bool:
    """Whether a file named `name` is a metadata document of some format or stage (what a workflow
    stage seals in its stage config): every JSON file, and the formats' own (METADATA_NAMES)."""
    return _METADATA_NAME.match(name) is not None


def format_module(name: str) -> Format:
    """The module implementing format `name` (imported on first use)."""
    entry = next((e for e in REGISTRY if e.name == name), None)
    if entry is None:
        raise KeyError(f"unknown format {name!r}; formats are {', '.join(FORMAT_NAMES)}")
    return cast(Format, importlib.import_module(entry.module))


def _linked_near(path: Path) -> bool:
    """Whether an entry of `path` (itself may be a link: a name users give a store), or of its
    subdirectories, is a symbolic link."""
    if not path.is_dir():
        return False
    for entry in path.iterdir():
        if entry.is_symlink() or (entry.is_dir() and any(child.is_symlink() for child in entry.iterdir())):
            return True
    return False


def detect_format(path: str | Path) -> str | None:
    """Name of the format a directory holds (first match in REGISTRY order): by content, else by
    file names alone (a damaged store is still some format's, for verify to name what broke). A
    store with a link in its top two levels, where the metadata detection reads is, is detected by
    names alone: the link may lead outside, and nothing outside a store is read (verify names it)."""
    if _linked_near(Path(path)):
        return next((entry.name for entry in REGISTRY if entry.claims(Path(path))), None)
    for name in FORMAT_NAMES:
        try:
            if format_module(name).detect(path):
                return name
        except (ImportError, OSError, ValueError, KeyError):
            continue
    return next((entry.name for entry in REGISTRY if entry.claims(Path(path))), None)
