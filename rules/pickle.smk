# Pickle shards: one store per extraction part (machine), then a merged metadata.json over them.

PICKLE_DIR = sdir("pickle")
# gzip runs at a few tens (zlib) or hundreds (isal) of MB/s on float32: extra passes over the part's bytes.
PICKLE_PASSES = {"none": 2.0, "isal": 3.0, "zlib": 6.0}[
    config["pickle"]["compressor"] if config["pickle"]["compression"] == "gzip" else "none"]


rule pickle_part:
    input:
        f"{EXTRACT_DIR}/part-{{part}}",
    output:
        directory(f"{PICKLE_DIR}/machine-{{part}}"),
    params:
        shard_size_mb=config["pickle"]["shard_size_mb"],
        compression=config["pickle"]["compression"],
        compresslevel=config["pickle"]["compresslevel"],
        compressor=config["pickle"]["compressor"],
    log:
        log_path("pickle", "machine-{part}"),
    benchmark:
        bench_path("pickle", "machine-{part}")
    wildcard_constraints:
        part=r"\d{4}",
    # pickle.threads shards dumped and gzipped at once, one per thread.
    threads: config["pickle"]["threads"]
    # One shard in memory per thread, plus its pickle stream. cpus_per_task: the Slurm profile's
    # default-resources give every job 1 CPU, which the jobstep would otherwise use over threads.
    resources:
        cpus_per_task=config["pickle"]["threads"],
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "pickle_part", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(
            config, attempt, jobs=N_PARTS, passes=PICKLE_PASSES),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/pickle_part.py"


rule pickle_merge:
    input:
        expand(f"{PICKLE_DIR}/machine-{{part}}", part=PARTS),
    output:
        metadata=f"{PICKLE_DIR}/metadata.json",
        stage_config=f"{PICKLE_DIR}/actstore_config.json",
    log:
        log_path("pickle", "merge"),
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/pickle_merge.py"


rule pickle:
    input:
        rules.pickle_merge.output.metadata,


TARGETS["pickle"] = [f"{PICKLE_DIR}/metadata.json"]
