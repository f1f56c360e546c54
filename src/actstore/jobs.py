"""Scattered writers: how many jobs write a stage and which contiguous range of items each takes.

A writer's items (saev shards, lmprobe tensor files, zarr parts) are known only once the extraction
exists, but the number of jobs is fixed at parse time, so `snakemake -n` shows the whole DAG."""
from __future__ import annotations

from typing import Any

JOBS_KEY = {"saev": "jobs", "lmprobe": "jobs", "zarr": "merge_jobs"}
# Unset, a writer gets a job per extraction part up to this many: at 10 TB each job then writes
# ~160 GB (about 15 min at Lustre's per-job rate), and the DAG of a 4,096-part run stays small.
DEFAULT_MAX_JOBS = 64


def write_jobs(config: dict[str, Any], stage: str) -> int:
    """Jobs writing `stage`: its `jobs` key, or one per extraction part up to DEFAULT_MAX_JOBS."""
    return int(config[stage].get(JOBS_KEY[stage]) or min(config["extract"]["parts"], DEFAULT_MAX_JOBS))


def job_items(n_items: int, jobs: int, job: int) -> range:
    """The contiguous items of job `job` of `jobs`: balanced (sizes differ by at most one), in order,
    together covering range(n_items) exactly once; empty when there are more jobs than items."""
    if not 0 <= job < jobs:
        raise ValueError(f"job {job} is not in 0..{jobs - 1}")
    base, extra = divmod(n_items, jobs)
    start = job * base + min(job, extra)
    return range(start, start + base + (job < extra))
