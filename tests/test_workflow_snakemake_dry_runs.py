"""Review 57 of the Snakemake workflow (Snakefile, rules/): dry runs, and single jobs run on made-up inputs."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import tiny
from actstore.hashing import stage_dir
from actstore.report import PLOTS

REPO = tiny.REPO
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def snakemake(workdir: Path, config: dict, *args: str) -> subprocess.CompletedProcess:
    configfile = tiny.save_config(config, workdir / "config.yaml")
    return subprocess.run([SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--configfile",
                           str(configfile), "--cores", "2", *args], capture_output=True, text=True, timeout=600)


def dry_run(workdir: Path, config: dict, *targets: str) -> str:
    proc = snakemake(workdir, config, "-n", *targets)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    return output


def test_a_run_of_more_than_9999_parts_and_writer_jobs_has_a_rule_for_each(tmp_path, model_dir, text_jsonl):
    """extract.parts and a writer's jobs have no maximum, and part 10000's directory and job 10000's
    record are named with five digits (f"{n:04d}"): a four-digit wildcard constraint left them with no
    rule, and the dry run of a 10,001-part extraction failed with a MissingInputException."""
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"parts": 10001},
                              pickle={"jobs": 10001}, sae={"enabled": False})
    part = stage_dir(config, "extract") / "part-10000"
    job = stage_dir(config, "pickle") / "scatter" / "job-10000"
    output = dry_run(tmp_path, config, str(part), str(job))  # those two jobs only: the DAG of all is slow
    assert re.search(r"^extract_part\s+1$", output, re.M), output[-3000:]
    assert re.search(r"^pickle_machines\s+1$", output, re.M), output[-3000:]
    assert f"output: {part}\n" in output and f"output: {job}\n" in output


# rule -> (stage, its log's name, its inputs and its outputs in the stage dirs: (stage, path)).
FINISHING_JOBS = {
    "extract_index": ("extract", "index", [("extract", "part-0000"), ("extract", "part-0001")],
                      [("extract", "extract.json")]),
    "pickle_merge": ("pickle", "merge", [("pickle", "scatter/job-0000"), ("pickle", "scatter/job-0001")],
                     [("pickle", "metadata.json")]),
    "zarr_manifest": ("zarr", "manifest", [("zarr", "scatter/shards-0000"), ("zarr", "scatter/shards-0001")],
                      [("zarr", "manifest.json")]),
    "validate_plots": ("validate", "validate_plots", [("validate", "report.json"), ("extract", "extract.json")],
                       [("validate", f"plots/{name}.png") for name in PLOTS]),
}


def failing_job(config: dict, rule: str) -> list[str]:
    """`rule`'s one job set to run alone and fail on every attempt: its inputs made up (empty folders, `{}`
    files), so nothing before it runs, and its log's path taken by a folder, where its script's logging
    cannot open a file. Returns its outputs, the targets that run it."""
    stage, log, inputs, outputs = FINISHING_JOBS[rule]
    for in_stage, name in inputs:
        path = stage_dir(config, in_stage) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".json":
            path.write_text("{}")
        else:
            path.mkdir()
    log_dir = Path(config["dump_to"]) / "logs" / stage / stage_dir(config, stage).name / f"{log}.log"
    (log_dir / "taken").mkdir(parents=True)  # not empty: Snakemake removes an empty one before the job
    return [str(stage_dir(config, out_stage) / name) for out_stage, name in outputs]


def test_every_rules_memory_and_time_scale_with_the_attempt():
    """Every rule's mem_mb and runtime are functions of the attempt (the run below shows what Snakemake
    then asks for): extract_index, pickle_merge, zarr_manifest and validate_plots asked for fixed ones."""
    rules = re.findall(r"^rule (\w+):\n((?:(?:    .*)?\n)*)", "".join(
        path.read_text() for path in sorted((REPO / "rules").glob("*.smk"))), re.M)
    with_resources = {name: body for name, body in rules if "    resources:" in body}
    assert {"extract_index", "pickle_merge", "zarr_manifest", "validate_plots"} <= set(with_resources)
    for name, body in with_resources.items():
        for key in ("mem_mb", "runtime"):
            setting = re.search(rf"^        {key}=(.*)$", body, re.M)
            assert setting and "attempt" in setting.group(1), (name, key)


# A failing job upstream of another job's inputs would keep that job from running: these two are apart.
@pytest.mark.parametrize("rules", [("pickle_merge", "zarr_manifest")])
def test_a_finishing_job_run_again_after_a_failure_asks_for_more_memory_and_time(
        tmp_path, model_dir, text_jsonl, rules):
    """profiles/osc retries a failed job once, and every rule scales its memory and runtime by the attempt
    (src/actstore/resources.py), so a job killed for its memory or time is not run again to the same end.
    These finishing jobs asked for a fixed 1000 or 2000 MB on every attempt, pickle_merge and zarr_manifest
    for a fixed 10 minutes, validate_plots for the profile's 30."""
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, sae={"enabled": False})
    targets = [target for rule in rules for target in failing_job(config, rule)]
    proc = snakemake(tmp_path, config, "--retries", "1", "--keep-going", *targets)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rule in rules:
        attempts = re.findall(rf"^(?:local)?rule {rule}:\n(?:    .*\n)*?    resources: (.*)$", output, re.M)
        assert len(attempts) == 2, (rule, output[-4000:])
        first, second = ({key: int(value) for key, value in re.findall(r"\b(mem_mb|runtime)=(\d+)", attempt)}
                         for attempt in attempts)
        assert set(first) == {"mem_mb", "runtime"}, (rule, attempts)
        assert all(second[key] > first[key] for key in first), (rule, attempts)
