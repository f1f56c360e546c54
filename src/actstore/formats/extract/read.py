"""Read an extraction: one part (Part) or all of them addressed by sample_idx (Extraction)."""
from __future__ import annotations

import json
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TypeVar

import numpy as np

from actstore.casts import RowFile, to_float32
from actstore.errors import FormatError
from actstore.formats.extract.contract import PartInfo
from actstore.formats.extract.layout import (CUT_FIELD, INDEX, MAX_ROW_BYTES, PART_META, PER_SAMPLE_FILES,
                                             FORMAT_NAME, FORMAT_VERSION, STORAGE_DESCR, part_dirname, part_dirs,
                                             tensor_file)
from actstore.integrity import (check_file, check_npy, file_records, inside, listed_problem, open_files_budget,
                                open_regular, read_index, read_json, refuse, unique_keys, unlisted, whole_number)
from actstore.io_utils import pread_into
from actstore.model_identity import MODEL_FILES_KEY, PART_FIELDS, well_formed


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

    @contextmanager
    def row_file(self) -> Iterator[RowFile]:
        """The tensor's file open for reading rows (casts.float16_file) until the block ends."""
        fd = os.open(self.raw.filename, os.O_RDONLY)
        try:
            yield RowFile(fd, str(self.raw.filename), self.raw.offset, self.stored_dtype, self.shape[1])
        finally:
            os.close(fd)

    def read_rows(self, a: int, b: int, out: np.ndarray) -> None:
        """Rows [a, b) into `out`: float32 widens, `raw`'s dtype takes the stored bits as they are (a
        writer storing the part's own dtype converts nothing). Read with pread rather than copied out
        of the mapping: a writer streaming every row pays no page fault per 4 KiB (half its time,
        measured, in a zarr shard's float16 cast), and its resident memory stays at its buffers."""
        raw = self.raw
        if not 0 <= a <= b <= len(raw):  # a row before 0 would be read from the .npy header's bytes
            raise IndexError(f"{raw.filename}: token rows {a}..{b} of {len(raw)}")
        if len(out) != b - a or out.dtype not in (raw.dtype, np.float32):
            raise ValueError(f"rows {a}..{b} of {raw.filename} ({self.stored_dtype}) into {out.dtype} {out.shape}")
        target = out if out.dtype == raw.dtype else np.empty((b - a, raw.shape[1]), raw.dtype)
        fd = os.open(raw.filename, os.O_RDONLY)
        try:
            if pread_into(fd, target, raw.offset + a * raw.shape[1] * raw.dtype.itemsize) < target.nbytes:
                raise FormatError(f"{raw.filename}: ends before token row {b}")
        finally:
            os.close(fd)
        if target is not out:
            to_float32(target, self.stored_dtype, out)


class SampleRows(Sequence):
    """A part's samples.jsonl, one dict per sample, parsed when asked for. The file is indexed once by
    where each line starts (8 bytes a row) and then read a line at a time, holding no open file: a
    job that reads every row of thousands of parts (the lmprobe index) holds neither their rows nor
    their file descriptors. Lines are read as the index spans them, each at most MAX_ROW_BYTES: a longer
    one is refused when the file is indexed, naming it, before any of it is read."""

    SCAN_BYTES = 1 << 20  # the newline scan compares this much at a time

    def __init__(self, path: Path, n_samples: int):
        self.path = path
        with open_regular(path) as fh:  # a FIFO in its place would block a plain open forever
            size = os.fstat(fh.fileno()).st_size
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else nullcontext(b"") as data:
                self._starts = self._line_starts(data, size, n_samples)
        if len(self) != n_samples:
            raise FormatError(f"{path}: {len(self)} rows, {PART_META} says {n_samples} samples")
        sizes = self.line_bytes()
        too_long = np.flatnonzero(sizes > MAX_ROW_BYTES)
        if too_long.size:
            raise FormatError(f"{path}: line {too_long[0] + 1} is {sizes[too_long[0]]} bytes, past the "
                              f"{MAX_ROW_BYTES} a row may take: not read")

    def _line_starts(self, data: Any, size: int, n_samples: int) -> np.ndarray:
        """Offset of each line's first byte, then one past the last line's newline (a last line
        without one counts as if it had it). Split on "\n" only, as the writer joins rows: text written
        with ensure_ascii=False may hold U+2028 and friends. A file of more lines than `n_samples` is
        refused once the scan passes them: a hostile file of newlines was indexed whole, 8 bytes a byte."""
        ends: list[np.ndarray] = []
        found = 0
        for a in range(0, size, self.SCAN_BYTES):  # in place: one block's comparison at a time
            block = min(self.SCAN_BYTES, size - a)
            ends.append(np.flatnonzero(np.frombuffer(data, np.uint8, block, a) == 0x0A) + a + 1)
            found += len(ends[-1])
            if found > n_samples:
                raise FormatError(f"{self.path}: {found} rows in its first {a + block} bytes, {PART_META} says "
                                  f"{n_samples} samples")
        starts = np.concatenate([np.zeros(1, np.int64), *ends]).astype(np.int64)
        if size and starts[-1] != size:
            starts = np.append(starts, size + 1)
        return starts

    def __len__(self) -> int:
        return len(self._starts) - 1

    def line_bytes(self) -> np.ndarray:
        """Each sample's line in bytes, its newline counted (from the line index: nothing parsed)."""
        return np.diff(self._starts)

    def __getitem__(self, local: int) -> dict:
        return self.rows([local])[0]

    def rows(self, locals_: Sequence[int]) -> list[dict]:
        """The rows at `locals_`, in that order, the file opened once for all of them."""
        n = len(self)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            out = []
            for local in locals_:
                if not -n <= local < n:
                    raise IndexError(f"{self.path}: row {local} of {n}")
                local %= n
                start, stop = int(self._starts[local]), int(self._starts[local + 1]) - 1
                out.append(self._parse(local, os.pread(fd, stop - start, start)))
            return out
        finally:
            os.close(fd)

    def __iter__(self) -> Iterator[dict]:
        """Each row in order, its line read as the index spans it (never past MAX_ROW_BYTES, whatever
        the file holds since it was indexed)."""
        with open(self.path, "rb") as fh:
            for local in range(len(self)):
                span = int(self._starts[local + 1] - self._starts[local])
                yield self._parse(local, fh.read(span).removesuffix(b"\n"))

    def _parse(self, local: int, line: bytes) -> dict:
        """A row; a key given twice (json.loads keeps the last value, where the part's sha256 saw
        both) or a row that is not an object with a whole-number sample_idx (its callers look it up)
        is a FormatError naming the line. NaN is taken: a dataset field holding one is written as
        the writer's json.dumps writes it."""
        try:
            row = json.loads(line.decode("utf-8"), object_pairs_hook=unique_keys)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FormatError(f"{self.path}: line {local + 1} is not valid JSON ({exc})") from None
        except RecursionError:
            raise FormatError(f"{self.path}: line {local + 1} is not valid JSON (nested too deeply to parse)") from None
        if not isinstance(row, dict) or not whole_number(row.get("sample_idx")):
            raise FormatError(f"{self.path}: line {local + 1} is not a sample's JSON object with a whole-number "
                              f"sample_idx: {line[:80]!r}")
        if problem := _row_problem(row):
            raise FormatError(f"{self.path}: line {local + 1} (sample {row['sample_idx']}): {problem}")
        return row


# What every format writer reads of a sample's row, and what each field must be: a row missing one, or
# holding a list for its label, stopped a writer with a bare KeyError or TypeError naming no file.
ROW_FIELDS = {"text": (str,), "label": (str, int, float, type(None)), "label_id": (int, type(None)),
              "num_tokens": (int,), "metadata": (dict,)}


def _row_problem(row: dict[str, Any]) -> str | None:
    """What keeps a samples.jsonl row from being one a writer can read (ROW_FIELDS, CUT_FIELD), or None."""
    for name, kinds in ROW_FIELDS.items():
        if name not in row:
            return f"no field {name!r}"
        if not isinstance(row[name], kinds) or (isinstance(row[name], bool) and name != "label"):
            return f"field {name!r} holds {type(row[name]).__name__} {row[name]!r:.40}"
    if CUT_FIELD in row and row[CUT_FIELD] is not True:  # "false" or 1 would be read as a cut, or not, by guess
        return f"field {CUT_FIELD!r} holds {row[CUT_FIELD]!r:.40}, where only true (a text cut) is written"
    return None


class _OpenMaps:
    """The memory maps every open Part holds, least recently used first. Each holds a file descriptor:
    a job reading all parts of a 4,096-part extraction would hold ~16K of them (measured ~4 a part),
    past a common soft limit of 1,024. Past the budget, a quarter of the soft limit, the oldest map
    is let go; its Part maps the file again when next asked."""

    def __init__(self):
        self._order: OrderedDict[tuple[int, str], weakref.ref] = OrderedDict()
        self._lock = threading.Lock()
        self.budget = None  # set on first use, from the limit the process then has

    def used(self, part: Part, file: str) -> None:
        if self.budget is None:
            self.budget = open_files_budget()
        key = (id(part), file)
        with self._lock:
            self._order[key] = weakref.ref(part)
            self._order.move_to_end(key)
            while len(self._order) > self.budget:
                (_, old_file), ref = self._order.popitem(last=False)
                if (old := ref()) is not None:
                    old._arrays.pop(old_file, None)


OPEN_MAPS = _OpenMaps()


@dataclass
class Part:
    """A finished part opened read-only; arrays are memory-mapped on first use."""

    dir: Path
    meta: dict[str, Any]  # part.json as written; read it through `info`
    info: PartInfo
    offsets: np.ndarray
    _arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    _samples: SampleRows | None = field(default=None, repr=False)

    @property
    def samples(self) -> SampleRows:
        """samples.jsonl's rows, indexed on first use (a scattered writer's plan needs only the token
        offsets and never opens it) and parsed one at a time (SampleRows)."""
        if self._samples is None:
            self._samples = SampleRows(inside(self.dir, "samples.jsonl", str(self.dir / PART_META)),
                                       self.info.n_samples)
        return self._samples

    def _load(self, file: str, mmap_mode: str = "r") -> np.ndarray:
        key = file if mmap_mode == "r" else f"{file}:{mmap_mode}"
        array = self._arrays.get(key)
        if array is None:
            if file not in self.meta["files"]:
                raise FormatError(f"{self.dir}: no {file} in this part")
            record = self.meta["files"][file]
            path = inside(self.dir, file, str(self.dir / PART_META))
            array = load_npy(path, record.get("bytes"), mmap_mode=mmap_mode)
            _check_header(array, record, self._rows(file), path)
            self._arrays[key] = array
        OPEN_MAPS.used(self, key)
        return array

    def _rows(self, file: str) -> int:
        """How many rows `file` holds: one a sample for the top-k logits, else one a token."""
        return self.info.n_samples if file in PER_SAMPLE_FILES else self.info.n_tokens

    @property
    def sample_start(self) -> int:
        return self.info.sample_range[0]

    @property
    def tensor_names(self) -> list[str]:
        return self.info.tensors

    def tensor(self, name: str, private: bool = False) -> StoredTensor:
        """(n_tokens, d) memory-mapped captured tensor, read as float32; samples in order, no padding.
        private: mapped copy-on-write, so its float32 slices are writable arrays without a copy of
        their bytes (a write changes this process's pages only, never the file)."""
        if name not in self.info.tensors:
            raise FormatError(f"{self.dir}: tensor {name!r} not captured; have {self.info.tensors}")
        file = tensor_file(name)
        raw = self._load(file, "c" if private else "r")
        stored_dtype = self.meta["files"][file]["dtype"]
        if stored_dtype not in STORAGE_DESCR or raw.ndim != 2:
            raise FormatError(f"{self.dir / PART_META}: files[{file!r}] is {stored_dtype!r} {list(raw.shape)}, "
                              f"not (tokens, width) in a storage dtype ({', '.join(STORAGE_DESCR)})")
        return StoredTensor(raw, stored_dtype)

    def sample_slice(self, local_idx: int) -> slice:
        """Token rows of local sample `local_idx`, a negative one counted from the end as samples[] counts
        it: offsets[-1]:offsets[0] was an empty slice, the last sample read as one of no tokens."""
        n = self.info.n_samples
        local_idx = read_index(local_idx, "local sample", self.dir)
        if not -n <= local_idx < n:
            raise IndexError(f"{self.dir}: local sample {local_idx} of {n}")
        local_idx %= n
        return slice(int(self.offsets[local_idx]), int(self.offsets[local_idx + 1]))

    def activations(self, name: str, local_idx: int) -> np.ndarray:
        """(num_tokens, d) activations of one sample."""
        return self.tensor(name)[self.sample_slice(local_idx)]

    # One sample's small arrays come back as copies: a view would keep its part's map (and a file
    # descriptor) open for as long as the caller holds it, whatever OPEN_MAPS lets go.

    def token_ids(self, local_idx: int) -> np.ndarray | None:
        if "token_ids.npy" not in self.meta["files"]:
            return None
        return self._load("token_ids.npy")[self.sample_slice(local_idx)].copy()

    def token_logprob(self, local_idx: int) -> np.ndarray | None:
        if "token_logprob.npy" not in self.meta["files"]:
            return None
        return self._load("token_logprob.npy")[self.sample_slice(local_idx)].copy()

    def topk(self, local_idx: int) -> tuple[np.ndarray, np.ndarray] | None:
        if "topk_values.npy" not in self.meta["files"]:
            return None
        return self._load("topk_values.npy")[local_idx].copy(), self._load("topk_indices.npy")[local_idx].copy()

    def verify(self) -> None:
        """Every listed file inside the part with its size and sha256, nothing unlisted; raise
        FormatError naming the file."""
        source = str(self.dir / PART_META)
        for file, info in self.meta["files"].items():
            check_file(inside(self.dir, file, source), info, PART_META)
        extra = unlisted(self.dir, set(self.meta["files"]) | {PART_META}, PART_META)
        if extra:
            raise FormatError(extra[0])
        # The headers as part.json records them (a misstated dtype is no byte of the file, so its
        # sha256 passes), and every tensor part.json names present in a storage dtype (a part of no
        # samples holds no data files: they are made from the first batch's shapes). Every data file,
        # a record without its shape too: it passed, and each read of the file was then refused.
        for name in self.info.tensors if self.info.n_samples else ():
            self.tensor(name)
        for file in self.meta["files"]:
            if file.endswith(".npy") and file != "offsets.npy":  # offsets.npy: checked as the part opened
                self._load(file)
        self._check_topk()

    def _check_topk(self) -> None:
        """FormatError unless the top-k files are both there or neither, each (n_samples, logits_topk):
        each header is checked against its own record only, so a pair of two widths, or of another k than
        the part's, passed; lmprobe's writer, taking the first logits_topk columns of each, then failed on
        a narrower file with a bare numpy broadcast error, or spread a width-1 file's column over all k."""
        records = {file: self.meta["files"].get(file) for file in PER_SAMPLE_FILES}
        if not any(records.values()):
            return
        want = [self.info.n_samples, self.info.logits_topk]
        shapes = {file: record.get("shape") if isinstance(record, dict) else None for file, record in records.items()}
        if any(shape != want for shape in shapes.values()):
            raise FormatError(f"{self.dir / PART_META}: top-k files' shapes {shapes} (null: not listed), where "
                              f"n_samples {self.info.n_samples} and logits_topk {self.info.logits_topk} give {want} each")


T = TypeVar("T")
PartFile = tuple[Part, str]  # a part and the name of one of its files, as part.json lists it


def part_reads(part: Part, tensors: Sequence[str], samples: bool) -> list[PartFile]:
    """The files of `part` a writer copying `tensors` (names) reads: offsets.npy, samples.jsonl when
    it reads the rows (`samples`), and the tensors' files (a part of no samples holds none)."""
    files = ["offsets.npy", *(["samples.jsonl"] if samples else [])]
    return [(part, file) for file in files + ([tensor_file(name) for name in tensors] if part.info.n_samples else [])]


class PartsCheck:
    """The part files a writer reads, each checked whole against part.json's size and sha256 (tree
    hash: integrity.DIGESTS) on a thread of its own from the moment this is made, while the writer reads
    the same bytes, so that the page cache serves one read of the disk to both. Entered inside the block
    that renames the writer's output into place (or before its job record is written): leaving it waits
    for the check, and a file that differs (a bit a disk flipped since extraction) is a FormatError
    naming it, so nothing is renamed. An open part's cheap checks (sizes, headers, offsets) let such a file through,
    and a writer recorded its own checksums over the damaged values: the store then verified OK."""

    def __init__(self, files: Sequence[PartFile]):
        self._files = files
        self._stop = threading.Event()  # the writer failed: no more files hashed for it
        self._problem: str | None = None
        self._error: BaseException | None = None  # what the hashing raised (a read's EIO)
        self._thread = threading.Thread(target=self._check, name="parts-check", daemon=True)
        self._thread.start()

    def _check(self) -> None:
        try:
            for part, file in self._files:
                if self._stop.is_set():
                    return
                source = str(part.dir / PART_META)
                if problem := listed_problem(part.dir, file, part.meta["files"].get(file), source):
                    self._problem = problem
                    return
        except BaseException as exc:  # re-raised on the writer's thread as __exit__ leaves
            self._error = exc

    def __enter__(self) -> PartsCheck:
        return self

    def guarded(self, items: Iterator[T]) -> Iterator[T]:
        """`items`, cut by the FormatError of a file found to differ as soon as the check finds it: a job
        reading the same rows for hours (an SAE's steps) is refused then, not when it ends; so is a read
        error of the check (EIO)."""
        for item in items:
            if self._error is not None:
                raise self._error
            if self._problem:
                raise FormatError(self._refusal())
            yield item

    def _refusal(self) -> str:
        return f"{self._problem}: refused to write from it (extract the part again)"

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        if kind is not None:
            self._stop.set()
        self._thread.join()
        if kind is None and self._error is not None:
            raise self._error
        if kind is None and self._problem:
            raise FormatError(self._refusal())


# Versions of part.json this reader knows: 1 recorded plain sha256, 2 the tree hash (integrity.DIGESTS
# checks either). A newer version's changes would be read as these, with no error.
READ_VERSIONS = (1, FORMAT_VERSION)


def open_part(part_dir: str | Path) -> Part:
    """Open a finished part directory; a missing part.json means the part never finished."""
    part_dir = Path(part_dir)
    meta_path = inside(part_dir, PART_META, str(part_dir))  # as every file of the part: never a link out of it
    if not meta_path.is_file():
        raise FormatError(f"{part_dir}: no {PART_META}; the extraction part is missing or unfinished")
    meta = read_json(meta_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise FormatError(f"{meta_path}: not an actstore extraction part")
    if not (whole_number(meta.get("version")) and meta["version"] in READ_VERSIONS):
        raise FormatError(f"{meta_path}: version {meta.get('version')!r:.40} of {FORMAT_NAME}; this actstore reads "
                          f"versions {', '.join(map(str, READ_VERSIONS))} (a newer actstore wrote it?)")
    files = file_records(meta.get("files"), str(meta_path))
    # Mapped, checked, then copied: a file far larger than the part's samples is never read whole. Looked
    # up with inside, as every other file of the part: a link leading out of the part is refused.
    offsets_path = inside(part_dir, "offsets.npy", str(meta_path))
    offsets = load_npy(offsets_path, files.get("offsets.npy", {}).get("bytes"), mmap_mode="r")
    info = PartInfo.parse(meta, meta_path)
    _check_offsets(offsets, info, offsets_path)
    return Part(part_dir, meta, info, np.array(offsets))


def _check_offsets(offsets: np.ndarray, info: PartInfo, path: Path) -> None:
    """FormatError unless `offsets` runs from 0 to n_tokens, never down, one step a sample: every
    token slice is read through it, so one changed value (the cheap open checks its size only) would
    give samples other samples' rows, or none, without an error."""
    if offsets.dtype != np.int64 or offsets.shape != (info.n_samples + 1,):
        raise FormatError(f"{path}: {offsets.dtype} {list(offsets.shape)}, {PART_META} says "
                          f"int64 [{info.n_samples + 1}] (n_samples + 1)")
    if offsets[0] != 0 or offsets[-1] != info.n_tokens or (np.diff(offsets) < 0).any():
        raise FormatError(f"{path}: token offsets do not run from 0 up to {PART_META}'s n_tokens "
                          f"{info.n_tokens} (first {offsets[0]}, last {offsets[-1]})")


def _check_header(array: np.ndarray, record: dict[str, Any], rows: int, path: Path) -> None:
    """FormatError unless the .npy header is what part.json records (dtype, shape, C order) and holds
    `rows` rows: the bytes of another dtype or order are read as other values, and a slice past a
    short file's end comes back short, each without an error."""
    dtype, shape = record.get("dtype"), record.get("shape")
    try:
        want = np.dtype(STORAGE_DESCR.get(dtype) or dtype) if isinstance(dtype, str) and dtype else None
    except (TypeError, ValueError):  # not a dtype numpy knows
        want = None
    if (want is None or array.dtype != want or list(array.shape) != shape or not array.shape
            or array.shape[0] != rows or not array.flags.c_contiguous):
        raise FormatError(f"{path}: .npy holds {array.dtype} {list(array.shape)} "
                          f"{'C' if array.flags.c_contiguous else 'Fortran'} order; {PART_META} records "
                          f"dtype {dtype!r:.40} shape {shape!r:.80} and {rows} rows")


def load_npy(path: Path, recorded_bytes: int | None, mmap_mode: str | None = None) -> np.ndarray:
    """A part's .npy file, its size checked against part.json and its header against its size
    (check_npy) before it is mapped (a truncated file is named, never a bare numpy "mmap length" error)."""
    if not path.is_file():
        raise FormatError(f"{path}: missing (listed in {PART_META})")
    size = path.stat().st_size
    if recorded_bytes is not None and size != recorded_bytes:
        raise FormatError(f"{path}: {size} bytes, {PART_META} says {recorded_bytes} (truncated or replaced)")
    check_npy(path)
    try:
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise FormatError(f"{path}: not a readable .npy file ({exc})") from None


class Extraction:
    """All parts of one extraction stage directory, addressed by global sample_idx."""

    def __init__(self, extract_dir: str | Path, n_parts: int | None = None):
        self.dir = Path(extract_dir)
        if n_parts is None and (self.dir / INDEX).is_file():
            n_parts = _listed_parts(self.dir / INDEX)  # a deleted part is missing, not skipped
        if n_parts is None:  # no index yet: every part.json says how many parts there are
            n_parts = parts_said(self.dir)
        if n_parts == 0:
            raise FormatError(f"{self.dir}: no extraction parts")
        self.parts = [open_part(self.dir / part_dirname(p)) for p in range(n_parts)]
        _check_cover(self.parts)
        _check_model_files(self.parts)
        self.meta = self.parts[0].meta
        self.info = self.parts[0].info  # run-wide fields; the counts below are the totals
        self._filled = [p for p in self.parts if p.info.n_samples]  # an empty part records sample_range [0, 0]
        self._filled_starts = np.array([p.sample_start for p in self._filled], dtype=np.int64)

    @property
    def n_samples(self) -> int:
        return sum(p.info.n_samples for p in self.parts)

    @property
    def n_tokens(self) -> int:
        return sum(p.info.n_tokens for p in self.parts)

    @property
    def tensor_names(self) -> list[str]:
        return self.info.tensors

    def locate(self, sample_idx: int) -> tuple[Part, int]:
        """The part holding `sample_idx` and the sample's local index in it (True is no row 1)."""
        sample_idx = read_index(sample_idx, "sample_idx", self.dir)
        if not 0 <= sample_idx < self.n_samples:
            raise IndexError(f"sample_idx {sample_idx} out of range [0, {self.n_samples})")
        w = int(np.searchsorted(self._filled_starts, sample_idx, side="right")) - 1
        return self._filled[w], sample_idx - int(self._filled_starts[w])

    def activations(self, name: str, sample_idx: int) -> np.ndarray:
        part, local = self.locate(sample_idx)
        return part.activations(name, local)

    def sample(self, sample_idx: int) -> dict:
        part, local = self.locate(sample_idx)
        return part.samples[local]

    def samples(self, sample_idxs: Sequence[int]) -> list[dict]:
        """The rows of `sample_idxs`, in that order; each part's samples.jsonl opened once."""
        idx = np.asarray(sample_idxs)
        if len(idx) and idx.dtype.kind not in "iu":  # int64 would cut 1.5 to 1: another sample's row
            raise TypeError(f"sample_idx must be integers, got {idx.dtype} {idx[:3].tolist()!r:.60}")
        if len(idx) and not (0 <= idx.min() and idx.max() < self.n_samples):
            raise IndexError(f"sample_idx out of range [0, {self.n_samples})")
        idx = idx.astype(np.int64)
        which = np.searchsorted(self._filled_starts, idx, side="right") - 1
        local = idx - self._filled_starts[which]
        by_part = np.argsort(which, kind="stable")
        bounds = np.flatnonzero(np.diff(which[by_part])) + 1
        out: list[Any] = [None] * len(idx)
        for positions in np.split(by_part, bounds) if len(idx) else []:
            part = self._filled[int(which[positions[0]])]
            for i, row in zip(positions.tolist(), part.samples.rows(local[positions].tolist())):
                out[i] = row
        return out

    def iter_samples(self) -> Iterator[tuple[Part, int, dict]]:
        """(part, local index, sample row) for every sample in sample_idx order."""
        for part in self.parts:
            for local, row in enumerate(part.samples):
                yield part, local, row


def parts_said(extract_dir: Path) -> int:
    """How many parts the first part directory's part.json says the extraction has (0: no part)."""
    found = part_dirs(extract_dir)
    return open_part(found[0]).info.parts if found else 0


def _listed_parts(index: Path) -> int:
    """How many parts extract.json lists; FormatError naming it when it is not an object whose
    `parts` is a list."""
    listed = read_json(index)
    if not isinstance(listed, dict) or not isinstance(listed.get("parts"), list):
        raise FormatError(f"{index}: not an object whose 'parts' is a list of the parts")
    return len(listed["parts"])


# PartInfo fields every part of one extraction shares: a format built from the parts reads them
# from the first (Extraction.info), so a part made by another run (another config, an actstore that
# numbers labels otherwise) would be mislabelled silently.
RUN_WIDE = ("tensors", "layers", "hooks", "modality", "model_kind", "max_seq_length", "logits_topk")
# part.json keys compared as written, run-wide: the model and dataset records whole: ModelInfo leaves
# out what says how the tokens and activations were made (fix_mistral_regex, blocks_path, tower,
# auto_map), and formats copy part 0's record as the whole store's. An image part's pixels also depend
# on the processor class that ran: transformers picks its torchvision or PIL backend by what the job's
# environment has installed, and the two differ slightly, so parts extracted in two environments would
# mix them.
RUN_WIDE_RECORDS = ("model", "dataset", "storage_dtype", "image_decoding", "image_processor", "image_pipeline")


def _check_model_files(parts: list[Part]) -> None:
    """FormatError naming the part whose model files (model_identity: sizes and mtimes) differ from the
    first recorded ones: the model folder changed between their jobs. A part made before they were
    recorded says nothing, so one part of an earlier release's extraction can be made again alone."""
    recorded = [(part, part.meta[MODEL_FILES_KEY]) for part in parts if part.meta.get(MODEL_FILES_KEY) is not None]
    for part, files in recorded:
        if not well_formed(files, PART_FIELDS):
            raise FormatError(f"{part.dir / PART_META}: {MODEL_FILES_KEY} is not a map of file names to their bytes "
                              f"and mtime_ns")
    for part, files in recorded[1:]:
        if files != recorded[0][1]:
            raise FormatError(f"{part.dir / PART_META}: {MODEL_FILES_KEY} differ from {recorded[0][0].dir / PART_META}'s: "
                              f"the model folder changed between the two parts' jobs (its files' sizes or mtimes), "
                              f"so they may hold two models' activations; extract them again together")


def _check_cover(parts: list[Part]) -> None:
    """FormatError naming the part.json that does not follow on from the parts before it: each says
    it is part p of len(parts), and together they cover sample_idx 0..n-1 of the dataset in order,
    made by one run (RUN_WIDE fields and RUN_WIDE_RECORDS as part 0's, data files of the row shapes
    and dtypes of the first part holding tokens)."""
    start = 0
    filled = [part for part in parts if part.info.n_tokens]  # an empty part may hold no data files
    for p, part in enumerate(parts):
        info, where = part.info, part.dir / PART_META
        differs = [name for name in RUN_WIDE if getattr(info, name) != getattr(parts[0].info, name)] + [
            key for key in RUN_WIDE_RECORDS if part.meta.get(key) != parts[0].meta.get(key)]
        if differs:
            raise FormatError(f"{where}: {differs[0]} differs from {parts[0].dir / PART_META}'s: the parts of one "
                              f"extraction come from one run (extract them again together)")
        if info.n_tokens and (rows := _row_shapes(part)) != _row_shapes(filled[0]):
            raise FormatError(f"{where}: files' row shapes and dtypes {rows} differ from "
                              f"{filled[0].dir / PART_META}'s {_row_shapes(filled[0])}")
        if (info.part, info.parts, info.n_dataset_samples) != (p, len(parts), parts[0].info.n_dataset_samples):
            raise FormatError(f"{where}: part {info.part} of {info.parts} of {info.n_dataset_samples} samples, in an "
                              f"extraction of {len(parts)} parts of {parts[0].info.n_dataset_samples} samples")
        if info.n_samples and (info.sample_range[0] != start or info.sample_range[1] - start != info.n_samples):
            raise FormatError(f"{where}: sample_range {list(info.sample_range)} with {info.n_samples} samples, "
                              f"where the parts before end at {start}")
        start += info.n_samples
    if start != parts[0].info.n_dataset_samples:
        raise FormatError(f"{parts[-1].dir / PART_META}: the parts hold {start} of the dataset's "
                          f"{parts[0].info.n_dataset_samples} samples")


def _row_shapes(part: Part) -> dict[str, tuple[list[int], str]]:
    """Each data file's row shape (its shape past the first axis) and dtype as part.json records them:
    a writer sizes its rows from the first part's, and a part of another width would be read into
    them as other bytes."""
    return {file: (record["shape"][1:], record.get("dtype")) for file, record in part.meta["files"].items()
            if "shape" in record}


def open_extraction(extract_dir: str | Path, n_parts: int | None = None, verify: bool = False) -> Extraction:
    """Open every part of an extraction stage directory. verify=True first checks every file's size
    and sha256 against part.json and extract.json (reads each file once)."""
    if verify:
        from actstore.formats.extract.check import verify as problems
        from actstore.hashing import stage_problems
        refuse(problems(extract_dir) + stage_problems(extract_dir))
    return Extraction(extract_dir, n_parts)
