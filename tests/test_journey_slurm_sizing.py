"""Review 64, journey D (planning a 10B-token run of a 7B model on OSC): Slurm sizing faults found
while reading a dry run's resources, each checked fixed here."""
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tiny
from actstore import resources
from test_workflow_slurm_requests import sparse_jsonl

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def test_a_folder_holding_both_weight_copies_is_sized_at_the_copy_loaded(model_dir, tmp_path, text_jsonl):
    folder = tmp_path / "llama"
    shutil.copytree(model_dir("llama"), folder)
    loaded = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert loaded > 0
    with open(folder / "pytorch_model.bin", "wb") as fh:  # the same weights, torch's format: never read
        fh.truncate(loaded)
    config = tiny.make_config(tmp_path, folder, text_jsonl)
    assert resources.workload(config).weight_bytes == loaded


def test_a_retry_of_a_job_sized_at_the_cap_asks_more_time(model_dir, tmp_path, text_jsonl, monkeypatch):
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl)
    # A 7B-class part: 10B tokens of 4 layers of 4,096 float32 values over 64 parts (docs/scale.md).
    seven_b = dataclasses.replace(resources.workload(config), tokens=10**10, d=4096, n_tensors=4,
                                  weight_bytes=27 * 10**9, itemsize=4, rows=3 * 10**7)
    monkeypatch.setattr(resources, "workload", lambda config: seven_b)
    config["extract"]["parts"] = 64
    first = resources.extract_part_runtime(config, attempt=1)
    assert first == resources.MAX_RUNTIME_MIN  # the estimate (~7 days) is cut to the cap
    assert resources.extract_part_runtime(config, attempt=2) > first


def dry_run_runtime(tmp_path: Path, config: dict, rule: str, target: str = "zarr") -> int:
    """The runtime (minutes) a local `snakemake <target> -n` of `config` gives `rule`'s jobs (each of
    them asks the same)."""
    configfile = tiny.save_config(config, tmp_path / f"parts-{config['extract']['parts']}.yaml")
    proc = subprocess.run([SNAKEMAKE, target, "-n", "--configfile", str(configfile)], cwd=tiny.REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    [runtime] = set(re.findall(rf"^rule {rule}:\n(?:    .*\n)*?    resources: .*\bruntime=(\d+)", proc.stdout, re.M))
    return int(runtime)


def test_the_zarr_merge_finisher_is_not_given_less_time_for_the_same_data_over_more_parts(model_dir, tmp_path):
    data = sparse_jsonl(tmp_path / "big.jsonl", 20 * 10**9)
    minutes = [dry_run_runtime(tmp_path, tiny.make_config(
        tmp_path, model_dir("gpt2"), data, extract={"parts": parts, "max_seq_length": 64},
        zarr={"merged": True}), "zarr_merge") for parts in (4, 400)]
    assert minutes[0] > 10 * resources.STARTUP_MIN  # the sizing sees a large run
    assert minutes[1] >= minutes[0]
