# saev protocol 2.1 shards. The store's own name is the hash of its metadata.json (unknown at parse
# time), so the declared output is a pointer file in the stage dir naming the store beside it:
# {dump_to}/saev/<HASH>/, or {dump_to}/saev/shards/<8 hex>/ for saev.flavor upstream (docs/formats/saev.md).
# Written by saev.jobs scatter jobs (default: one per extraction part, at most 64), each writing a contiguous range
# of shards (known only once the extraction exists, so the job count is fixed here and a job may get
# none), then one small job that assembles the store from their files and writes its metadata last.
from actstore.formats.saev import check_options
from actstore.jobs import write_jobs

SAEV_DIR = sdir("saev")
SAEV_JOBS = [f"{job:04d}" for job in range(write_jobs(config, "saev"))]
# saev.layers against extract.layers, before any job runs; not when saev is disabled: no saev job runs,
# and its options stopped the parse of every other stage.
if "saev" in enabled_stages(config):
    check_options(config)


rule saev_shards:
    input:
        index=rules.extract_index.output.index,
    output:
        temp(directory(f"{SAEV_DIR}/scatter/job-{{job}}")),
    params:
        job=lambda wildcards: int(wildcards.job),
        jobs=len(SAEV_JOBS),
    log:
        log_path("saev", job_name("job", len(SAEV_JOBS))),
    benchmark:
        bench_path("saev", job_name("job", len(SAEV_JOBS)))
    # The slab being filled and the tree hash of the one before run at once (io_utils.WriteBehind; its
    # 1 MiB leaves hashed by as many threads as the job has CPUs; a further thread's pwrite mostly
    # waits on the disk). cpus_per_task: Slurm's CPUs for those threads.
    threads: 2
    # Three 32 MiB slab buffers (filled from the extraction, written and checksummed from them); reads
    # and writes its share of the activations once each.
    resources:
        cpus_per_task=2,
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "saev_shards", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.saev_shards_runtime(config, attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/saev_shards.py"


rule saev:
    input:
        index=rules.extract_index.output.index,
        masks=saev_masks,
        jobs=expand(f"{SAEV_DIR}/scatter/job-{{job}}", job=SAEV_JOBS),
    output:
        pointer=f"{SAEV_DIR}/saev.json",
        stage_config=f"{SAEV_DIR}/actstore_config.json",
    log:
        log_path("saev", "saev"),
    benchmark:
        bench_path("saev", "saev")
    threads: 1
    # Links the jobs' shard files into the store (no copy) and writes the small files; labels.bin
    # (saev.patch_labels) is computed here from the masks.
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.writer_mem_mb(config, "saev", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.saev_runtime(config, attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/saev.py"


TARGETS["saev"] = [f"{SAEV_DIR}/saev.json"]
