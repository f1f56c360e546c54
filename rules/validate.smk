# Validation: integrity + cross-format agreement, then the report's plots.
from actstore.formats import FORMAT_STAGES
from actstore.report import PLOTS

VALIDATE_DIR = sdir("validate")


# Scattered like the writers: validate_jobs(store) share jobs per enabled store (verify of every
# shares-th file, its views' fingerprints of every shares-th block of rows; share 0 its sampled
# coordinates) and per extraction (verify of its parts, and their fingerprint of the rows every store's
# views must hold, in one pass), side by side; then validate_stores adds up each store's fingerprints,
# compares them (a few MB a view) and writes report.json. Each job's result is a temp .npz under
# scatter/ (integrity.STAGE_TEMPS).
VALIDATED_STORES = [name for name in FORMAT_STAGES if name in enabled_stages(config)]
VALIDATE_SCATTER = f"{VALIDATE_DIR}/scatter"


# verify checks up to 8 files at once (integrity.problems_of: sha256 is one core's per file), on the CPUs
# it is given; the views' full passes then read their streams on those CPUs (a layer's each; pickle's, each
# of other shards, as many as memory_budget holds). mem_mb: the opened extraction (the sampled
# coordinates' values), plus pickle shards checked at once (validate_store_mem_mb); runtime: verify's
# pass and each view's (validate_runtime).
rule validate_store:
    input:
        validated_store_inputs,
    output:
        temp(f"{VALIDATE_SCATTER}/{{store}}.{{share}}.npz"),
    wildcard_constraints:
        store="|".join(FORMAT_STAGES),
        share=r"\d+",
    log:
        log_path("validate", "validate_{store}_{share}"),
    benchmark:
        bench_path("validate", "validate_{store}_{share}")
    threads: 8
    resources:
        cpus_per_task=8,
        mem_mb=lambda wildcards, attempt: actstore_resources.validate_store_mem_mb(config, wildcards.store, attempt),
        runtime=lambda wildcards, attempt: actstore_resources.validate_runtime(config, wildcards.store, attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/validate_store.py"


# The extraction's verify and one pass over it, folding each row into the fingerprint of every store
# view that holds it: it reads the stores' metadata (their dtypes and layers), never their vectors.
rule validate_extract:
    input:
        validate_inputs,
    output:
        temp(f"{VALIDATE_SCATTER}/extract.{{share}}.npz"),
    wildcard_constraints:
        share=r"\d+",
    log:
        log_path("validate", "validate_extract_{share}"),
    benchmark:
        bench_path("validate", "validate_extract_{share}")
    threads: 8
    resources:
        cpus_per_task=8,
        mem_mb=lambda wildcards, attempt: actstore_resources.validate_store_mem_mb(config, "extract", attempt),
        runtime=lambda wildcards, attempt: actstore_resources.validate_runtime(config, "extract", attempt),
    conda:
        "../envs/actstore.yaml"
    script:
        "../workflow/scripts/validate_extract.py"


# Compares the jobs' fingerprints, checks the LUT against the SAE and every stage's seal, and writes
# report.json: it reads the fingerprints, the LUT and the SAE, no activation.
rule validate_stores:
    input:
        validate_inputs,
        extract=validate_extract_files,
        stores=validate_store_files,
    output:
        report=f"{VALIDATE_DIR}/report.json",
        stage_config=f"{VALIDATE_DIR}/actstore_config.json",
    params:
        shares=validate_shares,
    log:
        log_path("validate", "validate_stores"),
    benchmark:
        bench_path("validate", "validate_stores")
    resources:
        mem_mb=lambda wildcards, attempt: actstore_resources.VALIDATE_MEM_MB * attempt,
        runtime=lambda wildcards, attempt: actstore_resources.VALIDATE_REPORT_MIN * attempt,
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
