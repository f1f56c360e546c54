"""Write an extraction part (PartWriter, atomically) and the extraction's index (extract.json)."""
from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from actstore.errors import FormatError
from actstore.formats.extract.layout import (FORMAT_NAME, FORMAT_VERSION, INDEX, MAX_ROW_BYTES, PART_META,
                                             STORAGE_DESCR, from_float32, layer_tensor, npy_header, part_dirname,
                                             tensor_file)
from actstore.integrity import TREE_HASH_KEY
from actstore.io_utils import TreeHashFile, atomic_path, lower_priority, sha256_file, write_json_atomic

if TYPE_CHECKING:  # read imports this module
    from actstore.formats.extract.read import Extraction


@dataclass
class _Sink:
    """One data file: sample i fills units unit_offsets[i]:unit_offsets[i+1] of unit_bytes each.
    `written`: which samples it holds. The tree hash counts bytes per leaf, so a sample written twice
    would make up for another of its size never written; samples are counted here instead. Only the
    file's one writer thread touches it (pipeline.WritePipeline), so it needs no lock."""

    file: TreeHashFile
    unit_offsets: np.ndarray
    unit_bytes: int
    header_bytes: int
    shape: tuple[int, ...]
    dtype: str
    written: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.written = np.zeros(len(self.unit_offsets) - 1, dtype=bool)


class PartWriter:
    """Write one part: samples and offsets up front, then each data file declared (add_tokens /
    add_rows) and filled sample by sample from any thread (one thread per file), then finish().

    Samples arrive batched by length, so a file is filled out of order; each write goes straight to
    its place and each 1 MiB of the file is hashed as soon as it is whole: part.json records the
    SHA-256 tree hash (io_utils.TreeHashFile), complete when the last write returns.
    """

    def __init__(self, tmp_dir: Path, samples: list[dict], offsets: np.ndarray, hash_threads: int = 1):
        """hash_threads: threads, shared by the files, that hash each write's whole leaves while its
        bytes go to the kernel, so a writer thread's time is its writes (1: in the writing thread)."""
        # Checked before anything is made: offsets of another length failed finish with a bare
        # IndexError, or made a part every reader refused at open.
        if np.shape(offsets) != (len(samples) + 1,):
            raise ValueError(f"{tmp_dir}: offsets of shape {list(np.shape(offsets))} for {len(samples)} samples, "
                             f"expected [{len(samples) + 1}] (n_samples + 1)")
        # Offsets from 2 sized the files for rows no sample fills (refused only at finish), offsets going
        # down failed a write as ending past its file, and 1.5 tokens was cut to 1 without an error.
        if np.asarray(offsets).dtype.kind not in "iu" or offsets[0] != 0 or (np.diff(offsets) < 0).any():
            raise ValueError(f"{tmp_dir}: offsets {np.asarray(offsets)[:8].tolist()!r:.80} must be whole numbers of "
                             f"tokens from 0, never going down")
        self.dir = tmp_dir
        lines = self._sample_lines(samples)  # a row too long is named before anything is made
        # The hashing threads run below the job's others (lower_priority): a file's digests are needed
        # only when it closes, the thread feeding the GPU at every batch.
        self.hashers = (ThreadPoolExecutor(hash_threads, thread_name_prefix="part-hash", initializer=lower_priority)
                        if hash_threads > 1 else None)
        self.dir.mkdir(parents=True)
        self.samples = samples
        self.offsets = offsets.astype(np.int64)
        self.n_tokens = int(self.offsets[-1])
        self.sinks: dict[str, _Sink] = {}
        self.files: dict[str, dict[str, Any]] = {}
        buf = io.BytesIO()
        np.save(buf, self.offsets)
        self._write_whole("offsets.npy", buf.getvalue())
        self._write_whole("samples.jsonl", lines)

    def _sample_lines(self, samples: list[dict]) -> bytes:
        """samples.jsonl's bytes; ValueError naming the first row past MAX_ROW_BYTES: every reader refuses
        it, so the part would be written whole and opened by no one. A chat row's text (its template rendered
        in the part's job) or a library caller's rows reach here unchecked."""
        lines = [(json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8") for row in samples]
        for row, line in zip(samples, lines):
            if len(line) > MAX_ROW_BYTES:
                raise ValueError(f"{self.dir / 'samples.jsonl'}: sample_idx {row.get('sample_idx')}'s row is "
                                 f"{len(line)} bytes, past the {MAX_ROW_BYTES} a samples.jsonl row may take (its "
                                 f"text, label and kept fields); nothing written")
        return b"".join(lines)

    def _write_whole(self, file: str, data: bytes) -> None:
        sink = TreeHashFile(self.dir / file, len(data), data)
        self.files[file] = {"bytes": len(data), TREE_HASH_KEY: sink.close()}

    def _add(self, file: str, unit_offsets: np.ndarray, shape: tuple[int, ...], dtype: str) -> None:
        descr = STORAGE_DESCR.get(dtype) or np.dtype(dtype).str
        unit_bytes = int(np.dtype(descr).itemsize * int(np.prod(shape[1:], dtype=np.int64)))
        head = npy_header(shape, descr)
        size = len(head) + int(unit_offsets[-1]) * unit_bytes
        self.sinks[file] = _Sink(TreeHashFile(self.dir / file, size, head, self.hashers), unit_offsets, unit_bytes,
                                 len(head), shape, dtype)

    def add_tokens(self, file: str, width: int | None, dtype: str) -> None:
        """A token-packed file: (n_tokens, width), or (n_tokens,) per-token scalars when width is None."""
        self._add(file, self.offsets, (self.n_tokens,) if width is None else (self.n_tokens, width), dtype)

    def add_rows(self, file: str, width: int, dtype: str) -> None:
        """A fixed-width row per sample (top-k logits): (n_samples, width)."""
        self._add(file, np.arange(len(self.samples) + 1, dtype=np.int64), (len(self.samples), width), dtype)

    def write(self, file: str, local_idx: int, data: np.ndarray, n_samples: int = 1) -> None:
        """Store the values of `file` (C-order bytes in the file's dtype) of local samples
        local_idx .. local_idx + n_samples - 1, which lie end to end in the file: one write for a run
        of consecutive samples (a batch of images) is one system call, and its whole 1 MiB leaves are
        hashed from `data`, not read back."""
        sink = self.sinks[file]
        start, stop = sink.unit_offsets[local_idx], sink.unit_offsets[local_idx + n_samples]
        if data.nbytes != (stop - start) * sink.unit_bytes:
            which = f"sample {local_idx}" if n_samples == 1 else f"samples {local_idx}..{local_idx + n_samples - 1}"
            raise ValueError(f"{file}: {which} {'has' if n_samples == 1 else 'have'} {data.nbytes} bytes, expected "
                             f"{(stop - start) * sink.unit_bytes}")
        if (again := np.flatnonzero(sink.written[local_idx:local_idx + n_samples])).size:
            raise OSError(f"{self.file_path(file)}: sample_idx {self._sample_idx(local_idx + int(again[0]))} "
                          "written twice")
        # A transposed or Fortran-order view is copied to C order, its values in the order the file holds
        # them (the buffer protocol refuses to hand its bytes out flat); a C-order array is used as it is.
        sink.file.write(sink.header_bytes + int(start) * sink.unit_bytes, np.ascontiguousarray(data).data)
        sink.written[local_idx:local_idx + n_samples] = True

    def _sample_idx(self, local_idx: int) -> int:
        return self.samples[local_idx]["sample_idx"]

    def file_path(self, file: str) -> Path:
        return self.dir / file

    def abort(self) -> None:
        for sink in self.sinks.values():
            sink.file.abort()
        self._stop_hashers()

    def _stop_hashers(self) -> None:
        if self.hashers is not None:
            self.hashers.shutdown()

    def _unwritten(self) -> str | None:
        """The first file with samples never written, naming the first of them; None when all are whole."""
        for file, sink in self.sinks.items():
            if (missing := np.flatnonzero(~sink.written)).size:
                shown = ", ".join(str(self._sample_idx(int(i))) for i in missing[:5])
                more = f" and {missing.size - 5} more" if missing.size > 5 else ""
                return f"{self.file_path(file)}: sample_idx {shown}{more} never written"
        return None

    def finish(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Close (fsync) every data file with its tree hash, then write part.json last. A sample a
        file lacks is named before anything closes, and nothing is left that looks complete."""
        if missing := self._unwritten():
            self.abort()
            raise OSError(missing)
        self._stop_hashers()
        for file, sink in self.sinks.items():
            self.files[file] = {"shape": list(sink.shape), "dtype": sink.dtype, "bytes": sink.file.size,
                                TREE_HASH_KEY: sink.file.close()}
        files = {file: self.files[file] for file in sorted(self.files)}
        # The writer's keys last: a caller's meta copied from another part (an older version's) would
        # otherwise make this part claim that part's format version.
        meta = {**meta, "format": FORMAT_NAME, "version": FORMAT_VERSION,
                "n_samples": len(self.samples), "n_tokens": self.n_tokens, "files": files}
        (self.dir / PART_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return meta


def write_part(out_dir: str | Path):
    """Context manager yielding a temp dir for PartWriter; renamed to `out_dir` on success."""
    return atomic_path(out_dir)


def write_index(extract_dir: str | Path, index_path: str | Path, model_folder: Path | None = None) -> dict:
    """extract.json (index_of the extraction in extract_dir), written atomically; with the model
    files its parts loaded hashed from `model_folder` (model_identity), which parses compare. The
    parts are counted from their part.json, never from an extract.json already there: one written
    before the parts were made again (another part count) refused the parts it is rebuilt from."""
    from actstore.formats.extract.read import open_extraction, parts_said
    from actstore.model_identity import MODEL_FILES_KEY, hashed_model_files

    extraction = open_extraction(extract_dir, parts_said(Path(extract_dir)))
    index = index_of(extraction)
    recorded = [part.meta.get(MODEL_FILES_KEY) for part in extraction.parts]
    if model_folder is not None and recorded and None not in recorded:  # all equal (read._check_model_files)
        index[MODEL_FILES_KEY] = hashed_model_files(model_folder, recorded[0])
    write_json_atomic(index_path, index)
    return index


def index_of(extraction: Extraction) -> dict:
    """extract.json's content: the extraction's totals, tensors and every part's directory and
    part.json sha256 (so a deleted part is named, never skipped); the parts must cover sample_idx
    0..n-1 once. verify compares a store's extract.json with it."""
    # compared row by row: a list of every sample_idx took ~70 bytes a sample (GBs at 10^7 samples)
    for i, (part, local, row) in enumerate(extraction.iter_samples()):
        if row["sample_idx"] != i:  # the line named: which of thousands of parts was left to a search
            raise FormatError(f"{part.samples.path}: line {local + 1} says sample_idx {row['sample_idx']}, where it is "
                              f"row {i}: the parts do not cover sample_idx 0..{extraction.n_samples - 1} exactly once")
    return {
        "n_samples": extraction.n_samples, "n_tokens": extraction.n_tokens,
        "tensors": extraction.tensor_names, "layers": extraction.info.layers,
        "model": extraction.info.model.record, "dataset": extraction.info.dataset.record,
        "extraction_duration_seconds": sum(p.info.extraction_duration_seconds for p in extraction.parts),
        "parts": [{"dir": p.dir.name, "n_samples": p.info.n_samples, "n_tokens": p.info.n_tokens,
                   "sample_range": list(p.info.sample_range), "part_json_sha256": sha256_file(p.dir / PART_META)}
                  for p in extraction.parts],
    }


SYNTHETIC_POOL = 16 << 20  # random float32 values drawn once; each sample's rows are a slice of them


def synthetic_extraction(root: str | Path, n_bytes: int, parts: int, dim: int, layers: list[int],
                         tokens: tuple[int, int] = (64, 512), seed: int = 0, scale: float = 1.0,
                         dtype: str = "float32") -> Path:
    """A text extraction of random activations (normal, standard deviation `scale`) for benchmarks
    and scale tests, written by PartWriter like a real one: samples of tokens[0]..tokens[1] tokens
    (= max_seq_length) until the layers hold `n_bytes` as float32, split into `parts` parts, token
    ids, a bert-like model record (no model folder), extract.json. Stored in `dtype` (a storage
    dtype): the same samples and values whatever it is, rounded to it."""
    if not 0 <= tokens[0] <= tokens[1] or tokens[1] < 1:  # samples of no token never reach n_bytes: it looped
        raise ValueError(f"synthetic_extraction: tokens={tokens}, a range of 0 <= lo <= hi with hi >= 1")
    root = Path(root)
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    n_tokens = 0  # sum(lengths), kept as they grow: summed each turn, 10^5 samples took 10^10 additions
    while n_tokens * len(layers) * dim * 4 < n_bytes:
        lengths.append(int(rng.integers(tokens[0], tokens[1] + 1)))
        n_tokens += lengths[-1]
    # Each sample's rows start at a random place in the pool, so it holds the largest sample and one
    # value more (SYNTHETIC_POOL alone, as before, wherever that is enough: the same values)
    pool_size = max(SYNTHETIC_POOL, tokens[1] * dim + 1)
    pool = from_float32(rng.standard_normal(pool_size, dtype=np.float32) * np.float32(scale), dtype)
    per_part = -(-len(lengths) // parts)
    for part in range(parts):
        rows = range(part * per_part, min(len(lengths), (part + 1) * per_part))
        with write_part(root / part_dirname(part)) as tmp:
            _synthetic_part(tmp, rows, lengths, layers, dim, pool, rng, dtype).finish(
                _synthetic_meta(root, part, parts, rows, len(lengths), layers, tokens[1]))
    write_index(root, root / INDEX)
    return root


def _synthetic_part(tmp: Path, rows: range, lengths: list[int], layers: list[int], dim: int, pool: np.ndarray,
                    rng: np.random.Generator, dtype: str) -> PartWriter:
    local = [lengths[i] for i in rows]
    samples = [{"sample_idx": i, "text": f"synthetic sample {i}", "label": None, "label_id": None,
                "num_tokens": lengths[i], "metadata": {}} for i in rows]
    writer = PartWriter(tmp, samples, np.concatenate([[0], np.cumsum(local, dtype=np.int64)]))
    writer.add_tokens("token_ids.npy", None, "int64")
    files = [tensor_file(layer_tensor(layer)) for layer in layers]
    for file in files:
        writer.add_tokens(file, dim, dtype)
    for j, tokens in enumerate(local):
        writer.write("token_ids.npy", j, rng.integers(0, 30522, tokens, dtype=np.int64))
        for file in files:
            start = int(rng.integers(0, len(pool) - tokens * dim))
            writer.write(file, j, pool[start:start + tokens * dim])
    return writer


def _synthetic_meta(root: Path, part: int, parts: int, rows: range, n_dataset: int, layers: list[int],
                    max_seq_length: int) -> dict:
    return {"part": part, "parts": parts, "sample_range": [rows.start, rows.stop], "n_dataset_samples": n_dataset,
            "tensors": [layer_tensor(layer) for layer in layers], "layers": list(layers), "hooks": [],
            "modality": "text", "model_kind": "encoder", "max_seq_length": max_seq_length, "batch_size": 32,
            "logits_topk": None, "created_at": "1970-01-01T00:00:00+00:00", "versions": {},
            "model": {"name": "synthetic", "revision": None, "path": str(root), "model_type": "bert",
                      "architecture": "BertModel", "torch_dtype": "float32", "n_blocks": 6},
            "dataset": {"name": "synthetic", "split": "train", "path": str(root), "labels": []}}
