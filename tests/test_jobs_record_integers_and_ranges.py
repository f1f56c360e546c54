"""Review 61 of the scattered writers' jobs (actstore.jobs): a job record's numbers are integers, not
JSON booleans (True == 1 to every comparison), and the job ranges refuse what no split gives."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from actstore.errors import FormatError
from actstore.integrity import file_record
from actstore.jobs import JOB_RECORD, jobs_covering, read_job_records, write_job_record


def one_job(root: Path, data: bytes = b"x") -> Path:
    """A job dir with one file and the record the real writer leaves for it (job 0 of 1)."""
    job_dir = root / "job-0000"
    job_dir.mkdir(parents=True)
    (job_dir / "a.bin").write_bytes(data)
    write_job_record(job_dir, 1, 0, [("a.bin", file_record(job_dir / "a.bin"))])
    return job_dir


def edit(job_dir: Path, change) -> None:
    record = json.loads((job_dir / JOB_RECORD).read_text())
    change(record)
    (job_dir / JOB_RECORD).write_text(json.dumps(record))


def test_the_real_record_reads_back(tmp_path):
    job_dir = one_job(tmp_path)
    assert list(read_job_records([job_dir]).files) == ["a.bin"]


@pytest.mark.parametrize("changes", [{"jobs": True}, {"job": False}, {"jobs": True, "job": False}])
def test_booleans_for_job_numbers_are_refused(tmp_path, changes):
    """`"jobs": true, "job": false` compared equal to (1, 0): a record no writer made passed as job 0 of 1."""
    job_dir = one_job(tmp_path)
    edit(job_dir, lambda record: record.update(changes))
    with pytest.raises(FormatError, match=r"job-0000/job\.json: not a job record"):
        read_job_records([job_dir])


def test_a_boolean_file_size_is_refused(tmp_path):
    """`"bytes": true` equalled a 1-byte file's size: a record with no size passed the size check."""
    job_dir = one_job(tmp_path, b"x")
    edit(job_dir, lambda record: record["files"]["a.bin"].update(bytes=True))
    with pytest.raises(FormatError, match=r"job-0000/job\.json: no bytes and sha256 recorded for 'a\.bin'"):
        read_job_records([job_dir])


@pytest.mark.parametrize("n_items, jobs, items", [(3, 2, range(5, 6)), (3, 2, range(-1, 1)), (3, 5, range(3, 4)),
                                                  (0, 0, range(0, 1)), (3, 0, range(0, 1))])
def test_jobs_covering_refuses_items_or_jobs_no_split_has(n_items, jobs, items):
    """Items past n_items gave jobs that do not exist (job 4 of 2, or -1: zarr.smk's ZARR_RECORDS[-1]
    is the last job's record, silently) or divided by zero."""
    with pytest.raises(ValueError, match=r"items .* of \d+ in \d+ jobs"):
        jobs_covering(n_items, jobs, items)


def test_jobs_covering_matches_job_items_everywhere():
    from actstore.jobs import job_items

    for n in range(12):
        for jobs in range(1, 15):
            owner = {i: job for job in range(jobs) for i in job_items(n, jobs, job)}
            for a in range(n):
                for b in range(a + 1, n + 1):
                    assert list(jobs_covering(n, jobs, range(a, b))) == sorted({owner[i] for i in range(a, b)})


@pytest.mark.parametrize("digest", ["", "0" * 63, "X" * 64, "0" * 64 + "\n"])
def test_a_digest_that_is_no_sha256_is_refused(tmp_path, digest):
    """The finisher takes the recorded sha256 as it stands (it reads no file): one that is no sha256 at
    all ("" or a cut one) went on into the store's records, found wrong only when verified."""
    job_dir = one_job(tmp_path)
    edit(job_dir, lambda record: record["files"]["a.bin"].update(sha256=digest))
    with pytest.raises(FormatError, match=r"job-0000/job\.json: no bytes and sha256 recorded for 'a\.bin'"):
        read_job_records([job_dir])


def test_a_saev_shards_job_is_given_the_time_of_the_shards_it_writes(model_dir, text_jsonl, tmp_path, monkeypatch):
    """saev_shards jobs each write whole shards, but each was given a job count's share of the data: with
    2 shards and 4 jobs, two jobs write a shard each (half the data) in a quarter's time, and Slurm
    killed them at their limit. The busiest job's shards set it now; a job count below the shards,
    the most shards any job writes."""
    import tiny
    from actstore import resources

    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"layers": [0, 1], "parts": 4})
    work = resources.workload(config)
    vectors = work.tokens * 2
    # the rate made slow enough that a pass over the data is ~100 minutes, not the start-up minimum
    monkeypatch.setattr(resources, "IO_BYTES_PER_S", work.activation_bytes / 6000)
    config["saev"].update(jobs=4, patches_per_shard=-(-vectors // 2))
    assert resources.saev_shards_runtime(config) == resources.io_runtime(config, jobs=2)
    assert resources.saev_shards_runtime(config) > resources.io_runtime(config, jobs=4)
    config["saev"].update(jobs=2, patches_per_shard=-(-vectors // 3))  # 3 shards in 2 jobs: one writes 2
    assert resources.saev_shards_runtime(config) == resources.io_runtime(config, jobs=3, passes=4.0)
    config["saev"].update(jobs=4, patches_per_shard=10**9)
    assert resources.saev_shards_runtime(config) == resources.io_runtime(config, jobs=1)
