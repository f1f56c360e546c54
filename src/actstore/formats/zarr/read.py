"""Reading Zarr activation logger stores without zarr: validated metadata, then raw chunk reads.

Also the torch side: a map-style Dataset over (sample, layer), the spec's training-pattern batch
sampler and a padding collate function.
"""
from __future__ import annotations

import bisect
import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from actstore.errors import FormatError
from actstore.formats.zarr.layout import (ACTS, ACTS_ZARRAY, FORMAT_NAME, MANIFEST, MANIFEST_ENTRY_KEYS,
                                          REQUIRED_ATTRS, VECTOR_ZARRAY, chunk_bytes, chunk_counts, chunk_width,
                                          known_attrs)
from actstore.integrity import (TOOL_FILES, inside, read_index, read_json, read_sized, refuse, sorted_files,
                                whole_number, whole_numbers)


def _expect(path: str, field: str, value: Any, expected: Any) -> None:
    if not same_json(value, expected):  # as JSON: a shape of [true, ...] or zarr_format 2.0 is not the layout
        raise FormatError(f"{path}: {field}={value!r}, expected {expected!r}")


def _expect_fields(path: str, zarray: dict[str, Any], expected: dict[str, Any]) -> None:
    for field, value in expected.items():
        _expect(path, field, zarray.get(field), value)


def _plain_dtype(name: Any) -> np.dtype | None:
    """The numpy dtype a .zarray names, when it is a number or fixed-length bytes (what the logger
    writes); None for anything else (an object dtype, a name numpy does not know)."""
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        return None
    return dtype if dtype is not None and dtype.kind in "biufS" else None


def list_store_files(store: Path) -> list[str]:
    """Every file under `store`, as sorted POSIX paths relative to it (Snakemake's marker excluded)."""
    return list(store_files(store))


def store_files(store: Path) -> Iterator[str]:
    """list_store_files one at a time, walking one directory at a time (integrity.sorted_files)."""
    return (name for name in sorted_files(store) if name not in TOOL_FILES)


class ZarrStore:
    """One store (a shard or merged/) opened read-only: metadata validated once, chunks read raw.

    Holds no file handles and no zarr objects, so it is safe to use after fork in DataLoader workers.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        consolidated = read_json(self.path / ".zmetadata")
        metadata = consolidated.get("metadata", {}) if isinstance(consolidated, dict) else None
        if not isinstance(metadata, dict):
            raise FormatError(f"{self.path}/.zmetadata: not consolidated metadata (needs a metadata object)")
        self.metadata: dict[str, Any] = metadata
        self.attrs: dict[str, Any] = self._meta(".zattrs")
        for key in REQUIRED_ATTRS:
            if key not in self.attrs:
                raise FormatError(f"{self.path}/.zattrs: required field {key!r} missing")
        self._validate_counts()
        self.layers: list[int] = list(self.attrs["layers"])
        self._layer_pos = {layer: l for l, layer in enumerate(self.layers)}
        self.n_samples: int = self.attrs["num_samples"]
        self.hidden: int = self.attrs["hidden_size"]
        self.t_max: int = self.attrs["T_max"]
        self._validate_activations()
        self.seq_len = self.vector("seq_len")
        if self.seq_len.dtype.kind not in "iu":  # a float count opened fine, then failed every read unnamed
            raise FormatError(f"{self.path}/arrays/seq_len: dtype {self.seq_len.dtype}, expected integers")
        if self.seq_len.shape != (self.n_samples,) or (self.seq_len > self.t_max).any() or (self.seq_len < 0).any():
            raise FormatError(f"{self.path}/arrays/seq_len: values outside [0, T_max={self.t_max}] or wrong length")
        self._acts = str(self.path / ACTS)
        self._root = os.path.realpath(self.path) + os.sep  # what every chunk opened must lie under
        self._seq: list[int] = self.seq_len.tolist()  # Python ints: cheaper than numpy scalars per read

    def _meta(self, key: str) -> dict[str, Any]:
        if not isinstance(self.metadata.get(key), dict):
            raise FormatError(f"{self.path}/.zmetadata: no object entry {key!r}")
        return self.metadata[key]

    def _validate_counts(self) -> None:
        """The attrs every read counts with are whole numbers, and no layer is stored twice (one of its
        positions would be unreachable): a damaged .zattrs is named here, never a TypeError later
        (global_index_start: the merge named every chunk of a float one "15.0", a missing one a KeyError)."""
        where = f"{self.path}/.zattrs"
        for key in ("num_samples", "hidden_size", "T_max", "global_index_start"):
            if not whole_number(self.attrs[key]):
                raise FormatError(f"{where}: {key}={self.attrs[key]!r:.40}, expected a whole number")
        if self.attrs["num_samples"] and not self.attrs["hidden_size"]:  # width 0: an empty part's store alone
            raise FormatError(f"{where}: hidden_size=0 in a store of {self.attrs['num_samples']} samples")
        layers = self.attrs["layers"]
        if not whole_numbers(layers) or len(set(layers)) != len(layers):
            raise FormatError(f"{where}: layers={layers!r:.60}, expected a list of distinct block indices")

    def _validate_activations(self) -> None:
        """The fast path is only correct for raw little-endian float16 C-order chunks: check exactly that."""
        z = self._meta(f"{ACTS}/.zarray")
        where = f"{self.path}/{ACTS}/.zarray"
        shape = [self.n_samples, len(self.layers), self.t_max, self.hidden]
        _expect_fields(where, z, {**ACTS_ZARRAY, "shape": shape})
        chunks = z.get("chunks")
        width = chunk_width(self.hidden)
        if not (isinstance(chunks, list) and len(chunks) == 4 and chunks[:2] == [1, 1] and chunks[3] == width
                and whole_number(chunks[2], 1)):  # true is no T_chunk
            raise FormatError(f"{where}: chunks={chunks!r}, expected [1, 1, T_chunk, {width}]")
        self.t_chunk = chunks[2]
        self.chunk_bytes = chunk_bytes(self.t_chunk, self.hidden)
        self.n_chunks = math.ceil(self.t_max / self.t_chunk)

    @property
    def vector_names(self) -> list[str]:
        """The 1-D arrays .zmetadata lists (arrays/<name>/.zarray); FormatError naming a key whose name is
        not one plain path component."""
        return sorted(self._vector_name(k) for k in self.metadata if k.startswith("arrays/") and k.endswith("/.zarray")
                      and k != f"{ACTS}/.zarray")

    def _vector_name(self, key: str) -> str:
        """The array name in .zmetadata key arrays/<name>/.zarray. Its chunks are read at arrays/<name>/<c>:
        a name of "..", "." or "" put them outside arrays/ (the store's own files read as a vector, and
        merged as one), a nested or NUL one left the key unread or the open unnamed."""
        parts = key.split("/")
        if len(parts) != 3 or parts[1] in ("", ".", "..") or "\0" in parts[1]:
            raise FormatError(f"{self.path}/.zmetadata: {key!r:.80} is no array directly under arrays/ (a 1-D "
                              "array's name is one plain path component)")
        return parts[1]

    def vector(self, name: str) -> np.ndarray:
        """A 1-D per-sample array (seq_len, sample_key, ...) read raw after validating its .zarray."""
        dtype, _ = self._vector_layout(name)
        parts = list(self.vector_chunks(name))
        out = np.concatenate(parts) if parts else np.zeros(0, dtype)
        return out.astype(dtype.newbyteorder("="))

    def vector_chunks(self, name: str) -> Iterator[np.ndarray]:
        """1-D array `name`'s values a chunk file at a time, as stored (a store of 10^9 samples holds
        gigabytes of them: verify reads them so), its .zarray validated first."""
        dtype, chunk = self._vector_layout(name)
        source = f"{self.path}/arrays/{name}/.zarray"
        for c, key in enumerate(self.vector_chunk_names(name)):
            values = np.frombuffer(read_sized(inside(self.path, key, source), chunk * dtype.itemsize, source), dtype)
            yield values[: self.n_samples - c * chunk]

    def vector_chunk_names(self, name: str) -> Iterator[str]:
        """The chunk files of 1-D array `name`, relative to the store: what vector() reads, and what the
        merge checks against files.json before it copies them. Its .zarray is checked now, the names
        made one at a time: a .zattrs claiming 10^12 samples made a list of them (memory without end)
        before the first chunk, missing, was found."""
        _, chunk = self._vector_layout(name)
        return (f"arrays/{name}/{c}" for c in range(math.ceil(self.n_samples / chunk)))

    def _vector_layout(self, name: str) -> tuple[np.dtype, int]:
        """dtype and samples per chunk of 1-D array `name`, from its validated .zarray."""
        key = f"arrays/{name}/.zarray"
        where = f"{self.path}/{key}"
        self._vector_name(key)  # refuses a name whose chunks lie outside arrays/
        z = self._meta(key)
        _expect_fields(where, z, {**VECTOR_ZARRAY, "shape": [self.n_samples]})
        dtype, chunks = _plain_dtype(z.get("dtype")), z.get("chunks")
        if dtype is None or not (isinstance(chunks, list) and len(chunks) == 1 and whole_number(chunks[0]) and chunks[0]):
            raise FormatError(f"{where}: dtype={z.get('dtype')!r:.40} chunks={chunks!r:.40}, expected a numeric or "
                              "bytes dtype and [samples per chunk]")
        return dtype, chunks[0]

    def chunk_counts(self) -> np.ndarray:
        """The chunk files of each sample and layer: those its seq_len tokens fill (layout.chunk_counts)."""
        return chunk_counts(self.seq_len, self.t_chunk)

    def layer_position(self, layer: int) -> int:
        """Position on the L axis of block `layer`; FormatError naming the stored layers if absent."""
        try:
            return self._layer_pos[read_index(layer, "layer", self.path)]
        except KeyError:
            raise FormatError(f"{self.path}: layer {layer} not stored; layers are {self.layers}") from None

    def locate(self, sample_idx: int) -> tuple[ZarrStore, int]:
        """This store and the local index of dataset row `sample_idx` (ZarrRun.locate's answer): a shard
        holds the rows from its global_index_start on. IndexError for a row it does not hold."""
        row, start = read_index(sample_idx, "sample_idx", self.path), self.attrs["global_index_start"]
        if not start <= row < start + self.n_samples:
            raise IndexError(f"{self.path}: sample_idx {row} out of range [{start}, {start + self.n_samples})")
        return self, row - start

    def chunk_path(self, i: int, l: int, c: int) -> str:
        return f"{self._acts}/{i}/{l}/{c}/0"

    def read(self, i: int, layer: int) -> np.ndarray:
        """(seq_len[i], H) float16 activations of local sample i, block `layer`: only its own chunks."""
        i = read_index(i, "sample", self.path)
        if not 0 <= i < self.n_samples:
            raise IndexError(f"{self.path}: sample {i} out of range [0, {self.n_samples})")
        l = self.layer_position(layer)
        n = self._seq[i]
        out = np.empty((n, self.hidden), dtype=np.float16)
        tc = self.t_chunk
        for c in range(-(-n // tc)):  # row slices of a C-order array are contiguous buffers
            self._read_chunk(self.chunk_path(i, l, c), out[c * tc: (c + 1) * tc])
        return out

    def _read_chunk(self, path: str, into: np.ndarray) -> None:
        try:  # O_NONBLOCK: a FIFO in a chunk's place would block the open until a writer came
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        except FileNotFoundError:
            raise FormatError(f"{path}: chunk file missing") from None
        except OSError as exc:  # a loop of links is the store's damage (verify names it), not the machine's
            if exc.errno != errno.ELOOP:
                raise
            raise FormatError(f"{path}: a link that cannot be resolved (a loop of links)") from None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):  # a FIFO would block the read, a device never end
                raise FormatError(f"{path}: not a regular file (a FIFO, device or directory is never read)")
            if not (opened := _opened_path(fd, path)).startswith(self._root):
                # a chunk, or a sample's directory, linked out of the store: a file outside was read as data
                raise FormatError(f"{path}: leads outside {self.path} (to {opened}, through a link)")
            if (size := found.st_size) != self.chunk_bytes:  # a truncated or padded chunk is corruption, not fill
                raise FormatError(f"{path}: {size} bytes, expected {self.chunk_bytes}")
            if os.preadv(fd, [into], 0) != into.nbytes:
                raise FormatError(f"{path}: short read")
        finally:
            os.close(fd)


_FD_PATHS = os.path.isdir("/proc/self/fd")  # Linux names each open file's real path there


def _opened_path(fd: int, path: str) -> str:
    """The real path of the file open as `fd` (opened from `path`): the kernel's name for it where it
    gives one (one system call, and no link changed after the open can deceive it), else `path` resolved."""
    return os.readlink(f"/proc/self/fd/{fd}") if _FD_PATHS else os.path.realpath(path)


def entry_problem(entry: Any, where: str) -> str | None:
    """What is wrong with the shape of one manifest store entry (`where` names it), or None: an object
    with every MANIFEST_ENTRY_KEYS key, whole-number sample counts and a path."""
    if not isinstance(entry, dict):
        return f"{where} must be an object, got {entry!r:.60}"
    missing = [key for key in MANIFEST_ENTRY_KEYS if key not in entry]
    if missing:
        return f"{where} lacks {missing}"
    counts = [entry["global_index_start"], entry["num_samples"]]
    if not all(whole_number(n) for n in counts):
        return f"{where}: global_index_start and num_samples must be whole numbers, got {counts}"
    totals = [entry[key] for key in ("n_files", "bytes") if key in entry]
    if not all(whole_number(n) for n in totals):
        return f"{where}: n_files and bytes must be whole numbers, got {totals}"
    return None


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: true is not 1, 1.0 is not 1 (Python's == says both are)."""
    return json.dumps(a, sort_keys=True, default=int) == json.dumps(b, sort_keys=True, default=int)


def run_field_problems(manifest: dict[str, Any], store: ZarrStore, where: str) -> list[str]:
    """The run-wide fields manifest.json repeats (what ZarrRun reads from it) against one store's
    own: layers and hidden_size always, the others where the manifest has them (earlier releases); a
    store of no sample's width attrs are none of the run's (layout.WIDTH_ATTRS)."""
    have = {"layers": store.layers, "hidden_size": store.hidden, "num_layers": len(store.layers),
            "T_max": store.t_max, "T_chunk": store.t_chunk, "dtype": "float16",
            "schema_version": store.attrs.get("schema_version"), "model_id": store.attrs.get("model_id")}
    return [f"{where}: {key}={manifest.get(key)!r:.60}, but {store.path} holds {have[key]!r:.60}"
            for key in known_attrs(store.attrs, have)
            if (key in ("layers", "hidden_size") or key in manifest) and not same_json(manifest.get(key), have[key])]


def count_problems(entries: list[dict[str, Any]], stores: list[ZarrStore], names: list[str]) -> list[str]:
    """Each manifest entry's num_samples against its store's, and its start against the samples of the
    entries before it. Reads number a run's samples 0 .. num_samples-1 through the entries: a shard left
    out of the manifest made a gap whose indices were answered from the next store at a negative local
    index (seq_len: another sample's), and the last samples unreachable."""
    problems, first = [], 0
    for entry, name, store in zip(entries, names, stores):
        if not same_json(entry["num_samples"], store.n_samples):
            problems.append(f"{name}: num_samples={entry['num_samples']}, but {store.path}/.zattrs says "
                            f"{store.n_samples}")
        if not same_json(entry["global_index_start"], first):
            problems.append(f"{name}: global_index_start={entry['global_index_start']}, expected {first} (the "
                            "samples of the entries before it)")
        first += store.n_samples
    return problems


def start_problems(entry: dict[str, Any], store: ZarrStore, where: str, merged: bool) -> list[str]:
    """The global_index_start of a manifest entry (`where` names it) against its store's own .zattrs
    (a merged store's: 0). Reads find a sample's store by the entries' starts, so an entry that names
    another store (paths swapped) or a moved start would send every read to the wrong sample."""
    start, own = entry["global_index_start"], store.attrs.get("global_index_start")
    if merged and start != 0:
        return [f"{where}: global_index_start={start}, expected 0 (a merged store holds every sample)"]
    if not same_json(start, own):
        return [f"{where}: global_index_start={start}, but {store.path}/.zattrs says {own!r:.40}"]
    return []


def entry_names(where: Path, n: int, merged: bool) -> list[str]:
    """The names of a manifest's `n` store entries in messages: "<where>: shards[k]", or its merged one."""
    return [f"{where}: merged"] if merged else [f"{where}: shards[{k}]" for k in range(n)]


def check_entries(manifest: dict[str, Any], where: Path, entries: list[dict[str, Any]], stores: list[ZarrStore],
                  merged: bool) -> None:
    """FormatError naming what ZarrRun cannot read through in the store entries of manifest `where`
    (its shards', or its merged one) against their stores, from .zattrs alone (sample_idx is verify's)."""
    names = entry_names(where, len(entries), merged)
    refuse([problem for entry, name, store in zip(entries, names, stores)
            for problem in run_field_problems(manifest, store, str(where))
            + start_problems(entry, store, name, merged)])
    refuse(count_problems(entries, stores, names))
    if merged and not same_json(entries[0]["num_samples"], manifest.get("num_samples")):
        # a merged store of fewer samples than the run's shards: its reads would lose the rest
        raise FormatError(f"{names[0]}: num_samples={entries[0]['num_samples']}, but the run's num_samples is "
                          f"{manifest.get('num_samples')!r:.40} (its shards')")


class ZarrRun:
    """A run directory read through its manifest (Option A), or its merged/ store (Option B)."""

    def __init__(self, path: str | Path, merged: bool = False):
        self.path = Path(path)
        self.manifest = read_json(self.path / MANIFEST)
        if not isinstance(self.manifest, dict):  # a bare "actstore-zarr-..." string passed as its own format
            raise FormatError(f"{self.path / MANIFEST}: not a JSON object, got {self.manifest!r:.60}")
        if (found := self.manifest.get("format")) != FORMAT_NAME:
            raise FormatError(f"{self.path / MANIFEST}: format={found!r:.60}, expected {FORMAT_NAME!r}")
        if merged:
            if not self.manifest.get("merged"):
                raise FormatError(f"{self.path / MANIFEST}: no merged store (build it with zarr.merged: true)")
            entries = [self.manifest["merged"]]
        else:
            entries = self.manifest.get("shards")
            if not isinstance(entries, list) or not entries:  # none: its run-wide fields checked against no store
                raise FormatError(f"{self.path / MANIFEST}: 'shards' must be a non-empty list, got {entries!r:.60}")
        where = self.path / MANIFEST
        for entry, name in zip(entries, entry_names(where, len(entries), merged)):
            if problem := entry_problem(entry, name):
                raise FormatError(problem)
        self.stores = [ZarrStore(inside(self.path, e["path"], str(where))) for e in entries]
        check_entries(self.manifest, where, entries, self.stores, merged)
        self._starts = [int(e["global_index_start"]) for e in entries]
        self.n_samples = int(sum(e["num_samples"] for e in entries))
        self.layers: list[int] = list(self.manifest["layers"])
        self.hidden = int(self.manifest["hidden_size"])

    def locate(self, sample_idx: int) -> tuple[ZarrStore, int]:
        """The store holding global `sample_idx` and its local index there."""
        sample_idx = read_index(sample_idx, "sample_idx", self.path)
        if not 0 <= sample_idx < self.n_samples:
            raise IndexError(f"{self.path}: sample_idx {sample_idx} out of range [0, {self.n_samples})")
        k = bisect.bisect_right(self._starts, sample_idx) - 1  # the last of equal starts: empty shards skipped
        return self.stores[k], sample_idx - self._starts[k]

    def read(self, sample_idx: int, layer: int) -> np.ndarray:
        store, local = self.locate(sample_idx)
        return store.read(local, layer)

    def seq_len(self, sample_idx: int) -> int:
        store, local = self.locate(sample_idx)
        return int(store.seq_len[local])


def open_zarr(path: str | Path, merged: bool = False, verify: bool = False) -> ZarrRun | ZarrStore:
    """A run directory (manifest.json) or a single store, for reading. verify=True first checks
    every file against meta/files.json and the manifest (reads each file once)."""
    path = Path(path)
    if verify:
        from actstore.formats.zarr.check import verify as problems
        from actstore.hashing import stage_problems
        refuse(problems(path) + stage_problems(path))
    return ZarrRun(path, merged) if (path / MANIFEST).is_file() else ZarrStore(path)


# ----------------------------------------------------------------------------------------- torch
# A DataLoader takes any object with __len__ and __getitem__ (a sampler: any iterable), so these do
# not subclass torch's Dataset and Sampler: torch is imported on first use, not by every writer job
# and every workflow parse that imports this package (~2 s, ~150 MB each).


class ZarrActivationDataset:
    """Map-style dataset for torch's DataLoader: key (sample_idx, layer) -> (seq_len, H) float16 tensor
    (over a single store, a shard: its local index, as ZarrStore.read takes it).

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
            if len(key) != 2:  # unpacking it said "not enough values to unpack", naming nothing
                raise TypeError(f"{self.path}: key {key!r:.60} is not a (sample, layer) pair")
            i, layer = key
        else:  # int() made a key of 1.5 or True read sample 0 or 1: it is refused as the reader refuses it
            k = read_index(key, "key", self.path)
            i, layer = k // len(self.layers), self.layers[k % len(self.layers)]
        return torch.from_numpy(self.reader.read(i, layer))


class TrainingPatternSampler:
    """Batch sampler (DataLoader's batch_sampler) for the spec's pattern: b random samples x
    `layers_per_sample` random layers each.

    Yields lists of (sample_idx, layer) keys; new draws each epoch (seeded by [seed, epoch]).
    """

    def __init__(self, n_samples: int, layers: Sequence[int], batch_samples: int, layers_per_sample: int = 2,
                 num_batches: int | None = None, seed: int = 0):
        # each checked here, not at the first batch: layers_per_sample 0 drew empty batches, the others
        # failed there in numpy's words (a negative seed) or made a negative len (num_batches)
        if len(set(np.asarray(layers).tolist())) != len(layers):  # a layer listed twice could be drawn twice
            raise ValueError(f"layers={list(layers)} must be distinct")
        _check_argument("n_samples", n_samples, 1)
        _check_argument("batch_samples", batch_samples, 1, n_samples)
        _check_argument("layers_per_sample", layers_per_sample, 1, len(layers))
        _check_argument("seed", seed, 0)
        if num_batches is not None:
            _check_argument("num_batches", num_batches, 0)
        self.n_samples, self.layers, self.b = int(n_samples), np.asarray(layers), int(batch_samples)
        self.k, self.seed, self.epoch = int(layers_per_sample), int(seed), 0
        self.num_batches = int(num_batches) if num_batches is not None else self.n_samples // self.b

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        rng = np.random.default_rng([self.seed, self.epoch])  # seed + epoch: seed 1 drew seed 0's epoch 1
        self.epoch += 1
        for _ in range(self.num_batches):
            samples = rng.choice(self.n_samples, size=self.b, replace=False)
            yield [(int(i), int(layer)) for i in samples
                   for layer in rng.choice(self.layers, size=self.k, replace=False)]


def _check_argument(name: str, value: Any, least: int, most: int | None = None) -> None:
    """ValueError naming a sampler argument that is no integer (a bool, a float) in [least, most]."""
    if not whole_number(value, least) or (most is not None and value > most):
        raise ValueError(f"TrainingPatternSampler: {name}={value!r:.40} must be an integer in [{least}, "
                         f"{'inf' if most is None else most}]")


def collate_padded(batch: list[Any]) -> tuple[Any, Any]:
    """Stack (seq_len, H) tensors into (B, max_len, H) zero-padded plus the (B,) lengths."""
    import torch
    lengths = torch.tensor([x.shape[0] for x in batch], dtype=torch.int64)
    return torch.nn.utils.rnn.pad_sequence(list(batch), batch_first=True), lengths
