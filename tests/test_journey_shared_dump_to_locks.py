"""Review 66, journey: "my lab shares one dump_to on scratch". Snakemake locks a working directory, not
a dump_to, so two members' runs of one extraction hash can build the same part at once. Found: a writer's
start swept every temp of its output as a killed writer's debris, so the second run deleted the first's
part in progress; the first job then failed (FileNotFoundError on its temp's part.json) after its whole
forward pass, and where the second run's part landed first, Snakemake removed that failed job's output:
the second run's finished part. Fixed: atomic_path's writer holds a POSIX lock on a lock file beside its
temp, and a second writer of the same output stops before its work, naming the temp of the run at work
(errors.WriteInProgressError); a temp whose writer is gone (the kernel dropped its lock) is swept."""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import tiny
from actstore.errors import WriteInProgressError
from actstore.io_utils import is_temp, scratch_beside, write_bytes_atomic

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def test_a_second_run_of_a_part_stops_naming_the_temp_of_the_run_at_work(tmp_path, model_dir, text_jsonl):
    from actstore.extract import run_part
    from actstore.formats.extract import write_part

    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl)
    final = tmp_path / "part-0000"
    with write_part(final) as first_run:  # user A's job, mid-way through its part
        first_run.mkdir()
        (first_run / "layer_000.npy").write_bytes(b"user A's activations, still being written")
        with pytest.raises(WriteInProgressError, match=f"{re.escape(str(final))}: another run is writing it now "
                                                       f"\\(its temp {re.escape(str(first_run))}"):
            run_part(config, 0, final, progress=False)  # user B's job for the same part, from its own workdir
        assert (first_run / "layer_000.npy").is_file(), f"user B's run deleted user A's temp {first_run}"
    assert (final / "layer_000.npy").is_file()


# User A's writer of sys.argv[1], at work: it prints its temp's path, then waits to be killed.
WRITER = """
import sys, time
from actstore.io_utils import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.mkdir()
    (tmp / "acts.bin").write_bytes(b"user A's activations, still being written")
    print(tmp, flush=True)
    time.sleep(600)
"""


def running_writer(final: Path) -> tuple[subprocess.Popen, Path]:
    """Another process writing `final` (atomic_path), and its temp, once it is made."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(final)], stdout=subprocess.PIPE, text=True)
    temp = Path(writer.stdout.readline().strip())
    writer.stdout.close()
    assert temp.is_dir(), f"the writer of {final} ended before making its temp"
    return writer, temp


def test_a_writer_leaves_the_temp_of_a_running_writer_and_sweeps_it_once_that_writer_is_killed(tmp_path):
    final = tmp_path / "part-0000"
    writer, temp = running_writer(final)
    try:
        with pytest.raises(WriteInProgressError, match=f"another run is writing it now \\(its temp "
                                                       f"{re.escape(str(temp))}, whose lock {temp.name}.lock"):
            write_bytes_atomic(final, b"user B's part")
        assert (temp / "acts.bin").read_bytes() == b"user A's activations, still being written"
        assert sorted(p.name for p in tmp_path.iterdir()) == [temp.name, temp.name + ".lock"]  # B's own gone
    finally:
        writer.kill()  # SIGKILL: the kernel drops its lock; nothing of its own cleans up
        writer.wait()
    write_bytes_atomic(final, b"user B's part")
    assert final.read_bytes() == b"user B's part"
    assert [p.name for p in tmp_path.iterdir()] == [final.name], "the killed writer's temp or lock file was left"


def test_a_killed_writers_temp_and_lock_file_and_an_earlier_releases_lockless_temp_are_swept(tmp_path):
    final = tmp_path / "store.zarr"
    writer, killed = running_writer(final)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    earlier = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=tmp_path))  # no lock file
    (earlier / "acts.bin").write_bytes(b"an earlier release's debris")
    assert is_temp(tmp_path / (killed.name + ".lock"))  # verify and seals skip it as they skip the temps
    write_bytes_atomic(final, b"data")
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_a_one_job_writers_scratch_is_left_to_its_running_writer_and_swept_once_it_is_killed(tmp_path):
    """saev's write_raw_store and zarr's merge_stores write their scratch beside the store under a temp
    name of `<store>-shards` / `<store>-chunks` (io_utils.scratch_beside): another run of the same store
    stopped naming it, where TemporaryDirectory's scratch was swept as a killed run's debris."""
    scratch_of = tmp_path / "store-chunks"
    writer, temp = running_writer(scratch_of)
    try:
        with pytest.raises(WriteInProgressError, match=re.escape(str(temp))):
            with scratch_beside(scratch_of):
                pass
        assert (temp / "acts.bin").exists()
    finally:
        writer.kill()
        writer.wait()
    with scratch_beside(scratch_of) as scratch:
        assert scratch.is_dir() and is_temp(scratch)
    assert list(tmp_path.iterdir()) == [], "the killed writer's scratch, or this one, was left"


def test_where_the_file_system_takes_no_locks_a_writer_works_without_a_lock_file(tmp_path, monkeypatch):
    """NFS mounted nolock: lockf fails with ENOLCK; the writer goes on as before the locks, unprotected."""
    from actstore import io_utils

    def no_locks(fd: int, cmd: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(io_utils.fcntl, "lockf", no_locks)
    lockless = Path(tempfile.mkdtemp(prefix=".x.", suffix=".tmp", dir=tmp_path))
    with io_utils.atomic_path(tmp_path / "x") as tmp:
        assert not io_utils._lock_of(tmp).exists()
        tmp.write_bytes(b"data")
    assert [p.name for p in tmp_path.iterdir()] == ["x"] and not lockless.exists()


def snakemake(workdir: Path, config: dict) -> subprocess.Popen:
    """`snakemake extract` on `config` from its own working directory, as one lab member runs it (its
    output in workdir/snakemake.out)."""
    workdir.mkdir(exist_ok=True)
    configfile = tiny.save_config(config, workdir / "config.yaml")
    with open(workdir / "snakemake.out", "wb") as out:  # a file: a pipe nobody reads while it runs would fill
        return subprocess.Popen([SNAKEMAKE, "-s", str(tiny.REPO / "Snakefile"), "-d", str(workdir), "--configfile",
                                 str(configfile), "--cores", "1", "extract"], stdout=out, stderr=subprocess.STDOUT)


def part_job(run: subprocess.Popen, extract_root: Path) -> int:
    """The pid of `run`'s extract_part job once it writes its part (its temp is there)."""
    while run.poll() is None:
        if list(extract_root.glob("*/.part-0000.*.tmp")):
            jobs = [pid for pid in descendants(run.pid) if "extract_part" in cmdline(pid)]
            if jobs:
                return jobs[0]
        time.sleep(0.005)
    raise AssertionError(f"{run.args} ended before its extract_part job was seen writing under {extract_root}")


def descendants(pid: int) -> list[int]:
    """Snakemake starts jobs from its threads: each thread's children are listed under that thread."""
    children = [child for task in Path(f"/proc/{pid}/task").glob("*") for child in _read(task / "children").split()]
    return [int(child) for child in children] + [grand for child in children for grand in descendants(int(child))]


def cmdline(pid: int) -> str:
    return _read(Path(f"/proc/{pid}/cmdline")).replace("\0", " ")


def _read(proc_file: Path) -> str:
    """A /proc file's text; empty once its process or thread is gone."""
    try:
        return proc_file.read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


@pytest.mark.slow
def test_a_second_run_of_a_part_on_a_shared_dump_to_stops_at_once_and_the_first_run_finishes(tmp_path, model_dir):
    """User B's run starts while user A's extract_part job writes the part (A's GPU job, slower than B's):
    B's job stops before its forward pass, naming A's temp; A's run finishes and its part verifies; B's
    rerun once A is done reuses it."""
    from actstore.formats.extract import verify

    data = tiny.write_jsonl(tmp_path / "texts.jsonl", 200)
    config = tiny.make_config(tmp_path, model_dir("bert"), data, extract={"parts": 1, "batch_size": 1})
    extract_root = Path(config["dump_to"]) / "extract"
    user_a = snakemake(tmp_path / "a", config)
    job_a = part_job(user_a, extract_root)
    [temp_a] = extract_root.glob("*/.part-0000.*.tmp")
    os.kill(job_a, signal.SIGSTOP)
    try:
        user_b = snakemake(tmp_path / "b", config)
        user_b.wait(timeout=600)
    finally:
        os.kill(job_a, signal.SIGCONT)
    user_a.wait(timeout=600)
    output_a, output_b = ((tmp_path / user / "snakemake.out").read_text() for user in "ab")
    assert user_b.returncode != 0 and "Error in rule extract_part" in output_b, output_b[-3000:]
    # their one log, {dump_to}/logs/extract/<hash>/part-0000.log: B's job, started after A's, rewrote it
    [log] = Path(config["dump_to"]).glob("logs/extract/*/part-0000.log")
    assert f"WriteInProgressError: {temp_a.parent / 'part-0000'}: another run is writing it now (its temp {temp_a}" \
           in log.read_text(), log.read_text()[-3000:]
    assert user_a.returncode == 0, output_a[-3000:]
    assert verify(temp_a.parent) == []
    user_b = snakemake(tmp_path / "b", config)
    assert user_b.wait(timeout=600) == 0, (tmp_path / "b" / "snakemake.out").read_text()[-3000:]
    assert "extract_part" not in (tmp_path / "b" / "snakemake.out").read_text()
    assert verify(temp_a.parent) == []
