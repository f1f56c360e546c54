"""Review 65: each validate job split into share jobs (validate.jobs): job i of n checks every n-th file of
each of verify's lists and folds every n-th block of each view's rows into its fingerprints; the report job
adds them up. One job a store read a 100 TB store past Slurm's 48 h cap."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

import tiny
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.verify import reference_dtype
from test_extract import write_real_store
from test_fingerprints import zarr_chunk
from test_validate_job_per_store import timed_apart
from test_workflow import REPO, SNAKEMAKE, job_counts, snakemake, write

FORMATS = ("saev", "pickle", "lmprobe", "zarr")


def test_problems_of_checks_the_positions_of_its_share_only():
    from actstore.integrity import check_share, problems_of

    items = [f"file-{i}" for i in range(11)]
    found = {}
    for share in range(3):
        with check_share(share, 3):
            found[share] = problems_of(lambda item: [item], items, threads=2)
    assert found[1] == [f"file-{i}" for i in (1, 4, 7, 10)]
    assert sorted(p for share in found.values() for p in share) == sorted(items)
    assert problems_of(lambda item: [item], iter(items)) == items  # outside a share: every item


def assert_same_fingerprint(whole, one) -> None:
    """Counts and NaN hashes equal; sums and scales up to the order their rows were added in."""
    assert np.array_equal(whole.counts, one.counts) and np.array_equal(whole.specials, one.specials)
    for field in ("sums", "scales"):
        got, want = getattr(whole, field), getattr(one, field)
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max()), field


@pytest.mark.parametrize("shares", [2, 3])
def test_the_share_jobs_fingerprints_merged_compare_as_one_jobs(tmp_path, monkeypatch, shares):
    """Every format's views and the extraction's reference, read in shares and merged: the fingerprints one
    job reads, and the same comparison (a damaged zarr sample named alike)."""
    from actstore import fingerprints
    from actstore.fingerprints import compared, merged, reference_passes, store_passes, wanted_of
    from actstore.integrity import check_share

    monkeypatch.setattr(fingerprints, "BLOCK_BYTES", 4096)  # blocks of a few rows: each share reads several
    root = synthetic_extraction(tmp_path / "x", 200_000, 3, 8, [1, 2], tokens=(4, 10))
    extraction = open_extraction(root)
    stores = {name: (write_real_store(name, root, tmp_path / name, parts=(0, 1, 2)), "float16"
                     if name != "pickle" else "float32") for name in FORMATS}
    rows = np.fromfile(zarr_chunk(stores["zarr"][0], 3, 0), np.float16)
    rows[0] += 1
    rows.tofile(zarr_chunk(stores["zarr"][0], 3, 0))
    wanted = wanted_of(stores, extraction)
    one_reference = reference_passes(extraction, wanted, 0, reference_dtype)
    references = []
    for share in range(shares):
        with check_share(share, shares):
            references.append(reference_passes(extraction, wanted, 0, reference_dtype))
    reference = {w: merged([found[w] for found in references]) for w in wanted}
    for w in wanted:
        assert_same_fingerprint(reference[w], one_reference[w])
    for name, (store, dtype) in stores.items():
        one = store_passes(name, store, dtype, extraction, 0)
        parts = []
        for share in range(shares):
            with check_share(share, shares):
                parts.append(store_passes(name, store, dtype, extraction, 0))
        assert [counts_of(p) for p in parts].count(0) == 0, name  # each share read some rows
        for at, (label, _, mine) in enumerate(one.views):
            assert_same_fingerprint(merged([p.views[at][2] for p in parts]), mine)
        whole = type(one)([(label, w, merged([p.views[at][2] for p in parts]))
                           for at, (label, w, _) in enumerate(one.views)])
        assert compared(store, whole, reference) == compared(store, one, one_reference), name
    assert "holds other vectors" in compared(stores["zarr"][0], whole, reference)["problems"][0]


def counts_of(passes) -> int:
    return sum(int(mine.counts.sum()) for _, _, mine in passes.views)


def test_validate_jobs_null_reads_a_store_in_about_8_hours_a_job(tmp_path, model_dir, text_jsonl, monkeypatch):
    """validate.jobs null: as many share jobs as read the store (twice; zarr with its merged store three
    times) in VALIDATE_JOB_HOURS each at IO_BYTES_PER_S, each asking for its share's minutes."""
    from actstore import resources

    config = tiny.make_config(tmp_path, model_dir("gpt2"), text_jsonl, sae={"enabled": False}, zarr={"merged": True})
    assert resources.validate_jobs(config, "saev") == 1
    eight_hours = resources.workload(config).activation_bytes / (resources.VALIDATE_JOB_HOURS * 3600)
    monkeypatch.setattr(resources, "IO_BYTES_PER_S", eight_hours / 10)  # a pass: 80 h
    assert resources.validate_jobs(config, "saev") == 20 and resources.validate_jobs(config, "zarr") == 30
    assert resources.validate_runtime(config, "saev") == resources.validate_runtime(config, "zarr") < 48 * 60 / 2
    config["validate"]["jobs"] = 4
    assert resources.validate_jobs(config, "zarr") == 4


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory, model_dir, text_jsonl):
    """A tiny gpt2 run of every format (zarr's merged store too) through `snakemake validate`, in 2 share
    jobs a store."""
    workdir = tmp_path_factory.mktemp("shares")
    config = tiny.make_config(workdir, model_dir("gpt2"), text_jsonl, sae={"enabled": False},
                              zarr={"merged": True}, validate={"jobs": 2}, extract={"parts": 2})
    configfile = write(config, workdir / "config.yaml")
    plan = job_counts(snakemake(workdir, configfile, "-n", "validate"))
    snakemake(workdir, configfile, "validate")
    return workdir, config, configfile, plan


@pytest.mark.slow
def test_the_share_jobs_write_the_report_one_process_writes(shared_run, tmp_path):
    from actstore.hashing import stage_dirs, stage_hash
    from actstore.integrity import stage_config_problems
    from actstore.verify import validate_all

    workdir, config, _, plan = shared_run
    assert plan["validate_store"] == 4 * 2 and plan["validate_extract"] == 2 and plan["validate_stores"] == 1, plan
    validate_dir = stage_dirs(config)["validate"]
    validate_all(config, tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    assert timed_apart(json.loads((validate_dir / "report.json").read_text())) == timed_apart(report)
    assert set(report["formats"]["zarr"]["fingerprint"]) == {"zarr", "zarr merged"}
    # the jobs' results were temp files, deleted; the stage verifies
    assert not (validate_dir / "scatter").exists() or not any((validate_dir / "scatter").iterdir())
    assert stage_config_problems(validate_dir, required=True) == []
    assert stage_hash({**config, "validate": {**config["validate"], "jobs": 5}}, "validate") == \
        stage_hash(config, "validate")


@pytest.mark.slow
def test_a_damaged_file_is_named_once_by_the_share_job_holding_it(shared_run):
    """A byte flipped in one pickle shard and in one zarr chunk: the rerun stage fails, each file's sha256
    problem named once in the report job's error, found by the one share job that checked it."""
    from actstore.formats.pickle import load_metadata
    from actstore.formats.pickle.read import shard_path
    from actstore.hashing import stage_dirs
    from actstore.verify import load_store_check

    workdir, config, configfile, _ = shared_run
    dirs = stage_dirs(config)
    pickle_store = next(p.parent for p in dirs["pickle"].rglob("metadata.json"))
    shard = shard_path(pickle_store, load_metadata(pickle_store)["shards"][-1])
    chunk = zarr_chunk(dirs["zarr"], 0, 0)
    for damaged in (shard, chunk):
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 0x40
        damaged.write_bytes(bytes(data))
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--configfile", str(configfile),
           "--cores", "2", "validate", "--forcerun", "validate_store", "validate_extract"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0
    report_log = next(workdir.rglob("logs/validate/*/validate_stores*.log")).read_text()
    failed = report_log.rpartition("validation failed:")[2].splitlines()
    scatter = stage_dirs(config)["validate"] / "scatter"  # a failed job's inputs are kept
    for damaged, store in ((shard, "pickle"), (chunk, "zarr")):
        verified = [line for line in failed if line.startswith(f"{damaged}: ") and "fingerprint not read" not in line]
        assert len(verified) == 1, (damaged, failed)
        named = [share for share in range(2) if any(problem.startswith(f"{damaged}: ") for problem in
                                                     load_store_check(scatter / f"{store}.{share}.npz")[0]["problems"])]
        assert len(named) == 1, (damaged, named)
