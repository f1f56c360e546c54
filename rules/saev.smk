# saev protocol 2.1 shards. The store's own name is the hash of its metadata.json (unknown at parse
# time), so the declared output is a pointer file in the stage dir naming the store beside it:
# {dump_to}/saev/<HASH>/, or {dump_to}/saev/shards/<8 hex>/ for saev.flavor upstream (docs/formats/saev.md).

SAEV_DIR = sdir("saev")


rule saev:
    input:
        index=rules.extract_index.output.index,
        masks=saev_masks,
    output:
        pointer=f"{SAEV_DIR}/saev.json",
        stage_config=f"{SAEV_DIR}/actstore_config.json",
    log:
        log_path("saev", "saev"),
    benchmark:
        bench_path("saev", "saev")
    threads: 1
    # Streams ~64 MiB slabs into each shard; reads the extraction once, writes and checksums once.
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.io_mem_mb(config, attempt, buffered_mb=300),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(config, attempt, passes=3.0),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/saev.py"


TARGETS["saev"] = [f"{SAEV_DIR}/saev.json"]
