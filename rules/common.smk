# Config helpers, stage hashes and path functions. No I/O beyond reading the config and the data, and
# the stamp standing for saev.patch_labels' masks (saev_masks).
import json
import os
from pathlib import Path

from actstore import parse_memo
from actstore import resources as actstore_resources
from actstore.config import enabled_stages, validate_config
from actstore.datasets.scan import cut_from_scan
from actstore.errors import ConfigError
from actstore.hashing import upstream_stages
from actstore.integrity import read_json
from actstore.io_utils import canonical_sha256, write_json_atomic
from actstore.jobs import job_items
from actstore.model_config import (check_layers, check_logits_topk, check_sequence_length, resolve_model_path,
                                   run_config)
from actstore.model_identity import check_model_unchanged
from actstore.patch_labels import check_masks_dataset
from actstore.workflow import parse_dataset

# Cheap parse-time checks, so bad input fails before any job is scheduled. The library's validation
# after Snakemake's: it refuses the numbers Snakemake's passes (2.0 for an integer, .nan, .inf), and
# makes extract.layers' `all` and negative indices block indices: every rule, hash and job sees those.
validate_config(config)
model_config = run_config(config["model"])
check_layers(config["extract"]["layers"], model_config)
MODEL_PATH = resolve_model_path(config["model"]["path"])
check_sequence_length(config["extract"]["max_seq_length"], model_config, MODEL_PATH)
check_logits_topk(config["extract"]["logits_topk"], model_config)
# The dataset checked (path, shards, each table's columns and types; no rows read), every stage's
# hash and the Slurm sizes that follow the data: the data listed and stat'ed once, and only in the
# main process; the jobs it submits parse this file again and take its word for what it read
# (actstore/parse_memo.py, handed over in onstart below).
STAGE_HASHES = parse_dataset(config, main_process=workflow.is_main_process)
if config["saev"].get("patch_labels") and not Path(config["saev"]["patch_labels"]["masks"]).is_dir():
    raise ConfigError(f"saev.patch_labels.masks is not a directory: {config['saev']['patch_labels']['masks']}")
# The main process only: its dataset listing is remembered from parse_dataset; a job's parse lists nothing.
if config["saev"].get("patch_labels") and workflow.is_main_process:
    check_masks_dataset(config["dataset"])

# Every rule's paths are {dump_to}/...: a brace there is a Snakemake wildcard, which stopped the parse
# with a bare WildcardError naming a rule's line, not the key.
if "{" in config["dump_to"] or "}" in config["dump_to"]:
    raise ConfigError(f"dump_to {config['dump_to']!r}: a brace is a wildcard in the Snakemake rules' paths, "
                      f"which are under dump_to; name a folder without braces")
DUMP_TO = Path(config["dump_to"])
N_PARTS = config["extract"]["parts"]
PARTS = [f"{p:04d}" for p in range(N_PARTS)]

# Filled by each rules/<stage>.smk: stage -> the files its target rule builds.
TARGETS = {}


# A part's or a scatter job's number as its file names write it (f"{n:04d}"): four digits, and five or
# more from 10000 on (extract.parts and the writers' jobs go up to 100,000); never another zero-padding.
# (Not `\d{4,}`: Snakemake's wildcard pattern does not parse `{4,}` inside a constraint.)
wildcard_constraints:
    part=r"\d{4}|[1-9]\d{4}\d*",
    job=r"\d{4}|[1-9]\d{4}\d*",


onstart:
    parse_memo.hand_over(DUMP_TO / "logs" / "parse")


onsuccess:
    parse_memo.withdraw()


onerror:
    parse_memo.withdraw()


def sdir(stage):
    """{dump_to}/{stage}/{hash} as a string for rule inputs/outputs."""
    return str(DUMP_TO / stage / STAGE_HASHES[stage])


def log_path(stage, name):
    return str(DUMP_TO / "logs" / stage / STAGE_HASHES[stage] / f"{name}.log")


def bench_path(stage, name):
    return str(DUMP_TO / "benchmarks" / stage / STAGE_HASHES[stage] / f"{name}.tsv")


def job_name(prefix, jobs):
    """A scatter job's log and benchmark name, `<prefix>-{job}-of-<jobs>`. Snakemake takes a job's
    benchmark file for one of its outputs: a run whose job count changed would otherwise find job
    0's benchmark from a layout that covered fewer parts, older than its new parts, and redo a
    finished stage (the job count is an execution key, never a reason to rewrite)."""
    return f"{prefix}-{{job}}-of-{jobs:04d}"


def all_targets(wildcards):
    return [target for stage in enabled_stages(config) for target in TARGETS.get(stage, [])]


def job_parts(jobs, wildcards):
    """The extraction parts that job {job} of `jobs` writes (pickle machines, zarr shard stores), a
    contiguous range; none when there are more jobs than parts."""
    return job_items(N_PARTS, jobs, int(wildcards.job))


def job_part_dirs(jobs, wildcards):
    """The extraction part directories job {job} of `jobs` reads."""
    return [f"{EXTRACT_DIR}/part-{PARTS[p]}" for p in job_parts(jobs, wildcards)]


def part_scan(wildcards):
    """A part's scan, ancient() for a finished part written before it and cut from the same data
    (datasets.scan.cut_from_scan): the scan was lost (a temp file up to 2026-11-27) and scanned again to
    redo another part, and its mtime alone would redo this one (a GPU job). Not while the scan is forced
    (`--forcerun extract_scan` redoes every part: ancient would stop it here), nor for a part written
    after the scan (the usual case: its mtime redoes nothing, and the forcerun reaches it)."""
    scan, part_json = Path(rules.extract_scan.output[0]), Path(EXTRACT_DIR, f"part-{wildcards.part}", "part.json")
    if not (part_json.is_file() and scan.is_file()) or part_json.stat().st_mtime_ns > scan.stat().st_mtime_ns \
            or scan_forced(scan):
        return str(scan)
    return ancient(str(scan)) if cut_from_scan(part_json.parent, scan, config["extract"]["parts"]) else str(scan)


def scan_forced(scan):
    """Whether this run forces the scan job: --forceall, or --forcerun (-R) naming rule extract_scan or its file."""
    forced = {item if item == "extract_scan" else os.path.abspath(item) for item in workflow.dag_settings.forcerun}
    return workflow.dag_settings.forceall or not forced.isdisjoint({"extract_scan", os.path.abspath(scan)})


def saev_masks(wildcards):
    """What stands for the segmentation masks behind labels.bin, when saev.patch_labels is set: a file
    of their listing's digest (each mask's path, size and mtime), written again only when that changed.
    The folder as the input redid nothing for a mask saved over in place, or for any in a class
    subfolder (masks mirror dataset.path): its own mtime moves only when a file directly in it is added,
    removed or renamed. Not each mask an input: Snakemake took ~0.5 ms a file at every parse (a minute
    for 100,000 masks), where a stat each takes a second."""
    labels = config["saev"].get("patch_labels")
    if not labels:
        return []
    stamp = DUMP_TO / "logs" / "saev" / STAGE_HASHES["saev"] / "masks.json"
    masks = [path for path in Path(labels["masks"]).rglob(f"*{labels['mask_suffix']}") if path.is_file()]
    stats = {path.relative_to(labels["masks"]).as_posix(): path.stat() for path in masks}
    listing = {"masks": labels["masks"], "files": len(stats),
               "sha256": canonical_sha256(sorted([name, st.st_size, st.st_mtime_ns] for name, st in stats.items()))}
    if stamp.is_file() and read_json(stamp) == listing:
        return [str(stamp)]
    first = not stamp.exists()
    write_json_atomic(stamp, listing)
    if first:  # dated as its newest mask: a run finished before the stamp existed is not redone for it
        newest = max((st.st_mtime_ns for st in stats.values()), default=0)
        os.utime(stamp, ns=(newest, newest))
    return [str(stamp)]


def validate_inputs(wildcards):
    """Every enabled stage's target files: the stores validation reads."""
    return [target for stage in upstream_stages(config, "validate") for target in TARGETS.get(stage, [])]


def validated_store_inputs(wildcards):
    """The extraction's and one store's targets, the inputs of a validate_store job, which waits on no other stage."""
    return TARGETS["extract"] + TARGETS[wildcards.store]


def validate_shares(wildcards):
    """{store: its share jobs' count} of every validated store (VALIDATED_STORES, in order)."""
    return {name: actstore_resources.validate_jobs(config, name) for name in VALIDATED_STORES}


def validate_store_files(wildcards):
    """The files every validated store's share jobs leave, store by store, in share order."""
    return [f"{VALIDATE_SCATTER}/{name}.{share}.npz"
            for name, jobs in validate_shares(wildcards).items() for share in range(jobs)]


def validate_extract_files(wildcards):
    """The files the extraction's share jobs leave, in share order."""
    jobs = actstore_resources.validate_jobs(config, "extract")
    return [f"{VALIDATE_SCATTER}/extract.{share}.npz" for share in range(jobs)]
