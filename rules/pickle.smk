# Pickle shards: one store per extraction part (machine), written by pickle.jobs jobs (default: one
# per part, at most 64), each taking a contiguous range of parts one after another; then a merged
# metadata.json over them. A job's declared output is its record (the parts it wrote): the machine
# stores go straight to their place in the stage dir, so nothing is moved or copied afterwards.
from actstore.jobs import write_jobs

PICKLE_DIR = sdir("pickle")
PICKLE_JOBS = [f"{job:04d}" for job in range(write_jobs(config, "pickle"))]
PICKLE_MACHINES = expand(f"{PICKLE_DIR}/machine-{{part}}", part=PARTS)
# gzip runs at a few tens (zlib) or hundreds (isal) of MB/s on float32: extra passes over the part's bytes.
PICKLE_PASSES = {"none": 2.0, "isal": 3.0, "zlib": 6.0}[
    config["pickle"]["compressor"] if config["pickle"]["compression"] == "gzip" else "none"]


rule pickle_machines:
    input:
        lambda wildcards: job_part_dirs(len(PICKLE_JOBS), wildcards),
    output:
        temp(directory(f"{PICKLE_DIR}/scatter/job-{{job}}")),
    params:
        machines=lambda wildcards: [PICKLE_MACHINES[p] for p in job_parts(len(PICKLE_JOBS), wildcards)],
        parts=lambda wildcards: list(job_parts(len(PICKLE_JOBS), wildcards)),
        jobs=len(PICKLE_JOBS),
        shard_size_mb=config["pickle"]["shard_size_mb"],
        compression=config["pickle"]["compression"],
        compresslevel=config["pickle"]["compresslevel"],
        compressor=config["pickle"]["compressor"],
    log:
        log_path("pickle", job_name("job", len(PICKLE_JOBS))),
    benchmark:
        bench_path("pickle", job_name("job", len(PICKLE_JOBS)))
    # pickle.threads shards dumped and gzipped at once, one per thread.
    threads: config["pickle"]["threads"]
    # One shard in memory per thread, plus its pickle stream. cpus_per_task: the Slurm profile's
    # default-resources give every job 1 CPU, which the jobstep would otherwise use over threads.
    resources:
        cpus_per_task=config["pickle"]["threads"],
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "pickle_machines", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.part_jobs_runtime(config, attempt, "pickle",
                                                                                PICKLE_PASSES),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/pickle_machines.py"


rule pickle_merge:
    input:
        expand(f"{PICKLE_DIR}/scatter/job-{{job}}", job=PICKLE_JOBS),
    output:
        metadata=f"{PICKLE_DIR}/metadata.json",
        stage_config=f"{PICKLE_DIR}/actstore_config.json",
    params:
        machines=PICKLE_MACHINES,
    log:
        log_path("pickle", "merge"),
    benchmark:
        bench_path("pickle", "merge")
    resources:
        mem_mb=lambda wildcards, attempt: 1000 * attempt,
        runtime=lambda wildcards, attempt: 10 * attempt,
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/pickle_merge.py"


rule pickle:
    input:
        rules.pickle_merge.output.metadata,


TARGETS["pickle"] = [f"{PICKLE_DIR}/metadata.json"]
