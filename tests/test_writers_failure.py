"""The writers' failure paths: a file-size limit hit midway (as a full disk or a quota is) fails naming
the file and leaves nothing final-named, a rerun gives the clean run's bytes; a writer killed at a
set moment leaves no debris the next run does not sweep, and no job record that vouches for a
half-written file. Each writer runs in a subprocess, so a limit or a kill stays there."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actstore.errors import FormatError
from actstore.formats import saev
from actstore.formats.extract import open_extraction, synthetic_extraction

SAEV = {"patches_per_shard": 20_000, "tokens_per_window": 32}  # two shards of the extraction below
LMPROBE = {"token_strings": False, "shard_bytes": 1 << 20}
# Run in the child after its imports: SIGXFSZ ignored, so a write past the limit fails with EFBIG.
LIMITED = """
import resource, signal, sys
from pathlib import Path
from actstore.formats import lmprobe, saev, zarr
from actstore.formats.extract import open_extraction
from actstore.formats.pickle import write as pickle_write
extract, out, limit = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
SAEV, LMPROBE = {saev!r}, {lmprobe!r}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
"""


def run_child(body: str, *args: object) -> subprocess.CompletedProcess:
    """`body` after LIMITED's imports, in a fresh interpreter; a hang fails the test, not the suite."""
    code = LIMITED.format(saev=SAEV, lmprobe=LMPROBE) + body
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000"}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def extract(tmp_path_factory) -> Path:
    return synthetic_extraction(tmp_path_factory.mktemp("failure") / "extract", 6 * 10**6, 2, 64, [1, 2],
                                tokens=(16, 64))


NO_LIMIT = 1 << 40
WRITERS = {  # name: (the write, its final output under out)
    "saev": ("saev.write_store(open_extraction(extract), SAEV, out, model_config=None, progress=False)", "."),
    "pickle": ("pickle_write.write_machine(extract / 'part-0000', out / 'machine', model_params={}, "
               "shard_size_mb=0.5, progress=False)", "machine"),
    "zarr": ("zarr.write_shard(extract / 'part-0000', out / 'shard.zarr', progress=False)", "shard.zarr"),
}


def limit_below(reference: Path, name: str) -> int:
    """A file-size limit that the file `name` of a clean run under `reference` exceeds and every
    smaller file fits: halfway between its size and the next smaller one's."""
    sizes = {p.name: p.stat().st_size for p in reference.rglob("*") if p.is_file()}
    return (sizes[name] + max(size for size in sizes.values() if size < sizes[name])) // 2


@pytest.mark.parametrize("writer, named, limit_of", [
    ("saev", "acts000000.bin", lambda ref: 100_000),  # the shard's size is set by ftruncate, first
    ("pickle", "shard_0001.pkl.gz", lambda ref: 120_000),  # a shard fails at its close's flush
    ("zarr", "prompts.jsonl", lambda ref: limit_below(ref, "prompts.jsonl")),
    ("zarr", "files.json", lambda ref: limit_below(ref, "files.json")),
], ids=["saev-shard", "pickle-shard", "zarr-prompts", "zarr-files-json"])
def test_a_file_size_limit_fails_naming_the_file_and_a_rerun_gives_the_clean_bytes(extract, tmp_path, writer,
                                                                                   named, limit_of):
    write, final = WRITERS[writer]
    assert run_child(write, extract, tmp_path / "ref", NO_LIMIT).returncode == 0
    out = tmp_path / "out"
    failed = run_child(write, extract, out, limit_of(tmp_path / "ref" / final))
    error = failed.stderr.strip().splitlines()[-1]
    assert failed.returncode == 1 and error.startswith("OSError") and named in error and "File too large" in error
    assert not [p for p in out.iterdir() if not p.name.startswith(".")]  # nothing final-named
    assert run_child(write, extract, out, NO_LIMIT).returncode == 0
    assert tree(out) == tree(tmp_path / "ref")


@pytest.mark.parametrize("finish, named, limit", [
    ("saev.finish_store(plan, [out / 'job'], out / 'root')", "windows.npy", 5_000),
    ("lmprobe.finish_dataset(extract, [out / 'job'], out / 'dataset', LMPROBE)", "index/", 40_000),
], ids=["saev-windows", "lmprobe-index"])
def test_a_finishing_job_over_a_file_size_limit_names_the_file(extract, tmp_path, finish, named, limit):
    """The finishing jobs' own files (the job outputs are linked in, no byte written): numpy's and
    pyarrow's write errors name none."""
    plan = "plan = saev.plan_store(open_extraction(extract), SAEV, model_config=None)\n"
    job = ("saev.write_shards(plan, saev.extraction_fill(open_extraction(extract), plan), out / 'job', 1, 0)"
           if finish.startswith("saev") else "lmprobe.write_job(extract, out / 'job', LMPROBE, 1, 0, progress=False)")
    assert run_child(plan + job, extract, tmp_path, NO_LIMIT).returncode == 0
    failed = run_child(plan + finish, extract, tmp_path, limit)
    error = failed.stderr.strip().splitlines()[-1]
    assert failed.returncode == 1 and error.startswith("OSError") and named in error


# A fill that kills its process once it reaches example `at`: a job killed at a known moment.
KILLING_FILL = """
import os, signal
extraction = open_extraction(extract)
plan = saev.plan_store(extraction, SAEV, model_config=None)
fill = saev.extraction_fill(extraction, plan)
def killing_fill(start, out_rows):
    if start >= {at}:
        os.kill(os.getpid(), signal.SIGKILL)
    fill(start, out_rows)
"""


def test_a_killed_rerun_of_a_saev_shard_job_is_refused_by_its_finishing_job(extract, tmp_path):
    """Shard 1 rewritten (a new file, truncated to its size) when the job is killed: the job record of
    the earlier run must not be left to vouch for it, or finish_store builds a store of zeros."""
    extraction = open_extraction(extract)
    plan = saev.plan_store(extraction, SAEV, model_config=None)
    saev.write_shards(plan, saev.extraction_fill(extraction, plan), tmp_path / "job", 1, 0)
    kill = KILLING_FILL.format(at=plan.shard_sizes[0]) + "saev.write_shards(plan, killing_fill, out / 'job', 1, 0)"
    assert run_child(kill, extract, tmp_path, NO_LIMIT).returncode == -9
    with pytest.raises(FormatError, match="job.json"):
        saev.finish_store(plan, [tmp_path / "job"], tmp_path / "root")
    assert not (tmp_path / "root").exists() or not list((tmp_path / "root").iterdir())


def test_killed_saev_writes_leave_no_scratch_after_the_next_run(extract, tmp_path):
    """write_store's shards are written into a scratch dir beside the store: each killed run's (as large
    as the store) must be swept by the next run, not left to pile up."""
    kill = KILLING_FILL.format(at=1) + "saev.write_raw_store(plan, killing_fill, out, progress=False)"
    for _ in range(2):
        assert run_child(kill, extract, tmp_path / "out", NO_LIMIT).returncode == -9
    for out in ("out", "ref"):
        assert run_child(WRITERS["saev"][0], extract, tmp_path / out, NO_LIMIT).returncode == 0
    assert [p.name for p in (tmp_path / "out").iterdir()] == [p.name for p in (tmp_path / "ref").iterdir()]
    assert tree(tmp_path / "out") == tree(tmp_path / "ref")


@pytest.mark.slow
def test_killed_zarr_merges_leave_no_scratch_after_the_next_run(extract, tmp_path):
    """merge_stores links every chunk into a scratch dir beside the merged store, then finishes: a merge
    killed in between leaves a link to every chunk file there (millions of inodes), swept by the next."""
    shards = "".join(f"zarr.write_shard(extract / 'part-000{p}', out / 'shard-{p}.zarr', progress=False)\n"
                     for p in (0, 1))
    merge = "zarr.merge_stores([out / 'shard-0.zarr', out / 'shard-1.zarr'], out / 'merged', progress=False)\n"
    assert run_child(shards, extract, tmp_path, NO_LIMIT).returncode == 0
    killed = ("import os, actstore.formats.zarr.merge as zarr_merge\n"
              "zarr_merge.finish_merge = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n")
    for _ in range(2):
        assert run_child(killed + merge, extract, tmp_path, NO_LIMIT).returncode == -9
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".merged-chunks.")]
    assert run_child(merge, extract, tmp_path, NO_LIMIT).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "shard-0.zarr", "shard-1.zarr"]
