# Zarr activation logger: one shard store per extraction part (the spec's parallel writers), an
# optional merged store (zarr.merged: zarr.merge_jobs chunk-copy jobs over consecutive shards, then
# one finishing job), then manifest.json, written last, marks the run complete.
from actstore import resources as actstore_resources
from actstore.jobs import job_items, write_jobs

ZARR_DIR = sdir("zarr")
ZARR_SHARDS = expand(f"{ZARR_DIR}/shards/shard-{{part}}.zarr", part=PARTS)
ZARR_MERGED = [f"{ZARR_DIR}/merged"] if config["zarr"]["merged"] else []
ZARR_MERGE_JOBS = [f"{job:04d}" for job in range(write_jobs(config, "zarr"))]
# The most parts one chunk-copy job takes: its runtime is that many parts' bytes copied once.
ZARR_PARTS_PER_MERGE_JOB = -(-N_PARTS // len(ZARR_MERGE_JOBS))


rule zarr_part:
    input:
        f"{EXTRACT_DIR}/part-{{part}}",
    output:
        directory(f"{ZARR_DIR}/shards/shard-{{part}}.zarr"),
    params:
        t_chunk=config["zarr"]["t_chunk"],
    log:
        log_path("zarr", "shard-{part}"),
    benchmark:
        bench_path("zarr", "shard-{part}")
    wildcard_constraints:
        part=r"\d{4}",
    threads: 1
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "zarr_part", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(config, attempt, jobs=N_PARTS, passes=2.0),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/zarr_part.py"


# Job {job} copies the chunks of its consecutive shards (none when there are more jobs than parts).
rule zarr_merge_chunks:
    input:
        lambda wildcards: [ZARR_SHARDS[p] for p in job_items(N_PARTS, len(ZARR_MERGE_JOBS), int(wildcards.job))],
    output:
        temp(directory(f"{ZARR_DIR}/scatter/merge-{{job}}")),
    params:
        jobs=len(ZARR_MERGE_JOBS),
    log:
        log_path("zarr", "merge-{job}"),
    benchmark:
        bench_path("zarr", "merge-{job}")
    wildcard_constraints:
        job=r"\d{4}",
    threads: 1
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "zarr_merge_chunks", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(
            config, attempt, jobs=N_PARTS, passes=float(ZARR_PARTS_PER_MERGE_JOB)),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/zarr_merge_chunks.py"


# Moves the copied chunk directories into place by rename and writes the small files: it reads the
# shards' metadata, 1-D arrays and prompts, never their activations.
rule zarr_merge:
    input:
        shards=ZARR_SHARDS,
        chunks=expand(f"{ZARR_DIR}/scatter/merge-{{job}}", job=ZARR_MERGE_JOBS),
    output:
        directory(f"{ZARR_DIR}/merged"),
    log:
        log_path("zarr", "merge"),
    benchmark:
        bench_path("zarr", "merge")
    threads: 1
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "zarr_merge", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(config, attempt, jobs=N_PARTS, passes=1.0),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/zarr_merge.py"


rule zarr_manifest:
    input:
        shards=ZARR_SHARDS,
        merged=ZARR_MERGED,
    output:
        manifest=f"{ZARR_DIR}/manifest.json",
        stage_config=f"{ZARR_DIR}/actstore_config.json",
    log:
        log_path("zarr", "manifest"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/zarr_manifest.py"


rule zarr:
    input:
        rules.zarr_manifest.output.manifest,


TARGETS["zarr"] = [f"{ZARR_DIR}/manifest.json"]
