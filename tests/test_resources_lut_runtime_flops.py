"""Review 67: build_lut's Slurm runtime counts what the job computes (resources.lut_flops: each target's
products, the relative errors' encodings at every budget, the model run twice a budget end to end) on
lut.device, at the CPU's rate on `cpu`. Before, it asked for two reads of the activations alone
(io_runtime), the same few minutes whatever the LUT, and a large LUT built on the CPU was killed at its limit."""
import dataclasses

import pytest

from actstore import resources
from actstore.config import validate_config
from test_workflow import demo_config

# The slowest rate build_lut's work ran at on one thread (wall clock) of the 2-core dev VM at a load of 6-8
# (shared with other jobs), FLOPs counted as resources.lut_flops counts them at the real shapes (MiniLM's q/k/v,
# 384 wide, 16,384 latents, the 4,096 held-out tokens and 4,957 end-to-end tokens run, its non-embedding
# weights): relative errors 626 GFLOP in 26.2 s (24 GFLOP/s), end to end 1,110 GFLOP in 55.1 s (20), 51 and 43
# per CPU second: the process had half a core.
MEASURED_THREAD_FLOPS = 20e9
# Real build_lut jobs on lut.device cpu: `snakemake lut --cores 2` of the demo config (its extraction, an SAE of
# sae.num_basis latents), threads 2, on the loaded VM: the sae section's changes, the job's benchmark seconds (its
# .tsv's `s`: the whole job, its start included) and whether the reads-only estimate's work (its minutes less
# STARTUP_MIN, halved) covered them. The 65,536-latent job's 4.4 TFLOP at the real widths took 109 CPU seconds
# (40 GFLOP/s per CPU second) in its 285.
MEASURED_RUNS = {"demo": ({}, 96.37, True), "65k_latents": ({"num_basis": 65536, "steps": 10}, 284.96, False)}
MEASURED_JOB_THREADS = 2


@pytest.fixture
def demo(tmp_path):
    config = validate_config(demo_config(tmp_path / "dump"))
    config["lut"]["device"] = "cpu"
    return config


def with_lut(config: dict, **lut) -> dict:
    return {**config, "lut": {**config["lut"], **lut}}


def io_only_minutes(config: dict, attempt: int = 1) -> int:
    """build_lut's runtime before review 67: the activations read twice (io_runtime), nothing computed."""
    return resources.io_runtime(config, attempt, passes=2.0)


def slowest_cpu_minutes(config: dict) -> float:
    """The least time a build_lut job on the CPU needs: its start and its FLOPs (as resources counts them) at
    MEASURED_THREAD_FLOPS on each of its CPUs."""
    flops = resources.lut_flops(config, resources.workload(config))
    seconds = flops / (MEASURED_THREAD_FLOPS * resources.LUT_JOB_THREADS)
    return min(resources.MAX_RUNTIME_MIN, resources.STARTUP_MIN + seconds / 60)


@pytest.fixture
def large_lut(demo, monkeypatch):
    """An 8B-class model (16 GB of bfloat16 weights run in float32) over 10M tokens, its MLP's 14,336-wide
    input captured, and a LUT of 65,536 latents for four targets: its products and encodings, not the
    activations' reads, fill the job."""
    run = dataclasses.replace(resources.workload(demo), tokens=10**7, rows=10**7 // 512, d=14336, n_tensors=2,
                              itemsize=2, head_values=0, weight_bytes=16 * 10**9, weight_widening=2.0)
    monkeypatch.setattr(resources, "workload", lambda config: run)
    demo["sae"].update(num_basis=65536, k_active=64)
    demo["lut"]["targets"] = [f"model.layers.{i}.mlp.down_proj" for i in range(4)]
    return demo


def test_a_large_lut_on_the_cpu_asks_more_than_on_a_gpu_and_than_its_reads(large_lut):
    """On `cpu` the job is given its FLOPs at the measured rate of its CPUs; on a GPU less, though more than
    the activations' reads alone, which were all it asked before."""
    on_cpu, on_gpu = large_lut, with_lut(large_lut, device="cuda")
    for attempt in (1, 2):
        cpu, gpu, reads = (resources.lut_runtime(on_cpu, attempt), resources.lut_runtime(on_gpu, attempt),
                           io_only_minutes(on_cpu, attempt))
        assert cpu > gpu > reads, (cpu, gpu, reads)  # the products and encodings take time on a GPU too
        assert cpu >= attempt * slowest_cpu_minutes(on_cpu), (cpu, slowest_cpu_minutes(on_cpu))
    # auto is the GPU's rate: profiles/osc runs build_lut on the GPU partition
    assert resources.lut_runtime(with_lut(large_lut, device="auto")) == resources.lut_runtime(on_gpu)


@pytest.mark.parametrize("key, more", [("targets", [f"model.layers.{i}.mlp.down_proj" for i in range(8)]),
                                       ("budgets", [0, 8, 32, 128, 512, 2048]), ("eval_tokens", 65536),
                                       ("eval_samples", 1024)])
def test_more_lut_work_asks_more_time_on_the_cpu(demo, key, more):
    """More targets (their products and relative errors), budgets (an encoding and an end-to-end pair of
    runs each), held-out tokens or samples evaluated: each is more of the job's FLOPs (the demo's extraction,
    16,384 latents: well below the cap)."""
    demo["sae"]["num_basis"] = 16384
    base, larger = resources.lut_runtime(demo), resources.lut_runtime(with_lut(demo, **{key: more}))
    assert resources.STARTUP_MIN < base < larger < resources.MAX_RUNTIME_MIN, (base, larger)


@pytest.mark.parametrize("run", sorted(MEASURED_RUNS))
def test_the_estimate_covers_measured_cpu_jobs(demo, monkeypatch, run):
    """The demo's extraction, its build_lut jobs on the CPU (MEASURED_RUNS): the estimate's work term alone
    (the runtime less STARTUP_MIN, halved) covers the whole job's measured seconds, start included, with the
    job's threads; the reads-only estimate's did not cover the larger LUT's."""
    sae, seconds, covered_before = MEASURED_RUNS[run]
    demo["sae"].update(sae)
    monkeypatch.setattr(resources, "LUT_JOB_THREADS", MEASURED_JOB_THREADS)
    work_seconds = (resources.lut_runtime(demo) - resources.STARTUP_MIN) * 60 / 2
    assert work_seconds >= seconds, (work_seconds, seconds)
    assert ((io_only_minutes(demo) - resources.STARTUP_MIN) * 60 / 2 >= seconds) == covered_before
