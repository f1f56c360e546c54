# LUT: precompute one lookup table per target linear layer from the SAE, then measure its accuracy.
LUT_DIR = sdir("lut")


rule build_lut:
    input:
        index=rules.extract_index.output.index,
        sae=f"{SAE_DIR}/sae.safetensors",
    output:
        lut=directory(f"{LUT_DIR}/lut"),
        report=f"{LUT_DIR}/report.json",
        stage_config=f"{LUT_DIR}/actstore_config.json",
    log:
        log_path("lut", "build"),
    benchmark:
        bench_path("lut", "build")
    conda:
        "../envs/actstore.yaml"
    threads: actstore_resources.LUT_JOB_THREADS
    # One GPU when the profile gives one (profiles/osc), else the CPU: lut.device auto picks.
    resources:
        cpus_per_task=actstore_resources.LUT_JOB_THREADS,
        mem_mb=lambda wildcards, attempt: actstore_resources.lut_mem_mb(config, attempt),
        runtime=lambda wildcards, attempt: actstore_resources.lut_runtime(config, attempt),
    script:
        "../workflow/scripts/lut.py"


rule lut:
    input:
        rules.build_lut.output.report,


TARGETS["lut"] = [f"{LUT_DIR}/report.json"]
