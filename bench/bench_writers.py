"""Benchmark every format writer on a synthetic extraction against `cp` + `sync` of its .npy files.

Builds (once, in --work) an extraction with the real PartWriter: --parts parts of samples of 64-512
tokens, layers 1/3/5, d = --dim, float32, --gb GB of activations in all. Then, page cache warm, each
writer runs as its own process(es) (a job of the workflow), followed by `sync`; the baseline is
`cp` of the same .npy files + `sync`, run just before each writer run (best of --repeat each). Reported
per writer and job shape: MB/s of activation bytes (1 MB = 1e6 B), the ratio to the best cp of the
whole run, the median ratio to the cp run just before (paired: the disk's speed drifts between
runs, up to 5x on the development VM), and the peak anonymous + dirty file-mapped memory summed over
its concurrent processes (actstore.memwatch).
Writes bench/out/writers.json and prints a markdown table.

Job shapes: `1 job` = one process writes everything (or one job per part, run one after the other);
`N jobs` = the scattered writer's N jobs run at once, then its finishing job. pickle and zarr shard:
a row per thread count (--thread-counts, default 1 2; their rules give 2): pickle's compression
threads per part job, with each compressor (isal, the workflow's, and zlib); zarr shard's threads
reading, casting, writing and hashing the chunk files. Each row also says where its time went: the
jobs' CPU seconds, the system (kernel) share of them, and the closing `sync`'s seconds (the disk
catching up with what the jobs wrote); each zarr shard job prints its threads' seconds in each step
of a chunk (its file: read, cast, its directories and write, in one call; its hash).
Each run's output is set aside and deleted when the bench ends (set_aside: no run pays for the
deletions of the one before).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from actstore.formats.extract import INDEX, open_extraction, part_dirname, synthetic_extraction
from actstore.jobs import job_items
from actstore.memwatch import Memory, PeakMemory, machine_available_gb

OUT = Path(__file__).resolve().parent / "out"
LAYERS = [1, 3, 5]  # as the issue measured
SAEV = {"patches_per_shard": 2_400_000, "tokens_per_window": 32}  # the schema's defaults
LMPROBE = {"token_strings": False}  # the synthetic extraction has no tokenizer
PARAMS = {"hidden_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 16, "vocab_size": 30522}


def activation_files(extract: Path) -> list[Path]:
    return sorted(extract.glob("part-*/layer_*.npy"))


# ------------------------------------------------------------------ one job, run in its own process

def run_job(args: argparse.Namespace) -> None:
    """The body of one writer job (`--job NAME`), as the workflow's script would run it."""
    from actstore.formats import lmprobe, pickle, saev, zarr

    extract, out = Path(args.extract), Path(args.out)
    name, job_dirs = args.job, [out / f"job-{j:04d}" for j in range(args.jobs)]
    if name.startswith("saev"):
        extraction = open_extraction(extract)
        plan = saev.plan_store(extraction, SAEV, model_config=None, labels=False)
        if name == "saev":
            saev.write_store(extraction, SAEV, out, model_config=None, progress=False)
        elif name == "saev-shards":
            saev.write_shards(plan, saev.extraction_fill(extraction, plan), job_dirs[args.job_index], args.jobs,
                              args.job_index)
        else:
            saev.finish_store(plan, job_dirs, out)
    elif name == "lmprobe":
        lmprobe.write_dataset(extract, out / "dataset", LMPROBE, progress=False)
    elif name == "lmprobe-tensors":
        lmprobe.write_job(extract, job_dirs[args.job_index], LMPROBE, args.jobs, args.job_index, progress=False)
    elif name == "lmprobe-finish":
        lmprobe.finish_dataset(extract, job_dirs, out / "dataset", LMPROBE)
    elif name == "pickle":
        pickle.write_machine(extract / part_dirname(args.part), out / part_dirname(args.part), model_params=PARAMS,
                             threads=args.threads, compressor=args.compressor, progress=False)
    elif name == "zarr":
        logging.basicConfig(level=logging.INFO, format="%(message)s")  # the job's line: its chunk stages' seconds
        zarr.write_shard(extract / part_dirname(args.part), out / f"shard-{args.part:04d}.zarr", progress=False,
                         threads=args.threads)
    elif name == "zarr-merge":
        zarr.merge_stores(sorted(Path(args.shards).glob("shard-*.zarr")), out / "merged", progress=False)
    elif name == "zarr-chunks":
        shards = sorted(Path(args.shards).glob("shard-*.zarr"))
        zarr.link_chunks([shards[i] for i in job_items(len(shards), args.jobs, args.job_index)],
                         job_dirs[args.job_index], args.jobs, args.job_index, progress=False)
    elif name == "zarr-finish":
        zarr.finish_merge(sorted(Path(args.shards).glob("shard-*.zarr")), job_dirs, out / "merged", progress=False)
    else:
        raise SystemExit(f"unknown job {name!r}")


# ------------------------------------------------------------------ the driver

def job_argv(name: str, extract: Path, out: Path, **extra) -> list[str]:
    argv = [sys.executable, __file__, "--job", name, "--extract", str(extract), "--out", str(out)]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def children_cpu_seconds() -> tuple[float, float]:
    """The finished jobs' (user + system, system) CPU seconds: system time is the kernel's work for them
    (file and directory creation, page cache copies), user time their own."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime, usage.ru_stime


def run_phases(phases: list[list[list[str]]]) -> tuple[float, Memory, dict[str, float]]:
    """Run each phase's jobs at once, phases one after the other, then `sync`: (seconds, peak memory,
    where the time went: the jobs' CPU seconds, the kernel's share of them, and the closing `sync`'s
    wall seconds, which tell a job bound by its CPUs from one waiting for the disk)."""
    peak = Memory()
    t0, cpu0 = time.perf_counter(), children_cpu_seconds()
    for phase in phases:
        procs = [subprocess.Popen(argv) for argv in phase]
        with PeakMemory([p.pid for p in procs]) as watch:
            codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a job failed ({codes}): {phase}")
        peak = watch.peak if watch.peak.total > peak.total else peak
    t_sync, (cpu, system) = time.perf_counter(), children_cpu_seconds()
    subprocess.run(["sync"], check=True)
    end = time.perf_counter()
    return end - t0, peak, {"cpu_seconds": cpu - cpu0[0], "system_cpu_seconds": system - cpu0[1],
                            "sync_seconds": end - t_sync}


def set_aside(out: Path, trash: Path, keep_free: int) -> None:
    """Move a finished run's output into `trash` (emptied when the bench ends) rather than delete it.
    On an ext4 without a journal, as the development VM's disk, inode allocation skips the inodes freed
    in the last minutes, so a run that creates many files right after a run's deletions pays for them:
    8,000 directories with a file each took 0.15 s on fresh inodes and 3.4-4.2 s after such deletions,
    and a 1 GB zarr shard job's chunk loop 0.69-0.72 s against 0.81-0.92 s (session 47). The trash is
    emptied now instead when the disk would keep less than keep_free bytes free."""
    trash.mkdir(exist_ok=True)
    out.rename(trash / str(len(list(trash.iterdir()))))
    if shutil.disk_usage(trash).free < keep_free:
        shutil.rmtree(trash)


def cp_baseline(files: list[Path], dest: Path) -> float:
    t0 = time.perf_counter()
    for part in sorted({f.parent for f in files}):
        (dest / part.name).mkdir(parents=True)
        subprocess.run(["cp", *(str(f) for f in files if f.parent == part), str(dest / part.name)], check=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t0


def variants(extract: Path, work: Path, shards: Path, parts: int, jobs: int,
             thread_counts: list[int]) -> dict[str, tuple[str, list[list[list[str]]]]]:
    """writer -> (job shape, phases of concurrent job argvs); `shards`: the zarr merge's input stores."""
    out = work / "w"
    per_part = lambda name, **kw: [[job_argv(name, extract, out, part=p, **kw)] for p in range(parts)]  # noqa: E731

    def scattered(name: str, finish: str, **kw) -> tuple[str, list[list[list[str]]]]:
        scatter = [job_argv(name, extract, out, jobs=jobs, job_index=j, **kw) for j in range(jobs)]
        return f"{jobs} jobs + finish", [scatter, [job_argv(finish, extract, out, jobs=jobs, **kw)]]
    threaded = lambda t: f"{t} thread{'s' if t > 1 else ''}"  # noqa: E731
    return {
        "saev": ("1 job", [[job_argv("saev", extract, out)]]),
        "saev, scattered": scattered("saev-shards", "saev-finish"),
        "lmprobe": ("1 job", [[job_argv("lmprobe", extract, out)]]),
        "lmprobe, scattered": scattered("lmprobe-tensors", "lmprobe-finish"),
        **{f"pickle (gzip-1, {compressor}), {threaded(t)}": ("per part", per_part("pickle", threads=t,
                                                                                 compressor=compressor))
           for compressor in ("isal", "zlib") for t in thread_counts},
        **{f"zarr shard, {threaded(t)}": ("per part", per_part("zarr", threads=t)) for t in thread_counts},
        "zarr merge": ("1 job", [[job_argv("zarr-merge", extract, out, shards=shards)]]),
        "zarr merge, scattered": scattered("zarr-chunks", "zarr-finish", shards=shards),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0, help="GB of activations in the synthetic extraction")
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the extraction's storage dtype (bfloat16: what a bf16 model's extraction stores by "
                             "default); --gb counts its activations as float32")
    parser.add_argument("--jobs", type=int, default=2, help="jobs of the scattered writers")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2],
                        help="threads per job of the pickle and zarr shard rows (one row each)")
    parser.add_argument("--only", nargs="*", help="writers whose name starts with one of these")
    parser.add_argument("--work", default=str(OUT / "writers-work"), help="where the extraction is built (kept)")
    # one job (internal): run by the driver in its own process
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--extract", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--compressor", default="isal", help=argparse.SUPPRESS)
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    parser.add_argument("--job-index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return run_job(args)
    work = Path(args.work)
    shutil.rmtree(work / "trash", ignore_errors=True)  # an interrupted run's
    extract = work / f"extract-{args.gb:g}gb-{args.parts}p-d{args.dim}" / args.dtype
    if not (extract / INDEX).is_file():
        shutil.rmtree(extract, ignore_errors=True)
        synthetic_extraction(extract, int(args.gb * 1e9), args.parts, args.dim, LAYERS, dtype=args.dtype)
    files = activation_files(extract)
    n_bytes = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache, as every run below finds it
        subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)
    available = machine_available_gb()  # what the writers find (a machine short of it pays a reclaim a page)
    zarr_shards = extract.with_name(f"zarr-shards-{args.dtype}")
    chosen = {name: how for name, how in variants(extract, work, zarr_shards, args.parts, args.jobs,
                                                   args.thread_counts).items()
              if not args.only or name.startswith(tuple(args.only))}
    # the zarr merge rows' input stores, built only for them (--only "zarr shard" on a GPU lease: 15 s saved)
    if any(name.startswith("zarr merge") for name in chosen) and not zarr_shards.is_dir():
        run_phases([[job_argv("zarr", extract, zarr_shards, part=p)] for p in range(args.parts)])
    rows = []
    cp_s = []
    for name, (shape, phases) in chosen.items():
        best, paired = None, []
        for _ in range(args.repeat):
            shutil.rmtree(work / "cp", ignore_errors=True)
            cp_s.append(cp_baseline(files, work / "cp"))
            shutil.rmtree(work / "cp")
            shutil.rmtree(work / "w", ignore_errors=True)
            (work / "w").mkdir()
            seconds, peak, split = run_phases(phases)
            set_aside(work / "w", work / "trash", keep_free=2 * n_bytes)
            paired.append(cp_s[-1] / seconds)
            if best is None or seconds < best[0]:
                best = (seconds, peak, split)
        rows.append({"writer": name, "shape": shape, "seconds": best[0], **best[2], "mb_per_s": n_bytes / best[0] / 1e6,
                     "x_cp_paired": statistics.median(paired), "x_cp_paired_all": paired,
                     "anonymous_mb": best[1].anonymous / 1e6, "dirty_mapped_mb": best[1].dirty_mapped / 1e6})
    shutil.rmtree(work / "trash", ignore_errors=True)
    cp_rate = n_bytes / min(cp_s) / 1e6
    for row in rows:
        row["x_cp"] = row["mb_per_s"] / cp_rate
    result = {"bytes": n_bytes, "dtype": args.dtype, "parts": args.parts, "dim": args.dim, "layers": LAYERS,
              "n_samples": open_extraction(extract).n_samples, "cp_mb_per_s": cp_rate,
              "memory_available_gb": available, "writers": rows}
    OUT.mkdir(exist_ok=True)
    (OUT / "writers.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{n_bytes / 1e9:.2f} GB of {args.dtype}, {result['n_samples']} samples, cp + sync {cp_rate:.1f} MB/s (best of {len(cp_s)}), "
          f"{available} GB of memory available")
    print("| writer | job shape | MB/s | x best cp | x cp, paired | peak anonymous | peak dirty mapped "
          "| s (CPU s, of them system, closing sync s) |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        spread = f"{min(r['x_cp_paired_all']):.2f}–{max(r['x_cp_paired_all']):.2f}"
        print(f"| {r['writer']} | {r['shape']} | {r['mb_per_s']:.1f} | {r['x_cp']:.2f} | {r['x_cp_paired']:.2f} "
              f"({spread}) | {r['anonymous_mb']:.0f} MB | {r['dirty_mapped_mb']:.0f} MB "
              f"| {r['seconds']:.2f} ({r['cpu_seconds']:.2f}, {r['system_cpu_seconds']:.2f}, {r['sync_seconds']:.2f}) |")


if __name__ == "__main__":
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1700000000")
    main()
