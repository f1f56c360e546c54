"""Review 62 of validate's full pass (actstore.fingerprints) and of peak-memory sampling (actstore.memwatch)."""
from __future__ import annotations

import subprocess
import time

import pytest

from actstore import memwatch
from actstore.fingerprints import fingerprint_problems
from actstore.formats import format_module
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.verify import reference_dtype
from test_extract import write_real_store


@pytest.mark.parametrize("name", ["zarr", "saev", "lmprobe", "pickle"])
def test_a_store_of_another_hidden_width_is_named_not_a_traceback(name, tmp_path):
    """A store written from an extraction of hidden size 16 (the same samples and tokens) checked against one of
    hidden size 8: each view names the store and both widths. (numpy's matmul ValueError, naming no file,
    escaped validate.)"""
    root = synthetic_extraction(tmp_path / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))
    wide = synthetic_extraction(tmp_path / "w", 400_000, 2, 16, [1, 2], tokens=(4, 10))
    store = write_real_store(name, wide, tmp_path / name)
    dtype = format_module(name).inspect(store).get("dtype", "float32")
    result = fingerprint_problems({name: (store, dtype)}, open_extraction(root), 0, reference_dtype)[name]
    assert result["views"] == {} and result["problems"], result
    for problem in result["problems"]:
        assert problem.startswith(str(store)) and "16 values" in problem and "the extraction's 8" in problem, problem


SMAPS_MAPPING = """{start}-{end} rw-p 00000000 08:02 173521  /usr/lib/x.so
Size:               1024 kB
Rss:                 512 kB
Shared_Dirty:         {shared} kB
Private_Dirty:        {private} kB
Anonymous:            {anonymous} kB
VmFlags: rd wr mr mw me ac
"""


def test_a_kernel_without_smaps_rollup_sums_smaps(tmp_path, monkeypatch):
    """Linux before 4.14 (and some containers) has /proc/<pid>/smaps but no smaps_rollup: its mappings' fields
    are summed. (0 was returned, which read as "used no memory", so a memory bound passed whatever the job held.)
    A pid whose /proc entry is gone (the process exited) still reads as zero."""
    monkeypatch.setattr(memwatch, "PROC", tmp_path)
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "smaps").write_text(
        SMAPS_MAPPING.format(start="00400000", end="00452000", shared=10, private=300, anonymous=200)
        + SMAPS_MAPPING.format(start="7f0000000000", end="7f0000100000", shared=0, private=50, anonymous=40))
    memory = memwatch.process_memory(4242)
    assert (memory.anonymous, memory.dirty_mapped) == (240 * 1024, (360 - 240) * 1024)
    assert memwatch.process_memory(4343) == memwatch.Memory()


def test_smaps_summed_agrees_with_smaps_rollup_of_a_live_process(tmp_path, monkeypatch):
    """A sleeping process's smaps, copied where no smaps_rollup is, reads as its real smaps_rollup does."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.2)
        (tmp_path / str(proc.pid)).mkdir()
        (tmp_path / str(proc.pid) / "smaps").write_text(open(f"/proc/{proc.pid}/smaps").read())
        rollup = memwatch.process_memory(proc.pid)
        monkeypatch.setattr(memwatch, "PROC", tmp_path)
        assert rollup.anonymous > 0 and memwatch.process_memory(proc.pid) == rollup
    finally:
        proc.kill()
        proc.wait()


def test_a_zarr_chunk_that_is_a_loop_of_links_is_named_not_a_traceback(tmp_path):
    """A chunk file replaced by a link to itself: zarr's verify names it, but the full pass's read raised
    OSError (ELOOP), and validate ended in a traceback, its other problems unreported. Now a problem of
    the view, naming the file."""
    root = synthetic_extraction(tmp_path / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))
    store = write_real_store("zarr", root, tmp_path / "zarr")
    chunk = next((store / "shards" / "shard-0000.zarr" / "arrays" / "activations").glob("3/0/0/0"))
    chunk.unlink()
    chunk.symlink_to(chunk.name)
    dtype = format_module("zarr").inspect(store)["dtype"]
    result = fingerprint_problems({"zarr": (store, dtype)}, open_extraction(root), 0, reference_dtype)["zarr"]
    assert result["views"] == {} and len(result["problems"]) == 1, result
    assert str(chunk) in result["problems"][0] and "(zarr fingerprint not read)" in result["problems"][0], result


def test_a_sampled_coordinate_in_a_loop_of_links_is_a_named_problem(tmp_path):
    """The same chunk read at a sampled coordinate: a problem naming the coordinate and the file, the other
    coordinates still read. (The reader's OSError ended validate in a traceback.)"""
    from actstore.verify import check_format
    root = synthetic_extraction(tmp_path / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))
    store = write_real_store("zarr", root, tmp_path / "zarr")
    chunk = next((store / "shards" / "shard-0000.zarr" / "arrays" / "activations").glob("3/0/0/0"))
    chunk.unlink()
    chunk.symlink_to(chunk.name)
    report = check_format("zarr", store, open_extraction(root), [(3, 1, 0), (4, 1, 0)])
    unread = [p for p in report["problems"] if "(sample 3, layer 1, token 0)" in p]
    assert len(unread) == 1 and str(chunk) in unread[0] and report["checked"] == 1, report["problems"]
