# Extraction: one scan of the dataset on a CPU, one job per part (the unit Slurm schedules on a
# GPU) reading only its rows, then a small index.

from actstore.datasets import check_extraction_data_unchanged

EXTRACT_DIR = sdir("extract")
# A finished extraction whose model folder has since been given other weights (a model is named by
# its path) stops the run here, naming the file (actstore/model_identity.py); in the main process
# only: a copied folder's files are hashed to tell a copy from new weights. Likewise its data, where
# the hash names the data by its path alone (dataset.identity path, or a config of earlier releases):
# rows appended to the file found the old activations by hash (actstore/datasets/scan.py).
if workflow.is_main_process:
    check_model_unchanged(MODEL_PATH, Path(EXTRACT_DIR))
    check_extraction_data_unchanged(config["dataset"], Path(EXTRACT_DIR))
# A part job's CPUs (images: its decoding workers; actstore/resources.py), from config.json alone.
EXTRACT_PART_THREADS = actstore_resources.extract_part_threads(config)


# Every job needs the dataset's row count and labels (sample_idx and label_id are over the whole
# dataset): one job reads every row for them, and finds bad data before any GPU is held.
# Kept, never temp(): a part lost after the run is redone from the scan the others were cut from. A
# temp scan (releases up to 2026-11-27), deleted with the run's last part, is scanned again for it;
# part_scan keeps the other parts from being redone for its new mtime, in the runs after (in that run
# the scan job, making a missing input, redoes every part of the DAG: ancient() spares none of them).
# Verify skips it (integrity.STAGE_TEMPS).
rule extract_scan:
    output:
        f"{EXTRACT_DIR}/dataset_scan.json",
    log:
        log_path("extract", "scan"),
    benchmark:
        bench_path("extract", "scan")
    # JSONL or tar files scanned at once, each in its own process (a corpus of shards; one otherwise).
    threads: actstore_resources.extract_scan_threads(config)
    resources:
        cpus_per_task=lambda wildcards, threads: threads,
        mem_mb=lambda wildcards, attempt, threads: actstore_resources.extract_scan_mem_mb(config, attempt, threads),
        runtime=lambda wildcards, attempt: actstore_resources.extract_scan_runtime(config, attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/extract_scan.py"


rule extract_part:
    input:
        scan=part_scan,
    output:
        directory(f"{EXTRACT_DIR}/part-{{part}}"),
    params:
        part=lambda wildcards: int(wildcards.part),
    log:
        log_path("extract", "part-{part}"),
    benchmark:
        bench_path("extract", "part-{part}")
    # Images: 16 CPUs decoding (or extract.num_workers + the main process and writers); text: 4.
    threads: EXTRACT_PART_THREADS
    # Scale with the model and the part's share of the dataset (actstore/resources.py); the
    # partition, GPU and account come from the profile (profiles/osc), never from the rule.
    # cpus_per_task: Slurm's CPUs for those threads (Snakemake caps `threads` at the submitting
    # host's --cores, so not from them).
    resources:
        cpus_per_task=EXTRACT_PART_THREADS,
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
    benchmark:
        bench_path("extract", "index")
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.opened_extraction_mb(config, attempt=attempt),
        runtime=lambda wildcards, attempt: actstore_resources.extract_index_runtime(config, attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/extract_index.py"


rule extract:
    input:
        rules.extract_index.output.index,


TARGETS["extract"] = [f"{EXTRACT_DIR}/extract.json"]
