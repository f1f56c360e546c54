"""atomic_path over an existing directory (a stage or a store rerun over its old output), its writer
killed (SIGKILL, as a Slurm time limit or a node failure ends it) while the old tree is deleted: the
final name holds the whole old tree or the whole new one, never a tree half deleted or nothing, and
the next writer of that name sweeps what the killed one left."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from actstore.io_utils import atomic_path

OLD_FILES = 5000  # enough that deleting them takes far longer than one look at the directories
NEW_FILES = 3

# The file system refusing RENAME_EXCHANGE (NFS, Lustre): renameat2 fails with EINVAL, as there.
REFUSE_EXCHANGE = """
import ctypes, errno
from actstore import io_utils
def refuse(*args):
    ctypes.set_errno(errno.{errno})
    return -1
io_utils._RENAMEAT2 = refuse
"""

WRITE_NEW_TREE = """
from actstore.io_utils import atomic_path
with atomic_path({final!r}) as tmp:
    tmp.mkdir()
    for i in range({new_files}):
        (tmp / f"n{{i}}").write_bytes(b"")
    (tmp / "MARKER").write_text("new")
"""


def make_old_tree(final: Path) -> None:
    final.mkdir()
    for i in range(OLD_FILES):
        (final / f"o{i}").write_bytes(b"")
    (final / "MARKER").write_text("old")


def old_files_left(final: Path) -> int:
    """The old tree's files, under the final name or under a temp name of it."""
    count = 0
    for directory in [final, *final.parent.glob(f".{final.name}.*.tmp")]:
        try:
            count += sum(1 for entry in directory.iterdir() if entry.name.startswith("o"))
        except FileNotFoundError:
            pass
    return count


def whole_tree(final: Path) -> str:
    """Which tree the final name holds, refusing anything but a whole one."""
    marker = (final / "MARKER").read_text()
    names = {p.name for p in final.iterdir()} - {"MARKER"}
    expected = {"old": {f"o{i}" for i in range(OLD_FILES)}, "new": {f"n{i}" for i in range(NEW_FILES)}}
    assert names == expected[marker], f"{marker} tree with {len(names)} of {len(expected[marker])} files"
    return marker


@pytest.mark.parametrize("setup", ["", REFUSE_EXCHANGE.format(errno="EINVAL")], ids=["exchange", "refused"])
def test_a_writer_killed_while_replacing_a_directory_leaves_a_whole_tree(setup, tmp_path):
    final = tmp_path / "store"
    make_old_tree(final)
    code = setup + WRITE_NEW_TREE.format(final=str(final), new_files=NEW_FILES)
    writer = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    while old_files_left(final) >= OLD_FILES and writer.poll() is None:
        pass  # until the old tree's deletion has begun
    writer.send_signal(signal.SIGKILL)
    assert writer.wait() == -signal.SIGKILL, writer.stderr.read()
    writer.stderr.close()

    whole_tree(final)  # "new" once the deletion has begun; "old" only if the look raced the swap
    assert list(tmp_path.glob(".store.*.tmp")), "the half-deleted old tree, left for the next writer"
    with atomic_path(final) as tmp:
        tmp.mkdir()
        (tmp / "MARKER").write_text("newer")
    assert (final / "MARKER").read_text() == "newer" and {p.name for p in final.iterdir()} == {"MARKER"}
    assert [p.name for p in tmp_path.iterdir()] == ["store"]


def test_a_failed_exchange_names_both_directories(tmp_path):
    """renameat2 failing otherwise than a file system refusing the exchange (here EACCES) is an error."""
    final = tmp_path / "store"
    final.mkdir()
    code = REFUSE_EXCHANGE.format(errno="EACCES") + WRITE_NEW_TREE.format(final=str(final), new_files=1)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"PermissionError: [Errno 13] {tmp_path}/.store." in proc.stderr, proc.stderr[-2000:]
    assert f".tmp <-> {final}: renameat2: Permission denied" in proc.stderr, proc.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["store"]
