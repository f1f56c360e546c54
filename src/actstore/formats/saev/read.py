"""Reading a saev store: resolve a path to the store, open it, address vectors as the spec's §4 says."""
from __future__ import annotations

import itertools
import os
import re
import warnings
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Iterator

import numpy as np
from tqdm import tqdm

from actstore.errors import ConfigError, FormatError
from actstore.formats.saev.layout import (DTYPE, LABELS, METADATA, POINTER, SHARDS, SIDECAR, WINDOWS,
                                          check_metadata, dropped_tokens, examples_per_shard, flavor_of,
                                          protocol_problem, shard_name, to_spec, window_problem)
from actstore.integrity import (check_npy, file_records, inside, open_files_budget, read_index, read_json, refuse,
                                share_places, whole_number)
from actstore.io_utils import pread_into

# iter_ordered's default read: a whole shard of a multi-layer ViT store at the spec's default
# patches_per_shard is about 10 GiB, which 1024 examples a chunk could take at once.
READ_CHUNK_BYTES = 256 << 20


def resolve(path: str | Path) -> Path:
    """The store directory (absolute) from itself, a stage dir holding saev.json, or saev.json itself."""
    # Absolute: the store's name is its metadata's hash (check.verify, inspect), and a pointer's store is
    # its parent's sibling; "." named nothing, and the parent of "saev.json" or "." was "." again.
    path = Path(os.path.abspath(path))
    if path.is_dir() and (path / METADATA).exists():  # not a regular file: read_json names it
        return path
    pointer = path / POINTER if path.is_dir() else path
    if pointer.name == POINTER and pointer.is_file():
        record = read_json(pointer)  # never json.loads: a duplicate key or deep nesting is named there
        if not isinstance(record, dict) or "store" not in record:
            raise FormatError(f"{pointer}: not a saev pointer (needs a 'store' key)")
        target = record["store"]
        # The store is the stage dir's sibling named by its HASH (spec) or shards/<8 hex> (upstream).
        if not isinstance(target, str) or not re.fullmatch(r"\.\./([0-9a-f]{64}|shards/[0-9a-f]{8})", target):
            raise FormatError(f"{pointer}: store {target!r} is not '../<metadata sha256>' or '../shards/<8 hex>'")
        recorded = record.get("hash", PurePosixPath(target).name)
        if recorded != PurePosixPath(target).name:  # the hash the stage recorded names the store it points at
            raise FormatError(f"{pointer}: hash {recorded!r:.80} is not the store's name {PurePosixPath(target).name!r}")
        # Beside the stage dir, never through a link out of it: `inside` refuses one (nothing outside is read).
        return inside(pointer.parent.parent, target.removeprefix("../"), f"{pointer}: store").resolve()
    raise FormatError(f"{path / METADATA}: missing (and no {POINTER}: {path} is neither a saev store nor "
                      f"a stage dir pointing at one)")


class SaevStore:
    """An opened store of either flavor, or one saev wrote: spec §4 addressing, per-shard memmaps,
    ordered iteration. `metadata` has the spec's field names whatever the file's (`file_metadata`)."""

    def __init__(self, path: str | Path, check_sizes: bool = True):
        self.dir = resolve(path)
        self.file_metadata = read_json(self.dir / METADATA)
        check_metadata(self.file_metadata, self.dir / METADATA)
        self.flavor = flavor_of(self.file_metadata)
        self.metadata = to_spec(self.file_metadata)
        if problem := protocol_problem(self.metadata["protocol"]):  # spec §5: "a breaking warning"; verify names it
            warnings.warn(f"{self.dir / METADATA}: {problem}", stacklevel=2)
        self.shards = read_json(self.dir / SHARDS)
        self._check_shards_json()
        self.sidecar = self._read_sidecar()
        self.starts = np.concatenate([[0], np.cumsum([s["n_examples"] for s in self.shards])]).astype(np.int64)
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()  # least recently used first
        self._windows: np.ndarray | None | bool = False  # False: not looked for yet
        if check_sizes:
            problems = self.size_problems()
            if problems:
                raise FormatError("; ".join(problems))

    def _read_sidecar(self) -> dict:
        """actstore.json ({} for a store saev wrote): an object whose `files` records are checked for
        shape here, so that verify reports a bad record instead of failing on it, and whose
        `dropped_tokens` (the extracted tokens an upstream store leaves out) are the ones its writer
        records: find() shifts every token past them, so any other list hands out other tokens' vectors."""
        path = self.dir / SIDECAR
        if not path.is_file():
            return {}
        sidecar = read_json(path)
        if not isinstance(sidecar, dict):
            raise FormatError(f"{path}: must be a JSON object, got {type(sidecar).__name__}")
        file_records(sidecar.get("files", {}), str(path))
        dropped = sidecar.get("dropped_tokens", [])
        # write.plan_store: upstream leaves out the `registers` after CLS; spec keeps every token.
        registers = sidecar.get("registers", 0) if self.flavor == "upstream" else 0
        if not (isinstance(dropped, list) and all(type(t) is int for t in dropped) and type(registers) is int
                and len(dropped) == registers
                and dropped == dropped_tokens(self.metadata["cls_token"], len(dropped))):
            expected = (f"the registers={registers!r:.20} tokens after CLS" if self.flavor == "upstream"
                        else "none: a spec-flavor store keeps every extracted token")
            raise FormatError(f"{path}: dropped_tokens must be increasing token indices, got {dropped!r:.80}; "
                              f"its writer records {expected}")
        return sidecar

    # spec §4.1 names
    @property
    def layers(self) -> list[int]:
        return self.metadata["layers"]

    @property
    def L(self) -> int:
        return len(self.layers)

    @property
    def dropped_tokens(self) -> list[int]:
        """The extracted token positions the store leaves out (actstore.json, checked when opened): an
        upstream image store's registers after CLS; none for a spec store or one saev wrote."""
        return self.sidecar.get("dropped_tokens", [])

    @property
    def patches_per_ex(self) -> int:
        return self.metadata["patches_per_ex"]

    @property
    def T(self) -> int:
        return self.patches_per_ex + int(self.metadata["cls_token"])

    @property
    def D(self) -> int:
        return self.metadata["d_model"]

    @property
    def n_examples(self) -> int:
        return self.metadata["n_examples"]

    @property
    def examples_per_shard(self) -> int:
        return examples_per_shard(self.metadata["patches_per_shard"], self.T, self.L)

    @property
    def example_bytes(self) -> int:
        return self.L * self.T * self.D * DTYPE.itemsize

    def _check_shards_json(self) -> None:
        where = self.dir / SHARDS
        if not isinstance(self.shards, list) or not self.shards and self.n_examples:
            raise FormatError(f"{where}: must be a non-empty array of shard objects")
        per = self.examples_per_shard
        if per < 1 and self.n_examples:  # every shard then "expected 0" examples, blaming a right shards.json
            raise FormatError(f"{self.dir / METADATA}: patches_per_shard = {self.metadata['patches_per_shard']} holds "
                              f"no example ({self.T} tokens x {self.L} layers)")
        for i, shard in enumerate(self.shards):
            if not isinstance(shard, dict) or shard.get("name") != shard_name(i):
                raise FormatError(f"{where}: entry {i} must be named {shard_name(i)!r}, got {shard!r:.80}")
            n, last = shard.get("n_examples"), i == len(self.shards) - 1
            # saev's writer ends with an empty shard when n_examples is a multiple of examples_per_shard.
            if type(n) is not int or n < int(not last) or n > per or (not last and n != per):
                raise FormatError(f"{where}: {shard_name(i)} n_examples={n!r}; expected {per} "
                                  f"(only the last shard may be smaller)")
        total = sum(s["n_examples"] for s in self.shards)
        if total != self.n_examples:
            raise FormatError(f"{where}: shards hold {total} examples, metadata.json n_examples={self.n_examples}")

    def shard_bytes(self, idx: int) -> int:
        return self.shards[idx]["n_examples"] * self.example_bytes

    def allowed_bytes(self, idx: int) -> tuple[int, ...]:
        """A shard's size: n_examples examples; the last one may also be padded to examples_per_shard
        (saev memory-maps every shard at full size; padding rows are never read)."""
        if idx == len(self.shards) - 1:
            return self.shard_bytes(idx), self.examples_per_shard * self.example_bytes
        return (self.shard_bytes(idx),)

    def size_problems(self) -> list[str]:
        """Every shard present with an allowed size (checked before any read)."""
        return [problem for i in range(len(self.shards)) if (problem := self.shard_problem(i))]

    def shard_problem(self, idx: int) -> str | None:
        """What is wrong with shard `idx` (missing, of a size not allowed, linked out), None if nothing:
        a reader of a store opened earlier checks the one shard it reads, not every shard again."""
        shard = self.shards[idx]
        try:  # a shard linked to a file outside the store is never read
            path = inside(self.dir, shard["name"], str(self.dir / SHARDS))
        except FormatError as exc:
            return str(exc)
        if not path.is_file():
            return f"{path}: missing shard"
        if path.stat().st_size not in self.allowed_bytes(idx):
            return (f"{path}: {path.stat().st_size} bytes, expected {self.shard_bytes(idx)} "
                    f"({shard['n_examples']} x {self.L} x {self.T} x {self.D} float32)")
        return None

    def layer_index(self, layer: int) -> int:
        """Spec §4.2 step 2: a layer not stored is an error naming the stored layers."""
        read_index(layer, "layer", self.dir)
        if layer not in self.layers:
            raise FormatError(f"{self.dir}: layer {layer} not stored; stored layers are {self.layers}")
        return self.layers.index(layer)

    def _check_example(self, example: int) -> None:
        """IndexError naming the store unless `example` is one of its examples: example(-1) mapped a
        shard named acts-00001.bin (FileNotFoundError), one past the end a bare IndexError."""
        read_index(example, "example", self.dir)
        if not 0 <= example < self.n_examples:
            raise IndexError(f"{self.dir}: example {example} out of range [0, {self.n_examples})")

    def locate(self, example: int, layer: int, token: int) -> tuple[Path, int]:
        """Spec §4.2: (shard file, byte offset) of vector [example, layer value, token]."""
        self._check_example(example)
        read_index(token, "token", self.dir)
        if not 0 <= token < self.T:
            raise IndexError(f"{self.dir}: token {token} out of range [0, {self.T})")
        s = self.examples_per_shard
        shard_idx, ex_in_shard = divmod(example, s)
        offset_in_vectors = ex_in_shard * self.L * self.T + self.layer_index(layer) * self.T + token
        return self.dir / shard_name(shard_idx), offset_in_vectors * self.D * DTYPE.itemsize

    def vector(self, example: int, layer: int, token: int) -> np.ndarray:
        """One (D,) vector by seek + read at the spec's byte offset."""
        path, offset = self.locate(example, layer, token)
        out = np.empty(self.D, dtype=DTYPE)
        fd = os.open(path, os.O_RDONLY)
        try:
            _read_exactly(fd, path, out, offset)
        finally:
            os.close(fd)
        return out.astype(np.float32)

    def memmap(self, shard_idx: int) -> np.memmap:
        """Read-only (S, L, T, D) memmap of one shard (random access for visualisation). A shard cut
        short after it is mapped kills the process on access (SIGBUS, as any memory map); the other
        readers name it instead. Each map holds a file descriptor, so past open_files_budget() the least
        recently used one is let go (an array handed out stays valid) and mapped again when next asked:
        reading every example of a store of more shards than the open-file limit failed with EMFILE.
        A shard cut short (or gone) since the store was opened is named before it is mapped: numpy
        refused it with "mmap length is greater than file size", naming no file. Threads may read at
        once: the map returned is held here, since another thread may let it go from _maps meanwhile."""
        read_index(shard_idx, "shard", self.dir)
        if not 0 <= shard_idx < len(self.shards):  # -1 mapped the last shard, one past the end a bare IndexError
            raise IndexError(f"{self.dir}: shard {shard_idx} out of range [0, {len(self.shards)})")
        mapped = self._maps.get(shard_idx)
        if mapped is None:
            if problem := self.shard_problem(shard_idx):
                raise FormatError(problem)
            shape = (self.shards[shard_idx]["n_examples"], self.L, self.T, self.D)
            if not shape[0]:  # an empty last shard may have no bytes, which numpy refuses to map, naming nothing
                empty = np.empty(shape, dtype=DTYPE)
                empty.flags.writeable = False
                return empty
            mapped = np.memmap(self.dir / shard_name(shard_idx), dtype=DTYPE, mode="r", shape=shape)
            self._maps[shard_idx] = mapped
            while len(self._maps) > open_files_budget():
                try:
                    self._maps.popitem(last=False)
                except KeyError:  # emptied by the other threads letting maps go
                    break
        else:
            try:
                self._maps.move_to_end(shard_idx)
            except KeyError:  # let go by another thread since: it is mapped again when next asked
                pass
        return mapped

    def example(self, example: int) -> np.ndarray:
        """(L, T, D) view of one example through the shard memmap."""
        self._check_example(example)
        shard_idx, ex_in_shard = divmod(example, self.examples_per_shard)
        return self.memmap(shard_idx)[ex_in_shard]

    def iter_ordered(self, chunk_examples: int | None = None, progress: bool = False, *,
                     share: tuple[int, int] = (0, 1)) -> Iterator[tuple[int, np.ndarray]]:
        """(first example, (n, L, T, D) array) in example order, one large sequential read each of
        chunk_examples (default: as many as READ_CHUNK_BYTES holds, at least one). share (k, n): only
        the chunks at places k, k + n, k + 2n, ... of the store's chunks in that order (integrity.in_share's
        pick, a validate share job's), the others never read."""
        if chunk_examples is None:
            chunk_examples = max(1, READ_CHUNK_BYTES // self.example_bytes)
        if not whole_number(chunk_examples, least=1):  # range() yielded nothing for -1, with no error
            raise ConfigError(f"chunk_examples={chunk_examples!r} must be a whole number >= 1")
        first, every = share_places(share)
        places = itertools.count()  # each chunk's place in the store's order, shards after one another
        for idx, shard in enumerate(tqdm(self.shards, desc="saev read", disable=not progress)):
            path = self.dir / shard["name"]
            fd = os.open(path, os.O_RDONLY)
            try:
                for lo in range(0, shard["n_examples"], chunk_examples):
                    if next(places) % every != first:
                        continue
                    n = min(chunk_examples, shard["n_examples"] - lo)
                    out = np.empty((n, self.L, self.T, self.D), dtype=DTYPE)
                    # pread_into loops: one read() returns at most 2 GiB - 4 KiB on Linux
                    _read_exactly(fd, path, out, lo * self.example_bytes)
                    yield int(self.starts[idx]) + lo, out
            finally:
                os.close(fd)

    @property
    def windows(self) -> np.ndarray | None:
        """Text stores: (n_examples, 3) sample_idx, token_start, n_valid; None for images. FormatError
        naming windows.npy when it is not a 2-D integer array of 3 columns (every reader indexes it so)
        or its rows do not give each token of a sample one place (layout.window_problem: `find` would
        hand out other tokens' vectors). FormatError too when actstore.json records windows.npy and it
        is missing (a copy of the *.bin and *.json files alone): read as an image store's, example e was
        dataset row e and the loader yielded the zero padding."""
        if self._windows is False:  # looked up once: the loader asks for every block
            path = inside(self.dir, WINDOWS, str(self.dir))  # never a file a link out leads to
            if not path.is_file() and WINDOWS in self.sidecar.get("files", {}):
                raise FormatError(f"{path}: missing, but {self.dir / SIDECAR} records it: this text store's "
                                  "examples cannot be mapped to dataset rows and tokens without it")
            self._windows = _load_windows(path) if path.is_file() else None
            if self._windows is not None and (problem := window_problem(self._windows, self.n_examples, self.T)):
                self._windows = False
                raise FormatError(f"{path}: {problem}")
        return self._windows

    def labels(self) -> np.ndarray | None:
        """labels.bin as a read-only uint8 (n_examples, patches_per_ex) memmap, or None; FormatError when
        it leads out of the store through a link (verify names it; the loader filtered by it), or when
        actstore.json records it and it is missing (the loader said the store had no labels.bin)."""
        path = inside(self.dir, LABELS, str(self.dir))
        if not path.is_file() and LABELS in self.sidecar.get("files", {}):
            raise FormatError(f"{path}: missing, but {self.dir / SIDECAR} records it (written with this store)")
        if not path.is_file():
            return None
        want = self.n_examples * self.patches_per_ex
        if path.stat().st_size != want:
            raise FormatError(f"{path}: {path.stat().st_size} bytes, expected {want} (uint8 n_examples x patches_per_ex)")
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(self.n_examples, self.patches_per_ex))

    def find(self, sample_idx: int, token_idx: int) -> tuple[int, int] | None:
        """(example, token) holding token `token_idx` of dataset row `sample_idx`, or None."""
        read_index(sample_idx, "sample_idx", self.dir)
        read_index(token_idx, "token_idx", self.dir)
        windows = self.windows
        if windows is None:
            dropped = self.dropped_tokens
            if token_idx in dropped:
                return None
            token_idx -= sum(1 for t in dropped if t < token_idx)
            ok = 0 <= sample_idx < self.n_examples and 0 <= token_idx < self.T
            return (sample_idx, token_idx) if ok else None
        lo, hi = np.searchsorted(windows[:, 0], [sample_idx, sample_idx + 1])
        for ex in range(lo, hi):
            _, start, valid = windows[ex]
            if start <= token_idx < start + valid:
                return int(ex), int(token_idx - start)
        return None


def _read_exactly(fd: int, path: Path, out: np.ndarray, offset: int) -> None:
    """Fill `out` from `path` at `offset`; a shard that ends first (cut after the store was opened) is
    named, never read as what the buffer held."""
    if pread_into(fd, out, offset) < out.nbytes:
        raise FormatError(f"{path}: ends at byte {os.fstat(fd).st_size}, before byte {offset + out.nbytes} "
                          "of the vectors asked for; was it truncated or purged?")


def _load_windows(path: Path) -> np.ndarray:
    """windows.npy, refused naming it when it is no .npy of the bytes its header describes (check_npy:
    an .npz archive neither), np.load cannot read it (an object array) or it is not the (n, 3)
    integer table the writer saves."""
    check_npy(path, "a .npy array of windows")
    try:
        windows = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise FormatError(f"{path}: not a .npy array of windows ({exc})") from None
    if windows.ndim != 2 or windows.shape[1] != 3 or windows.dtype.kind not in "iu":
        raise FormatError(f"{path}: {windows.dtype} {windows.shape}, not an integer (n_examples, 3) table")
    return windows


def open_store(path: str | Path, verify: bool = False) -> SaevStore:
    """Open a store (or a stage dir / saev.json pointing at one); checks every shard's size first.
    verify=True first runs the full verify (every shard's sha256, metadata, sidecar; reads each once)."""
    if verify:
        from actstore.formats.saev.check import verify as problems
        from actstore.hashing import stage_problems
        refuse(problems(path) + stage_problems(path))
    return SaevStore(path)

