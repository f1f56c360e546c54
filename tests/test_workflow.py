"""The Snakemake workflow on small configs: failures at the parse or the scan, jobs over ranges of parts,
image folders with metadata, dry runs of the DAG, and what the parse and writer jobs import. (The demo
config's run is test_workflow_demo.py's.)"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import tiny
from actstore.hashing import stage_dir

REPO = tiny.REPO
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def demo_config(dump_to: Path) -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["dump_to"] = str(dump_to)
    config["dataset"]["path"] = str(REPO / config["dataset"]["path"])
    return config


def snakemake(workdir: Path, configfile: Path, *args: str, timeout: int = 900, env: dict | None = None) -> str:
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--configfile", str(configfile),
           "--cores", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def scheduled(workdir: Path, configfile: Path) -> dict[str, int]:
    """Jobs a dry run would execute, rule -> count ({} when there is nothing to do)."""
    return job_counts(snakemake(workdir, configfile, "-n"))


def job_counts(output: str) -> dict[str, int]:
    """A dry run's jobs, rule -> count, from its output."""
    if "Nothing to be done" in output:
        return {}
    table = output.split("Job stats:")[1].split("Reasons:")[0]
    jobs = dict((m.group(1), int(m.group(2))) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M))
    jobs.pop("total", None)
    return jobs


def write(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_bad_line_fails_the_scan_before_any_part_job_starts(tmp_path):
    """A bad line deep in a JSONL shard is found by the one scan job, which scans the shards at
    once on its threads, and whose log names it; no part's job (a GPU each on a cluster) starts."""
    config = demo_config(tmp_path / "dump")
    good = Path(config["dataset"]["path"]).read_text().splitlines()
    config["dataset"]["path"] = str(tmp_path / "docs")
    (tmp_path / "docs").mkdir()
    for name, lines in (("a", good[:20]), ("b", [*good[20:40], '{"text": "ok", "label": ["a"]}']), ("c", good[40:])):
        (tmp_path / "docs" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
           str(write(config, tmp_path / "bad.yaml")), "--cores", "2", "extract"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "Error in rule extract_scan" in proc.stdout + proc.stderr
    log = next((tmp_path / "dump" / "logs" / "extract").glob("*/scan.log")).read_text()
    assert "scan dataset (2 processes)" in log  # three shards, on the two cores Snakemake gives the rule
    assert "b.jsonl:21: field 'label' is a JSON list" in log
    assert not list((tmp_path / "dump").glob("extract/*/part-*")) and not list((tmp_path / "dump").glob("logs/extract/*/part-*"))


# What rules/common.smk's parse learns of the data, handed over as the main process's onstart does.
MAIN_PARSE = """
import json, sys
from actstore import parse_memo, workflow
workflow.parse_dataset(json.loads(sys.argv[1]), main_process=True)
print(parse_memo.hand_over(sys.argv[2]))
"""


def test_a_job_takes_the_main_processs_hashes_and_its_scan_refuses_data_changed_since(model_dir, tmp_path):
    """A cluster job parses the Snakefile again and takes what the main process's parse learnt of the
    data from the file its environment names (actstore/parse_memo.py); here the job runs as Slurm's
    jobstep runs it. Data touched after the main process read it would be extracted under the old
    data's hash: the scan job refuses it. Handed the data as it is, the same job scans it."""
    data = tiny.write_jsonl(tmp_path / "docs.jsonl", 12)
    config = tiny.make_config(tmp_path, model_dir("bert"), data, dataset={"identity": "stat"})
    job = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
           str(write(config, tmp_path / "job.yaml")), "--cores", "1", "--target-jobs", "extract_scan:",
           "--allowed-rules", "extract_scan", "--force", "--nolock", "--no-hooks", "--mode", "subprocess"]

    def main_parse() -> str:
        return subprocess.run([sys.executable, "-c", MAIN_PARSE, json.dumps(config), str(tmp_path / "handed")],
                              capture_output=True, text=True, check=True).stdout.strip()

    def job_run(handed: str) -> subprocess.CompletedProcess:
        return subprocess.run(job, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "ACTSTORE_PARSE_MEMO": handed})

    handed = main_parse()
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    refused = job_run(handed)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and f"the dataset as the main process read it: {handed}" in output
    scan_log = next((tmp_path / "dump" / "logs" / "extract").glob("*/scan.log"))
    assert "the data changed after Snakemake read it" in scan_log.read_text()
    assert scan_log.parent.name != stage_dir(config, "extract").name  # named by the main process's hash
    assert not list((tmp_path / "dump").glob("extract/*/dataset_scan.json"))

    scanned = job_run(main_parse())  # the main process read the data as it is now
    assert scanned.returncode == 0, (scanned.stdout + scanned.stderr)[-4000:]
    assert (stage_dir(config, "extract") / "dataset_scan.json").is_file()


@pytest.mark.slow
def test_an_image_folders_metadata_file_labels_its_images_through_the_workflow(model_dir, image_folder, tmp_path):
    """Hugging Face's imagefolder layout through Snakemake: the scan job checks metadata.csv against
    every image, the part jobs read their images' rows, and lmprobe's index carries each image's
    label from dataset.label_field and its kept field as a column, in sample order."""
    import shutil

    import pyarrow.parquet as pq

    from actstore.formats import lmprobe

    photos = shutil.copytree(image_folder, tmp_path / "photos")
    names = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.png"))
    kinds = ["striped" if i % 3 == 0 else "plain" for i in range(len(names))]
    rows = [f"{name},{kind},photo {i}" for i, (name, kind) in enumerate(zip(names, kinds))]
    (photos / "metadata.csv").write_text("file_name,kind,caption\n" + "\n".join(reversed(rows)) + "\n")
    config = tiny.make_config(tmp_path, model_dir("dinov2"), photos, sae={"enabled": False},
                              dataset={"label_field": "kind", "keep_fields": ["caption"]})
    snakemake(tmp_path, write(config, tmp_path / "described.yaml"), "lmprobe")
    index = pq.read_table(lmprobe.find_index(stage_dir(config, "lmprobe") / "dataset")).to_pylist()
    by_sample = sorted(index, key=lambda row: row["sample_idx"])
    assert [(r["label"], r["caption"]) for r in by_sample] == [(kind, f"photo {i}") for i, kind in enumerate(kinds)]


def test_misspelled_key_fails_at_parse_time_naming_it(tmp_path):
    config = demo_config(tmp_path / "dump")
    config["extract"]["layerz"] = [1]
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
           str(write(config, tmp_path / "bad.yaml")), "-n"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "layerz" in proc.stdout + proc.stderr


@pytest.mark.parametrize("section, key, value, message", [
    ("pickle", "shard_size_mb", float("nan"), "invalid config at pickle/shard_size_mb: nan is not a finite number"),
    ("extract", "parts", 2.0, "invalid config at extract/parts: 2.0 is not of type 'integer'")])
def test_a_number_snakemakes_validation_passes_fails_at_parse_time_naming_it(tmp_path, section, key, value, message):
    """Snakemake's validation passes YAML's .nan (a job would record it in a stage config that is not
    JSON) and 2.0 for an integer (the parse then died in range(2.0)): the library's validation refuses them."""
    config = demo_config(tmp_path / "dump")
    config.setdefault(section, {})[key] = value
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
           str(write(config, tmp_path / "bad.yaml")), "-n"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_a_mask_folder_that_is_not_there_fails_at_parse_time_as_a_config_error(tmp_path):
    config = demo_config(tmp_path / "dump")
    config["saev"] = {"patch_labels": {"masks": str(tmp_path / "no-masks")}}
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
           str(write(config, tmp_path / "bad.yaml")), "-n"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ConfigError in file" in proc.stdout + proc.stderr
    assert f"saev.patch_labels.masks is not a directory: {tmp_path / 'no-masks'}" in proc.stdout + proc.stderr


def test_layer_out_of_range_fails_at_parse_time(tmp_path):
    config = demo_config(tmp_path / "dump")
    config["extract"]["layers"] = [1, 6]
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
           str(write(config, tmp_path / "bad.yaml")), "-n"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "[6] out of range" in proc.stdout + proc.stderr


@pytest.mark.parametrize("section", ["saev", "lmprobe"])
def test_a_formats_layer_not_extracted_fails_at_parse_time(tmp_path, section):
    """saev's jobs found it only after the extraction ran (lmprobe's was checked at parse time)."""
    config = demo_config(tmp_path / "dump")
    config["extract"]["layers"] = [0, 2]
    config[section] = {"layers": [1]}
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
           str(write(config, tmp_path / "bad.yaml")), "-n"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"{section}.layers: [1] not extracted" in proc.stdout + proc.stderr


def test_all_layers_are_resolved_at_parse_time_for_every_rule(tmp_path):
    """extract.layers: all becomes the model's blocks before any rule or hash sees it: the dry run
    plans the extraction directory of the explicit list."""
    from actstore.config import validate_config
    from actstore.hashing import stage_hash

    config = demo_config(tmp_path / "dump")
    config["extract"]["layers"] = "all"
    output = snakemake(tmp_path, write(config, tmp_path / "all.yaml"), "-n")
    explicit = copy.deepcopy(config)
    explicit["extract"]["layers"] = [0, 1, 2, 3, 4, 5]
    planned = set(re.findall(r"dump/extract/([0-9a-f]{64})/", output))
    assert planned == {stage_hash(validate_config(explicit), "extract")}


def test_snakemake_lint_is_clean(tmp_path):
    """`snakemake --lint` (the snakemake-workflows catalogue's bar) finds nothing to complain about."""
    configfile = write(demo_config(tmp_path / "dump"), tmp_path / "demo.yaml")
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(REPO), "--configfile", str(configfile), "--lint"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "good condition" in proc.stdout + proc.stderr


def test_zarr_merge_is_scattered_over_merge_jobs_in_the_dry_run(tmp_path):
    """zarr.merged: zarr.merge_jobs chunk-copy jobs (here more than the parts), then one finishing job.
    Every job of the whole workflow, each stage's finishing one too (extract_index over thousands of
    parts, pickle_merge, zarr_manifest, validate_plots wrote none before 2026-11-28), records its wall
    time and peak memory under {dump_to}/benchmarks/, what a cluster user sizes the next run from."""
    config = demo_config(tmp_path / "dump")
    config["zarr"] = {"merged": True, "merge_jobs": 3}
    output = snakemake(tmp_path, write(config, tmp_path / "merged.yaml"), "-n")
    jobs = job_counts(output)
    assert jobs["zarr_shards"] == config["extract"]["parts"] == 2
    assert jobs["zarr_merge_chunks"] == 3 and jobs["zarr_merge"] == 1 and jobs["zarr_manifest"] == 1
    blocks = re.findall(r"^rule (\w+):\n((?:    .*\n)*)", output, re.M)
    ran = {name for name, body in blocks if "    output: " in body}
    assert {"extract_index", "pickle_merge", "zarr_manifest", "validate_plots", "build_lut"} <= ran
    assert {name for name in ran if not any("    benchmark: " in body for n, body in blocks if n == name)} == set()


def test_many_parts_are_written_by_at_most_64_jobs_per_format_in_the_dry_run(tmp_path):
    """The DAG grows by one job per part (its extraction), not four: every format's writers default to
    one job per part up to 64, each taking a contiguous range (a 4,096-part run: 4,362 jobs)."""
    config = demo_config(tmp_path / "dump")
    config["extract"]["parts"] = 200
    config["zarr"] = {"merged": True}
    jobs = scheduled(tmp_path, write(config, tmp_path / "parts200.yaml"))
    assert jobs["extract_part"] == 200
    for rule in ("pickle_machines", "zarr_shards", "zarr_merge_chunks", "saev_shards", "lmprobe_tensors"):
        assert jobs[rule] == 64, (rule, jobs)


@pytest.mark.slow
def test_pickle_and_zarr_jobs_each_write_a_range_of_parts_byte_identical_to_a_job_per_part(
        tmp_path, model_dir, text_jsonl):
    """pickle.jobs / zarr.jobs group the parts (2 jobs over 3 parts, the merge split 3 ways) and write
    the same bytes as a job per part, from the same extraction, with every store in its place."""
    def config(dump: str, **jobs: int) -> dict:
        return {"dump_to": str(tmp_path / dump), "model": {"path": str(model_dir("bert"))},
                "dataset": {"path": str(text_jsonl)},
                "extract": {"layers": [0, 1], "max_seq_length": 16, "batch_size": 8, "parts": 3},
                "pickle": {"jobs": jobs["pickle"], "shard_size_mb": 0.01},
                "zarr": {"jobs": jobs["zarr"], "merged": True, "merge_jobs": 3}}

    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000"}
    per_part = write(config("per_part", pickle=3, zarr=3), tmp_path / "per_part.yaml")
    grouped = write(config("grouped", pickle=2, zarr=2), tmp_path / "grouped.yaml")
    for configfile in (per_part, grouped):
        if configfile is grouped:  # the same extraction (its timings are part of the pickle metadata)
            shutil.copytree(tmp_path / "per_part" / "extract", tmp_path / "grouped" / "extract", symlinks=True)
        output = snakemake(tmp_path, configfile, "pickle", "zarr", timeout=600, env=env)
        ran = dict(re.findall(r"^(\w+)\s+(\d+)$", output.split("Job stats:")[1], re.M))
        n = "2" if configfile is grouped else "3"
        assert ran["pickle_machines"] == ran["zarr_shards"] == n and ran["zarr_merge_chunks"] == "3", ran
    for stage in ("pickle", "zarr"):
        a, b = tmp_path / "per_part" / stage, tmp_path / "grouped" / stage
        files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
        assert {f.name for f in files} >= {"metadata.json" if stage == "pickle" else "manifest.json"}
        assert not any("scatter" in f.parts for f in files), files
        # Snakemake marks its directory() outputs: no store is one (the merged store is declared by its .zmetadata)
        assert not any(f.name == ".snakemake_timestamp" for f in files), files
        for rel in files:
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), f"{stage}/{rel}"
    for part in range(3):
        assert next((tmp_path / "grouped" / "pickle").glob(f"*/machine-{part:04d}/metadata.json"))
        assert next((tmp_path / "grouped" / "zarr").glob(f"*/shards/shard-{part:04d}.zarr/.zattrs"))


# The rules that run no model: their scripts' imports must not pull in torch. (extract_scan builds the
# model's skeleton when extract.hooks names modules, to check them before any part's GPU job.)
NO_MODEL_SCRIPTS = ["saev", "saev_shards", "pickle_machines", "pickle_merge", "lmprobe", "lmprobe_tensors",
                    "zarr_shards", "zarr_merge_chunks", "zarr_merge", "zarr_manifest"]


def test_the_workflow_parse_never_imports_torch(tmp_path):
    """torch costs a process ~4 s and ~150 MB: the Snakefile's parse (run again by every Slurm job) reads
    configs and files only. Its imports are what a dry run of the demo config loaded (the safetensors
    library's safe_open, which listed the checkpoint's tensors until review 68, imported torch)."""
    configfile = write(demo_config(tmp_path / "dump"), tmp_path / "demo.yaml")
    cmd = [sys.executable, "-X", "importtime", SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path),
           "--configfile", str(configfile), "-n"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "actstore.resources" in imported and not imported & {"torch", "transformers"}


@pytest.mark.parametrize("what", NO_MODEL_SCRIPTS)
def test_the_writer_jobs_never_import_torch(what):
    """The writer jobs import only what reads configs and files."""
    sources = [REPO / "workflow" / "scripts" / f"{what}.py"]
    modules = sorted({m for src in sources for m in re.findall(r"^\s*from (actstore[\w.]*) import", src.read_text(), re.M)})
    assert modules, what
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "[]", (modules, run.stdout, run.stderr[-2000:])


def test_the_float16_and_bfloat16_writers_run_without_torch(tmp_path):
    """The imports above are only half of it: zarr's and lmprobe's float16 / bfloat16 casts once
    imported torch when they ran (actstore.casts does them now). Run those writers and look."""
    code = f"""
import sys
from pathlib import Path
from actstore.formats import lmprobe, zarr
from actstore.formats.extract import part_dirname, synthetic_extraction
root = Path({str(tmp_path)!r})
extract = synthetic_extraction(root / "extract", 2_000_000, parts=1, dim=64, layers=[0, 1], tokens=(8, 32))
zarr.write_shard(extract / part_dirname(0), root / "shard.zarr", progress=False)
for dtype in ("float16", "bfloat16"):
    lmprobe.write_dataset(extract, root / dtype, {{"token_strings": False, "dtype": dtype}}, progress=False)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "[]", (run.stdout, run.stderr[-2000:])
