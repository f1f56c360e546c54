"""The extraction intermediate: one token-packed, lossless directory per extraction part.

Layout of `part-NNNN/` (the only place that knows it):
  part.json        metadata: sample range, tensors {name: {file, shape, dtype, sha256}}, model, ...
  samples.jsonl    one row per sample: sample_idx, text (or image path), label, label_id,
                   num_tokens, metadata (extra dataset fields)
  offsets.npy      int64 (n+1,): tokens of local sample i are rows offsets[i]:offsets[i+1]
  token_ids.npy    int64 (n_tokens,)                        text models
  token_logprob.npy float32 (n_tokens,), NaN at each sample's first token   causal LMs
  topk_values.npy / topk_indices.npy  float32 / int64 (n, k) last-token top-k logits   causal LMs
  <tensor>.npy     float32 (n_tokens, d) per captured tensor, samples in sample_idx order,
                   no padding ("layer_3" -> layer_003.npy; hook "m.path:input" -> hook-m.path-input.npy)
The directory is built under a temp name and renamed into place last, so a killed job leaves
nothing that looks complete.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from actstore.errors import FormatError
from actstore.io_utils import atomic_path, sha256_file

PART_META = "part.json"
FORMAT_NAME = "actstore-part"
FORMAT_VERSION = 1


def layer_tensor(layer_idx: int) -> str:
    """Tensor name of block `layer_idx`'s output."""
    return f"layer_{layer_idx}"


def tensor_file(name: str) -> str:
    """File name of a captured tensor inside a part directory."""
    if name.startswith("layer_"):
        return f"layer_{int(name[6:]):03d}.npy"
    module_path, _, io = name.partition(":")
    return f"hook-{module_path}-{io}.npy"


def part_dirname(part: int) -> str:
    return f"part-{part:04d}"


class PartWriter:
    """Write one part: samples and offsets up front, then tensors batch by batch, then finish()."""

    def __init__(self, tmp_dir: Path, samples: list[dict], offsets: np.ndarray):
        self.dir = tmp_dir
        self.dir.mkdir(parents=True)
        self.samples = samples
        self.offsets = offsets.astype(np.int64)
        self.n_tokens = int(self.offsets[-1])
        self.arrays: dict[str, np.memmap] = {}
        np.save(self.dir / "offsets.npy", self.offsets)
        with (self.dir / "samples.jsonl").open("w", encoding="utf-8") as fh:
            for row in samples:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")

    def _array(self, file: str, shape: tuple[int, ...], dtype: str) -> np.memmap:
        if file not in self.arrays:
            self.arrays[file] = np.lib.format.open_memmap(self.dir / file, mode="w+", dtype=dtype, shape=shape)
        return self.arrays[file]

    def write_tokens(self, name: str, local_idx: int, values: np.ndarray) -> None:
        """Store the (num_tokens, d) activations of local sample `local_idx` for tensor `name`."""
        start, stop = self.offsets[local_idx], self.offsets[local_idx + 1]
        if values.shape[0] != stop - start:
            raise ValueError(f"{name}: sample {local_idx} has {values.shape[0]} rows, expected {stop - start}")
        self._array(tensor_file(name), (self.n_tokens, values.shape[1]), "float32")[start:stop] = values

    def write_token_values(self, file: str, local_idx: int, values: np.ndarray, dtype: str) -> None:
        """Per-token scalars (token ids, log-probs) of one sample."""
        start, stop = self.offsets[local_idx], self.offsets[local_idx + 1]
        self._array(file, (self.n_tokens,), dtype)[start:stop] = values

    def write_row(self, file: str, local_idx: int, values: np.ndarray, dtype: str) -> None:
        """A fixed-width per-sample row (top-k logits)."""
        self._array(file, (len(self.samples), values.shape[0]), dtype)[local_idx] = values

    def finish(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Flush arrays, checksum every file and write part.json (the last file written)."""
        files = {}
        for file, array in self.arrays.items():
            array.flush()
            files[file] = {"shape": list(array.shape), "dtype": str(array.dtype)}
        self.arrays.clear()
        for file in sorted(os.listdir(self.dir)):
            path = self.dir / file
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())
            files.setdefault(file, {})
            files[file].update({"bytes": path.stat().st_size, "sha256": sha256_file(path)})
        meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **meta,
                "n_samples": len(self.samples), "n_tokens": self.n_tokens, "files": files}
        (self.dir / PART_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return meta


def write_part(out_dir: str | Path):
    """Context manager yielding a temp dir for PartWriter; renamed to `out_dir` on success."""
    return atomic_path(out_dir)


@dataclass
class Part:
    """A finished part opened read-only; arrays are memory-mapped on first use."""

    dir: Path
    meta: dict[str, Any]
    samples: list[dict]
    offsets: np.ndarray
    _arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def _load(self, file: str) -> np.ndarray:
        if file not in self._arrays:
            if file not in self.meta["files"]:
                raise FormatError(f"{self.dir}: no {file} in this part")
            self._arrays[file] = np.load(self.dir / file, mmap_mode="r")
        return self._arrays[file]

    @property
    def sample_start(self) -> int:
        return self.meta["sample_range"][0]

    @property
    def tensor_names(self) -> list[str]:
        return self.meta["tensors"]

    def tensor(self, name: str) -> np.ndarray:
        """(n_tokens, d) float32 memmap of a captured tensor, samples in order, no padding."""
        if name not in self.meta["tensors"]:
            raise FormatError(f"{self.dir}: tensor {name!r} not captured; have {self.meta['tensors']}")
        return self._load(tensor_file(name))

    def sample_slice(self, local_idx: int) -> slice:
        return slice(int(self.offsets[local_idx]), int(self.offsets[local_idx + 1]))

    def activations(self, name: str, local_idx: int) -> np.ndarray:
        """(num_tokens, d) activations of one sample."""
        return self.tensor(name)[self.sample_slice(local_idx)]

    def token_ids(self, local_idx: int) -> np.ndarray | None:
        if "token_ids.npy" not in self.meta["files"]:
            return None
        return self._load("token_ids.npy")[self.sample_slice(local_idx)]

    def token_logprob(self, local_idx: int) -> np.ndarray | None:
        if "token_logprob.npy" not in self.meta["files"]:
            return None
        return self._load("token_logprob.npy")[self.sample_slice(local_idx)]

    def topk(self, local_idx: int) -> tuple[np.ndarray, np.ndarray] | None:
        if "topk_values.npy" not in self.meta["files"]:
            return None
        return self._load("topk_values.npy")[local_idx], self._load("topk_indices.npy")[local_idx]

    def verify(self) -> None:
        """Check every file's size and sha256 against part.json; raise FormatError naming the file."""
        for file, info in self.meta["files"].items():
            path = self.dir / file
            if not path.is_file():
                raise FormatError(f"{path}: missing")
            if path.stat().st_size != info["bytes"]:
                raise FormatError(f"{path}: {path.stat().st_size} bytes, part.json says {info['bytes']}")
            if sha256_file(path) != info["sha256"]:
                raise FormatError(f"{path}: sha256 mismatch with part.json")


def open_part(part_dir: str | Path) -> Part:
    """Open a finished part directory; a missing part.json means the part never finished."""
    part_dir = Path(part_dir)
    meta_path = part_dir / PART_META
    if not meta_path.is_file():
        raise FormatError(f"{part_dir}: no {PART_META}; the extraction part is missing or unfinished")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT_NAME:
        raise FormatError(f"{meta_path}: not an actstore extraction part")
    with (part_dir / "samples.jsonl").open(encoding="utf-8") as fh:
        samples = [json.loads(line) for line in fh]
    offsets = np.load(part_dir / "offsets.npy")
    return Part(part_dir, meta, samples, offsets)


class Extraction:
    """All parts of one extraction stage directory, addressed by global sample_idx."""

    def __init__(self, extract_dir: str | Path, n_parts: int | None = None):
        self.dir = Path(extract_dir)
        if n_parts is None:
            n_parts = len(sorted(self.dir.glob("part-[0-9][0-9][0-9][0-9]")))
        if n_parts == 0:
            raise FormatError(f"{self.dir}: no extraction parts")
        self.parts = [open_part(self.dir / part_dirname(p)) for p in range(n_parts)]
        self.meta = self.parts[0].meta
        self._starts = np.array([p.sample_start for p in self.parts])

    @property
    def n_samples(self) -> int:
        return sum(p.meta["n_samples"] for p in self.parts)

    @property
    def n_tokens(self) -> int:
        return sum(p.meta["n_tokens"] for p in self.parts)

    @property
    def tensor_names(self) -> list[str]:
        return self.meta["tensors"]

    def locate(self, sample_idx: int) -> tuple[Part, int]:
        """The part holding `sample_idx` and the sample's local index in it."""
        if not 0 <= sample_idx < self.n_samples:
            raise IndexError(f"sample_idx {sample_idx} out of range [0, {self.n_samples})")
        p = int(np.searchsorted(self._starts, sample_idx, side="right") - 1)
        while self.parts[p].meta["n_samples"] == 0 or sample_idx >= self.parts[p].sample_start + self.parts[p].meta["n_samples"]:
            p += 1
        return self.parts[p], sample_idx - self.parts[p].sample_start

    def activations(self, name: str, sample_idx: int) -> np.ndarray:
        part, local = self.locate(sample_idx)
        return part.activations(name, local)

    def sample(self, sample_idx: int) -> dict:
        part, local = self.locate(sample_idx)
        return part.samples[local]

    def iter_samples(self) -> Iterator[tuple[Part, int, dict]]:
        """(part, local index, sample row) for every sample in sample_idx order."""
        for part in self.parts:
            for local, row in enumerate(part.samples):
                yield part, local, row


def open_extraction(extract_dir: str | Path, n_parts: int | None = None) -> Extraction:
    """Open every part of an extraction stage directory."""
    return Extraction(extract_dir, n_parts)


def detect(path: str | Path) -> bool:
    """An extraction stage directory (part-NNNN/part.json) or a single part directory."""
    path = Path(path)
    return (path / PART_META).is_file() or (path / part_dirname(0) / PART_META).is_file()


def _part_dirs(path: Path) -> list[Path]:
    return [path] if (path / PART_META).is_file() else sorted(path.glob("part-[0-9][0-9][0-9][0-9]"))


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary of an extraction (all parts) for `actstore inspect`."""
    parts = [open_part(p) for p in _part_dirs(Path(path))]
    meta = parts[0].meta
    first_layer = layer_tensor(meta["layers"][0])
    return {
        "format": "actstore-extract", "model": meta["model"]["name"], "layers": meta["layers"],
        "hooks": meta["hooks"], "n_examples": sum(p.meta["n_samples"] for p in parts),
        "n_tokens": sum(p.meta["n_tokens"] for p in parts),
        "d_model": parts[0].meta["files"].get(tensor_file(first_layer), {}).get("shape", [0, None])[1],
        "dtype": "float32", "n_shards": len(parts),
        "bytes": sum(info["bytes"] for p in parts for info in p.meta["files"].values()),
    }


def verify(path: str | Path) -> list[str]:
    """Every part's files present with the recorded size and sha256; problems name the file."""
    problems = []
    for part_dir in _part_dirs(Path(path)):
        try:
            open_part(part_dir).verify()
        except (FormatError, OSError, ValueError) as exc:
            problems.append(str(exc))
    return problems


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """The stored float32 vector of (dataset row, block output, token)."""
    extraction = open_extraction(path)
    if layer_idx not in extraction.meta["layers"]:
        return None
    rows = extraction.activations(layer_tensor(layer_idx), sample_idx)
    return np.array(rows[token_idx]) if token_idx < len(rows) else None
