"""Review 65, journey H: a researcher iterating on one config over weeks. Found: data edited under the
demo's style of config (its hash names the data by its path alone) kept its old activations; now
refused at parse time (datasets.check_extraction_data_unchanged), while a copied dump_to still runs
nothing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import tiny

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def user_config(tmp: Path, model: Path, data: Path) -> dict:
    """A config as the demo's is written: dataset by path and name only (no dataset.identity)."""
    return {"dump_to": str(tmp / "results"), "model": {"path": str(model)},
            "dataset": {"path": str(data), "name": "mytexts"},
            "extract": {"layers": [0, 2], "max_seq_length": 24, "batch_size": 4, "parts": 1},
            **{stage: {"enabled": False} for stage in ("saev", "pickle", "lmprobe", "zarr", "validate")}}


def snakemake(workdir: Path, config: dict, *args: str) -> subprocess.CompletedProcess:
    configfile = workdir / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    return subprocess.run([SNAKEMAKE, "-s", str(tiny.REPO / "Snakefile"), "-d", str(workdir), "--configfile",
                           str(configfile), "--cores", "2", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def finished_extraction(tmp_path_factory, model_dir):
    """(workdir, config, data file) after `snakemake extract` on 12 rows of JSON lines."""
    tmp = tmp_path_factory.mktemp("journey")
    data = tiny.write_jsonl(tmp / "texts.jsonl", 12)
    config = user_config(tmp, model_dir("bert"), data)
    proc = snakemake(tmp, config, "extract")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return tmp, config, data


@pytest.mark.slow
def test_a_dump_to_copied_with_cp_a_runs_nothing(finished_extraction):
    workdir, config, _ = finished_extraction
    subprocess.run(["cp", "-a", config["dump_to"], str(workdir / "copied")], check=True)
    proc = snakemake(workdir, {**config, "dump_to": str(workdir / "copied")}, "-n", "extract")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Nothing to be done" in output, output[-3000:]


def test_rows_appended_to_the_data_of_a_demo_style_config_are_not_silently_ignored(finished_extraction):
    workdir, config, data = finished_extraction
    scanned, stat = data.read_bytes(), data.stat()
    rows = scanned.decode().splitlines(keepends=True)
    data.write_text("".join(rows + rows[:3]))  # the user adds three rows
    try:
        proc = snakemake(workdir, config, "-n", "extract")
    finally:
        data.write_bytes(scanned)  # the module's other tests run on the data the extraction scanned
        os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert f"{data}: changed since the dataset was scanned (size {len(scanned)} -> " in output, output[-3000:]
    assert "dataset.identity: stat" in output, output[-3000:]
