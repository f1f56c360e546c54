"""Writers' memory is bounded by design: each writer job runs in its own process on a synthetic
extraction and on one 8x larger, with its copy buffers shrunk to 1 MiB so that both are many
buffers long; its peak anonymous + dirty file-mapped memory (what a Slurm memory cgroup charges
and cannot drop) must not grow with the data, and must stay under the bound its rules' mem_mb
states (actstore.resources.writer_mem_mb) for that extraction."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tiny
from actstore import resources
from actstore.config import load_config
from actstore.formats.extract import layer_tensor, open_extraction, synthetic_extraction
from actstore.memwatch import PeakMemory, process_memory

SMALL_MB = 8           # activations of the smaller extraction; the larger holds LARGER x as many
LARGER = 8
DIM = 32               # narrow rows: many tokens per MB, so per-token structures would show
LAYERS = [1, 3, 5]
GROWTH_MB = 8          # allowed difference between the two writes' memory (allocator noise, per-sample rows)

# One writer job, as the workflow's script runs it, with every copy buffer at 1 MiB.
JOB = """
import importlib, sys
from pathlib import Path
from actstore.formats.extract import open_extraction

name, extract, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
shrunk = sys.argv[4:] != ["real"]  # "real": the writers' own buffer sizes (the data-4x-the-bound test)
fmt = importlib.import_module("actstore.formats." + name.removesuffix("-merge"))  # its imports only
if name == "saev" and shrunk:
    fmt.write.CHUNK_BYTES = 1 << 20
if name == "lmprobe":
    import os
    os.environ["ARROW_DEFAULT_MEMORY_POOL"] = "system"  # as workflow/scripts/lmprobe.py sets it
    import pandas, pyarrow.parquet  # the index's imports (pa.array imports pandas): constants, measured before
if name == "lmprobe" and shrunk:
    fmt.write.COPY_BYTES = 1 << 20
    # The index's row groups (per-token columns, ~50 B a token) are bounded at 2^20 tokens, more than the
    # larger extraction holds: shrunk, so the bound is what is measured, not a group still filling.
    fmt.write.ROW_GROUP_TOKENS = 1 << 14
if name == "zarr-merge":  # zarr writes one chunk (here 64 KiB) at a time
    shards = [fmt.write_shard(extract / f"part-{p:04d}", out / f"shard-{p}.zarr", progress=False) for p in (0, 1)]
print("ready", flush=True)
sys.stdin.readline()  # the parent starts measuring the writer alone, after its imports
if name == "saev":
    fmt.write_store(open_extraction(extract), {"patches_per_shard": 2_400_000, "tokens_per_window": 32}, out,
                    model_config=None, progress=False)
elif name == "lmprobe":
    fmt.write_dataset(extract, out / "dataset", {"token_strings": False, "shard_bytes": 4 << 20}, progress=False)
elif name == "pickle":
    fmt.write_machine(extract / "part-0000", out / "machine", model_params={}, shard_size_mb=1, threads=2,
                      progress=False)
elif name == "zarr":
    fmt.write_shard(extract / "part-0000", out / "shard.zarr", progress=False)
elif name == "zarr-merge":
    fmt.merge_stores([out / "shard-0.zarr", out / "shard-1.zarr"], out / "merged", progress=False)
"""


@pytest.fixture(scope="module")
def extractions(tmp_path_factory):
    """{(storage dtype, size): extraction}: float32, and bfloat16 (what a bf16 model's extraction stores
    by default, widened to float32 by every writer as it reads)."""
    root = tmp_path_factory.mktemp("scale")
    return {(dtype, size): synthetic_extraction(root / f"extract-{dtype}-{size}", size * SMALL_MB * 10**6, 2, DIM,
                                                LAYERS, dtype=dtype)
            for dtype in ("float32", "bfloat16") for size in (1, LARGER)}


def write_mb(name: str, extract: Path, out: Path, *flags: str) -> tuple[float, float]:
    """(MB the job's write adds to what it held before it: its imports and, for the merge, its
    shards; the job's peak MB)."""
    proc = subprocess.Popen([sys.executable, "-c", JOB, name, str(extract), str(out), *flags], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", f"{name} job failed to start"
    before = process_memory(proc.pid).total / 1e6
    with PeakMemory([proc.pid], interval=0.005) as watch:
        proc.stdin.close()
        assert proc.wait() == 0, f"{name} job failed"
    peak = watch.peak.total / 1e6
    return peak - before, peak


# The rules whose work each job above does in one process: its peak must stay under the larger bound.
RULES = {"saev": ("saev_shards", "saev"), "lmprobe": ("lmprobe_tensors", "lmprobe_dataset"),
         "pickle": ("pickle_machines",), "zarr": ("zarr_shards",), "zarr-merge": ("zarr_merge_chunks", "zarr_merge")}


def bound_mb(name: str, extract: Path, layers: list[int] = LAYERS, dim: int = DIM) -> float:
    """The mem_mb the rules state for this extraction (in its storage dtype), before rounding up to whole GB."""
    extraction = open_extraction(extract)
    stored = extraction.parts[0].tensor(layer_tensor(layers[0])).raw.dtype
    config = load_config(tiny.REPO / "config" / "config.yaml")
    config["extract"].update(layers=layers, max_seq_length=extraction.info.max_seq_length, parts=2)
    config["pickle"].update(threads=2, shard_size_mb=1)
    text_bytes = sum((part.dir / "samples.jsonl").stat().st_size for part in extraction.parts)
    w = resources.Workload(rows=extraction.n_samples, tokens=extraction.n_tokens, d=dim, n_tensors=len(layers),
                           weight_bytes=0, text_bytes=text_bytes, itemsize=stored.itemsize)
    return resources.WRITER_BASE_MB + max(resources.writer_buffer_bytes(w, config, rule) for rule in RULES[name]) / 1e6


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["saev", "lmprobe", "pickle", "zarr", "zarr-merge"])
@pytest.mark.slow
def test_writer_memory_does_not_grow_with_the_data(extractions, name, dtype, tmp_path):
    small, _ = write_mb(name, extractions[dtype, 1], tmp_path / "small")
    large_write, large = write_mb(name, extractions[dtype, LARGER], tmp_path / "large")
    assert large_write - small < GROWTH_MB, (f"{name}: writing {SMALL_MB} MB took {small:.1f} MB, "
                                             f"{LARGER}x that took {large_write:.1f} MB")
    bound = bound_mb(name, extractions[dtype, LARGER])
    assert large < bound, f"{name}: peak {large:.0f} MB over the {bound:.0f} MB its rules ask for"


SCALE = os.environ.get("ACTSTORE_SCALE_TESTS") == "1"  # `make test-scale`: minutes and ~15 GB of disk


@pytest.fixture(scope="module")
def extraction_4x_the_bound(tmp_path_factory):
    """An extraction (d = 1024, layers 1/3/5) holding 6 GB: more than 4x each writer's mem_mb (<= 1.45 GB;
    lmprobe's tensor jobs, a ring a file for each of their threads, 1.40 GB)."""
    return synthetic_extraction(tmp_path_factory.mktemp("scale-4x") / "extract", 6_000 * 10**6, 2, 1024, LAYERS)


@pytest.mark.skipif(not SCALE, reason="data 4x the memory bound: run with make test-scale")
@pytest.mark.parametrize("name", ["saev", "lmprobe", "pickle", "zarr", "zarr-merge"])
def test_writer_peak_stays_under_its_mem_mb_on_data_4x_larger(extraction_4x_the_bound, name, tmp_path):
    """Each writer job with its own buffer sizes on activations over 4x the mem_mb its rules ask for:
    its peak anonymous + dirty file-mapped memory stays under that mem_mb (unrounded)."""
    extract = extraction_4x_the_bound
    data_mb = sum(f.stat().st_size for f in extract.glob("part-*/layer_*.npy")) / 1e6
    bound = bound_mb(name, extract, dim=1024)
    assert data_mb > 4 * bound, f"{data_mb:.0f} MB of activations, not 4x the {bound:.0f} MB bound"
    _, peak = write_mb(name, extract, tmp_path, "real")
    shutil.rmtree(tmp_path)
    print(f"{name}: peak {peak:.0f} MB, mem_mb {bound:.0f} (unrounded), data {data_mb:.0f} MB")
    assert peak < bound, f"{name}: peak {peak:.0f} MB over the {bound:.0f} MB its rules ask for"


def test_lmprobe_index_holds_one_row_group_of_rows(tmp_path):
    """Many short samples (1-4 tokens; an index row group holds ~6,500): the finisher parses
    each part's rows as it writes them (extract.read.SampleRows), so it grows only by the per-row
    arrays its rules state (the plan's and the rows' line index, resources.py). Holding every row as a
    dict, as it once did, took ~500 B a row more."""
    extracts = {n: synthetic_extraction(tmp_path / f"extract-{n}", n * 2.5 * 32 * 4, 2, 32, [1], tokens=(1, 4))
                for n in (8_000, 32_000)}
    rows = {n: open_extraction(e).n_samples for n, e in extracts.items()}
    small, _ = write_mb("lmprobe", extracts[8_000], tmp_path / "small")
    large_write, large = write_mb("lmprobe", extracts[32_000], tmp_path / "large")
    designed = (resources.LMPROBE_PLAN_ROW_BYTES + resources.ROW_INDEX_BYTES) * (rows[32_000] - rows[8_000]) / 1e6
    assert large_write - small < designed + 4, (f"lmprobe: {small:.1f} MB at {rows[8_000]} rows, "
                                                f"{large_write:.1f} MB at {rows[32_000]}")
    bound = bound_mb("lmprobe", extracts[32_000], layers=[1])
    assert large < bound, f"lmprobe: peak {large:.0f} MB over the {bound:.0f} MB its rules ask for"


MANY_PARTS = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from actstore.formats import lmprobe, saev
from actstore.formats.extract import open_extraction
extract, out = Path(sys.argv[1]), Path(sys.argv[2])
lmprobe.write_dataset(extract, out / "lmprobe", {"token_strings": False}, progress=False)
saev.write_store(open_extraction(extract), {"patches_per_shard": 5_000, "tokens_per_window": 4}, out / "saev",
                 model_config=None, progress=False)
"""


def test_jobs_reading_every_part_stay_under_the_open_files_limit(tmp_path):
    """96 parts read in a random prompt order with the soft limit at 64 descriptors: each part's
    maps (token ids, a layer) and samples.jsonl would hold ~4 descriptors a part, and the job
    failed with "Too many open files"; the parts now keep a quarter of the limit mapped at once."""
    from actstore.formats import lmprobe, saev

    extract = synthetic_extraction(tmp_path / "extract", 96 * 2_000, 96, 8, [1, 2], tokens=(2, 8))
    run = subprocess.run([sys.executable, "-c", MANY_PARTS, str(extract), str(tmp_path)], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    (store,) = (tmp_path / "saev").iterdir()  # root/<hash>/
    assert lmprobe.verify(tmp_path / "lmprobe") == [] and saev.verify(store) == []


def test_scatter_jobs_never_read_the_sample_rows(tmp_path):
    """saev_shards and lmprobe_tensors plan from the token offsets alone: with every samples.jsonl
    made unreadable JSON they still write their files (the finishing jobs are the ones that need rows)."""
    from actstore.formats import lmprobe, saev

    extract = synthetic_extraction(tmp_path / "extract", 2 * 10**6, 2, DIM, LAYERS)
    for rows in extract.glob("part-*/samples.jsonl"):
        rows.write_text("not json\n")
    extraction = open_extraction(extract)
    plan = saev.plan_store(extraction, {"patches_per_shard": 5_000, "tokens_per_window": 32}, model_config=None,
                           labels=False)
    saev.write_shards(plan, saev.extraction_fill(extraction, plan), tmp_path / "saev-job", 1, 0)
    written = lmprobe.write_job(extract, tmp_path / "lmprobe-job", {"token_strings": False}, jobs=1, job=0,
                                progress=False)
    assert len(plan.shard_sizes) > 1 and len(list((tmp_path / "saev-job").glob("acts*.bin"))) == len(plan.shard_sizes)
    assert written and all((tmp_path / "lmprobe-job" / rel).is_file() for rel in written)
    with pytest.raises(Exception, match="samples.jsonl"):
        extraction.sample(0)  # the rows really are unreadable


MERGE_FINISH = """
import sys
from pathlib import Path
from actstore.formats import zarr
root = Path(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
zarr.finish_merge(sorted(root.glob("shard-*.zarr")), sorted(root.glob("merge-*")), root / "merged", progress=False)
print("merged", flush=True)
sys.stdin.readline()
assert zarr.verify(root / "merged") == []
"""


def test_zarr_merge_finisher_and_verify_hold_nothing_per_chunk_file(tmp_path):
    """Samples of 2-4 tokens in 1-token chunks: ~4 chunk files a sample, 7.5K and 30K files. The
    finisher streams the jobs' records into a table on disk and files.json out in name order, and
    verify walks files.json beside the store in that order, so each grows by per-sample arrays alone
    (resources: the merged 1-D vectors and the activations' directory listing, 300 B a sample). Holding
    the records, the listing and files.json as dicts took ~500 B a file more in the finisher (the
    larger run: +11 MB), ~700 B in verify (+16 MB)."""
    from actstore.formats import zarr

    grown = {}
    for rows in (750, 3_000):
        root = tmp_path / str(rows)
        extract = synthetic_extraction(root / "extract", rows * 3 * 8 * 4, 2, 8, [1], tokens=(2, 4))
        shards = [zarr.write_shard(extract / f"part-{p:04d}", root / f"shard-{p}.zarr", t_chunk=1, progress=False)
                  for p in (0, 1)]
        for job in (0, 1):
            zarr.link_chunks([root / shards[job]["path"]], root / f"merge-{job}", 2, job, progress=False)
        proc = subprocess.Popen([sys.executable, "-c", MERGE_FINISH, str(root)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        for step, done in (("finish", lambda: proc.stdout.readline().strip() == "merged"), ("verify", proc.wait)):
            before = process_memory(proc.pid).total / 1e6
            with PeakMemory([proc.pid], interval=0.005) as watch:
                proc.stdin.write("go\n")
                proc.stdin.flush()
                assert done() in (True, 0), f"{step} failed"
            grown[step, rows] = watch.peak.total / 1e6 - before
    designed = resources.ZARR_MERGE_SAMPLE_BYTES * (3_000 - 750) / 1e6
    for step in ("finish", "verify"):
        assert grown[step, 3_000] - grown[step, 750] < designed + 4, \
            f"{step}: grew {grown[step, 750]:.1f} MB, then {grown[step, 3_000]:.1f} MB"


LINK_JOB = """
import sys
from pathlib import Path
from actstore.formats import zarr
root, n = Path(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
zarr.link_chunks(sorted(root.glob("shard-*.zarr"))[:n], root / f"merge-{n}", 1, 0, progress=False)
"""


def test_a_zarr_link_job_holds_one_shards_records_whatever_the_shards_it_takes(tmp_path):
    """A chunk-link job of 4 shards (~6K chunk files each) against one of 1: it streams each chunk's
    {bytes, sha256} into its job record as it links the file, and holds the files.json of the shard it
    is on alone (resources: a part's records). Holding every shard's records to the end took ~1 KB a
    chunk file, ~18 MB more for 4 shards than for 1."""
    from actstore.formats import zarr

    extract = synthetic_extraction(tmp_path / "extract", 8_000 * 3 * 8 * 4, 4, 8, [1], tokens=(2, 4))
    for part in range(4):
        zarr.write_shard(extract / f"part-{part:04d}", tmp_path / f"shard-{part}.zarr", t_chunk=1, progress=False)
    grown = {}
    for n in (1, 4):
        proc = subprocess.Popen([sys.executable, "-c", LINK_JOB, str(tmp_path), str(n)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        before = process_memory(proc.pid).total / 1e6
        with PeakMemory([proc.pid], interval=0.005) as watch:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.wait() == 0
        grown[n] = watch.peak.total / 1e6 - before
    chunks = sum(path.is_file() for path in (tmp_path / "merge-1" / zarr.ACTS).rglob("*"))
    per_shard = resources.FILES_JSON_ENTRY_BYTES * chunks / 1e6
    assert grown[4] - grown[1] < per_shard, f"1 shard: grew {grown[1]:.1f} MB, 4 shards: {grown[4]:.1f} MB"
