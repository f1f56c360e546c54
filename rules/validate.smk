# Validation: integrity + cross-format agreement, then the report's plots.
from actstore.report import PLOTS

VALIDATE_DIR = sdir("validate")


rule validate_stores:
    input:
        validate_inputs,
    output:
        report=f"{VALIDATE_DIR}/report.json",
        stage_config=f"{VALIDATE_DIR}/actstore_config.json",
    log:
        log_path("validate", "validate_stores"),
    benchmark:
        bench_path("validate", "validate_stores")
    # verify checks up to 8 files at once (integrity.problems_of: sha256 is one core's per file), on the
    # CPUs it is given; then every vector is compared (fingerprints: the extraction and each store read
    # once more, a thread each). cpus_per_task: Slurm's CPUs for those threads. mem_mb: pickle shards
    # checked at once hold up to 1 GiB (pickle.check.SHARDS_VERIFY_BYTES), a larger one four times its
    # size (the quarter of the job's memory a file's claims may take); a full-pass thread ~200 MB.
    threads: 8
    resources:
        cpus_per_task=8,
        mem_mb=lambda wildcards, attempt: actstore_resources.validate_mem_mb(config, attempt),
        runtime=lambda wildcards, attempt: actstore_resources.io_runtime(config, attempt, passes=2.0),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/validate_stores.py"


rule validate_plots:
    input:
        report=rules.validate_stores.output.report,
        extract=f"{EXTRACT_DIR}/extract.json",
    output:
        **{
            name: report(
                f"{VALIDATE_DIR}/plots/{name}.png",
                caption=f"../report/{name}.rst",
                category="actstore",
            )
            for name in PLOTS
        },
    log:
        log_path("validate", "validate_plots"),
    benchmark:
        bench_path("validate", "validate_plots")
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.opened_extraction_mb(
            config, actstore_resources.PLOTS_BASE_MB, attempt),
        runtime=lambda wildcards, attempt: 30 * attempt,
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/validate_plots.py"


rule validate:
    input:
        rules.validate_stores.output.report,
        rules.validate_plots.output,


TARGETS["validate"] = [f"{VALIDATE_DIR}/report.json"] + [
    f"{VALIDATE_DIR}/plots/{name}.png" for name in PLOTS
]
