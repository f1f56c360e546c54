"""The OSC profile and a real Slurm: dry runs of profiles/osc (no cluster needed), then a tiny config
run end to end through snakemake-executor-plugin-slurm on the cluster of tests/slurm/cluster.sh,
checked against sacct and byte-compared with a local run of the same config.

The cluster tests are skipped when no cluster answers, unless ACTSTORE_REQUIRE_SLURM=1 (.ci/run sets
it), which turns "no cluster" into a failure. ACTSTORE_SLURM_TARGET picks the target (default `all`:
every stage but SAE/LUT, whose float reductions depend on the job's thread count)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
import yaml

import tiny
from actstore.integrity import SEAL_KEY

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
TARGET = os.environ.get("ACTSTORE_SLURM_TARGET", "all")
REQUIRED = os.environ.get("ACTSTORE_REQUIRE_SLURM") == "1"
RUN_TIMEOUT_S = int(os.environ.get("ACTSTORE_SLURM_TIMEOUT_S", "900"))
# Both runs record created_at = SOURCE_DATE_EPOCH, so what legitimately differs between them is
# measured time: durations and waits, the CPU threads torch had (the rule's, capped by --cores), the
# checksums of metadata files that hold one (the extract index's of part.json, the pickle merge's of each
# machine's metadata.json), validation's read latencies, and the plots drawn from those latencies.
SOURCE_DATE_EPOCH = "1700000000"
VOLATILE_KEYS = {"extraction_duration_seconds", "extraction_waits", "part_json_sha256", "metadata_sha256",
                 "read_latency_us", "torch_threads"}
VOLATILE_SUFFIXES = {".png"}


def run(cmd: list[str], timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run cmd from the repo root in its own process group; on timeout kill the whole group (a
    stuck Snakemake ignores SIGTERM) and fail with the output so far."""
    return finish(start(cmd, env), timeout)


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """cmd started from the repo root in its own process group, its output (stderr too) into a temporary
    file: a pipe nobody reads while another run goes on would block it once full."""
    output = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    proc.output = output
    return proc


def finish(proc: subprocess.Popen, timeout: int) -> subprocess.CompletedProcess:
    """proc's exit and output; on timeout its whole group killed and the test failed with the output so far."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"{' '.join(proc.args)} did not finish in {timeout}s:\n{output_of(proc)[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, output_of(proc), "")


def stop(proc: subprocess.Popen) -> None:
    """proc's whole process group killed (Snakemake's jobs with it), and waited for."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def output_of(proc: subprocess.Popen) -> str:
    """What proc wrote (stdout and stderr), its temporary file closed."""
    with proc.output:
        proc.output.seek(0)
        return proc.output.read()


def write_config(tmp: Path, model: Path, data: Path, name: str, **sections) -> Path:
    # The SAE stage needs a captured hook that this tiny text config does not have.
    config = tiny.make_config(tmp / name, model, data, **{"sae": {"enabled": False}, **sections})
    return tiny.save_config(config, tmp / f"{name}.yaml")


# ---------------------------------------------------------------- no cluster needed


def test_env_matches_pyproject_pins():
    """envs/actstore.yaml pins exactly pyproject's dependencies, so --sdm conda runs the tested set."""
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    env = yaml.safe_load((REPO / "envs/actstore.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert sorted(pip) == sorted(pins)
    assert "python=3.11" in env["dependencies"]
    for rule in re.findall(r"^rule (\w+):\n((?:    .*\n|\n)*)", (REPO / "rules/extract.smk").read_text(), re.M):
        if "script:" in rule[1]:
            assert 'conda:\n        "../envs/actstore.yaml"' in rule[1], f"rule {rule[0]} names no conda env"


def test_osc_profile_requires_account(tmp_path, model_dir, text_jsonl):
    """Without ACTSTORE_SLURM_ACCOUNT the profile stops with a message naming the variable."""
    configfile = write_config(tmp_path, model_dir("bert"), text_jsonl, "noacct")
    env = {k: v for k, v in os.environ.items() if k != "ACTSTORE_SLURM_ACCOUNT"}
    proc = subprocess.run([SNAKEMAKE, "extract", "-n", "--profile", "profiles/osc", "--configfile", str(configfile)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ACTSTORE_SLURM_ACCOUNT is not set" in proc.stdout + proc.stderr


def test_osc_dry_run_64_parts(tmp_path, model_dir, text_jsonl):
    """parts=64: the whole DAG in one dry run, each part a GPU job, the rest on the CPU partition,
    the account from the environment, runtime and memory from the rule's data-size estimate."""
    configfile = write_config(tmp_path, model_dir("bert"), text_jsonl, "dry64", extract={"parts": 64})
    started = time.perf_counter()
    proc = run([SNAKEMAKE, "extract", "-n", "--profile", "profiles/osc", "--configfile", str(configfile)],
               timeout=300, env={"ACTSTORE_SLURM_ACCOUNT": "PAS0042", "ACTSTORE_GPU_PARTITION": "gpuserial"})
    elapsed = time.perf_counter() - started
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert re.search(r"^extract_part\s+64$", proc.stdout, re.M), proc.stdout[-3000:]
    assert re.search(r"^extract_index\s+1$", proc.stdout, re.M)
    jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", proc.stdout, re.M)
    parts = [res for rule, res in jobs if rule == "extract_part"]
    assert len(parts) == 64
    for res in parts:
        assert "slurm_partition=gpuserial" in res and "gpu=1" in res and "slurm_account=PAS0042" in res
        assert re.search(r"runtime=\d+", res) and re.search(r"mem_mb=\d+", res)
    for rule in ("extract_scan", "extract_index"):  # one each, on a CPU
        [res] = [res for name, res in jobs if name == rule]
        assert "slurm_partition=cpu" in res and "gpu=" not in res, rule
    print(f"dry run, 64 parts: {elapsed:.1f} s wall")


def test_osc_sae_and_lut_jobs_get_the_cpus_their_rules_use(tmp_path, model_dir, text_jsonl):
    """train_sae and build_lut: a GPU each, and the CPUs of their rule's threads from the rule (the profile
    held its own copy of the number before review 67)."""
    from actstore import resources

    configfile = write_config(tmp_path, model_dir("gpt2"), text_jsonl, "saelut",
                              extract={"hooks": ["h.1.attn.c_attn:input"]}, sae={"enabled": True},
                              lut={"enabled": True, "targets": ["h.1.attn.c_attn"]})
    proc = run([SNAKEMAKE, "lut", "-n", "--profile", "profiles/osc", "--configfile", str(configfile)],
               timeout=300, env={"ACTSTORE_SLURM_ACCOUNT": "PAS0042"})
    assert proc.returncode == 0, proc.stdout[-4000:]
    jobs = dict(re.findall(r"^rule (train_sae|build_lut):\n(?:    .*\n)*?    resources: (.*)$", proc.stdout, re.M))
    for rule, threads in (("train_sae", resources.SAE_JOB_THREADS), ("build_lut", resources.LUT_JOB_THREADS)):
        assert f"cpus_per_task={threads}" in jobs[rule] and "gpu=1" in jobs[rule], (rule, jobs)


def extract_part_resources(configfile: Path, *options: str) -> list[str]:
    """The `resources:` line of every extract_part job in a dry run of profiles/osc."""
    proc = run([SNAKEMAKE, "extract", "-n", "--profile", "profiles/osc", "--configfile", str(configfile), *options],
               timeout=300, env={"ACTSTORE_SLURM_ACCOUNT": "PAS0042"})
    assert proc.returncode == 0, proc.stdout[-4000:]
    jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", proc.stdout, re.M)
    return [res for rule, res in jobs if rule == "extract_part"]


def test_osc_image_parts_get_the_cpus_that_decode(tmp_path, model_dir, text_jsonl, image_folder):
    """An image part's Slurm job asks for IMAGE_JOB_THREADS CPUs (its decoding workers), a text part's
    for TEXT_JOB_THREADS, whatever the submitting host's cores (which cap Snakemake's `threads`);
    extract.num_workers asks for those workers, the main process and a writer thread per tensor,
    and the memory of the decoded images they keep ahead follows."""
    from actstore import resources

    def cpus_and_mem(name: str, model: str, data: Path, **extract) -> tuple[int, int]:
        config = write_config(tmp_path, model_dir(model), data, name, extract={"parts": 2, **extract})
        found = {(int(re.search(r"cpus_per_task=(\d+)", res).group(1)), int(re.search(r"mem_mb=(\d+)", res).group(1)))
                 for res in extract_part_resources(config)}
        assert len(found) == 1, found
        return found.pop()

    images, images_mem = cpus_and_mem("images", "dinov2", image_folder)
    assert images == resources.IMAGE_JOB_THREADS == 16
    assert cpus_and_mem("text", "bert", text_jsonl)[0] == resources.TEXT_JOB_THREADS == 4
    many, many_mem = cpus_and_mem("many", "dinov2", image_folder, layers=[0, 1], num_workers=512)  # > 1 GB ahead
    assert many == 512 + 1 + 2 and many_mem > images_mem


def test_resources_scale_with_data(tmp_path, model_dir, text_jsonl):
    """More tokens per part -> longer runtime; a bigger batch or more layers -> more memory; attempt 2
    doubles. (A huge max_seq_length makes the 30-row corpus big enough to leave the startup floor.)"""
    from actstore import resources

    base = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"parts": 1, "max_seq_length": 10**7})
    split = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"parts": 64, "max_seq_length": 10**7})
    assert resources.workload(base).rows == 30
    assert resources.extract_part_runtime(base) > resources.extract_part_runtime(split)
    big = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl,
                           extract={"batch_size": 100000, "max_seq_length": 10**7, "layers": [0, 1, 2]})
    assert resources.extract_part_mem_mb(big) > resources.extract_part_mem_mb(base)
    assert resources.extract_part_mem_mb(base, attempt=2) == 2 * resources.extract_part_mem_mb(base)


def test_image_tokens_follow_a_tower_that_emits_more_than_a_vit(tmp_path, model_dir, image_folder):
    """Slurm sizing counts an image as at least MAX_IMAGE_TOKENS tokens, and as the patches its
    config.json implies when more (Gemma 3's tower: 896 // 14 = 64, so 4,096 patches an image)."""
    import json
    import shutil

    from actstore import resources

    folder = shutil.copytree(model_dir("gemma3"), tmp_path / "gemma3")
    config = tiny.make_config(tmp_path, folder, image_folder, model={"tower": "vision"})
    assert resources.workload(config).tokens == 8 * resources.MAX_IMAGE_TOKENS
    document = json.loads((folder / "config.json").read_text())
    document["vision_config"].update(image_size=896, patch_size=14)
    (folder / "config.json").write_text(json.dumps(document))
    resources._workload.cache_clear()
    assert resources.workload(config).tokens == 8 * (4096 + 1)


def test_image_jobs_ask_for_what_they_hold_not_for_the_image_files(tmp_path, model_dir, image_folder):
    """An image sample is held as its name (its pixels are read when decoded), so 8 GB of image
    files ask for no more memory than 8 small ones did; what extraction adds for images is the
    decoded pixels its workers keep ahead, which follow the worker count (extract.num_workers, else
    the job's threads)."""
    import shutil

    from actstore import resources
    large = tmp_path / "large"
    shutil.copytree(image_folder, large)
    for path in large.rglob("*.png"):
        with path.open("r+b") as fh:
            fh.truncate(1 << 30)  # sparse: resources reads sizes, never pixels
    small = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder, extract={"parts": 1})
    big = tiny.make_config(tmp_path, model_dir("dinov2"), large, extract={"parts": 1})
    assert resources.workload(big).rows == resources.workload(small).rows == 8
    assert resources.extract_part_mem_mb(big) == resources.extract_part_mem_mb(small)
    for job in ("saev", "pickle_machines", "zarr_shards", "lmprobe_dataset"):
        assert resources.writer_mem_mb(big, job) == resources.writer_mem_mb(small, job), job
    pixels = resources.workload(small).pixel_bytes
    assert pixels >= 3 * 4 * tiny.IMAGE_SIZE ** 2  # a float32 RGB image of the tiny model's size fits
    half = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder, model={"torch_dtype": "bfloat16"},
                            extract={"parts": 1})
    assert resources.workload(half).pixel_bytes == pixels // 2  # the workers hand on bf16 pixels
    workers = 512  # enough decoded images ahead to cross the 1,000 MB rounding
    ahead = (workers * resources.items_ahead(4, workers) * resources.IMAGES_PER_ITEM + 8) * pixels
    assert ahead > 1e9
    named = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder, extract={"parts": 1, "num_workers": workers})
    one = resources.extract_part_mem_mb(small, threads=1)
    assert resources.extract_part_mem_mb(named, threads=1) >= one + ahead / 1e6 - 1000
    assert resources.extract_part_mem_mb(small, threads=workers) >= one + ahead / 1e6 - 1000


# ---------------------------------------------------------------- a real cluster


def cluster_problem() -> str | None:
    """None when the local cluster answers and its node takes jobs, else what is wrong."""
    if not shutil.which("sbatch"):
        return "no sbatch on PATH (bring a cluster up with: sudo tests/slurm/cluster.sh up)"
    try:
        proc = subprocess.run(["bash", str(REPO / "tests/slurm/cluster.sh"), "status"], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "tests/slurm/cluster.sh status did not answer in 60 s"
    return None if proc.returncode == 0 else f"cluster unhealthy:\n{proc.stdout}{proc.stderr}"


@pytest.fixture(scope="module")
def cluster():
    problem = cluster_problem()
    if problem and REQUIRED:
        pytest.fail(f"ACTSTORE_REQUIRE_SLURM=1 but {problem}")
    if problem:
        pytest.skip(problem)


def sacct(job_ids: list[str]) -> dict[str, dict]:
    """jobid -> {partition, account, state, tres} from the accounting database (bounded wait:
    slurmctld reports to slurmdbd asynchronously)."""
    fields = ["JobID", "Partition", "Account", "State", "AllocTRES"]
    rows: dict[str, dict] = {}
    for _ in range(30):
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", ",".join(job_ids), "-o", ",".join(fields)],
                             capture_output=True, text=True, timeout=30).stdout
        rows = {r.split("|")[0]: dict(zip(fields[1:], r.split("|")[1:])) for r in out.splitlines() if r}
        if set(job_ids) <= set(rows) and all(rows[j]["State"] == "COMPLETED" for j in job_ids):
            break
        time.sleep(1)
    return rows


def tree(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def strip_volatile(obj, parent: str | None = None):
    """Drop VOLATILE_KEYS, and a store's total size in the validation report's `inspect` entries
    (metadata files that hold a duration change length with its digits; data files are compared
    byte for byte anyway); a stage config's seal keeps its names alone (it records the digests of
    metadata files that hold the volatile keys)."""
    if isinstance(obj, dict):
        return {k: sorted(v) if k == SEAL_KEY else strip_volatile(v, k) for k, v in obj.items()
                if k not in VOLATILE_KEYS and not (parent == "inspect" and k == "bytes")}
    if isinstance(obj, list):
        return [strip_volatile(v, parent) for v in obj]
    return obj


def assert_same_outputs(local: Path, remote: Path) -> int:
    """Every stage directory byte-identical; JSON metadata equal once VOLATILE_KEYS are dropped."""
    stages = [d for d in sorted(local.iterdir()) if d.name not in ("logs", "benchmarks")]
    assert stages, f"no stage output under {local}"
    compared = 0
    for stage in stages:
        a, b = tree(stage), tree(remote / stage.name)
        assert sorted(a) == sorted(b), f"{stage.name}: files differ: {sorted(set(a) ^ set(b))}"
        for rel, path in a.items():
            if path.read_bytes() == b[rel].read_bytes() or path.suffix in VOLATILE_SUFFIXES:
                compared += 1
                continue
            assert path.suffix == ".json", f"{stage.name}/{rel} differs between the local and the Slurm run"
            assert strip_volatile(json.loads(path.read_text())) == strip_volatile(json.loads(b[rel].read_text())), \
                f"{stage.name}/{rel} differs beyond {sorted(VOLATILE_KEYS)}"
            compared += 1
    return compared


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_run_matches_local(cluster, tmp_path, model_dir, text_jsonl):
    model, data = model_dir("bert"), text_jsonl
    # The cluster's GPUs are fake ones torch cannot see: named cpu, the jobs on them run on the CPU.
    local_cfg = write_config(tmp_path, model, data, "local", extract={"device": "cpu"})
    slurm_cfg = write_config(tmp_path, model, data, "slurm", extract={"device": "cpu"})

    # The local run beside the Slurm one, which mostly waits on its status checks (their interval grows
    # by 10 s while no job finishes), on one core: the Slurm jobs run on this host too. Two Snakemake runs
    # share a working directory when their outputs are disjoint: the dump_to differs.
    env = {"SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
    local_run = start([SNAKEMAKE, TARGET, "--cores", "1", "--configfile", str(local_cfg)], env=env)
    logdir = tmp_path / "slurm_logs"
    try:
        remote = run([SNAKEMAKE, TARGET, "--profile", "tests/slurm/profile", "--slurm-logdir", str(logdir),
                      "--configfile", str(slurm_cfg)], timeout=RUN_TIMEOUT_S, env=env)
    except BaseException:  # the Slurm run timed out (the test has failed): its twin is not left running
        stop(local_run)
        raise
    local = finish(local_run, RUN_TIMEOUT_S)
    assert local.returncode == 0, local.stdout[-4000:]
    assert remote.returncode == 0, remote.stdout[-6000:]

    # Every job Snakemake ran was an sbatch job: one Slurm log per job, named by rule and job id.
    jobs = {p.stem: p.relative_to(logdir).parts[0].removeprefix("rule_") for p in logdir.rglob("*.log")}
    submitted = re.findall(r"submitted with SLURM jobid (\d+)", remote.stdout)
    n_jobs = int(re.search(r"^total\s+(\d+)$", remote.stdout, re.M).group(1))
    localrules = len(re.findall(r"^localrule ", remote.stdout, re.M))
    assert sorted(submitted) == sorted(jobs) and len(jobs) == n_jobs - localrules, remote.stdout[-4000:]
    assert sorted(jobs.values()).count("extract_part") == 2 and {"extract_scan", "extract_index"} <= set(jobs.values())
    # Each job's parse took what the main process had learnt of the data (actstore/parse_memo.py),
    # from a file it removed when the run was over.
    for log in logdir.rglob("*.log"):
        assert "actstore: the dataset as the main process read it:" in log.read_text(), log
    assert not list((tmp_path / "slurm" / "dump" / "logs" / "parse").iterdir())

    acct = sacct(list(jobs))
    for job_id, rule in jobs.items():
        row = acct.get(job_id)
        assert row and row["State"] == "COMPLETED", f"sacct for job {job_id} ({rule}): {row}"
        assert row["Account"] == "pas1234", row
        if rule == "extract_part":  # a text part: TEXT_JOB_THREADS CPUs, though this host has fewer cores
            assert row["Partition"] == "gpu" and "gres/gpu=1" in row["AllocTRES"], row
            assert "cpu=4" in row["AllocTRES"].split(","), row
        else:
            assert row["Partition"] == "cpu" and "gres/gpu" not in row["AllocTRES"], row
        if rule == "pickle_machines":  # pickle.threads (4 by default): as many CPUs as its threads
            assert "cpu=4" in row["AllocTRES"].split(","), row
        if rule in ("saev_shards", "lmprobe_tensors", "zarr_shards"):  # gathering and hashing at once
            assert "cpu=2" in row["AllocTRES"].split(","), row
        if rule in ("validate_store", "validate_extract"):  # verify checks up to 8 files at once
            assert "cpu=8" in row["AllocTRES"].split(","), row

    assert assert_same_outputs(tmp_path / "local" / "dump", tmp_path / "slurm" / "dump") > 0


@pytest.mark.slurm
def test_a_part_given_a_gpu_torch_cannot_see_is_refused_not_run_on_the_cpu(cluster, tmp_path, model_dir, text_jsonl):
    """extract.device auto in a Slurm job step given a GPU (the cluster's fake one, with the
    environment Slurm sets for it) that this CPU-only torch cannot see: the part stops before
    tokenizing, saying so and naming the key, instead of running on the CPU for many times as long;
    no part is written. run_part is what the extract_part rule's script calls."""
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"parts": 1})
    (tmp_path / "config.json").write_text(json.dumps(config))
    account = os.environ.get("ACTSTORE_TEST_ACCOUNT", "pas1234")
    script = ("import json, sys; from actstore.extract import run_part; "
              "run_part(json.load(open(sys.argv[1])), 0, sys.argv[2], progress=False)")
    proc = run(["srun", "-A", account, "-p", "gpu", "--gpus=1", "-t", "5", "--mem=2000", sys.executable, "-c", script,
                str(tmp_path / "config.json"), str(tmp_path / "part")], timeout=300)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert "extract.device auto: this Slurm job was given GPUs" in proc.stdout, proc.stdout[-4000:]
    assert "CPU-only build" in proc.stdout and not (tmp_path / "part").exists()
