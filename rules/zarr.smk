# Zarr activation logger: one shard store per extraction part (the spec's parallel writers), an
# optional merged store (zarr.merged), then manifest.json, written last, marks the run complete.
from actstore import resources as actstore_resources

ZARR_DIR = sdir("zarr")
ZARR_SHARDS = expand(f"{ZARR_DIR}/shards/shard-{{part}}.zarr", part=PARTS)
ZARR_MERGED = [f"{ZARR_DIR}/merged"] if config["zarr"]["merged"] else []


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
        mem_mb=lambda wildcards, attempt: actstore_resources.io_mem_mb(config, attempt, per_part=True, buffered_mb=200),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(config, attempt, per_part=True, passes=2.0),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/zarr_part.py"


rule zarr_merge:
    input:
        ZARR_SHARDS,
    output:
        directory(f"{ZARR_DIR}/merged"),
    log:
        log_path("zarr", "merge"),
    benchmark:
        bench_path("zarr", "merge")
    threads: 1
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.io_mem_mb(config, attempt),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(config, attempt, passes=1.0),
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
