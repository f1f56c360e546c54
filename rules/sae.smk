# SAE: train (or import) a TopK SAE on the captured input of the LUT target modules; the same SAE
# in SAELens' layout in saelens/ (SAE.load_from_disk).
from actstore.config import import_files, resolve_hook

SAE_DIR = sdir("sae")
if config["sae"]["enabled"]:
    resolve_hook(config)  # parse time: sae.hook must have been captured by extract.hooks


# The files sae.import reads: inputs, so that one replaced at its path reruns the stage (its hash names
# the path, not the bytes).
SAE_IMPORT = config["sae"].get("import")
SAE_IMPORT_FILES = [str(path) for path in import_files(**SAE_IMPORT)] if SAE_IMPORT else []


# An import needs no GPU: its rule is named import_sae, which the profiles leave on a CPU partition
# (profiles/osc puts train_sae on the GPU partition by name).
rule train_sae:
    name:
        "import_sae" if SAE_IMPORT else "train_sae"
    input:
        index=rules.extract_index.output.index,
        imported=SAE_IMPORT_FILES,
    output:
        sae=f"{SAE_DIR}/sae.safetensors",
        saelens_cfg=f"{SAE_DIR}/saelens/cfg.json",
        saelens_weights=f"{SAE_DIR}/saelens/sae_weights.safetensors",
        report=f"{SAE_DIR}/report.json",
        stage_config=f"{SAE_DIR}/actstore_config.json",
    log:
        log_path("sae", "train"),
    benchmark:
        bench_path("sae", "train")
    conda:
        "../envs/actstore.yaml"
    threads: actstore_resources.SAE_JOB_THREADS
    # One GPU when the profile gives one (profiles/osc), else the CPU: sae.device auto picks.
    resources:
        cpus_per_task=actstore_resources.SAE_JOB_THREADS,
        mem_mb=lambda wildcards, attempt: actstore_resources.sae_mem_mb(config, attempt),
        runtime=lambda wildcards, attempt: actstore_resources.sae_runtime(config, attempt),
    script:
        "../workflow/scripts/sae.py"


rule sae:
    input:
        f"{SAE_DIR}/report.json",


TARGETS["sae"] = [f"{SAE_DIR}/report.json"]
