"""Writing an lmprobe 2.0 dataset from an extraction, in two steps that may run as separate jobs.

1. Tensor files: a deterministic plan (prompt order, shard assignment, the file list: every hidden
   (layer, shard) file, then the top-k logits shards) is computed from the extraction and options
   alone, so any number of jobs agree on it; each job writes a contiguous range of the files
   (`write_job`) and records their {bytes, sha256}, hashed as they are written.
2. Finishing (`finish_dataset`): the files are renamed (never copied) out of the job directories
   into the dataset, the index parquet is streamed in bounded row groups, README.md and SHA256SUMS
   (tensor digests from the jobs' records; only index and card hashed here) follow, and the dataset
   appears under its final name at once.
`write_dataset` is both in one process: all files, then the same finishing step.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator

import numpy as np

from actstore.errors import ConfigError, FormatError
from actstore.formats.extract import CUT_FIELD, Part, PartFile, PartsCheck, layer_tensor, part_reads, tensor_file
from actstore.formats.extract.layout import PER_SAMPLE_FILES
from actstore.formats.lmprobe.check import check_selection
from actstore.formats.lmprobe.layout import (CARD, DTYPES, FORMAT_VERSION, HIDDEN_FILE_PATTERN, HIDDEN_KEY_PATTERN,
                                             INDEX, INDEX_COLUMNS, LARGEST, LOGITS_FILE_PATTERN, LOGITS_INDICES_KEY,
                                             LOGITS_ROW_BYTES_PER_K, LOGITS_VALUES_KEY, PREFIX, ST_METADATA, STORAGES,
                                             SUMS, TensorSpec, dataset_card, encode_header, from_float32,
                                             prompt_order, rows_per_shard, tensor_bytes)
from actstore.integrity import whole_number
from actstore.io_utils import (BEHIND, OrderedHashFile, WriteBehind, atomic_path, canonical_sha256, errors_naming,
                               sha256_file, utc_now)
from actstore.jobs import JOB_RECORD, JobFiles, job_items, read_job_records, write_job_record
from actstore.model_config import check_remote_code

log = logging.getLogger(__name__)

COPY_BYTES = 32 << 20  # each of the BEHIND + 1 buffers a shard is gathered into while earlier ones are written
# Tensor files a job writes at once (the lmprobe_tensors rule's threads): a file's sha256 (SHA256SUMS)
# is sequential by definition, one core's ~1-1.5 GB/s, so a job on a fast disk writes several.
THREADS = 2
# Index row groups: at most ROW_GROUP_ROWS rows (pq.write_table's default, so a small index is one
# group and byte-identical to writing it whole) and ending at the first row that brings the group
# to ROW_GROUP_TOKENS tokens or ROW_GROUP_LINE_BYTES bytes of samples.jsonl lines. One group's columns,
# as arrow arrays and again encoded, are what the finishing job holds beyond its per-prompt arrays:
# measured 70 B a token without token_strings (about 70 MB at 2**20 tokens; 2**22 held 480 MB in all
# where the whole 11.5M-token index held 730). Its rows' texts are whole, not cut at max_seq_length:
# 2**20 tokens of 1 MB web pages or books held gigabytes, so the lines' bytes end a group too. Ordinary
# prompts (under 128 B of line a token) never reach it: their groups are as the tokens alone made them.
ROW_GROUP_ROWS = 1024 * 1024
ROW_GROUP_TOKENS = 1 << 20
ROW_GROUP_LINE_BYTES = 128 << 20
DEFAULTS = {"storage": "full_sequence", "prompt_ordering": "random", "seed": 0, "dtype": "float32",
            "shard_bytes": 1 << 30, "logits_topk": None, "layers": None, "token_strings": True}


def write_safetensors(path: Path, specs: list[TensorSpec], chunks: Iterable[np.ndarray],
                      metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Stream `chunks` (in spec order; each left unchanged until BEHIND more are asked for) into a
    safetensors file; return its {bytes, sha256}. Each chunk is written and hashed while the next is
    gathered (io_utils.WriteBehind), the disk started every few tens of MB: dirty pages stay bounded
    whatever the shard size. A failed write leaves no file."""
    header = encode_header(specs, metadata)
    size = len(header) + sum(tensor_bytes(d, s) for _, d, s in specs)
    sink = OrderedHashFile(path, size, header)
    try:
        with WriteBehind(sink) as behind:
            written = len(header)
            for chunk in chunks:
                block = np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)
                if written + len(block) > size:
                    break
                behind.submit(written, block)
                written += len(block)
            if written != size:
                raise FormatError(f"{path}: data does not match the header's {size - len(header)} bytes")
        return {"bytes": size, "sha256": behind.digest}
    except BaseException:
        sink.abort()
        path.unlink(missing_ok=True)
        raise


def pack_shards(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Shard of each item packed in order; a shard takes items until `capacity` rows, items never split."""
    shard = np.zeros(len(sizes), dtype=np.int64)
    current, used = 0, 0
    for i, size in enumerate(sizes.tolist()):
        if used and used + size > capacity:
            current, used = current + 1, 0
        shard[i] = current
        used += size
    return shard


class _TokenRows:
    """Global token addressing over an extraction: sample_idx -> (part, token rows in the part)."""

    def __init__(self, extraction):
        self.extraction = extraction
        self.parts = extraction.parts
        self.sample_part = np.concatenate([np.full(p.info.n_samples, i, np.int64) for i, p in enumerate(self.parts)])
        self.local = np.concatenate([np.arange(p.info.n_samples, dtype=np.int64) for p in self.parts])
        self.start = np.concatenate([p.offsets[:-1] for p in self.parts]).astype(np.int64)
        self.stop = np.concatenate([p.offsets[1:] for p in self.parts]).astype(np.int64)
        self.overflow = 0  # finite values that became +-inf in the storage dtype (lmprobe.dtype float16, bfloat16)
        self.lock = threading.Lock()  # files are gathered on several threads

    def runs(self, samples: np.ndarray) -> Iterator[tuple[int, int, int]]:
        """(part, start, stop) token-row runs of `samples` in order, adjacent runs merged."""
        run = None
        for s in samples.tolist():
            p, a, b = int(self.sample_part[s]), int(self.start[s]), int(self.stop[s])
            if run and run[0] == p and run[2] == a:
                run[2] = b
            else:
                if run:
                    yield tuple(run)
                run = [p, a, b]
        if run:
            yield tuple(run)

    def by_part(self, samples: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """(part, positions in `samples`) of each part the samples come from."""
        parts = self.sample_part[samples]
        for p in np.unique(parts).tolist():
            yield p, np.flatnonzero(parts == p)

    def last_rows(self, name: str, samples: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The last-token rows of `samples` gathered into `out[:len(samples)]`: float32, or the
        part's stored dtype (its bits as they are)."""
        out = out[:len(samples)]
        for p, where in self.by_part(samples):
            tensor, last = self.parts[p].tensor(name), self.stop[samples[where]] - 1
            out[where] = tensor.raw[last] if out.dtype == tensor.raw.dtype else tensor[last]
        return out

    def chunks(self, name: str, samples: np.ndarray, last_only: bool, dtype: str) -> Iterator[np.ndarray]:
        """Rows of tensor `name` for `samples` (or their last tokens), converted to `dtype`, gathered
        into a ring of BEHIND + 1 fixed COPY_BYTES buffers used in turn (each chunk valid until BEHIND
        more are asked for, as write_safetensors needs): memory does not grow with the shard. Parts
        stored in `dtype` are gathered as their bits, converted not at all (a bfloat16 round trip
        through float32 would be a third of the job's CPU, and would turn each NaN into 0xFFFF)."""
        first = self.parts[0].tensor(name)
        dim = first.shape[1]
        gathered = first.raw.dtype if first.stored_dtype == dtype else np.float32
        ring = [np.empty((max(1, COPY_BYTES // (dim * 4)), dim), gathered) for _ in range(BEHIND + 1)]
        rows = len(ring[0])
        if last_only:
            for i, lo in enumerate(range(0, len(samples), rows)):
                yield self._stored(self.last_rows(name, samples[lo:lo + rows], ring[i % len(ring)]), dtype)
            return
        fill, turn = 0, 0
        for p, a, b in self.runs(samples):
            while a < b:
                buf = ring[turn % len(ring)]
                n = min(b - a, rows - fill)
                self.parts[p].tensor(name).read_rows(a, a + n, buf[fill:fill + n])
                fill, a = fill + n, a + n
                if fill == rows:
                    yield self._stored(buf, dtype)
                    fill, turn = 0, turn + 1
        if fill:
            yield self._stored(ring[turn % len(ring)][:fill], dtype)

    def _stored(self, rows: np.ndarray, dtype: str) -> np.ndarray:
        """Rows in the storage dtype: float32 ones converted (values made +-inf are counted, and
        _log_overflow logs them), ones gathered in it as they are."""
        if rows.dtype == DTYPES[dtype][1]:
            return rows
        stored, overflow = from_float32(rows, dtype)
        if overflow:
            with self.lock:
                self.overflow += overflow
        return stored

    def topk(self, samples: np.ndarray, k: int, which: int) -> np.ndarray:
        """Top-k values (which=0, float32) or indices (which=1, int64) of `samples`, first k kept."""
        out = np.empty((len(samples), k), (np.float32, np.int64)[which])
        for p, where in self.by_part(samples):
            out[where] = self.parts[p].topk(self.local[samples[where]])[which][:, :k]
        return out


def _options(options: dict[str, Any], extraction) -> dict[str, Any]:
    """Resolved writer options, checked against the extraction; ConfigError names the key at fault."""
    info = extraction.info
    opts = {**DEFAULTS, **options}
    opts.pop("enabled", None)
    if opts["storage"] not in STORAGES:
        raise ConfigError(f"lmprobe.storage: unknown value {opts['storage']!r} (pooled or full_sequence)")
    if opts["dtype"] not in (*DTYPES, "auto"):
        raise ConfigError(f"lmprobe.dtype: unknown value {opts['dtype']!r} (auto, {', '.join(DTYPES)})")
    if not whole_number(opts["seed"]):  # None drew a fresh permutation in each job, under one plan digest
        raise ConfigError(f"lmprobe.seed: {opts['seed']!r} is not a whole number (every job computes the "
                          "prompt permutation from it alike)")
    layers = opts["layers"] if opts["layers"] is not None else info.layers
    if not layers:  # the schema's minItems: [] was a bare IndexError
        raise ConfigError(f"lmprobe.layers: {layers!r} names no layer")
    # The schema's minimum: True was a bare TypeError, -1 numpy's ValueError, 0 silently the extraction's k
    if opts["logits_topk"] is not None and not whole_number(opts["logits_topk"], 1):
        raise ConfigError(f"lmprobe.logits_topk: {opts['logits_topk']!r:.40} is not a whole number of 1 or more")
    k_have = info.logits_topk
    check_selection(layers, opts["logits_topk"], info.layers, k_have)
    opts["layers"] = sorted(layers)
    if opts["dtype"] == "auto":  # the extraction's, run-wide: lossless, and its bits copied as they are
        opts["dtype"] = extraction.parts[0].tensor(layer_tensor(opts['layers'][0])).stored_dtype
    opts["logits_topk"] = opts["logits_topk"] or k_have  # None where the extraction kept none (checked above)
    return opts


# ---------------------------------------------------------------- the plan every job computes alike

@dataclass(frozen=True, eq=False)
class Plan:
    """Everything about a dataset that follows from the extraction and the options alone."""

    extraction: Any
    opts: dict[str, Any]
    src: _TokenRows
    order: np.ndarray          # sample_idx of each index row
    num_tokens: np.ndarray     # tokens of each index row
    dim: int
    lt_rows: int               # rows of a last-token shard (and of a sequence shard at most)
    groups: list[tuple[int, int, bool]]  # each hidden shard: index rows [start, stop), last token only
    seq_shard: np.ndarray | None  # full_sequence: hidden shard of each row's tokens
    seq_first: np.ndarray | None  # full_sequence: row of each prompt's first token in that shard
    logits_rows: int           # rows of a logits shard
    files: list[str]           # every tensor file, relative to the root, in the order jobs split them
    trust_remote_code: bool = False  # model.trust_remote_code: token_strings' tokenizer may be the folder's code

    @property
    def n(self) -> int:
        return len(self.order)

    @property
    def digest(self) -> str:
        """What every job's files follow from: the resolved options and each part's record (its files'
        sha256 among them). A job's record carries it, so a finisher never links files written for
        other options (a float16 job's tensors under a float32 index) or another extraction."""
        return canonical_sha256({"options": self.opts, "parts": [part.meta for part in self.extraction.parts]})

    @property
    def last_token_shards(self) -> int:
        return sum(last for _, _, last in self.groups)

    @property
    def n_hidden_files(self) -> int:
        return len(self.opts["layers"]) * len(self.groups)

    def reads(self, items: range) -> list[PartFile]:
        """The part files, to be checked whole (PartsCheck), whose rows the tensor files `items` are the
        first of the plan's to read: a part's layer file (or its top-k files) is checked by the one job
        writing the first tensor file that takes a row of it, not by each job taking some (in a shuffled
        order every file takes rows of every part). The jobs after read the rest unchecked by themselves,
        but no dataset is finished unless every job is. In the order the files are written."""
        hidden = _first_holding(self.src, self.order, [(a, b) for a, b, _ in self.groups])
        firsts = [(li * len(self.groups) + g, p, tensor_file(layer_tensor(layer)))
                  for li, layer in enumerate(self.opts["layers"]) for p, g in hidden.items()]
        if self.logits_rows:
            bounds = [(a, a + self.logits_rows) for a in range(0, self.n, self.logits_rows)]
            firsts += [(self.n_hidden_files + g, p, file) for p, g in
                       _first_holding(self.src, self.order, bounds).items() for file in PER_SAMPLE_FILES]
        return [(self.extraction.parts[p], file) for i, p, file in sorted(firsts) if i in items]

    def index_reads(self) -> list[PartFile]:
        """The part files the index reads: every part's offsets.npy and samples.jsonl, and the token
        files (_token_files) of each part holding samples."""
        tokens = _token_files(self.extraction.parts)
        return [pair for part in self.extraction.parts for pair in part_reads(part, [], samples=True)
                + [(part, file) for file in tokens if part.info.n_samples]]


def _first_holding(src: _TokenRows, order: np.ndarray, bounds: list[tuple[int, int]]) -> dict[int, int]:
    """part -> the first of the ranges `bounds` of `order` (index rows) that holds one of its samples."""
    first: dict[int, int] = {}
    for i, (a, b) in enumerate(bounds):
        for p in np.unique(src.sample_part[order[a:b]]).tolist():
            first.setdefault(p, i)
    return first


def _token_files(parts: list[Part]) -> list[str]:
    """The per-token files the index reads: token_ids.npy where every part holding samples has it,
    token_logprob.npy too where every one has that as well."""
    filled = [p for p in parts if p.info.n_samples]
    files = [file for file in ("token_ids.npy", "token_logprob.npy") if all(file in p.meta["files"] for p in filled)]
    return files if "token_ids.npy" in files else []


def plan_dataset(extract_dir: str | Path, options: dict[str, Any], trust_remote_code: bool = False) -> Plan:
    """The plan of the dataset `options` (the `lmprobe` config section) make of an extraction;
    `trust_remote_code`: model.trust_remote_code (it changes no byte, only whether a tokenizer
    that is the model folder's own code may load)."""
    from actstore.formats.extract import open_extraction

    extraction = open_extraction(extract_dir)
    check_label_texts(extraction.info.dataset.labels, f"{extract_dir}: dataset labels")
    opts = _options(options, extraction)
    n = extraction.n_samples
    if n == 0:
        raise FormatError(f"{extract_dir}: extraction has no samples")
    src = _TokenRows(extraction)
    order = prompt_order(n, opts["prompt_ordering"], opts["seed"])
    num_tokens = src.stop[order] - src.start[order]
    dim = extraction.parts[0].tensor(layer_tensor(opts['layers'][0])).shape[1]
    per_shard = rows_per_shard(opts["shard_bytes"], dim * DTYPES[opts["dtype"]][1].itemsize)
    groups = [(a, min(n, a + per_shard), True) for a in range(0, n, per_shard)]
    seq_shard = seq_first = None
    if opts["storage"] == "full_sequence":
        packed = pack_shards(num_tokens, per_shard)
        starts = np.concatenate([[0], np.flatnonzero(np.diff(packed)) + 1]).astype(np.int64)
        groups += [(a, b, False) for a, b in zip(starts.tolist(), [*starts[1:].tolist(), n])]
        seq_shard = packed + len(groups) - len(starts)
        before = np.cumsum(num_tokens) - num_tokens  # tokens of the rows before each row
        seq_first = before - before[starts[packed]]
    k = opts["logits_topk"]
    logits_rows = rows_per_shard(opts["shard_bytes"], k * LOGITS_ROW_BYTES_PER_K) if k else 0
    files = [HIDDEN_FILE_PATTERN.format(layer=layer, shard=s) for layer in opts["layers"] for s in range(len(groups))]
    if k:
        files += [LOGITS_FILE_PATTERN.format(shard=s) for s in range(-(-n // logits_rows))]
    return Plan(extraction, opts, src, order, num_tokens, dim, per_shard, groups, seq_shard, seq_first,
                logits_rows, files, trust_remote_code)


# ---------------------------------------------------------------- step 1: tensor files

def write_tensor_files(plan: Plan, root: Path, items: range, progress: bool = False,
                       threads: int = THREADS) -> dict[str, dict]:
    """Write the planned files `items` under `root`, `threads` files at once (each its own gather ring:
    memory grows with threads, not with the data); return {rel path: {bytes, sha256}} in plan order."""
    from tqdm import tqdm

    (root / "tensors").mkdir(parents=True, exist_ok=True)

    def write_file(i: int) -> dict[str, Any]:
        specs, chunks = _hidden_file(plan, i) if i < plan.n_hidden_files else _logits_file(plan, i)
        return write_safetensors(root / plan.files[i], specs, chunks, ST_METADATA)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="lmprobe-file") as pool:
        written = tqdm(pool.map(write_file, items), total=len(items), desc="lmprobe tensor files", unit="file",
                       disable=not progress)
        return {plan.files[i]: record for i, record in zip(items, written)}


def _log_overflow(plan: Plan, overflow: int, dataset: str | Path) -> None:
    """The activations the storage dtype made +-inf, named by the dataset they are in: the files' own
    directory is a temp name (atomic_path's, a job's scatter folder) gone once the dataset is finished."""
    if overflow:
        log.warning("lmprobe.dtype %s: %d finite activations beyond %s are stored as +-inf in %s (float32 keeps "
                    "them)", plan.opts["dtype"], overflow, LARGEST[plan.opts["dtype"]], Path(dataset) / "tensors")


def _hidden_file(plan: Plan, i: int) -> tuple[list[TensorSpec], Iterator[np.ndarray]]:
    layer, s = plan.opts["layers"][i // len(plan.groups)], i % len(plan.groups)
    a, b, last = plan.groups[s]
    rows = b - a if last else int(plan.num_tokens[a:b].sum())
    spec = [(HIDDEN_KEY_PATTERN.format(layer=layer), DTYPES[plan.opts["dtype"]][0], [rows, plan.dim])]
    return spec, plan.src.chunks(layer_tensor(layer), plan.order[a:b], last, plan.opts["dtype"])


def _logits_file(plan: Plan, i: int) -> tuple[list[TensorSpec], Iterator[np.ndarray]]:
    k, s = plan.opts["logits_topk"], i - plan.n_hidden_files
    samples = plan.order[s * plan.logits_rows:(s + 1) * plan.logits_rows]
    spec = [(LOGITS_VALUES_KEY, "F32", [len(samples), k]), (LOGITS_INDICES_KEY, "I64", [len(samples), k])]
    step = max(1, COPY_BYTES // (k * LOGITS_ROW_BYTES_PER_K))
    chunks = (plan.src.topk(samples[lo:lo + step], k, which)
              for which in (0, 1) for lo in range(0, len(samples), step))
    return spec, chunks


def write_job(extract_dir: str | Path, job_dir: str | Path, options: dict[str, Any], jobs: int, job: int,
              progress: bool = True, threads: int = THREADS) -> dict[str, dict]:
    """Job `job` of `jobs`: its contiguous range of the planned tensor files, `threads` at once, under
    `job_dir` (atomically) with its job record (jobs.write_job_record); return {rel path: {bytes, sha256}}."""
    plan = plan_dataset(extract_dir, options)
    items = job_items(len(plan.files), jobs, job)
    # PartsCheck: the part files read checked against part.json as they are read, before the rename
    with atomic_path(job_dir) as tmp, PartsCheck(plan.reads(items)):
        records = write_tensor_files(plan, tmp, items, progress, threads)
        # the overflow count, for the finishing job to log naming the dataset (_log_overflow)
        write_job_record(tmp, jobs, job, records.items(), plan=plan.digest, overflow=plan.src.overflow)
    log.info("lmprobe job %d/%d: %d tensor files -> %s", job, jobs, len(items), job_dir)
    return records


# ---------------------------------------------------------------- step 2: finishing

def finish_dataset(extract_dir: str | Path, job_dirs: list[str | Path], out_dir: str | Path,
                   options: dict[str, Any], trust_remote_code: bool = False) -> dict[str, Any]:
    """Link the tensor files of `job_dirs` (job 0, 1, ... as `write_job` wrote them) into the dataset
    `out_dir`, then write its index, card and checksums; atomic. Return the info dict.
    `trust_remote_code`: model.trust_remote_code, for token_strings' tokenizer.

    Every job's record and file size is checked before anything is linked (FormatError naming the
    file). Hard links, not renames: no byte is copied, and a finisher killed at any point leaves the
    jobs' outputs whole for a rerun (Snakemake removes them, temp(), once this job succeeds)."""
    plan = plan_dataset(extract_dir, options, trust_remote_code)
    sources, overflow = _collect(plan, [Path(d) for d in job_dirs])
    with atomic_path(out_dir) as tmp, PartsCheck(plan.index_reads()):
        (tmp / "tensors").mkdir(parents=True)
        for rel, (job_dir, _) in sources.items():
            os.link(job_dir / rel, tmp / rel)
        info = _finish(plan, tmp, {rel: record for rel, (_, record) in sources.items()})
    _log_overflow(plan, overflow, out_dir)
    log.info("lmprobe: %d prompts, layers %s, %s -> %s", plan.n, plan.opts["layers"], plan.opts["storage"], out_dir)
    return info


def _collect(plan: Plan, job_dirs: list[Path]) -> tuple[JobFiles, int]:
    """rel path -> (its job directory, {bytes, sha256}), in plan order, from the jobs' records
    (jobs.read_job_records: each file there with its recorded size); every job must list exactly
    the files the plan gives it (jobs.job_items). And the activations the jobs made +-inf, summed
    (a record written before the count was kept: none)."""
    records = read_job_records(job_dirs)
    files = records.files
    digest = plan.digest  # hashes every part's record: once, not once a job
    for job_dir, extra in zip(job_dirs, records.extras):
        if extra.get("plan") != digest:
            raise FormatError(f"{job_dir / JOB_RECORD}: written for other lmprobe options or another extraction "
                              f"(plan {str(extra.get('plan'))[:12]}, this finisher's {digest[:12]}); "
                              "run the job again")
        if not whole_number(extra.get("overflow", 0)):
            raise FormatError(f"{job_dir / JOB_RECORD}: overflow {extra['overflow']!r:.40}, expected a whole number")
    for job, job_dir in enumerate(job_dirs):
        for rel in (plan.files[i] for i in job_items(len(plan.files), len(job_dirs), job)):
            if files.get(rel, (None,))[0] != job_dir:
                raise FormatError(f"{job_dir / JOB_RECORD}: does not list {rel}, a file the plan gives job {job}")
    if len(files) != len(plan.files):
        planned = set(plan.files)
        rel, job_dir = next((rel, job_dir) for rel, (job_dir, _) in files.items() if rel not in planned)
        raise FormatError(f"{job_dir / rel}: not a file of the planned dataset (listed in {job_dir / JOB_RECORD})")
    return {rel: files[rel] for rel in plan.files}, sum(extra.get("overflow", 0) for extra in records.extras)


def write_dataset(extract_dir: str | Path, out_dir: str | Path, options: dict[str, Any],
                  progress: bool = True, trust_remote_code: bool = False, threads: int = THREADS) -> dict[str, Any]:
    """Write an lmprobe 2.0 dataset of an extraction into `out_dir` (atomically); return its info dict.

    `options` = the `lmprobe` config section (defaults as in the schema). One process doing what the
    scattered jobs and the finishing job do: every tensor file (`threads` at once), then the same
    finishing step.
    `trust_remote_code`: model.trust_remote_code, for token_strings' tokenizer."""
    plan = plan_dataset(extract_dir, options, trust_remote_code)
    with atomic_path(out_dir) as tmp, PartsCheck(plan.reads(range(len(plan.files))) + plan.index_reads()):
        records = write_tensor_files(plan, tmp, range(len(plan.files)), progress, threads)
        info = _finish(plan, tmp, records)
    _log_overflow(plan, plan.src.overflow, out_dir)
    log.info("lmprobe: %d prompts, layers %s, %s -> %s", plan.n, plan.opts["layers"], plan.opts["storage"], out_dir)
    return info


def _finish(plan: Plan, root: Path, records: dict[str, dict]) -> dict[str, Any]:
    """Index, card and checksums into a root that holds every planned tensor file (`records`)."""
    tensors: dict[str, Any] = {"hidden_layers": _hidden_descriptor(plan)}
    if plan.opts["logits_topk"]:
        tensors["logits_topk"] = _logits_descriptor(plan)
    groups = row_groups(plan.num_tokens, _line_bytes(plan))
    columns = _IndexColumns(plan, groups)  # its pass over every row finds which were cut, for the metadata
    info = _info(plan, tensors, {rel: records[rel] for rel in plan.files})
    index_rel = INDEX  # whatever the split (recorded in lmprobe:dataset.split and the card)
    (root / "index").mkdir()
    with errors_naming(root / index_rel):  # pyarrow's write errors name no file
        _write_index(root / index_rel, columns, groups, info)
    with errors_naming(root / CARD):
        (root / CARD).write_text(dataset_card(info, index_rel, int((~columns.cut_known).sum())))
    digests = {rel: record["sha256"] for rel, record in records.items()}
    write_sums(root, {**digests, index_rel: sha256_file(root / index_rel), CARD: sha256_file(root / CARD)})
    return info


def write_sums(root: Path, digests: dict[str, str]) -> None:
    """SHA256SUMS (sha256sum format) of `digests` {rel path: sha256}, in path order."""
    lines = [f"{digests[rel]}  {rel}\n" for rel in sorted(digests, key=lambda rel: PurePosixPath(rel).parts)]
    with errors_naming(root / SUMS):
        (root / SUMS).write_text("".join(lines))


def _hidden_descriptor(plan: Plan) -> dict[str, Any]:
    """lmprobe:tensors.hidden_layers (key order is part of the index bytes)."""
    opts, full = plan.opts, plan.seq_shard is not None
    shards = [{"num_prompts": b - a, "num_tokens": b - a if last else int(plan.num_tokens[a:b].sum())}
              if full else {"num_prompts": b - a}  # the spec's pooled descriptor lists num_prompts only
              for a, b, last in plan.groups]
    row_bytes = plan.dim * DTYPES[opts["dtype"]][1].itemsize
    hidden = {"type": "hidden", "layers": opts["layers"], "dim": int(plan.dim), "dtype": opts["dtype"],
              "layout": "per_layer", "file_pattern": HIDDEN_FILE_PATTERN, "key_pattern": HIDDEN_KEY_PATTERN}
    if full:
        hidden.update(storage="full_sequence", last_token_shards=plan.last_token_shards, row_bytes=row_bytes,
                      sequence_includes_last_token=True, shards=shards)
    else:
        hidden.update(storage="pooled", pooling="last_token", row_bytes=row_bytes, shards=shards)
    return hidden


def _logits_descriptor(plan: Plan) -> dict[str, Any]:
    k = plan.opts["logits_topk"]
    rels = plan.files[plan.n_hidden_files:]
    shards = [{"file": rel, "num_prompts": min(plan.n, (s + 1) * plan.logits_rows) - s * plan.logits_rows}
              for s, rel in enumerate(rels)]
    return {"type": "logits_topk", "k": k, "dtype": "float32", "pooling": "last_token",
            "file_pattern": LOGITS_FILE_PATTERN, "row_bytes": k * LOGITS_ROW_BYTES_PER_K, "shards": shards}


def _provenance(extraction) -> dict[str, Any]:
    import pyarrow
    import safetensors

    import actstore
    versions = extraction.info.versions
    return {"lmprobe_version": None, "actstore_version": actstore.__version__, "extraction_backend": "local",
            "nnsight_version": None, "torch_version": versions.get("torch"),
            "transformers_version": versions.get("transformers"), "python_version": versions.get("python"),
            "numpy_version": versions.get("numpy"), "pyarrow_version": pyarrow.__version__,
            "safetensors_version": safetensors.__version__, "extracted_at": extraction.info.created_at,
            "created_at": utc_now().isoformat(timespec="seconds"),
            "platform": platform.platform()}


def _info(plan: Plan, tensors: dict[str, Any], files: dict[str, dict]) -> dict[str, Any]:
    """The lmprobe:* schema metadata (key order is part of the index bytes)."""
    extraction, opts = plan.extraction, plan.opts
    return {
        "format_version": FORMAT_VERSION,
        "model": {"name": extraction.info.model.name, "revision": extraction.info.model.revision},
        "num_prompts": extraction.n_samples, "prompt_ordering": opts["prompt_ordering"],
        "prompt_ordering_seed": opts["seed"] if opts["prompt_ordering"] == "random" else None,
        "tensors": tensors, "provenance": _provenance(extraction),
        "dataset": {"name": extraction.info.dataset.name, "split": extraction.info.dataset.split,
                    "labels": extraction.info.dataset.labels, "max_seq_length": extraction.info.max_seq_length,
                    "n_truncated_samples": _cut_count(extraction)},
        "files": files,
    }


# ---------------------------------------------------------------- the index, streamed in row groups

def row_groups(num_tokens: np.ndarray, line_bytes: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) index rows of each row group: ROW_GROUP_ROWS rows at most, ending at the row that
    brings the group to ROW_GROUP_TOKENS tokens or to ROW_GROUP_LINE_BYTES of `line_bytes` (each row's
    samples.jsonl line: its text, metadata and label as parsed)."""
    token_ends, byte_ends = np.cumsum(num_tokens), np.cumsum(line_bytes)
    groups, start = [], 0
    while start < len(num_tokens):
        stop = min(len(num_tokens), start + ROW_GROUP_ROWS, _reaching(token_ends, start, ROW_GROUP_TOKENS),
                   _reaching(byte_ends, start, ROW_GROUP_LINE_BYTES))
        groups.append((start, stop))
        start = stop
    return groups


def _reaching(ends: np.ndarray, start: int, limit: int) -> int:
    """One past the first row from `start` whose running total (`ends`: cumulative) reaches `limit`."""
    before = int(ends[start - 1]) if start else 0
    return int(np.searchsorted(ends, before + limit, side="left")) + 1


def _line_bytes(plan: Plan) -> np.ndarray:
    """Each index row's samples.jsonl line, in bytes (its newline counted): from where SampleRows found
    each line to start (8 B a sample, indexed already; nothing parsed)."""
    per_sample = np.concatenate([part.samples.line_bytes() for part in plan.extraction.parts])
    return per_sample[plan.order]


def _write_index(path: Path, columns: _IndexColumns, groups: list[tuple[int, int]], info: dict[str, Any]) -> None:
    """The index parquet, one row group (`groups`) at a time (the schema fixed beforehand, see _scan_rows).
    Arrow's allocator (mimalloc in pyarrow 26) keeps freed pages for reuse, and a finished group's
    arrays are rarely the size of the next: unless they are handed back after each group the job
    grew ~1 MB a group (tests/test_scale.py); handed back, it holds one group's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    metadata = {f"{PREFIX}{k}".encode(): json.dumps(v).encode() for k, v in info.items()}
    writer = None
    try:
        for start, stop in groups:
            table = columns.block(start, stop)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema.with_metadata(metadata), write_page_checksum=True)
            writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
            del table
            pa.default_memory_pool().release_unused()
    finally:
        if writer is not None:
            writer.close()


class _IndexColumns:
    """The index columns of any block of rows, typed alike for every block."""

    def __init__(self, plan: Plan, groups: list[tuple[int, int]]):
        self.plan = plan
        token_files = _token_files(plan.extraction.parts)
        self.token_ids, self.logprob = "token_ids.npy" in token_files, "token_logprob.npy" in token_files
        self.strings = (_TokenStrings(plan.extraction, plan.trust_remote_code)
                        if self.token_ids and plan.opts["token_strings"] else None)
        self.meta_types, marked = _scan_rows(plan, groups)
        self.cut, self.cut_known = _cut_flags(plan, marked)
        labels = plan.extraction.info.dataset.labels
        self.label_type = _label_type(labels)
        # Each label as lmprobe:dataset.labels spells it, found by equality: a row's 1.0 where the
        # class is 1 (one class to the extraction, one label_id) was stored as a second text "1.0".
        self.class_labels = {label: label for label in labels}

    def block(self, start: int, stop: int):
        """Index rows [start, stop) as a pyarrow Table (columns in the order of the spec's tables)."""
        import pyarrow as pa

        plan = self.plan
        order, num_tokens = plan.order[start:stop], plan.num_tokens[start:stop]
        samples = plan.extraction.samples(order.tolist())
        rows, labels = np.arange(start, stop), [self.class_labels.get(r["label"], r["label"]) for r in samples]
        cols: dict[str, Any] = {
            "text": pa.array([r["text"] for r in samples], pa.string()),
            "label": pa.array(labels if self.label_type == pa.int32() else list(map(_label_text, labels)),
                              self.label_type),
            "num_tokens": num_tokens.astype(np.int32), "shard_index": (rows // plan.lt_rows).astype(np.int32),
            "row_offset": (rows % plan.lt_rows).astype(np.int32)}
        if plan.seq_shard is not None:
            cols.update(_sequence_columns(plan, start, stop))
        if plan.opts["logits_topk"]:
            cols.update(shard_index_logits=(rows // plan.logits_rows).astype(np.int32),
                        row_offset_logits=(rows % plan.logits_rows).astype(np.int32))
        if self.token_ids:
            cols.update(self._token_columns(order))
        cols["sample_idx"] = pa.array(order, pa.int64())
        cols["label_id"] = pa.array([None if r["label"] is None else r["label_id"] for r in samples], pa.int32())
        cols["truncated"] = pa.array(self.cut[start:stop], pa.bool_(), mask=~self.cut_known[start:stop])
        # A field named as any column the spec or actstore defines gets `meta_`, one this dataset lacks
        # too: stored under that name, a field `token_strings` or `perplexity_mean` was read as the spec's.
        taken = set(cols) | set(INDEX_COLUMNS)
        for key, type_ in self.meta_types.items():
            name = f"meta_{key}" if key in taken else key
            if name in cols:  # fields `x` (x a column) and `meta_x`: the later one replaced the other's column
                other = name.removeprefix("meta_") if name == key else name
                raise FormatError(f"{plan.extraction.dir}: sample metadata fields {other!r} and {key!r} would both "
                                  f"be index column {name!r} (a field named as a column gets meta_); rename one")
            cols[name] = pa.array([r["metadata"].get(key) for r in samples], type_)
        return pa.table(cols)

    def _token_columns(self, order: np.ndarray) -> dict[str, Any]:
        """token_ids / perplexity_* / token_perplexity / token_logprob / token_strings."""
        import pyarrow as pa

        located = [self.plan.extraction.locate(s) for s in order.tolist()]
        ids = [part.token_ids(local) for part, local in located]
        list_offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int32)
        flat_ids = np.concatenate(ids).astype(np.int64)
        cols: dict[str, Any] = {"token_ids": pa.ListArray.from_arrays(list_offsets, pa.array(flat_ids, pa.int64()))}
        if self.logprob:
            logprobs = np.concatenate([part.token_logprob(local) for part, local in located]).astype(np.float32)
            cols.update(_perplexity_columns(list_offsets, logprobs))
        if self.strings:
            cols["token_strings"] = pa.ListArray.from_arrays(list_offsets,
                                                             pa.array(self.strings.decode(flat_ids), pa.string()))
        return cols


def _label_type(labels: list) -> Any:
    """The label column's type, one for every row group: the spec's int32 when every label of the
    dataset is an integer that fits it (a table's class column, a webdataset's cls), else string
    (a number label in a string column crashed the finishing job with a bare ArrowTypeError)."""
    import pyarrow as pa

    return pa.int32() if _int32_labels(labels) else pa.string()


def _int32_labels(labels: list) -> bool:
    return bool(labels) and all(type(label) is int and -2**31 <= label < 2**31 for label in labels)


def check_dataset_labels(config: dict[str, Any], labels: list) -> None:
    """check_label_texts of the dataset's labels where the config enables lmprobe: a mixed JSONL
    dataset is refused by the scan and by each part's preflight, not by lmprobe's job after the
    whole extraction has run."""
    from actstore.config import enabled_stages

    if "lmprobe" in enabled_stages(config):
        check_label_texts(labels, f"dataset.path {config['dataset']['path']} (lmprobe is enabled)")


def check_label_texts(labels: list, where: str) -> None:
    """ConfigError naming two labels a string label column would store as one text: a JSONL dataset's
    labels 1 and "1" (or 2.5 and "2.5") are two classes, but both were stored as label "1", told
    apart by label_id only."""
    if _int32_labels(labels):
        return
    first: dict[str | None, Any] = {}
    for label in labels:
        other = first.setdefault(_label_text(label), label)
        if other is not label:
            raise ConfigError(f"{where}: labels {json.dumps(other)} and {json.dumps(label)} would both be stored "
                              f"as label {_label_text(label)!r} in lmprobe's string label column; make the "
                              "dataset's labels all strings or all numbers")


def _label_text(label: Any) -> str | None:
    """`label` as a string column stores it: a number or boolean as its JSON text."""
    return label if label is None or isinstance(label, str) else json.dumps(label)


def _sequence_columns(plan: Plan, start: int, stop: int) -> dict[str, Any]:
    """token_offset (= row_offset) and per-token shard ids/offsets into the packed sequence shards."""
    num_tokens = plan.num_tokens[start:stop]
    list_offsets = np.concatenate([[0], np.cumsum(num_tokens)]).astype(np.int64)
    ids = np.repeat(plan.seq_shard[start:stop], num_tokens)
    within = np.arange(list_offsets[-1]) - np.repeat(list_offsets[:-1], num_tokens)
    offsets = np.repeat(plan.seq_first[start:stop], num_tokens) + within
    return {"token_offset": (np.arange(start, stop) % plan.lt_rows).astype(np.int64),
            "token_shard_ids": _int64_lists(list_offsets, ids),
            "token_shard_offsets": _int64_lists(list_offsets, offsets)}


def _int64_lists(list_offsets: np.ndarray, values: np.ndarray):
    """A list<int64> column from int64 offsets (built as a large list, so any length fits)."""
    import pyarrow as pa

    return pa.LargeListArray.from_arrays(list_offsets, pa.array(values, pa.int64())).cast(pa.list_(pa.int64()))


def _perplexity_columns(list_offsets: np.ndarray, flat_lp: np.ndarray) -> dict[str, Any]:
    """perplexity_mean/min/max per prompt (over tokens 1..; null with none), token_perplexity and
    token_logprob lists. Prompts of one body length are reduced together, each row as np.mean/min/max
    reduce it alone (the same pairwise sum, so the same bits): a Python loop over the prompts took 5-30 s
    a million; np.add.reduceat sums in order, and its means differ in the last bit."""
    import pyarrow as pa

    ppl = np.exp(-flat_lp.astype(np.float64))  # NaN at token 0: nothing predicts the first token
    starts = list_offsets[:-1].astype(np.int64) + 1
    lengths = np.maximum(list_offsets[1:] - starts, 0)
    stats = np.zeros((3, len(lengths)))
    by_length = np.argsort(lengths, kind="stable")
    for rows in np.split(by_length, np.flatnonzero(np.diff(lengths[by_length])) + 1):
        n = int(lengths[rows[0]]) if len(rows) else 0
        if n:
            bodies = np.lib.stride_tricks.sliding_window_view(ppl, n)[starts[rows]]  # (rows, n), a copy
            stats[:, rows] = np.add.reduce(bodies, axis=1) / n, bodies.min(axis=1), bodies.max(axis=1)
    empty = lengths == 0
    cols: dict[str, Any] = {name: pa.array(values, pa.float64(), mask=empty) for name, values in
                            zip(("perplexity_mean", "perplexity_min", "perplexity_max"), stats)}
    cols["token_perplexity"] = pa.ListArray.from_arrays(list_offsets, pa.array(ppl, pa.float64()))
    cols["token_logprob"] = pa.ListArray.from_arrays(list_offsets, pa.array(flat_lp, pa.float32()))
    return cols


class _TokenStrings:
    """Each token decoded on its own with the model's tokenizer (special tokens kept); an id the
    tokenizer has no token for (past its vocabulary, in a model's padded embedding) is null, where
    decoding it gave "", a string no reader could tell from a token's. Decoded ids are kept, so memory
    is bounded by the vocabulary, not the data. The tokenizer loads here, not through actstore.models,
    which imports torch: this writer job never needs it."""

    def __init__(self, extraction, trust_remote_code: bool):
        from transformers import AutoTokenizer

        path = extraction.info.model.path
        try:
            # A folder whose code is its own, untrusted: the key is named (transformers would prompt, or fail).
            check_remote_code(path, trust_remote_code)
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                           trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"lmprobe.token_strings: cannot load the tokenizer from {path} ({exc}); "
                              "set lmprobe.token_strings: false") from None
        self.known: dict[int, str | None] = {}

    def decode(self, flat_ids: np.ndarray) -> list[str | None]:
        uniq, inverse = np.unique(flat_ids, return_inverse=True)
        new = [i for i in uniq.tolist() if i not in self.known]
        tokens = self.tokenizer.convert_ids_to_tokens(new)
        have = [i for i, token in zip(new, tokens) if token is not None]
        self.known.update(dict.fromkeys(new))
        self.known.update(zip(have, self.tokenizer.batch_decode([[i] for i in have])))
        return np.array([self.known[i] for i in uniq.tolist()], dtype=object)[inverse].tolist()


def _scan_rows(plan: Plan, groups: list[tuple[int, int]]) -> tuple[dict[str, Any], np.ndarray]:
    """The first pass over every row, block by block (`groups`: the blocks the index is written in):
    each user metadata field -> its arrow type, as pyarrow infers it over every row (a field null in the
    first blocks takes its type from later ones, ints and floats unify to double; incompatible types fail
    naming the field), and which index rows samples.jsonl marks cut (CUT_FIELD). It also checks each row
    is the sample it is read as (_check_sample_idx)."""
    import pyarrow as pa

    types: dict[str, Any] = {}
    marked = np.zeros(plan.n, bool)
    for start, stop in groups:
        samples = plan.extraction.samples(plan.order[start:stop].tolist())
        _check_sample_idx(plan.extraction, plan.order[start:stop], samples)
        marked[start:stop] = [CUT_FIELD in row for row in samples]
        rows = [row["metadata"] for row in samples]
        for row in rows:
            types.update({k: pa.null() for k in row if k not in types})
        for key, have in types.items():
            values = [row.get(key) for row in rows]
            try:
                types[key] = _unify(have, pa.array(values).type)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                raise FormatError(f"{plan.extraction.dir}: sample metadata field {key!r} mixes types "
                                  f"({exc}); lmprobe cannot store it as one index column") from None
    return types, marked


def _cut_flags(plan: Plan, marked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each index row's `truncated` flag and whether it is known. A part's rows marked cut (`marked`) are
    all its cut rows when it marks as many as its part.json counts (none of none); an image is never cut. A
    part that cannot tell (a slow tokenizer), or that counts cut texts and marks none (written before rows
    were marked), leaves unknown (null) each row of max_seq_length tokens: its shorter ones were not cut."""
    parts = plan.extraction.parts
    part_of_row = plan.src.sample_part[plan.order]
    marks = np.bincount(part_of_row, weights=marked, minlength=len(parts)).astype(np.int64)
    for part, n in zip(parts, marks.tolist()):
        if n and n != part.info.n_truncated_samples:  # actstore verify names the part's fault too
            raise FormatError(f"{part.samples.path}: {n} rows say {CUT_FIELD}, where its part.json's "
                              f"n_truncated_samples says {part.info.n_truncated_samples}; the extraction is damaged")
    complete = np.array([part.info.modality == "image" or part.info.n_truncated_samples == n
                         for part, n in zip(parts, marks.tolist())])
    return marked, complete[part_of_row] | (plan.num_tokens < plan.extraction.info.max_seq_length)


def _cut_count(extraction) -> int | None:
    """Prompts cut at max_seq_length, as the parts count them (none of an image); None where one cannot tell."""
    counts = [0 if part.info.modality == "image" else part.info.n_truncated_samples for part in extraction.parts]
    return None if None in counts else sum(counts)


def _check_sample_idx(extraction, order: np.ndarray, samples: list[dict]) -> None:
    """FormatError naming the samples.jsonl line read as sample `order[i]` that says it is another:
    lines moved within a part put one sample's text and label beside another's activations, a fault
    only a part's sha256 (hashed by verify, not by writers) would otherwise tell."""
    for want, row in zip(order.tolist(), samples):
        if row["sample_idx"] != want:
            part, local = extraction.locate(want)
            raise FormatError(f"{part.samples.path}: line {local + 1} says sample_idx {row['sample_idx']!r:.40}, "
                              f"where the part's sample_range makes it sample {want}; the extraction is damaged "
                              "(actstore verify names its faults)")


def _unify(a, b):
    """The type pyarrow infers for values of types a and b together (null + T = T, int + float = double)."""
    import pyarrow as pa

    if a == b:
        return a
    schemas = [pa.schema([("x", a)]), pa.schema([("x", b)])]
    return pa.unify_schemas(schemas, promote_options="permissive").field("x").type
