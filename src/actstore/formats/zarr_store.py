"""The Zarr activation logger (specs/zarr-activation-logger.md): the only place that knows its layout.

Run directory `{dump_to}/zarr/{hash}/`:
  shards/shard-NNNN.zarr/   one self-contained Zarr v2 store per extraction part (parallel writers)
  merged/                   optional single store over every sample (Option B, `zarr.merged`)
  manifest.json             shards [{path, num_samples, global_index_start, files_sha256, ...}]
Each store:
  .zgroup .zattrs .zmetadata    group attrs = global metadata; consolidated metadata
  arrays/activations            (N, L, T_max, H) float16, chunks (1, 1, T_chunk, H), no compressor,
                                no filters, fill 0, C order, "/" separator, every chunk written
  arrays/seq_len prompt_len     (N,) int32
  arrays/sample_key             (N,) |S64, sha256 hex of the sample's text (image path for images)
  arrays/sample_idx             (N,) int64 global row index (extension)
  arrays/label split            (N,) int32 label_id (-1 = none) / int8 0=train 1=val 2=test, when known
  text/prompts.jsonl            {i, sample_idx, sample_key, prompt, label, metadata} per sample
  meta/files.json               bytes + sha256 of every other file in the store (extension)
Writes go through zarr-python 3 (zarr_format=2); reads of activations bypass zarr: the `.zarray`
metadata is validated once, then chunk files (raw little-endian float16) are read with os.preadv.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from actstore.errors import FormatError
from actstore.integrity import TOOL_FILES, dir_bytes, file_problem, inside, read_json
from actstore.io_utils import atomic_path, sha256_file, utc_now, write_json_atomic

log = logging.getLogger(__name__)

FORMAT_NAME = "actstore-zarr-activation-logger"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
FILES_JSON = "meta/files.json"
ACTS = "arrays/activations"
MERGED = "merged"
TARGET_CHUNK_BYTES = 1 << 20  # middle of the spec's 0.5-2 MB window
WRITE_BLOCK_BYTES = 64 << 20  # samples buffered per zarr write
VECTOR_CHUNK = 1 << 16  # samples per chunk of the 1-D per-sample arrays
SPLIT_CODES = {"train": 0, "val": 1, "validation": 1, "test": 2}
REQUIRED_ATTRS = ("schema_version", "model_id", "num_layers", "layers", "hidden_size", "T_max",
                  "dtype", "T_chunk", "num_samples")


def shard_name(part: int) -> str:
    return f"shard-{part:04d}.zarr"


def choose_t_chunk(t_max: int, hidden: int, t_chunk: int | None = None) -> int:
    """Tokens per chunk: the configured value, else the power of two nearest a 1 MiB chunk; <= T_max."""
    if t_chunk is None:
        t_chunk = 2 ** max(0, round(math.log2(TARGET_CHUNK_BYTES / (2 * hidden))))
    return max(1, min(int(t_chunk), t_max))


def git_commit() -> str | None:
    """HEAD of the repository actstore runs from, or None outside a git checkout."""
    from actstore.config import REPO_ROOT
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------------------- writing

def _create(group: Any, name: str, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str,
            fill: Any = 0) -> Any:
    """An uncompressed, unfiltered, C-order v2 array whose every chunk is written, '/'-separated keys."""
    return group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=None, filters=None,
                              fill_value=fill, order="C", chunk_key_encoding={"name": "v2", "separator": "/"},
                              config={"write_empty_chunks": True})


def _vector_chunks(n: int) -> tuple[int]:
    return (max(1, min(n, VECTOR_CHUNK)),)


def _store_attrs(meta: dict[str, Any], n: int, start: int, t_chunk: int, hidden: int) -> dict[str, Any]:
    """Global metadata kept in the group attrs (never per-sample data: the spec's attrs guardrail)."""
    layers = list(meta["layers"])
    return {
        "format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "model_id": meta["model"]["name"],
        "num_layers": len(layers), "layers": layers, "model_num_blocks": meta["model"].get("n_blocks"),
        "hidden_size": hidden, "T_max": int(meta["max_seq_length"]), "dtype": "float16",
        "T_chunk": t_chunk, "chunk_shape": [1, 1, t_chunk, hidden], "chunk_bytes": t_chunk * hidden * 2,
        "num_samples": n, "global_index_start": start,
        "created": utc_now().isoformat(timespec="seconds"), "git_commit": git_commit(),
        "dataset": meta["dataset"], "model": meta["model"], "modality": meta.get("modality"),
        "model_kind": meta.get("model_kind"), "label_names": meta["dataset"].get("labels") or [],
        "split_codes": SPLIT_CODES, "extraction_created_at": meta.get("created_at"),
    }


def _sample_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).hexdigest().encode("ascii")


def _write_vectors(arrays: Any, rows: list[dict], attrs: dict[str, Any]) -> None:
    """Per-sample numeric metadata as Zarr arrays (spec: 'Required per-sample numeric metadata')."""
    n = len(rows)
    seq_len = np.array([r["num_tokens"] for r in rows], dtype=np.int32)
    values = {"seq_len": seq_len, "sample_idx": np.array([r["sample_idx"] for r in rows], dtype=np.int64),
              "sample_key": np.array([_sample_key(r["text"]) for r in rows], dtype="S64")}
    if attrs["modality"] == "text":  # the whole text is the prompt; images have no prompt tokens
        values["prompt_len"] = seq_len
    if attrs["label_names"]:
        values["label"] = np.array([r["label_id"] for r in rows], dtype=np.int32)
    split = SPLIT_CODES.get(str(attrs["dataset"].get("split")).lower())
    if split is not None:
        values["split"] = np.full(n, split, dtype=np.int8)
    for name, array in values.items():
        z = _create(arrays, name, (n,), _vector_chunks(n), array.dtype.str, fill=b"" if name == "sample_key" else 0)
        if n:
            z[:] = array


def _write_text(store: Path, rows: list[dict]) -> None:
    (store / "text").mkdir()
    with (store / "text" / "prompts.jsonl").open("w", encoding="utf-8") as fh:
        for i, r in enumerate(rows):
            fh.write(json.dumps({"i": i, "sample_idx": r["sample_idx"], "sample_key": _sample_key(r["text"]).decode(),
                                 "prompt": r["text"], "label": r.get("label"), "metadata": r.get("metadata")},
                                ensure_ascii=False) + "\n")


def _consolidate(store: Path) -> None:
    import zarr
    with warnings.catch_warnings():  # text/ and meta/ are plain files beside the hierarchy, by design
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(store))


def _write_files_json(store: Path, known: dict[str, dict] | None = None) -> dict[str, Any]:
    """Record bytes + sha256 of every file in the store (reusing `known` hashes of copied files)."""
    known = known or {}
    files = {}
    for rel in _walk(store):
        if rel == FILES_JSON:
            continue
        size = (store / rel).stat().st_size
        entry = known.get(rel)
        files[rel] = entry if entry and entry["bytes"] == size else {"bytes": size, "sha256": sha256_file(store / rel)}
    doc = {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "files": files}
    (store / "meta").mkdir(exist_ok=True)
    (store / FILES_JSON).write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")
    return doc


def _walk(store: Path) -> list[str]:
    """Every file under `store`, as sorted POSIX paths relative to it (Snakemake's marker excluded)."""
    out = []
    for dirpath, _, names in os.walk(store):
        rel = Path(dirpath).relative_to(store)
        out.extend((rel / name).as_posix() for name in names)
    return sorted(set(out) - TOOL_FILES)


def _fill_block(part: Any, layers: list[int], start: int, stop: int, buf: np.ndarray) -> int:
    """Copy samples [start, stop) of a part into a zeroed float16 block; return float16 overflows."""
    from actstore.formats.parts import layer_tensor
    buf[: stop - start] = 0
    overflow = 0
    with np.errstate(over="ignore"):
        for j, local in enumerate(range(start, stop)):
            for l, layer in enumerate(layers):
                x = part.activations(layer_tensor(layer), local)
                buf[j, l, : x.shape[0]] = x
                overflow += int(np.isinf(buf[j, l, : x.shape[0]]).sum() - np.isinf(x).sum())
    return overflow


def write_shard(part_dir: str | Path, out_path: str | Path, t_chunk: int | None = None,
                progress: bool = True) -> dict[str, Any]:
    """Write one extraction part as a self-contained shard store (atomic); return its manifest entry."""
    import zarr
    from tqdm import tqdm

    from actstore.formats.parts import layer_tensor, open_part
    part = open_part(part_dir)
    meta, rows = part.meta, part.samples
    n, layers, t_max = len(rows), list(meta["layers"]), int(meta["max_seq_length"])
    hidden = int(part.tensor(layer_tensor(layers[0])).shape[1])
    tc = choose_t_chunk(t_max, hidden, t_chunk)
    attrs = _store_attrs(meta, n, int(meta["sample_range"][0]), tc, hidden)
    with atomic_path(out_path) as tmp:
        root = zarr.open_group(str(tmp), mode="w", zarr_format=2, attributes=attrs)
        arrays = root.create_group("arrays")
        acts = _create(arrays, "activations", (n, len(layers), t_max, hidden), (1, 1, tc, hidden), "<f2")
        _write_vectors(arrays, rows, attrs)
        per_block = max(1, WRITE_BLOCK_BYTES // (len(layers) * t_max * hidden * 2))
        buf = np.zeros((min(per_block, max(n, 1)), len(layers), t_max, hidden), dtype=np.float16)
        overflow = 0
        for start in tqdm(range(0, n, per_block), desc=f"zarr {Path(out_path).name}", unit="block",
                          disable=not progress):
            stop = min(n, start + per_block)
            overflow += _fill_block(part, layers, start, stop, buf)
            acts[start:stop] = buf[: stop - start]  # whole samples: chunk-aligned writes
        if overflow:
            log.warning("%s: %d activation values exceed float16 range and are stored as +-inf", part_dir, overflow)
            root.attrs["float16_overflow_count"] = overflow
        _consolidate(tmp)
        _write_text(tmp, rows)
        _write_files_json(tmp)
    return store_entry(out_path)


def store_entry(store: str | Path, rel_to: str | Path | None = None) -> dict[str, Any]:
    """The manifest record of a finished store: path, counts and the sha256 of its meta/files.json."""
    store = Path(store)
    attrs = json.loads((store / ".zattrs").read_text())
    files = json.loads((store / FILES_JSON).read_text())["files"]
    return {"path": store.relative_to(rel_to).as_posix() if rel_to else store.name,
            "num_samples": attrs["num_samples"], "global_index_start": attrs["global_index_start"],
            "files_sha256": sha256_file(store / FILES_JSON), "n_files": len(files) + 1,
            "bytes": sum(f["bytes"] for f in files.values()) + (store / FILES_JSON).stat().st_size}


def _check_compatible(stores: list[Path], attrs: list[dict]) -> None:
    keys = ("layers", "hidden_size", "T_max", "T_chunk", "dtype", "model_id", "schema_version")
    for store, a in zip(stores[1:], attrs[1:]):
        for key in keys:
            if a.get(key) != attrs[0].get(key):
                raise FormatError(f"{store}/.zattrs: {key}={a.get(key)!r} differs from {stores[0]} ({attrs[0].get(key)!r})")
    expected = 0
    for store, a in zip(stores, attrs):
        if a["global_index_start"] != expected and a["num_samples"]:
            raise FormatError(f"{store}/.zattrs: global_index_start={a['global_index_start']}, expected {expected}")
        expected += a["num_samples"]


def merge_stores(shards: Sequence[str | Path], out_path: str | Path, progress: bool = True) -> dict[str, Any]:
    """Option B: one store over every shard, in shard order (atomic).

    Chunking and encoding are identical, so activation chunks are copied file for file (renumbered on
    the sample axis) instead of decoded and re-encoded; the 1-D arrays are concatenated through zarr.
    """
    import zarr
    from tqdm import tqdm

    shards = [Path(s) for s in shards]
    readers = [ZarrStore(s) for s in shards]
    attrs = [r.attrs for r in readers]
    _check_compatible(shards, attrs)
    n = sum(a["num_samples"] for a in attrs)
    a0 = attrs[0]
    merged_attrs = {**a0, "num_samples": n, "global_index_start": 0, "merged_from": [s.name for s in shards],
                    "created": utc_now().isoformat(timespec="seconds")}
    merged_attrs.pop("float16_overflow_count", None)
    overflow = sum(a.get("float16_overflow_count", 0) for a in attrs)
    if overflow:
        merged_attrs["float16_overflow_count"] = overflow
    with atomic_path(out_path) as tmp:
        root = zarr.open_group(str(tmp), mode="w", zarr_format=2, attributes=merged_attrs)
        arrays = root.create_group("arrays")
        _create(arrays, "activations", (n, a0["num_layers"], a0["T_max"], a0["hidden_size"]),
                (1, 1, a0["T_chunk"], a0["hidden_size"]), "<f2")
        for name in readers[0].vector_names:
            values = np.concatenate([r.vector(name) for r in readers])
            z = _create(arrays, name, (n,), _vector_chunks(n), values.dtype.str, fill=b"" if name == "sample_key" else 0)
            if n:
                z[:] = values
        known: dict[str, dict] = {}
        g = 0
        for shard, reader in zip(shards, tqdm(readers, desc="zarr merge", unit="shard", disable=not progress)):
            shard_files = json.loads((shard / FILES_JSON).read_text())["files"]
            for local in range(reader.n_samples):
                _copy_sample_chunks(shard, tmp, local, g, shard_files, known)
                g += 1
        _consolidate(tmp)
        _merge_text(shards, tmp)
        _write_files_json(tmp, known)
    return store_entry(out_path)


def _copy_sample_chunks(src: Path, dst: Path, local: int, g: int, src_files: dict, known: dict) -> None:
    for chunk in sorted((src / ACTS / str(local)).rglob("*")):
        if chunk.is_dir():
            continue
        rel = chunk.relative_to(src / ACTS / str(local)).as_posix()
        target = f"{ACTS}/{g}/{rel}"
        (dst / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(chunk, dst / target)
        known[target] = src_files[f"{ACTS}/{local}/{rel}"]


def _merge_text(shards: list[Path], dst: Path) -> None:
    (dst / "text").mkdir()
    i = 0
    with (dst / "text" / "prompts.jsonl").open("w", encoding="utf-8") as out:
        for shard in shards:
            with (shard / "text" / "prompts.jsonl").open(encoding="utf-8") as fh:
                for line in fh:
                    out.write(json.dumps({**json.loads(line), "i": i}, ensure_ascii=False) + "\n")
                    i += 1


def write_manifest(run_dir: str | Path, shards: Sequence[str | Path], merged: str | Path | None = None) -> dict:
    """manifest.json of a run: every shard's entry (global_index_start = sample_idx), merged when built."""
    run_dir = Path(run_dir)
    entries = [store_entry(s, run_dir) for s in shards]
    first = ZarrStore(shards[0]).attrs
    manifest = {
        "format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "model_id": first["model_id"],
        "num_samples": sum(e["num_samples"] for e in entries), "layers": first["layers"],
        "num_layers": first["num_layers"], "hidden_size": first["hidden_size"], "T_max": first["T_max"],
        "T_chunk": first["T_chunk"], "dtype": "float16", "shards": entries,
        "merged": store_entry(merged, run_dir) if merged else None,
        "created": utc_now().isoformat(timespec="seconds"),
    }
    write_json_atomic(run_dir / MANIFEST, manifest)
    return manifest


# ----------------------------------------------------------------------------------------- reading

def _expect(path: str, field: str, value: Any, expected: Any) -> None:
    if value != expected:
        raise FormatError(f"{path}: {field}={value!r}, expected {expected!r}")


class ZarrStore:
    """One store (a shard or merged/) opened read-only: metadata validated once, chunks read raw.

    Holds no file handles and no zarr objects, so it is safe to use after fork in DataLoader workers.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        consolidated = read_json(self.path / ".zmetadata")
        self.metadata: dict[str, Any] = consolidated.get("metadata", {})
        self.attrs: dict[str, Any] = self._meta(".zattrs")
        for key in REQUIRED_ATTRS:
            if key not in self.attrs:
                raise FormatError(f"{self.path}/.zattrs: required field {key!r} missing")
        self.layers: list[int] = list(self.attrs["layers"])
        self._layer_pos = {layer: l for l, layer in enumerate(self.layers)}
        self.n_samples = int(self.attrs["num_samples"])
        self.hidden = int(self.attrs["hidden_size"])
        self.t_max = int(self.attrs["T_max"])
        self._validate_activations()
        self.seq_len = self.vector("seq_len")
        if self.seq_len.shape != (self.n_samples,) or (self.seq_len > self.t_max).any() or (self.seq_len < 0).any():
            raise FormatError(f"{self.path}/arrays/seq_len: values outside [0, T_max={self.t_max}] or wrong length")
        self._acts = str(self.path / ACTS)
        self._seq: list[int] = self.seq_len.tolist()  # Python ints: cheaper than numpy scalars per read

    def _meta(self, key: str) -> dict[str, Any]:
        if key not in self.metadata:
            raise FormatError(f"{self.path}/.zmetadata: no entry {key!r}")
        return self.metadata[key]

    def _validate_activations(self) -> None:
        """The fast path is only correct for raw little-endian float16 C-order chunks: check exactly that."""
        z = self._meta(f"{ACTS}/.zarray")
        where = f"{self.path}/{ACTS}/.zarray"
        shape = [self.n_samples, len(self.layers), self.t_max, self.hidden]
        for field, expected in (("zarr_format", 2), ("dtype", "<f2"), ("order", "C"), ("compressor", None),
                                ("filters", None), ("dimension_separator", "/"), ("shape", shape)):
            _expect(where, field, z.get(field), expected)
        chunks = z.get("chunks")
        if not (isinstance(chunks, list) and len(chunks) == 4 and chunks[:2] == [1, 1] and chunks[3] == self.hidden
                and isinstance(chunks[2], int) and chunks[2] >= 1):
            raise FormatError(f"{where}: chunks={chunks!r}, expected [1, 1, T_chunk, {self.hidden}]")
        self.t_chunk = chunks[2]
        self.chunk_bytes = self.t_chunk * self.hidden * 2
        self.n_chunks = math.ceil(self.t_max / self.t_chunk)

    @property
    def vector_names(self) -> list[str]:
        return sorted(k.split("/")[1] for k in self.metadata if k.startswith("arrays/") and k.endswith("/.zarray")
                      and k != f"{ACTS}/.zarray")

    def vector(self, name: str) -> np.ndarray:
        """A 1-D per-sample array (seq_len, sample_key, ...) read raw after validating its .zarray."""
        where = f"{self.path}/arrays/{name}/.zarray"
        z = self._meta(f"arrays/{name}/.zarray")
        for field, expected in (("zarr_format", 2), ("compressor", None), ("filters", None), ("shape", [self.n_samples])):
            _expect(where, field, z.get(field), expected)
        dtype, chunk = np.dtype(z["dtype"]), int(z["chunks"][0])
        parts = []
        for c in range(math.ceil(self.n_samples / chunk)):
            path = self.path / "arrays" / name / str(c)
            raw = path.read_bytes() if path.is_file() else b""
            if len(raw) != chunk * dtype.itemsize:
                raise FormatError(f"{path}: {len(raw)} bytes, expected {chunk * dtype.itemsize}")
            parts.append(np.frombuffer(raw, dtype=dtype))
        out = np.concatenate(parts)[: self.n_samples] if parts else np.zeros(0, dtype)
        return out.astype(dtype.newbyteorder("="))

    def layer_position(self, layer: int) -> int:
        """Position on the L axis of block `layer`; FormatError naming the stored layers if absent."""
        try:
            return self._layer_pos[layer]
        except KeyError:
            raise FormatError(f"{self.path}: layer {layer} not stored; layers are {self.layers}") from None

    def chunk_path(self, i: int, l: int, c: int) -> str:
        return f"{self._acts}/{i}/{l}/{c}/0"

    def read(self, i: int, layer: int) -> np.ndarray:
        """(seq_len[i], H) float16 activations of local sample i, block `layer`: only its own chunks."""
        if not 0 <= i < self.n_samples:
            raise IndexError(f"{self.path}: sample {i} out of range [0, {self.n_samples})")
        l = self.layer_position(layer)
        n = self._seq[i]
        out = np.empty((n, self.hidden), dtype=np.float16)
        tc = self.t_chunk
        for c in range(-(-n // tc)):  # row slices of a C-order array are contiguous buffers
            self._read_chunk(f"{self._acts}/{i}/{l}/{c}/0", out[c * tc: (c + 1) * tc])
        return out

    def _read_chunk(self, path: str, into: np.ndarray) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FormatError(f"{path}: chunk file missing") from None
        try:
            size = os.fstat(fd).st_size
            if size != self.chunk_bytes:  # a truncated or padded chunk is corruption, not fill
                raise FormatError(f"{path}: {size} bytes, expected {self.chunk_bytes}")
            if os.preadv(fd, [into], 0) != into.nbytes:
                raise FormatError(f"{path}: short read")
        finally:
            os.close(fd)


class ZarrRun:
    """A run directory read through its manifest (Option A), or its merged/ store (Option B)."""

    def __init__(self, path: str | Path, merged: bool = False):
        self.path = Path(path)
        self.manifest = read_json(self.path / MANIFEST)
        if self.manifest.get("format") != FORMAT_NAME:
            raise FormatError(f"{self.path / MANIFEST}: format={self.manifest.get('format')!r}, expected {FORMAT_NAME!r}")
        if merged:
            if not self.manifest.get("merged"):
                raise FormatError(f"{self.path / MANIFEST}: no merged store (build it with zarr.merged: true)")
            entries = [self.manifest["merged"]]
        else:
            entries = self.manifest.get("shards") or []
        self.stores = [ZarrStore(inside(self.path, e["path"], str(self.path / MANIFEST))) for e in entries]
        self._starts = [int(e["global_index_start"]) for e in entries]
        self.n_samples = int(sum(e["num_samples"] for e in entries))
        self.layers: list[int] = list(self.manifest["layers"])
        self.hidden = int(self.manifest["hidden_size"])

    def locate(self, sample_idx: int) -> tuple[ZarrStore, int]:
        """The store holding global `sample_idx` and its local index there."""
        if not 0 <= sample_idx < self.n_samples:
            raise IndexError(f"{self.path}: sample_idx {sample_idx} out of range [0, {self.n_samples})")
        k = bisect.bisect_right(self._starts, sample_idx) - 1
        while sample_idx - self._starts[k] >= self.stores[k].n_samples:  # skip empty shards
            k += 1
        return self.stores[k], sample_idx - self._starts[k]

    def read(self, sample_idx: int, layer: int) -> np.ndarray:
        store, local = self.locate(sample_idx)
        return store.read(local, layer)

    def seq_len(self, sample_idx: int) -> int:
        store, local = self.locate(sample_idx)
        return int(store.seq_len[local])


def open_zarr(path: str | Path, merged: bool = False) -> ZarrRun | ZarrStore:
    """A run directory (manifest.json) or a single store, for reading."""
    path = Path(path)
    return ZarrRun(path, merged) if (path / MANIFEST).is_file() else ZarrStore(path)


# ----------------------------------------------------------------------------------------- torch

try:
    from torch.utils.data import Dataset as _TorchDataset, Sampler as _TorchSampler
except ImportError:  # torch is optional for plain numpy readers
    _TorchDataset = _TorchSampler = object


class ZarrActivationDataset(_TorchDataset):
    """Map-style dataset: key (sample_idx, layer) -> (seq_len, H) float16 tensor.

    An int key k means (k // L, layers[k % L]). The reader is rebuilt in each process (pid check),
    so DataLoader workers never share state with the parent.
    """

    def __init__(self, path: str | Path, merged: bool = False):
        self.path, self.merged = Path(path), merged
        self._pid, self._reader = os.getpid(), open_zarr(self.path, merged)
        self.layers: list[int] = list(self._reader.layers)
        self.n_samples = self._reader.n_samples

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None, "_pid": None}

    @property
    def reader(self) -> ZarrRun | ZarrStore:
        if self._reader is None or self._pid != os.getpid():
            self._pid, self._reader = os.getpid(), open_zarr(self.path, self.merged)
        return self._reader

    def __len__(self) -> int:
        return self.n_samples * len(self.layers)

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        import torch
        if isinstance(key, tuple):
            i, layer = key
        else:
            i, layer = int(key) // len(self.layers), self.layers[int(key) % len(self.layers)]
        return torch.from_numpy(self.reader.read(int(i), int(layer)))


class TrainingPatternSampler(_TorchSampler):
    """Batch sampler for the spec's pattern: b random samples x `layers_per_sample` random layers each.

    Yields lists of (sample_idx, layer) keys; a new permutation per epoch (seed + epoch).
    """

    def __init__(self, n_samples: int, layers: Sequence[int], batch_samples: int, layers_per_sample: int = 2,
                 num_batches: int | None = None, seed: int = 0):
        if layers_per_sample > len(layers):
            raise ValueError(f"layers_per_sample={layers_per_sample} > {len(layers)} stored layers {list(layers)}")
        if not 1 <= batch_samples <= n_samples:
            raise ValueError(f"batch_samples={batch_samples} must be in [1, n_samples={n_samples}]")
        self.n_samples, self.layers, self.b = n_samples, np.asarray(layers), batch_samples
        self.k, self.seed, self.epoch = layers_per_sample, seed, 0
        self.num_batches = num_batches if num_batches is not None else n_samples // batch_samples

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        rng = np.random.default_rng(self.seed + self.epoch)
        self.epoch += 1
        for _ in range(self.num_batches):
            samples = rng.choice(self.n_samples, size=self.b, replace=False)
            yield [(int(i), int(layer)) for i in samples
                   for layer in rng.choice(self.layers, size=self.k, replace=False)]


def collate_padded(batch: list[Any]) -> tuple[Any, Any]:
    """Stack (seq_len, H) tensors into (B, max_len, H) zero-padded plus the (B,) lengths."""
    import torch
    lengths = torch.tensor([x.shape[0] for x in batch], dtype=torch.int64)
    return torch.nn.utils.rnn.pad_sequence(list(batch), batch_first=True), lengths


# ----------------------------------------------------------------------------------------- CLI / validate API

def detect(path: str | Path) -> bool:
    """True for a run directory (manifest.json of this format) or a single store of this format."""
    path = Path(path)
    for file, key in ((path / MANIFEST, "format"), (path / ".zattrs", "format")):
        try:
            if json.loads(file.read_text()).get(key) == FORMAT_NAME:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary of a run directory or store (the `actstore inspect` fields plus zarr specifics)."""
    path = Path(path)
    reader = open_zarr(path)
    stores = reader.stores if isinstance(reader, ZarrRun) else [reader]
    attrs = stores[0].attrs if stores else {}
    manifest = reader.manifest if isinstance(reader, ZarrRun) else None
    return {
        "format": FORMAT_NAME, "model": attrs.get("model_id"), "layers": list(reader.layers),
        "n_examples": reader.n_samples, "n_tokens": int(sum(int(s.seq_len.sum()) for s in stores)),
        "d_model": reader.hidden, "dtype": "float16", "n_shards": len(stores), "bytes": dir_bytes(path),
        "T_max": attrs.get("T_max"), "T_chunk": attrs.get("T_chunk"), "chunk_bytes": attrs.get("chunk_bytes"),
        "merged": bool(manifest and manifest.get("merged")), "schema_version": attrs.get("schema_version"),
    }


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """float32 (H,) of dataset row `sample_idx`, block `layer_idx`, token `token_idx`; None if layer not stored."""
    reader = open_zarr(path)
    if layer_idx not in reader.layers:
        return None
    x = reader.read(sample_idx, layer_idx)
    if not 0 <= token_idx < x.shape[0]:
        raise IndexError(f"{path}: token {token_idx} out of range [0, {x.shape[0]}) for sample {sample_idx}")
    return x[token_idx].astype(np.float32)


def verify(path: str | Path) -> list[str]:
    """Full integrity check of a run (manifest + every store) or of one store; problems name the file."""
    path = Path(path)
    try:
        if (path / MANIFEST).is_file():
            return _verify_run(path)
        return _verify_store(path, None)
    except Exception as exc:  # a bad store must yield problems, never an exception
        return [f"{path}: cannot verify ({type(exc).__name__}: {exc})"]


def _verify_run(run: Path) -> list[str]:
    try:
        manifest = read_json(run / MANIFEST)
    except FormatError as exc:
        return [str(exc)]
    where = run / MANIFEST
    problems = [] if manifest.get("format") == FORMAT_NAME else [f"{where}: format={manifest.get('format')!r}"]
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        return problems + [f"{where}: 'shards' must be a non-empty list"]
    expected_start = 0
    for k, entry in enumerate(shards):
        missing = [key for key in ("path", "num_samples", "global_index_start", "files_sha256") if key not in entry]
        if missing:
            problems.append(f"{where}: shards[{k}] lacks {missing}")
            continue
        if entry["global_index_start"] != expected_start:
            problems.append(f"{where}: shards[{k}].global_index_start={entry['global_index_start']}, expected {expected_start}")
        expected_start += entry["num_samples"]
        problems += _verify_store(inside(run, entry["path"], str(where)), entry)
    if manifest.get("num_samples") != expected_start:
        problems.append(f"{where}: num_samples={manifest.get('num_samples')}, shards hold {expected_start}")
    if manifest.get("merged"):
        problems += _verify_store(inside(run, manifest["merged"]["path"], str(where)), manifest["merged"])
    return problems


def _verify_store(store: Path, entry: dict | None) -> list[str]:
    """Checksums of every file, no file missing or extra, spec fields, consolidated == per-file metadata."""
    files_json = store / FILES_JSON
    if not files_json.is_file():
        return [f"{files_json}: missing"]
    if entry is not None and sha256_file(files_json) != entry["files_sha256"]:
        return [f"{files_json}: sha256 differs from manifest.json"]
    try:
        files = read_json(files_json)["files"]
    except (FormatError, KeyError, TypeError) as exc:
        return [f"{files_json}: unreadable ({exc})"]
    problems = _verify_files(store, files)
    try:
        reader = ZarrStore(store)
    except FormatError as exc:
        return problems + [str(exc)]
    problems += _verify_metadata(store, reader, files)
    if entry is not None and entry["num_samples"] != reader.n_samples:
        problems.append(f"{store}/.zattrs: num_samples={reader.n_samples}, manifest.json says {entry['num_samples']}")
    return problems


def _verify_files(store: Path, files: dict[str, dict]) -> list[str]:
    problems = []
    for rel, info in files.items():
        try:
            problem = file_problem(inside(store, rel, str(store / FILES_JSON)), info, FILES_JSON)
        except FormatError as exc:
            problem = str(exc)
        if problem:
            problems.append(problem)
    extra = set(_walk(store)) - set(files) - {FILES_JSON}
    problems += [f"{store / rel}: not listed in {FILES_JSON}" for rel in sorted(extra)]
    return problems


def _verify_metadata(store: Path, reader: ZarrStore, files: dict[str, dict]) -> list[str]:
    problems = []
    for key, value in reader.metadata.items():  # what plain zarr clients see must equal the files
        path = store / key
        try:
            on_disk = json.loads(path.read_text())
        except (OSError, ValueError):
            problems.append(f"{path}: missing or not JSON (listed in .zmetadata)")
            continue
        if isinstance(value, dict):  # zarr-python nests a consolidated_metadata stub in sub-group entries
            value = {k: v for k, v in value.items() if k != "consolidated_metadata"}
        if on_disk != value:
            problems.append(f"{path}: differs from its entry in {store}/.zmetadata")
    chunks = {f"{ACTS}/{i}/{l}/{c}/0" for i in range(reader.n_samples) for l in range(len(reader.layers))
              for c in range(reader.n_chunks)}
    lost = chunks - set(files)
    if lost:
        problems.append(f"{store}/{ACTS}: {len(lost)} chunk files not recorded, e.g. {sorted(lost)[0]}")
    if reader.attrs.get("dtype") != "float16":
        problems.append(f"{store}/.zattrs: dtype={reader.attrs.get('dtype')!r}, expected 'float16'")
    if reader.attrs.get("num_layers") != len(reader.layers):
        problems.append(f"{store}/.zattrs: num_layers={reader.attrs.get('num_layers')} != len(layers)")
    return problems
