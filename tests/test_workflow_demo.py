"""The demo config run once through Snakemake, then dry runs that prove the stage hashes schedule
exactly what a config change invalidates. (Apart from test_workflow.py's runs: its own file is a worker's
whole share of the suite under pytest-xdist's --dist loadfile.)"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from actstore.config import load_config
from actstore.hashing import STAGES, stage_dir
from test_workflow import REPO, demo_config, scheduled, snakemake, write


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo config run once through Snakemake into a temp dump_to."""
    workdir = tmp_path_factory.mktemp("workflow")
    configfile = write(demo_config(workdir / "dump"), workdir / "demo.yaml")
    first_plan = scheduled(workdir, configfile)
    snakemake(workdir, configfile, timeout=1200)
    return workdir, configfile, first_plan


@pytest.mark.slow
def test_demo_runs_every_stage_and_then_has_nothing_to_do(demo_run):
    workdir, configfile, first_plan = demo_run
    config = load_config(configfile)
    assert first_plan["extract_part"] == config["extract"]["parts"] and first_plan["extract_scan"] == 1
    assert len(list(workdir.glob("dump/extract/*/dataset_scan.json"))) == 1  # kept: a part lost is redone from it
    for stage in ("extract", "saev", "pickle", "lmprobe", "zarr", "sae", "lut", "validate"):
        if (REPO / "rules" / f"{stage}.smk").exists():
            directory = stage_dir(config, stage)
            assert (directory / "actstore_config.json").is_file(), stage
    assert scheduled(workdir, configfile) == {}


@pytest.mark.slow
def test_changing_t_chunk_schedules_only_zarr_and_what_follows(demo_run, tmp_path):
    workdir, configfile, first_plan = demo_run
    config = yaml.safe_load(configfile.read_text())
    config.setdefault("zarr", {})["t_chunk"] = 7
    jobs = scheduled(workdir, write(config, tmp_path / "t_chunk.yaml"))
    assert any(rule.startswith("zarr") for rule in jobs), jobs
    assert all(rule.startswith(("zarr", "validate", "report")) or rule == "all" for rule in jobs), jobs


@pytest.mark.slow
def test_changing_how_a_finished_run_executes_schedules_nothing(demo_run, tmp_path):
    """Keys that change how a stage runs, never what it writes, are not hashed (hashing.EXECUTION_KEYS)
    and must not redo a finished stage either: here every writer's (and validate's) job count and thread
    count, and model.trust_remote_code."""
    from actstore.hashing import EXECUTION_KEYS

    workdir, configfile, _ = demo_run
    config = yaml.safe_load(configfile.read_text())
    # Job 0 of the pickle and zarr shard jobs needed part 0 only, and on a cluster finishes before
    # part 1 does; make it so whatever order this machine ran them in. With one job, job 0 covers
    # part 1 too: a benchmark of the old layout's job 0 under its name would be older than its input.
    part0 = stage_dir(load_config(configfile), "extract") / "part-0000"
    finished = max(f.stat().st_mtime for f in part0.iterdir())
    old_benchmarks = [*workdir.glob("dump/benchmarks/pickle/*/job-0000*.tsv"),
                      *workdir.glob("dump/benchmarks/zarr/*/shards-0000*.tsv")]
    assert len(old_benchmarks) == 2, old_benchmarks
    for benchmark in old_benchmarks:
        os.utime(benchmark, (finished, finished))
    changes = {("saev", "jobs"): 1, ("lmprobe", "jobs"): 1, ("pickle", "jobs"): 1, ("pickle", "threads"): 1,
               ("zarr", "jobs"): 1, ("zarr", "merge_jobs"): 1, ("zarr", "threads"): 1, ("extract", "writer_threads"): 2,
               ("extract", "buffers"): 2, ("extract", "num_workers"): 1, ("model", "trust_remote_code"): True,
               ("validate", "jobs"): 1}
    assert set(changes) == {(section, key) for section, keys in EXECUTION_KEYS.items() for key in keys}
    for (section, key), value in changes.items():
        config.setdefault(section, {})[key] = value
    assert scheduled(workdir, write(config, tmp_path / "execution.yaml")) == {}


@pytest.mark.slow
def test_changing_layers_schedules_extraction_and_everything_downstream(demo_run, tmp_path):
    workdir, configfile, first_plan = demo_run
    config = yaml.safe_load(configfile.read_text())
    config["extract"]["layers"] = [0, 3, 5]
    jobs = scheduled(workdir, write(config, tmp_path / "layers.yaml"))
    assert jobs == first_plan


@pytest.mark.slow
def test_two_configs_share_one_dump_to_without_touching_each_other(demo_run, model_dir, text_jsonl, tmp_path):
    workdir, configfile, _ = demo_run
    demo = load_config(configfile)
    before = {p: p.stat().st_mtime_ns for p in Path(demo["dump_to"]).rglob("*") if p.is_file()}
    other = copy.deepcopy(yaml.safe_load(configfile.read_text()))
    other["model"] = {"path": str(model_dir("bert"))}
    other["dataset"] = {"path": str(text_jsonl)}
    other["extract"] = {"layers": [0, 1], "max_seq_length": 16, "parts": 1, "batch_size": 8,
                        "hooks": ["encoder.layer.1.attention.self.query:input"]}
    for section in ("sae", "lut"):
        other[section] = {"enabled": False}
    other_file = write(other, tmp_path / "other.yaml")
    snakemake(workdir, other_file)
    other_config = load_config(other_file)
    for stage in STAGES:
        assert stage_dir(other_config, stage) != stage_dir(demo, stage)
    after = {p: p.stat().st_mtime_ns for p in Path(demo["dump_to"]).rglob("*") if p in before}
    assert after == before
    assert scheduled(workdir, configfile) == {}
    assert scheduled(workdir, other_file) == {}
