# Extraction: one job per part (the unit Slurm schedules on a GPU), then a small index.

EXTRACT_DIR = sdir("extract")


rule extract_part:
    output:
        directory(f"{EXTRACT_DIR}/part-{{part}}"),
    params:
        part=lambda wildcards: int(wildcards.part),
    log:
        log_path("extract", "part-{part}"),
    benchmark:
        bench_path("extract", "part-{part}")
    wildcard_constraints:
        part=r"\d{4}",
    threads: 4
    # Scale with the model and the part's share of the dataset (actstore/resources.py); the
    # partition, GPU and account come from the profile (profiles/osc), never from the rule.
    resources:
        mem_mb=lambda wildcards, threads, attempt: actstore_resources.extract_part_mem_mb(config, attempt, threads),
        runtime=lambda wildcards, attempt: actstore_resources.extract_part_runtime(config, attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/extract_part.py"


rule extract_index:
    input:
        expand(f"{EXTRACT_DIR}/part-{{part}}", part=PARTS),
    output:
        index=f"{EXTRACT_DIR}/extract.json",
        stage_config=f"{EXTRACT_DIR}/actstore_config.json",
    log:
        log_path("extract", "index"),
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/extract_index.py"


rule extract:
    input:
        rules.extract_index.output.index,


TARGETS["extract"] = [f"{EXTRACT_DIR}/extract.json"]
