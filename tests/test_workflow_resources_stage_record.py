"""Review 56 of the workflow glue: Slurm sizes that follow the config (resources) and the stage
config a rule's script records (workflow.record_stage)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiny


def test_a_dataset_limit_sizes_the_text_of_the_rows_it_keeps(model_dir, tmp_path):
    """dataset.limit kept the rows' count but not their text: a part was sized to hold the whole
    corpus's text (twice), so `limit: 1000` on a 100 GB JSONL asked Slurm for 200 GB."""
    from actstore import resources

    data = tiny.write_jsonl(tmp_path / "docs.jsonl", 30)
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines * 40))  # 1,200 rows
    full = resources.workload(tiny.make_config(tmp_path, model_dir("gpt2"), data))
    limited = tiny.make_config(tmp_path, model_dir("gpt2"), data, dataset={"limit": 30})
    kept = resources.workload(limited)
    assert kept.rows == 30
    assert abs(kept.text_bytes / kept.rows - full.text_bytes / full.rows) < 0.01 * full.text_bytes / full.rows
    assert resources.dataset_bytes(limited) < 2 * len("".join(lines)) + 30 * resources.PYTHON_ROW_BYTES


def bfloat16_checkpoint(model_dir, out: Path) -> Path:
    """The tiny Llama saved in bfloat16 (config.json says so), as most checkpoints on the Hub are."""
    import transformers

    source = model_dir("llama")
    transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(out)
    for tokenizer_file in source.glob("tokenizer*"):
        shutil.copy(tokenizer_file, out / tokenizer_file.name)
    return out


def test_extraction_memory_holds_a_16bit_checkpoint_run_in_float32(model_dir, tmp_path):
    """model.torch_dtype float32 (the default) loads a bfloat16 checkpoint on the host at twice its
    files' bytes before it moves to the GPU; the estimate took the files' bytes, so a 7B bfloat16
    model's extraction job (29 GB of float32 weights) asked for 25 GB and was killed."""
    from actstore import resources
    from actstore.model_config import run_dtype
    from actstore.models import load_model, weight_bytes

    checkpoint = bfloat16_checkpoint(model_dir, tmp_path / "bf16")
    data = tiny.write_jsonl(tmp_path / "docs.jsonl", 30)
    for dtype in ("float32", "bfloat16", "auto"):
        config = tiny.make_config(tmp_path, checkpoint, data, model={"torch_dtype": dtype})
        loaded = weight_bytes(load_model(checkpoint, run_dtype(config["model"]), "cpu").model)
        assert resources.workload(config).host_weight_bytes >= loaded, dtype


def test_a_finished_stage_records_the_hashes_that_named_its_directory(model_dir, tmp_path):
    """A stage finished after the data was touched (same bytes, a new mtime: identity stat) recorded
    the config of another stage directory, hashed from the data as it then was: `actstore verify`
    refused the store it was named for. The main process's parse and the rule's script run apart,
    as under Snakemake, the script inheriting the file the main process handed over."""
    data = tiny.write_jsonl(tmp_path / "docs.jsonl", 30)
    config = tiny.make_config(tmp_path, model_dir("gpt2"), data, dataset={"text_field": "text"})
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(config))
    main = f"""import json
from actstore import parse_memo
from actstore.workflow import parse_dataset
hashes = parse_dataset(json.load(open({str(config_file)!r})), main_process=True)
print(json.dumps([str(parse_memo.hand_over({str(tmp_path / 'parse')!r})), hashes['pickle']]))"""
    handed, pickle_hash = json.loads(run_python(main, os.environ).splitlines()[-1])
    stage = Path(config["dump_to"]) / "pickle" / pickle_hash
    stage.mkdir(parents=True)
    os.utime(data, ns=(0, data.stat().st_mtime_ns + 10**9))
    script = f"""import json
from actstore.hashing import stage_problems
from actstore.workflow import record_stage
record_stage(json.load(open({str(config_file)!r})), "pickle", {str(stage)!r})
print(json.dumps(stage_problems({str(stage)!r})))"""
    from actstore.parse_memo import ENV
    assert json.loads(run_python(script, {**os.environ, ENV: handed}).splitlines()[-1]) == []


def run_python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_zarr_merge_job_taking_more_parts_than_its_share_is_sized_for_the_part_it_holds(extracted, tmp_path):
    """A chunk-link job holds the files.json entries of the part it is linking (the others' stream
    into its job record); with parts not a multiple of zarr.merge_jobs job 0 takes two parts, and is
    sized for the larger of them whatever it takes (tests/test_scale.py measures the memory)."""
    from actstore import resources
    from actstore.formats.zarr import ACTS, link_chunks, write_shard
    from actstore.jobs import job_items, write_jobs

    config, extract_dir = extracted("gpt2", extract={"parts": 3}, zarr={"merged": True, "merge_jobs": 2, "t_chunk": 4})
    shards = [tmp_path / f"shard-{part}.zarr" for part in range(3)]
    for part, shard in enumerate(shards):
        write_shard(extract_dir / f"part-{part:04d}", shard, 4)
    held = [sum(path.is_file() and not path.name.startswith(".") for path in (shard / ACTS).rglob("*"))
            for shard in shards]  # its chunk files' entries
    jobs = write_jobs(config, "zarr", "merge_jobs")
    taken = [shards[part] for part in job_items(3, jobs, 0)]
    assert len(taken) == 2 and link_chunks(taken, tmp_path / "merge-0", jobs, 0, progress=False) > max(held)
    assert max(held) * resources.FILES_JSON_ENTRY_BYTES <= resources.writer_buffer_bytes(
        resources.workload(config), config, "zarr_merge_chunks")


def test_a_writer_job_taking_two_parts_asks_for_two_parts_time_whatever_the_job_count(tmp_path):
    """4 parts in 3 pickle / zarr jobs: job 0 takes 2 parts, and asked for a third of the whole (1.5
    parts' time), where 2 jobs of 2 parts each asked for 2 parts' time; Slurm killed it at its limit."""
    import re

    import yaml
    from test_workflow import demo_config, snakemake

    def runtimes(jobs: int) -> dict[str, int]:
        config = demo_config(tmp_path / f"r{jobs}")
        config["extract"].update(parts=4, max_seq_length=512)
        config["pickle"], config["zarr"] = {"jobs": jobs}, {"jobs": jobs}
        (tmp_path / f"c{jobs}.yaml").write_text(yaml.safe_dump(config))
        output = snakemake(tmp_path, tmp_path / f"c{jobs}.yaml", "-n", "pickle", "zarr")
        jobs_run = {}  # rule of job 0000 -> its runtime, from each job's block of the dry run
        for block in output.split("\nrule ")[1:]:
            rule, wildcards, runtime = (re.search(pattern, block) for pattern in (
                r"^(\w+):", r"wildcards: job=(\d+)", r"resources: .*runtime=(\d+)"))
            if rule[1] in ("pickle_machines", "zarr_shards") and wildcards[1] == "0000":
                jobs_run[rule[1]] = int(runtime[1])
        return jobs_run

    three, two = runtimes(3), runtimes(2)
    assert set(three) == {"pickle_machines", "zarr_shards"}
    assert three == two


@pytest.mark.parametrize("shard_size_mb", [100, 500, 2000])
def test_the_validate_job_holds_a_pickle_shard_within_its_memory_budget(shard_size_mb):
    """A file's claims may take a quarter of a job's memory (integrity.memory_budget, from its cgroup's
    limit under Slurm): the validate job, a fixed 4,000 MB, refused a 2,000 MB shard as too large."""
    import yaml

    from actstore.config import validate_config
    from actstore.resources import validate_mem_mb

    config = validate_config(yaml.safe_load((tiny.REPO / "config" / "config.yaml").read_text()))
    config["pickle"]["shard_size_mb"] = shard_size_mb
    assert validate_mem_mb(config) / 4 >= shard_size_mb * 1.1
    assert validate_mem_mb(config) >= 4000


@pytest.mark.parametrize("section", ["model", "dataset"])
def test_an_empty_path_is_refused_naming_its_key(section, tmp_path):
    """model.path or dataset.path "" passed the schema and resolved to the working directory: its
    files were read as the dataset, and failed far away naming them."""
    import yaml

    from actstore.config import load_config
    from actstore.errors import ConfigError

    config = yaml.safe_load((tiny.REPO / "config" / "config.yaml").read_text())
    config[section]["path"] = ""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=rf"{section}/path"):
        load_config(tmp_path / "c.yaml")
