"""The extraction intermediate: one token-packed, lossless directory per extraction part.

Layout of `part-NNNN/` (the only place that knows it):
  part.json        metadata: sample range, tensors {name: {file, shape, dtype, sha256}}, model, ...
  samples.jsonl    one row per sample: sample_idx, text (or image path), label, label_id,
                   num_tokens, metadata (extra dataset fields)
  offsets.npy      int64 (n+1,): tokens of local sample i are rows offsets[i]:offsets[i+1]
  token_ids.npy    int64 (n_tokens,)                        text models
  token_logprob.npy float32 (n_tokens,), NaN at each sample's first token   causal LMs
  topk_values.npy / topk_indices.npy  float32 / int64 (n, k) last-token top-k logits   causal LMs
  <tensor>.npy     (n_tokens, d) per captured tensor in the storage dtype (float32, float16, or
                   bfloat16 as its uint16 bits), samples in sample_idx order, no padding
                   ("layer_3" -> layer_003.npy; hook "m.path:input" -> hook-m.path-input.npy)
The directory is built under a temp name and renamed into place last, so a killed job leaves
nothing that looks complete.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from actstore.errors import FormatError
from actstore.integrity import check_file, file_problem, inside, read_json, unlisted
from actstore.io_utils import OrderedHashFile, atomic_path

PART_META = "part.json"
INDEX = "extract.json"  # beside the parts: every part's directory and part.json sha256
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


# Storage dtypes of captured tensors and their .npy descr. numpy has no bfloat16: it is kept as its
# uint16 bit pattern (part.json says "bfloat16"); every reader widens it to float32, which is exact.
STORAGE_DESCR = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


def npy_header(shape: tuple[int, ...], descr: str) -> bytes:
    """The .npy 1.0 header numpy itself writes for a C-order array (np.save / open_memmap)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values as float32 (exact for every storage dtype); float32 is returned as is."""
    if dtype == "bfloat16":
        return (np.asarray(values).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return np.asarray(values, dtype=np.float32)
    return values


@dataclass
class _Sink:
    """One data file: sample i fills units unit_offsets[i]:unit_offsets[i+1] of unit_bytes each."""

    file: OrderedHashFile
    unit_offsets: np.ndarray
    unit_bytes: int
    header_bytes: int
    shape: tuple[int, ...]
    dtype: str


class PartWriter:
    """Write one part: samples and offsets up front, then each data file declared (add_tokens /
    add_rows) and filled sample by sample from any thread (one thread per file), then finish().

    Samples arrive batched by length, so a file is filled out of order; each write goes straight to
    its place and the file's sha256 follows the written prefix (io_utils.OrderedHashFile).
    """

    def __init__(self, tmp_dir: Path, samples: list[dict], offsets: np.ndarray):
        self.dir = tmp_dir
        self.dir.mkdir(parents=True)
        self.samples = samples
        self.offsets = offsets.astype(np.int64)
        self.n_tokens = int(self.offsets[-1])
        self.sinks: dict[str, _Sink] = {}
        self.files: dict[str, dict[str, Any]] = {}
        buf = io.BytesIO()
        np.save(buf, self.offsets)
        self._write_whole("offsets.npy", buf.getvalue())
        self._write_whole("samples.jsonl", "".join(json.dumps(row, ensure_ascii=False) + "\n"
                                                   for row in samples).encode("utf-8"))

    def _write_whole(self, file: str, data: bytes) -> None:
        sink = OrderedHashFile(self.dir / file, len(data), data)
        self.files[file] = {"bytes": len(data), "sha256": sink.close()}

    def _add(self, file: str, unit_offsets: np.ndarray, shape: tuple[int, ...], dtype: str) -> None:
        descr = STORAGE_DESCR.get(dtype) or np.dtype(dtype).str
        unit_bytes = int(np.dtype(descr).itemsize * int(np.prod(shape[1:], dtype=np.int64)))
        head = npy_header(shape, descr)
        size = len(head) + int(unit_offsets[-1]) * unit_bytes
        self.sinks[file] = _Sink(OrderedHashFile(self.dir / file, size, head), unit_offsets, unit_bytes,
                                 len(head), shape, dtype)

    def add_tokens(self, file: str, width: int | None, dtype: str) -> None:
        """A token-packed file: (n_tokens, width), or (n_tokens,) per-token scalars when width is None."""
        self._add(file, self.offsets, (self.n_tokens,) if width is None else (self.n_tokens, width), dtype)

    def add_rows(self, file: str, width: int, dtype: str) -> None:
        """A fixed-width row per sample (top-k logits): (n_samples, width)."""
        self._add(file, np.arange(len(self.samples) + 1, dtype=np.int64), (len(self.samples), width), dtype)

    def write(self, file: str, local_idx: int, data: np.ndarray) -> None:
        """Store local sample `local_idx`'s values of `file` (C-order bytes in the file's dtype)."""
        sink = self.sinks[file]
        start, stop = sink.unit_offsets[local_idx], sink.unit_offsets[local_idx + 1]
        if data.nbytes != (stop - start) * sink.unit_bytes:
            raise ValueError(f"{file}: sample {local_idx} has {data.nbytes} bytes, expected "
                             f"{(stop - start) * sink.unit_bytes}")
        sink.file.write(sink.header_bytes + int(start) * sink.unit_bytes, data.data)

    def file_path(self, file: str) -> Path:
        return self.dir / file

    def abort(self) -> None:
        for sink in self.sinks.values():
            sink.file.abort()

    def finish(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Close (fsync) every data file with its running sha256, then write part.json last."""
        for file, sink in self.sinks.items():
            self.files[file] = {"shape": list(sink.shape), "dtype": sink.dtype, "bytes": sink.file.size,
                                "sha256": sink.file.close()}
        files = {file: self.files[file] for file in sorted(self.files)}
        meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **meta,
                "n_samples": len(self.samples), "n_tokens": self.n_tokens, "files": files}
        (self.dir / PART_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return meta


def write_part(out_dir: str | Path):
    """Context manager yielding a temp dir for PartWriter; renamed to `out_dir` on success."""
    return atomic_path(out_dir)


class StoredTensor:
    """A stored (n_tokens, d) tensor: indexing reads float32 whatever the storage dtype
    (`stored_dtype`); `raw` is the memmap as stored (bfloat16 as uint16 bits)."""

    def __init__(self, raw: np.ndarray, stored_dtype: str):
        self.raw = raw
        self.stored_dtype = stored_dtype
        self.shape = raw.shape

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, key: Any) -> np.ndarray:
        return to_float32(self.raw[key], self.stored_dtype)


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
            self._arrays[file] = load_npy(inside(self.dir, file, str(self.dir / PART_META)),
                                          self.meta["files"][file].get("bytes"), mmap_mode="r")
        return self._arrays[file]

    @property
    def sample_start(self) -> int:
        return self.meta["sample_range"][0]

    @property
    def tensor_names(self) -> list[str]:
        return self.meta["tensors"]

    def tensor(self, name: str) -> StoredTensor:
        """(n_tokens, d) memory-mapped captured tensor, read as float32; samples in order, no padding."""
        if name not in self.meta["tensors"]:
            raise FormatError(f"{self.dir}: tensor {name!r} not captured; have {self.meta['tensors']}")
        file = tensor_file(name)
        return StoredTensor(self._load(file), self.meta["files"][file]["dtype"])

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
        """Every listed file inside the part with its size and sha256, nothing unlisted; raise
        FormatError naming the file."""
        source = str(self.dir / PART_META)
        for file, info in self.meta["files"].items():
            check_file(inside(self.dir, file, source), info, PART_META)
        extra = unlisted(self.dir, set(self.meta["files"]) | {PART_META}, PART_META)
        if extra:
            raise FormatError(extra[0])


def open_part(part_dir: str | Path) -> Part:
    """Open a finished part directory; a missing part.json means the part never finished."""
    part_dir = Path(part_dir)
    meta_path = part_dir / PART_META
    if not meta_path.is_file():
        raise FormatError(f"{part_dir}: no {PART_META}; the extraction part is missing or unfinished")
    meta = read_json(meta_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise FormatError(f"{meta_path}: not an actstore extraction part")
    samples = read_json(part_dir / "samples.jsonl", lines=True)
    offsets = load_npy(part_dir / "offsets.npy", meta.get("files", {}).get("offsets.npy", {}).get("bytes"))
    return Part(part_dir, meta, samples, offsets)


def load_npy(path: Path, recorded_bytes: int | None, mmap_mode: str | None = None) -> np.ndarray:
    """A part's .npy file, its size checked against part.json before it is mapped (a truncated
    file is named, never a bare numpy "mmap length" error)."""
    if not path.is_file():
        raise FormatError(f"{path}: missing (listed in {PART_META})")
    size = path.stat().st_size
    if recorded_bytes is not None and size != recorded_bytes:
        raise FormatError(f"{path}: {size} bytes, {PART_META} says {recorded_bytes} (truncated or replaced)")
    try:
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise FormatError(f"{path}: not a readable .npy file ({exc})") from None


class Extraction:
    """All parts of one extraction stage directory, addressed by global sample_idx."""

    def __init__(self, extract_dir: str | Path, n_parts: int | None = None):
        self.dir = Path(extract_dir)
        if n_parts is None and (self.dir / INDEX).is_file():
            n_parts = len(read_json(self.dir / INDEX)["parts"])  # a deleted part is missing, not skipped
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
        "dtype": parts[0].meta["files"].get(tensor_file(first_layer), {}).get("dtype", "float32"),
        "n_shards": len(parts),
        "bytes": sum(info["bytes"] for p in parts for info in p.meta["files"].values()),
    }


def verify(path: str | Path) -> list[str]:
    """Every part extract.json lists present with its part.json, every part's files present with the
    recorded size and sha256 and nothing unlisted; problems name the file."""
    path = Path(path)
    problems = _index_problems(path) if (path / INDEX).is_file() else []
    for part_dir in _part_dirs(path):
        try:
            open_part(part_dir).verify()
        except (FormatError, OSError, ValueError) as exc:
            problems.append(str(exc))
    return problems


def _index_problems(extract_dir: Path) -> list[str]:
    try:
        parts = read_json(extract_dir / INDEX)["parts"]
        listed = {entry["dir"]: entry["part_json_sha256"] for entry in parts}
        records = {inside(extract_dir, d, str(extract_dir / INDEX)) / PART_META: {"sha256": sha}
                   for d, sha in listed.items()}
    except (FormatError, KeyError, TypeError) as exc:
        return [f"{extract_dir / INDEX}: unreadable ({exc})"]
    problems = [p for meta, record in records.items() if (p := file_problem(meta, record, INDEX))]
    unlisted = sorted(d.name for d in _part_dirs(extract_dir) if d.name not in listed)
    return problems + [f"{extract_dir / d}: not listed in {INDEX}" for d in unlisted]


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """The stored float32 vector of (dataset row, block output, token)."""
    extraction = open_extraction(path)
    if layer_idx not in extraction.meta["layers"]:
        return None
    rows = extraction.activations(layer_tensor(layer_idx), sample_idx)
    return np.array(rows[token_idx]) if token_idx < len(rows) else None
