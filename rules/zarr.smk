# Zarr activation logger: one shard store per extraction part (the spec's parallel writers), written
# by zarr.jobs jobs (default: one per part, at most 64), each taking a contiguous range of parts one
# after another; an optional merged store (zarr.merged: zarr.merge_jobs chunk-link jobs over
# consecutive shards, then one finishing job); then manifest.json, written last, marks the run
# complete. A shard job's declared output is its record (the parts it wrote): the shard stores go
# straight to shards/, so nothing is moved or copied afterwards.
from actstore import resources as actstore_resources
from actstore.jobs import jobs_covering, write_jobs

ZARR_DIR = sdir("zarr")
ZARR_SHARDS = expand(f"{ZARR_DIR}/shards/shard-{{part}}.zarr", part=PARTS)
ZARR_JOBS = [f"{job:04d}" for job in range(write_jobs(config, "zarr"))]
ZARR_RECORDS = expand(f"{ZARR_DIR}/scatter/shards-{{job}}", job=ZARR_JOBS)
# The merged store is declared by a file of its own, its consolidated metadata, not as directory():
# Snakemake marks a directory() output with a .snakemake_timestamp file inside it, a foreign file in
# a store users open with zarr and copy around.
ZARR_MERGED_ZMETADATA = f"{ZARR_DIR}/merged/.zmetadata"
ZARR_MERGED = [ZARR_MERGED_ZMETADATA] if config["zarr"]["merged"] else []
ZARR_MERGE_JOBS = [f"{job:04d}" for job in range(write_jobs(config, "zarr", "merge_jobs"))]


rule zarr_shards:
    input:
        lambda wildcards: job_part_dirs(len(ZARR_JOBS), wildcards),
    output:
        temp(directory(f"{ZARR_DIR}/scatter/shards-{{job}}")),
    params:
        shards=lambda wildcards: [ZARR_SHARDS[p] for p in job_parts(len(ZARR_JOBS), wildcards)],
        parts=lambda wildcards: list(job_parts(len(ZARR_JOBS), wildcards)),
        jobs=len(ZARR_JOBS),
        t_chunk=config["zarr"]["t_chunk"],
    log:
        log_path("zarr", job_name("shards", len(ZARR_JOBS))),
    benchmark:
        bench_path("zarr", job_name("shards", len(ZARR_JOBS)))
    # zarr.threads threads each read, cast, write and hash a chunk file.
    threads: config["zarr"]["threads"]
    resources:
        cpus_per_task=config["zarr"]["threads"],
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "zarr_shards", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.part_jobs_runtime(config, attempt, "zarr", 2.0),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/zarr_shards.py"


# Job {job} hard-links the chunks of its consecutive shards (none when there are more jobs than parts),
# once the shard jobs that wrote them are done.
rule zarr_merge_chunks:
    input:
        lambda wildcards: [ZARR_RECORDS[j] for j in jobs_covering(
            N_PARTS, len(ZARR_JOBS), job_parts(len(ZARR_MERGE_JOBS), wildcards))],
    output:
        temp(directory(f"{ZARR_DIR}/scatter/merge-{{job}}")),
    params:
        shards=lambda wildcards: [ZARR_SHARDS[p] for p in job_parts(len(ZARR_MERGE_JOBS), wildcards)],
        jobs=len(ZARR_MERGE_JOBS),
    log:
        log_path("zarr", job_name("merge", len(ZARR_MERGE_JOBS))),
    benchmark:
        bench_path("zarr", job_name("merge", len(ZARR_MERGE_JOBS)))
    threads: 1
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "zarr_merge_chunks", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.zarr_merge_chunks_runtime(config, attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/zarr_merge_chunks.py"


# Moves the linked chunk directories into place by rename and writes the small files: it reads the
# shards' metadata, 1-D arrays and prompts, never their activations. On a rerun Snakemake deletes the
# declared .zmetadata alone: the script deletes the rest of the earlier store first.
rule zarr_merge:
    input:
        records=ZARR_RECORDS,
        chunks=expand(f"{ZARR_DIR}/scatter/merge-{{job}}", job=ZARR_MERGE_JOBS),
    output:
        zmetadata=ZARR_MERGED_ZMETADATA,
    params:
        shards=ZARR_SHARDS,
    log:
        log_path("zarr", "merge"),
    benchmark:
        bench_path("zarr", "merge")
    threads: 1
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "zarr_merge", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.zarr_merge_runtime(config, attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/zarr_merge.py"


rule zarr_manifest:
    input:
        records=ZARR_RECORDS,
        merged=ZARR_MERGED,
    output:
        manifest=f"{ZARR_DIR}/manifest.json",
        stage_config=f"{ZARR_DIR}/actstore_config.json",
    params:
        shards=ZARR_SHARDS,
    log:
        log_path("zarr", "manifest"),
    benchmark:
        bench_path("zarr", "manifest")
    threads: 1
    resources:
        mem_mb=lambda wildcards, attempt: 1000 * attempt,
        runtime=lambda wildcards, attempt: 10 * attempt,
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/zarr_manifest.py"


rule zarr:
    input:
        rules.zarr_manifest.output.manifest,


TARGETS["zarr"] = [f"{ZARR_DIR}/manifest.json"]
