"""Losing one finished part redoes that part alone: the dataset scan every part was cut from stays in
the stage directory (rules/extract.smk: never temp(); a temp scan, deleted with the run's last part,
was scanned again for a lost part and its new mtime redid every part, one GPU job each), the part
redone reads the scan the others read, and verify skips the scan (integrity.STAGE_TEMPS)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import tiny
from actstore.hashing import stage_dir
from test_workflow import snakemake, write

pytestmark = pytest.mark.slow


def plan(workdir, configfile) -> dict[str, int]:
    """Jobs a dry run of target `extract` would execute, rule -> count ({} when nothing is to do)."""
    import re

    output = snakemake(workdir, configfile, "-n", "extract")
    if "Nothing to be done" in output:
        return {}
    table = output.split("Job stats:")[1].split("Reasons:")[0]
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}
    jobs.pop("total", None)
    return jobs


@pytest.fixture(scope="module")
def lost_part(model_dir, tmp_path_factory):
    """One real 3-part extraction, then part-0002 and extract.json deleted, a dry run, and the run
    again: what each step left."""
    workdir = tmp_path_factory.mktemp("scan-rerun")
    data = tiny.write_jsonl(workdir / "docs.jsonl", 12)
    config = tiny.make_config(workdir, model_dir("bert"), data, extract={"parts": 3})
    configfile = write(config, workdir / "three.yaml")
    snakemake(workdir, configfile, "extract")
    out = stage_dir(config, "extract")
    scan = out / "dataset_scan.json"
    seen = {"out": out, "scan_after_run": scan.stat().st_mtime_ns if scan.is_file() else None}
    shutil.rmtree(out / "part-0002")
    (out / "extract.json").unlink()
    seen["plan"] = plan(workdir, configfile)
    kept = {p: p.stat().st_mtime_ns for p in out.glob("part-000[01]/*")}
    snakemake(workdir, configfile, "extract")
    seen["kept_rewritten"] = sorted(p.name for p, mtime in kept.items() if p.stat().st_mtime_ns != mtime)
    seen["scan_after_rerun"] = scan.stat().st_mtime_ns if scan.is_file() else None
    seen["plan_after"] = plan(workdir, configfile)
    return seen


def test_losing_one_finished_part_schedules_that_part_alone(lost_part):
    assert lost_part["plan"] == {"extract_part": 1, "extract_index": 1, "extract": 1}


def test_the_scan_outlives_the_run_and_the_redone_part_reads_it(lost_part):
    assert lost_part["scan_after_run"] is not None
    assert lost_part["scan_after_rerun"] == lost_part["scan_after_run"]
    assert (lost_part["out"] / "part-0002" / "part.json").is_file()


def test_the_parts_kept_are_not_rewritten_and_then_nothing_is_left_to_do(lost_part):
    assert lost_part["kept_rewritten"] == []
    assert lost_part["plan_after"] == {}


def test_the_stage_with_its_scan_verifies(lost_part):
    proc = subprocess.run([sys.executable, "-m", "actstore.cli", "verify", str(lost_part["out"])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "dataset_scan" not in proc.stdout, proc.stdout + proc.stderr
