"""Scattered writers: how many jobs write a stage, which contiguous range of items each takes, and
the job record each leaves for the finishing job (one format and one reader for every writer).

A writer's items (saev shards, lmprobe tensor files, extraction parts for pickle and zarr) are known
only once the extraction exists, but the number of jobs is fixed at parse time, so `snakemake -n`
shows the whole DAG."""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from actstore.errors import FormatError
from actstore.integrity import (DIGESTS, is_sha256, listed_problem, stream_json_members, stream_json_object,
                                whole_number)
from actstore.io_utils import atomic_path, errors_naming

# Unset, a writer gets a job per extraction part up to this many: at 10 TB each job then writes
# ~160 GB (about 15 min at Lustre's per-job rate), and the DAG of a 4,096-part run stays small.
DEFAULT_MAX_JOBS = 64


def write_jobs(config: dict[str, Any], stage: str, key: str = "jobs") -> int:
    """Jobs writing `stage`: its `key` (`jobs`, or zarr's `merge_jobs`), or one per extraction part
    up to DEFAULT_MAX_JOBS."""
    return int(config[stage].get(key) or min(config["extract"]["parts"], DEFAULT_MAX_JOBS))


def job_items(n_items: int, jobs: int, job: int) -> range:
    """The contiguous items of job `job` of `jobs`: balanced (sizes differ by at most one), in order,
    together covering range(n_items) exactly once; empty when there are more jobs than items."""
    if not 0 <= job < jobs:
        raise ValueError(f"job {job} is not in 0..{jobs - 1}")
    base, extra = divmod(n_items, jobs)
    start = job * base + min(job, extra)
    return range(start, start + base + (job < extra))


def jobs_covering(n_items: int, jobs: int, items: range) -> range:
    """The jobs of `jobs` (as job_items splits n_items) that hold any of the consecutive `items`."""
    if not items:
        return range(0)
    # an item no job holds gave a job that is none (-1: the last job's record to a list index) or divided by 0
    if jobs < 1 or items[0] < 0 or items[-1] >= n_items:
        raise ValueError(f"items {items[0]}..{items[-1]} of {n_items} in {jobs} jobs: not all held by a job")
    base, extra = divmod(n_items, jobs)

    def job_of(item: int) -> int:
        big = extra * (base + 1)  # the first `extra` jobs take one item more
        return item // (base + 1) if item < big else extra + (item - big) // base

    return range(job_of(items[0]), job_of(items[-1]) + 1)


# ---------------------------------------------------------------- the job record every scattered writer keeps

JOB_RECORD = "job.json"  # in a job dir: {"jobs", "job", "files": {rel path: {bytes, sha256}}, **the format's own}
RECORD_KEYS = ("jobs", "job", "files")
# rel path -> (its job dir, {bytes, sha256}): the dir, not the file's path, so that a finisher of
# millions of chunk files holds one Path per job (a Path per file was ~40 % of the records' memory)
JobFiles = dict[str, tuple[Path, dict[str, Any]]]


def write_job_record(job_dir: str | Path, jobs: int, job: int, files: Iterable[tuple[str, dict[str, Any]]],
                     **extra: Any) -> Path:
    """Record what job `job` of `jobs` wrote into `job_dir`: each file (a relative POSIX path) with its
    {bytes, sha256}, taken as it was written, plus the format's own `extra` keys; written atomically,
    after the files, so a record means the job finished. Returns the record's path. `files` is
    streamed into the record as it comes (a zarr merge job lists millions): a job holds none of it."""
    path = Path(job_dir) / JOB_RECORD
    head = json.dumps({**extra, "jobs": jobs, "job": job, "files": {}})
    with atomic_path(path) as tmp, open(tmp, "w") as out:
        # Compact, the keys before the files (iter_job_records reads them first), the files in order.
        # errors_naming round the writes alone: an error of whatever yields `files` is its own.
        with errors_naming(path):
            out.write(head[:-len("}}")])
        for i, (name, entry) in enumerate(files):
            text = f"{', ' if i else ''}{json.dumps(name)}: {json.dumps(entry)}"
            with errors_naming(path):
                out.write(text)
        with errors_naming(path):
            out.write("}}\n")
            out.flush()
    return path


def check_job_parts(job_dirs: Sequence[str | Path], n_parts: int) -> None:
    """The records of a writer whose jobs each wrote a range of extraction parts into the stage dir
    (pickle machines, zarr shard stores: its `parts` key): every job's there, each of this run, and
    together they wrote parts 0..n_parts-1 in order. FormatError names what is wrong."""
    written: list[int] = []
    for job_dir, extra in zip(job_dirs, read_job_records(job_dirs).extras):
        parts = extra.get("parts", [])
        # type(): a part number is an int, not true or 1.0, which compare equal to 1
        if not isinstance(parts, list) or not all(type(part) is int for part in parts):
            raise FormatError(f"{Path(job_dir) / JOB_RECORD}: parts {parts!r:.70} is not a list of part numbers")
        written += parts
    if written != list(range(n_parts)):
        missing = sorted(set(range(n_parts)) - set(written))
        records = [str(Path(d) / JOB_RECORD) for d in job_dirs]
        named = ", ".join(records) if len(records) <= 4 else f"{records[0]} ... {records[-1]}"
        raise FormatError(f"{named}: the jobs wrote parts {written[:8]}"
                          f"{'...' if len(written) > 8 else ''} of {n_parts}"
                          + (f", none of part {', '.join(map(str, missing[:8]))}" if missing else ""))


@dataclass(frozen=True)
class JobRecords:
    """What read_job_records found: every job's own keys and every file the jobs wrote."""

    extras: list[dict[str, Any]]  # each record's keys beyond RECORD_KEYS, in job order
    files: JobFiles               # in job order, each job's files in the order it listed them


def read_job_records(job_dirs: Sequence[str | Path]) -> JobRecords:
    """The records of jobs 0, 1, ... of one scattered write, in `job_dirs` order, held: every check of
    iter_job_records, and each name listed once over all jobs."""
    extras: list[dict[str, Any]] = []
    files: JobFiles = {}
    for job_dir, extra, listed in iter_job_records(job_dirs, files):
        extras.append(extra)
        files.update((name, (job_dir, entry)) for name, entry in listed)
    return JobRecords(extras, files)


def iter_job_records(job_dirs: Sequence[str | Path], earlier: JobFiles | None = None,
                     ) -> Iterator[tuple[Path, dict[str, Any], Iterator[tuple[str, dict]]]]:
    """(job dir, the record's own keys, its files) of jobs 0, 1, ... of one scattered write, in
    `job_dirs` order, checked before the finisher touches a file: first every record's head (each
    well-formed and the job it says it is: none missing, twice or of another run), then, as each
    job's files are streamed (a record is read 1 MiB at a time, so millions of files cost no
    memory), each name inside its job dir, not among the files of `earlier` jobs (when the caller
    holds them), and each file there with its recorded size. FormatError names the record or file at
    fault. No file is read: the recorded sha256 stands (the job hashed the bytes as it wrote them)."""
    dirs = [Path(d) for d in job_dirs]
    heads = [_read_head(d / JOB_RECORD) for d in dirs]
    _check_numbering([d / JOB_RECORD for d in dirs], heads)
    for job_dir, head in zip(dirs, heads):
        yield job_dir, {k: v for k, v in head.items() if k not in RECORD_KEYS}, _record_files(job_dir, earlier or {})


_NOT_A_RECORD = "a job record (needs integers jobs and job and a files object)"


def _read_head(path: Path) -> dict[str, Any]:
    """A job record's keys before its files (write_job_record puts them first), checked for type."""
    head: dict[str, Any] = {}
    for key, value in stream_json_object(path, "files", _NOT_A_RECORD):
        if key == "files":
            break
        head[key] = value
    else:
        raise FormatError(f"{path}: not {_NOT_A_RECORD}")
    # whole_number: true and false are ints to Python, and equal to job 0 of 1
    if not (whole_number(head.get("jobs"), 1) and whole_number(head.get("job"))):
        raise FormatError(f"{path}: not {_NOT_A_RECORD}")
    return head


def _record_files(job_dir: Path, earlier: JobFiles) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, {bytes, sha256 or sha256_tree}) of each file the record in `job_dir` lists, each checked there."""
    path = job_dir / JOB_RECORD
    source = str(path)
    for name, entry in stream_json_members(path, "files", _NOT_A_RECORD):
        if not isinstance(entry, dict) or not whole_number(entry.get("bytes")) or not _digests_recorded(entry):
            raise FormatError(f"{path}: no bytes and sha256 recorded for {name!r}")
        if name in earlier:
            raise FormatError(f"{path}: {name} also listed in {earlier[name][0] / JOB_RECORD}")
        problem = listed_problem(job_dir, name, {"bytes": entry["bytes"]}, source, digest=False)
        if problem:
            raise FormatError(problem)
        yield name, entry


def _digests_recorded(entry: dict[str, Any]) -> bool:
    """A sha256 (or sha256_tree) recorded, each one given a sha256's 64 hex digits: the finisher hands
    them on unread, so one that is no digest ("", cut short) would reach the store's own records."""
    digests = [entry[key] for key in DIGESTS if key in entry]
    return bool(digests) and all(map(is_sha256, digests))


def _check_numbering(paths: list[Path], records: list[dict[str, Any]]) -> None:
    """Record i is job i of len(records): a job missing, recorded twice or of another run is named."""
    claims = [(r["jobs"], r["job"]) for r in records]
    counts = {jobs for jobs, _ in claims}
    if len(counts) == 1 and (jobs := counts.pop()) > len(records):
        # The first few only, found lazily: `jobs` is read from a record (one damaged digit, 2 -> 2000000)
        # and a set of every job number, each then printed, grew with it.
        claimed = {job for _, job in claims}
        missing = list(itertools.islice((job for job in range(jobs) if job not in claimed), 9))
        raise FormatError(f"{', '.join(map(str, paths))}: records of {jobs} jobs, none of job "
                          f"{', '.join(map(str, missing[:8]))}{', ...' if len(missing) > 8 else ''}")
    seen: dict[tuple[int, int], Path] = {}
    for path, claim in zip(paths, claims):
        if claim in seen:
            raise FormatError(f"{path}: the record of job {claim[1]} of {claim[0]}, as is {seen[claim]}")
        seen[claim] = path
    for i, (path, (jobs, job)) in enumerate(zip(paths, claims)):
        if (jobs, job) != (len(records), i):
            raise FormatError(f"{path}: the record of job {job} of {jobs}, given as job {i} of {len(records)}")
