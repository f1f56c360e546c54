# lmprobe 2.0 dataset: one gather job over every extraction part writes the dataset root
# {stage dir}/dataset/ (index/*.parquet, tensors/*.safetensors, README.md, SHA256SUMS) atomically.
from actstore.formats.lmprobe import check_options

LMPROBE_DIR = sdir("lmprobe")
check_options(config)  # lmprobe.layers / logits_topk against extract.*, before any job runs


rule lmprobe_dataset:
    input:
        index=rules.extract_index.output.index,
        parts=expand(f"{EXTRACT_DIR}/part-{{part}}", part=PARTS),
    output:
        dataset=directory(f"{LMPROBE_DIR}/dataset"),
        stage_config=f"{LMPROBE_DIR}/actstore_config.json",
    log:
        log_path("lmprobe", "lmprobe"),
    benchmark:
        bench_path("lmprobe", "lmprobe")
    threads: 1
    # Streams each shard in 64 MiB copies; the index columns (token lists) are held in memory.
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.io_mem_mb(config, attempt, buffered_mb=1000),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(config, attempt, passes=3.0),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/lmprobe.py"


rule lmprobe:
    input:
        rules.lmprobe_dataset.output.dataset,


TARGETS["lmprobe"] = [f"{LMPROBE_DIR}/dataset", f"{LMPROBE_DIR}/actstore_config.json"]
