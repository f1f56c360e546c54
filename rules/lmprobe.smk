# lmprobe 2.0 dataset: write_jobs(config, "lmprobe") jobs each write a contiguous range of the planned
# tensor files (hidden (layer, shard) files, then top-k logits shards) into scatter/job-NNNN/ with
# their {bytes, sha256}; one finishing job hard-links them into the dataset root {stage dir}/dataset/,
# streams the index parquet in bounded row groups and writes README.md and SHA256SUMS, atomically.
from actstore.formats.lmprobe import check_options
from actstore.jobs import write_jobs

LMPROBE_DIR = sdir("lmprobe")
LMPROBE_JOBS = write_jobs(config, "lmprobe")
# lmprobe.layers / logits_topk against extract.* and the model's kind (common.smk's config.json), before any job;
# not when lmprobe is disabled: no lmprobe job runs, and its options stopped the parse of every other stage.
if "lmprobe" in enabled_stages(config):
    check_options(config, model_config)


# Only the index as input: it already depends on every part (and records each part.json's sha256),
# and 64 jobs x every part would make the DAG of a 4,096-part run quadratic to build.
rule lmprobe_tensors:
    input:
        index=rules.extract_index.output.index,
    output:
        temp(directory(f"{LMPROBE_DIR}/scatter/job-{{job}}")),
    params:
        jobs=LMPROBE_JOBS,
    log:
        log_path("lmprobe", job_name("tensors", LMPROBE_JOBS)),
    benchmark:
        bench_path("lmprobe", job_name("tensors", LMPROBE_JOBS))
    # Two tensor files at once (lmprobe.write.THREADS: each file's sha256 is sequential), each with
    # its rows gathered while the chunk before is written and hashed (io_utils.WriteBehind).
    threads: 2
    # Per file at once, three 32 MiB gather buffers (plus their dtype conversions); dirty pages are
    # written back every 16 MiB. Reads and writes a 1/jobs share of the activations once.
    resources:
        cpus_per_task=2,
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "lmprobe_tensors", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(config, attempt, jobs=LMPROBE_JOBS),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/lmprobe_tensors.py"


rule lmprobe_dataset:
    input:
        index=rules.extract_index.output.index,
        parts=expand(f"{EXTRACT_DIR}/part-{{part}}", part=PARTS),
        jobs=expand(f"{LMPROBE_DIR}/scatter/job-{{job}}", job=[f"{j:04d}" for j in range(LMPROBE_JOBS)]),
    output:
        dataset=directory(f"{LMPROBE_DIR}/dataset"),
        stage_config=f"{LMPROBE_DIR}/actstore_config.json",
    log:
        log_path("lmprobe", "lmprobe"),
    benchmark:
        bench_path("lmprobe", "lmprobe")
    threads: 1
    # Tensor files are linked, not read; the index is streamed one row group at a time
    # (write.ROW_GROUP_TOKENS tokens, about 100 MB) beside the per-prompt arrays and sample rows.
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "lmprobe_dataset", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.lmprobe_dataset_runtime(config, attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/lmprobe.py"


rule lmprobe:
    input:
        rules.lmprobe_dataset.output.dataset,


TARGETS["lmprobe"] = [f"{LMPROBE_DIR}/dataset", f"{LMPROBE_DIR}/actstore_config.json"]
