"""Zarr merge review: a finisher whose sync or rename fails leaves the link jobs' chunk dirs whole; a
shard written again after its link job is named, not merged from its old files; tree hashes taken from
several threads at once share one pool of leaf hashers."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from actstore import io_utils
from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.integrity import file_problem, problems_of
from actstore.io_utils import TREE_LEAF, tree_root
from test_zarr_killed_merge_rerun import EPOCH, linked, shards, tree  # noqa: F401 (shards: a fixture)


def fail_once(error: BaseException, original, when=lambda *args: True):
    """`original`, except that its first call for which `when(*args)` holds raises `error` (the OS or
    the user failing it once)."""
    failed = []

    def call(*args, **kwargs):
        if not failed and when(*args):
            failed.append(args)
            raise error
        return original(*args, **kwargs)
    return call


@pytest.mark.parametrize("failing", ["rename", "sync"])
def test_a_finisher_whose_rename_or_sync_fails_leaves_the_chunk_dirs_to_its_rerun(shards, tmp_path, monkeypatch,
                                                                                   failing):
    """The store's sync (Ctrl-C in a syncfs of minutes) or its rename into place (EIO, a quota) failed
    after the sample directories were moved into the temp, which was then deleted with them: every
    rerun was refused (the chunk dirs' chunk files missing) until the link jobs were run again."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    zs.merge_stores(shards, tmp_path / "ref" / zs.MERGED, progress=False)
    dirs = linked(shards, tmp_path)
    before = [tree(d) for d in dirs]
    out = tmp_path / "run" / zs.MERGED
    with monkeypatch.context() as failed:
        if failing == "rename":
            failed.setattr(os, "replace", fail_once(OSError(5, "Input/output error"), os.replace,
                                                    lambda src, dst: Path(dst) == out))
            raised = OSError
        else:
            failed.setattr(io_utils, "sync_filesystem", fail_once(KeyboardInterrupt(), io_utils.sync_filesystem))
            raised = KeyboardInterrupt
        with pytest.raises(raised):
            zs.finish_merge(shards, dirs, out, progress=False)
    assert not out.exists() and [tree(d) for d in dirs] == before
    zs.finish_merge(shards, dirs, out, progress=False)
    assert tree(out) == tree(tmp_path / "ref" / zs.MERGED)
    assert zs.verify(out) == [] and [p.name for p in out.parent.iterdir()] == [zs.MERGED]


def test_a_shard_written_again_after_its_link_job_is_named_not_merged_from_its_old_files(shards, tmp_path):
    """An upstream shard job rerun after the link jobs (new activations, the same token counts) left
    the chunk dirs linked to its old files: the merged store took their bytes beside the new shard's
    1-D arrays and prompts, and verified clean, though no sample of that shard read as the shard."""
    own = [Path(shutil.copytree(s, tmp_path / "shards" / s.name)) for s in shards]  # this test writes one
    dirs = linked(own, tmp_path)
    again = synthetic_extraction(tmp_path / "again", 200_000, 3, 16, [1, 2], tokens=(3, 20), scale=2.0)
    zs.write_shard(open_extraction(again).parts[1].dir, own[1], t_chunk=4, progress=False)
    assert zs.verify(own[1]) == [] and not np.array_equal(zs.ZarrStore(own[1]).read(0, 1),
                                                          zs.ZarrStore(shards[1]).read(0, 1))
    before = [tree(d) for d in dirs]
    out = tmp_path / "run" / zs.MERGED
    g = zs.ZarrStore(own[1]).attrs["global_index_start"]
    with pytest.raises(FormatError, match=f"merge-0/{zs.ACTS}/{g}/0/0/0: not a link to .*{own[1].name}/"
                                          f"{zs.ACTS}/0/0/0/0 .*zarr_merge_chunks job of .*merge-0/job.json"):
        zs.finish_merge(own, dirs, out, progress=False)
    assert not out.exists() and [tree(d) for d in dirs] == before


def reference_tree_hash(data: bytes) -> str:
    return tree_root([hashlib.sha256(data[i:i + TREE_LEAF]).digest() for i in range(0, len(data), TREE_LEAF)])


def test_tree_hashes_taken_by_several_threads_at_once_share_one_pool_of_leaf_hashers(tmp_path, monkeypatch):
    """verify hashes several files at once from its own threads, and each sha256_tree_file started a
    pool of a thread a CPU: threads x CPUs threads and leaf buffers at once, started anew each file."""
    rng = np.random.default_rng(0)
    files = []
    for i in range(16):
        data = rng.bytes(8 * TREE_LEAF + 123)
        (tmp_path / f"f{i}").write_bytes(data)
        files.append((tmp_path / f"f{i}", {"bytes": len(data), "sha256_tree": reference_tree_hash(data)}))
    started = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda thread: started.append(thread) or start(thread))
    verify_threads = 4
    assert problems_of(lambda f: [p for p in [file_problem(f[0], f[1], "test")] if p], files, verify_threads) == []
    assert len(started) <= verify_threads + len(os.sched_getaffinity(0))


FORKED = """
import os, signal, sys
from actstore.io_utils import sha256_tree_file
digest = sha256_tree_file(sys.argv[1])  # the parent's leaf hashers started
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a child left waiting is killed by it (no orphan), and the parent sees it
    os._exit(0 if sha256_tree_file(sys.argv[1]) == digest else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_takes_tree_hashes_with_leaf_hashers_of_its_own(tmp_path):
    """A child forked after the parent hashed (a DataLoader worker) has none of the pool's threads: a
    leaf given that pool would wait forever."""
    (tmp_path / "f").write_bytes(np.random.default_rng(1).bytes(3 * TREE_LEAF))
    forked = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path / "f")], capture_output=True, text=True,
                            timeout=120)
    assert forked.returncode == 0, forked.stderr
