"""Review 66: a stage run on the CPU (extract.device or sae.device `cpu`) is given the time its FLOPs take
there. Counted at one GPU's rate (resources.GPU_FLOPS) whatever the device, a CPU job asked about a
hundredth of its time and Slurm killed it at its limit, the retry too. `auto` and `cuda` keep the GPU's
rate: profiles/osc runs those rules on the GPU partition."""
import dataclasses
import math
import re
import subprocess

import pytest

import tiny
from actstore import resources
from actstore.config import validate_config
from test_journey_slurm_sizing import SNAKEMAKE
from test_resources_finisher_runtimes import seven_b_run  # noqa: F401 (a fixture)
from test_workflow import demo_config
from test_workflow_slurm_requests import sparse_jsonl

# The slowest dense float32 rate measured on the 2-core dev VM for one thread (an SAE training step, FLOPs
# counted as resources counts them: 30 GFLOP/s; matmuls 35-160): a CPU job's limit must cover its FLOPs at
# that rate on each of its CPUs.
MEASURED_THREAD_FLOPS = 30e9
MINILM_PARAMS = 22_700_000  # the demo model's (all-MiniLM-L6-v2) float32 weights


def slowest_cpu_minutes(flops: float, threads: int) -> float:
    """The least time a job of `threads` CPUs needs: its start and `flops` at MEASURED_THREAD_FLOPS each."""
    return min(resources.MAX_RUNTIME_MIN, resources.STARTUP_MIN + flops / (MEASURED_THREAD_FLOPS * threads) / 60)


def part_flops(config: dict) -> float:
    """An extraction part's forward FLOPs, as resources counts them: 2 per float32 weight per token."""
    w = resources.workload(config)
    return 2 * w.host_weight_bytes / 4 * w.tokens / config["extract"]["parts"]


def sae_flops(config: dict) -> float:
    """train_sae's FLOPs, as resources counts them: 12 x d x num_basis per training token."""
    w, sae = resources.workload(config), config["sae"]
    return 12 * w.d * resources.sae_basis(config, w) * sae["steps"] * sae["batch_size"]


def gpu_part_minutes(config: dict, attempt: int = 1) -> int:
    """extract_part's runtime before review 66, whatever extract.device: its FLOPs on one GPU."""
    w = resources.workload(config)
    seconds = (part_flops(config) * config["extract"]["parts"] / resources.GPU_FLOPS
               + w.activation_bytes / resources.IO_BYTES_PER_S) / config["extract"]["parts"]
    return resources._minutes(seconds, attempt)


def gpu_sae_minutes(config: dict, attempt: int = 1) -> int:
    """train_sae's runtime before review 66, whatever sae.device: its FLOPs on one GPU."""
    w, sae = resources.workload(config), config["sae"]
    trained = sae["steps"] * sae["batch_size"]
    held_out = math.ceil(w.tokens * sae["heldout_fraction"])
    evaluated = min(held_out, sae["eval_tokens"] or held_out)
    reads = 4 * (min(w.tokens, resources.SAE_MOMENT_TOKENS) + trained + evaluated) * w.d * w.itemsize
    seconds = sae_flops(config) / resources.GPU_FLOPS + reads / resources.IO_BYTES_PER_S
    return resources._minutes(seconds + w.tokens * resources.SAE_TOKEN_SECONDS, attempt)


@pytest.fixture
def demo(tmp_path):
    return validate_config(demo_config(tmp_path / "dump"))


@pytest.fixture
def minilm_run(demo, monkeypatch):
    """The demo model over 100M tokens, one 2,048-wide tensor captured (a CPU part a day long), and an SAE
    of 4x its width trained for 30,000 steps: their FLOPs, not the bytes read, fill a CPU job's time."""
    run = dataclasses.replace(resources.workload(demo), tokens=10**8, rows=10**8 // 128, d=2048, n_tensors=1,
                              head_values=0, weight_bytes=4 * MINILM_PARAMS, weight_widening=1.0)
    monkeypatch.setattr(resources, "workload", lambda config: run)
    demo["sae"].update(steps=30_000, num_basis=None)
    return demo


def with_devices(config: dict, device: str) -> dict:
    return {**config, "extract": {**config["extract"], "device": device}, "sae": {**config["sae"], "device": device}}


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_a_cpu_extraction_part_is_given_its_flops_at_the_measured_cpu_rate(minilm_run, device):
    config = with_devices(minilm_run, device)
    threads = resources.extract_part_threads(config)
    bound = slowest_cpu_minutes(part_flops(config), threads)
    assert bound > gpu_part_minutes(config)  # a run whose CPU time the GPU's rate misses
    for attempt in (1, 2):
        assert resources.extract_part_runtime(config, attempt) >= attempt * bound


def test_a_cpu_sae_run_is_given_its_flops_at_the_measured_cpu_rate(minilm_run):
    config = with_devices(minilm_run, "cpu")
    bound = slowest_cpu_minutes(sae_flops(config), resources.SAE_JOB_THREADS)
    assert bound > gpu_sae_minutes(config)
    for attempt in (1, 2):
        assert resources.sae_runtime(config, attempt) >= attempt * bound


@pytest.mark.parametrize("run", ["demo", "seven_b_run", "minilm_run"])
def test_auto_and_cuda_keep_the_gpu_rate_and_only_cpu_asks_more(request, run):
    """The GPU devices' runtimes are the formula's at GPU_FLOPS, as before; the same config on `cpu` asks
    more for the SAE (the 7B extraction is at the 48 h cap either way)."""
    config = request.getfixturevalue(run)
    for device in ("auto", "cuda", "cuda:1"):
        on_gpu = with_devices(config, device)
        for attempt in (1, 2):
            assert resources.extract_part_runtime(on_gpu, attempt) == gpu_part_minutes(on_gpu, attempt), device
            assert resources.sae_runtime(on_gpu, attempt) == gpu_sae_minutes(on_gpu, attempt), device
    on_cpu = with_devices(config, "cpu")
    assert resources.sae_runtime(on_cpu) > gpu_sae_minutes(on_cpu)
    assert resources.extract_part_runtime(on_cpu) >= gpu_part_minutes(on_cpu)
    if run != "seven_b_run":
        assert resources.extract_part_runtime(on_cpu) > gpu_part_minutes(on_cpu)


def test_a_cpu_job_with_more_cpus_is_given_less_time(model_dir, image_folder, tmp_path, monkeypatch):
    """An image part's CPUs follow extract.num_workers (extract_part_threads) and the SAE's its job's
    threads: on the CPU more of them shorten the FLOPs' time, on a GPU they change nothing."""
    vit = tiny.make_config(tmp_path, model_dir("vit"), image_folder, sae={"steps": 3_000})
    run = dataclasses.replace(resources.workload(vit), tokens=10**8, d=2048, n_tensors=1,
                              weight_bytes=4 * MINILM_PARAMS)
    monkeypatch.setattr(resources, "workload", lambda config: run)
    minutes = {}
    for device in ("cpu", "cuda"):
        for workers in (1, 13):
            config = with_devices(vit, device)
            config["extract"] = {**config["extract"], "num_workers": workers}
            minutes[device, workers] = resources.extract_part_runtime(config)
            if device == "cpu":
                bound = slowest_cpu_minutes(part_flops(config), resources.extract_part_threads(config))
                assert minutes[device, workers] >= bound
        for threads in (4, 8):
            monkeypatch.setattr(resources, "SAE_JOB_THREADS", threads)
            minutes[device, "sae", threads] = resources.sae_runtime(with_devices(vit, device))
    assert minutes["cpu", 1] > minutes["cpu", 13] > minutes["cuda", 1] == minutes["cuda", 13], minutes
    assert minutes["cpu", "sae", 4] > minutes["cpu", "sae", 8] > minutes["cuda", "sae", 4], minutes
    assert minutes["cuda", "sae", 4] == minutes["cuda", "sae", 8], minutes


def dry_run_minutes(tmp_path, config: dict, rules: tuple[str, ...]) -> dict[str, int]:
    """The runtime a local `snakemake lut -n` of `config` gives each of `rules`' jobs."""
    configfile = tiny.save_config(config, tmp_path / f"{config['extract']['device']}.yaml")
    proc = subprocess.run([SNAKEMAKE, "lut", "-n", "--configfile", str(configfile)], cwd=tiny.REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    minutes = {}
    for rule in rules:
        [runtime] = set(re.findall(rf"^rule {rule}:\n(?:    .*\n)*?    resources: .*\bruntime=(\d+)", proc.stdout,
                                   re.M))
        minutes[rule] = int(runtime)
    return minutes


def test_the_rules_ask_slurm_for_the_cpu_time(model_dir, tmp_path):
    """The dry run's extract_part, train_sae and build_lut jobs (what Slurm is asked) of a 2 GB text dataset
    on `cpu`: the runtime functions' values for that config, more than the GPU formula's (which `auto` and
    `cuda` ask: test_auto_and_cuda_keep_the_gpu_rate_and_only_cpu_asks_more); build_lut (review 67) more
    than the reads-only estimate it asked before."""
    data = sparse_jsonl(tmp_path / "big.jsonl", 2 * 10**9)
    config = tiny.make_config(tmp_path, model_dir("gpt2"), data, extract={"parts": 4, "max_seq_length": 64,
                                                                          "hooks": ["h.1.attn.c_attn:input"]},
                              sae={"enabled": True, "num_basis": 2**16, "k_active": 8, "steps": 10**5},
                              lut={"enabled": True, "targets": ["h.1.attn.c_attn"], "eval_tokens": 10**6})
    on_cpu = {**with_devices(config, "cpu"), "lut": {**config["lut"], "device": "cpu"}}
    asked = dry_run_minutes(tmp_path, on_cpu, ("extract_part", "train_sae", "build_lut"))
    assert asked == {"extract_part": resources.extract_part_runtime(on_cpu), "train_sae": resources.sae_runtime(on_cpu),
                     "build_lut": resources.lut_runtime(on_cpu)}
    assert asked["extract_part"] > gpu_part_minutes(config) and asked["train_sae"] > gpu_sae_minutes(config), asked
    on_gpu = resources.lut_runtime({**on_cpu, "lut": {**on_cpu["lut"], "device": "cuda"}})
    assert asked["build_lut"] > max(on_gpu, resources.io_runtime(on_cpu, passes=2.0)), (asked, on_gpu)
