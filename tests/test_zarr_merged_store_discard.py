"""Review 67: rule zarr_merge declared directory(".../merged"), so Snakemake wrote its marker
`.snakemake_timestamp` into the finished merged Zarr store (test_workflow's pickle/zarr range test
asserts no store holds one now). The rule declares the store's `.zmetadata` instead, which is all
Snakemake deletes before a rerun: the job discards the rest of the earlier store first (io_utils.discard),
so a failed or killed rerun leaves no store under the name that looks whole."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from actstore.io_utils import atomic_path, discard, is_temp


def a_store(path: Path) -> Path:
    (path / "arrays" / "activations" / "0").mkdir(parents=True)
    (path / "arrays" / "activations" / "0" / "0.0").write_bytes(b"chunk")
    (path / ".zattrs").write_text("{}")
    return path


def test_discard_leaves_nothing_under_the_name_and_a_file_is_unlinked(tmp_path):
    store = a_store(tmp_path / "merged")
    discard(store)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    discard(tmp_path / "file")
    discard(tmp_path / "absent")
    assert list(tmp_path.iterdir()) == []


def test_a_discard_killed_while_deleting_leaves_a_temp_the_next_writer_sweeps(tmp_path):
    """SIGKILL inside the deletion (shutil.rmtree): the store is gone from its name in one rename, the
    rest lies under a temp name of it, which the next atomic_path writer of the store deletes."""
    store = a_store(tmp_path / "merged")
    script = ("import os, shutil, signal, sys\n"
              "shutil.rmtree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
              "from actstore.io_utils import discard\n"
              "discard(sys.argv[1])\n")
    killed = subprocess.run([sys.executable, "-c", script, str(store)], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    left = list(tmp_path.iterdir())
    assert not store.exists() and len(left) == 1 and is_temp(left[0]) and left[0].name.startswith(".merged.")
    assert (left[0] / "arrays" / "activations" / "0" / "0.0").read_bytes() == b"chunk"

    with atomic_path(store) as tmp:
        a_store(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
    assert os.path.isfile(store / ".zattrs")
