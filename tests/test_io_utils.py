"""io_utils' shared write helpers under a full disk (simulated with RLIMIT_FSIZE: Python ignores
SIGXFSZ, so a write past the limit fails with EFBIG, as one on a full disk fails with ENOSPC; one
that crosses the limit writes the bytes below it and returns that short count), and after a crash."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actstore.io_utils import write_bytes_atomic

MIB = 1 << 20


def run_with_file_size_limit(limit: int, code: str) -> subprocess.CompletedProcess:
    """Run code in a fresh Python whose files may not grow past limit bytes."""
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("kind", ["TreeHashFile", "OrderedHashFile"])
def test_a_direct_write_to_a_full_disk_names_the_file(kind, tmp_path):
    """The extract writer calls TreeHashFile.write in its own thread: pwrite's error names no file."""
    target = tmp_path / "full.bin"
    proc = run_with_file_size_limit(MIB, f"from actstore.io_utils import {kind}\n"
                                          f"{kind}({str(target)!r}, 4 * {MIB}).write(0, bytes(4 * {MIB}))\n")
    assert proc.returncode != 0
    assert f"OSError: [Errno 27] {target}: File too large" in proc.stderr, proc.stderr[-2000:]


def test_a_short_write_under_a_hashing_writer_is_resumed_and_its_failure_named(tmp_path):
    """An unbuffered file's write may take fewer bytes than given: the rest is written (here: fails,
    the disk being full), never left out of the file while the digest counts it."""
    target = tmp_path / "short.bin"
    proc = run_with_file_size_limit(MIB, "from actstore.io_utils import HashingWriter\n"
                                         f"with open({str(target)!r}, 'wb', buffering=0) as raw:\n"
                                         f"    with HashingWriter(raw, {str(target)!r}) as out:\n"
                                         f"        out.write(bytes(4 * {MIB}))\n")
    assert proc.returncode != 0
    assert f"OSError: {target}: [Errno 27] File too large" in proc.stderr, proc.stderr[-2000:]


def test_directories_atomic_path_creates_are_fsynced_into_their_parents(monkeypatch, tmp_path):
    """A new directory's name is durable only once the directory holding it is fsynced: without
    that a crash after the write returned could lose the output directory and the file in it."""
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    write_bytes_atomic(tmp_path / "run" / "layer_3" / "acts.bin", b"x")
    assert (tmp_path / "run" / "layer_3" / "acts.bin").read_bytes() == b"x"
    assert {str(tmp_path), str(tmp_path / "run"), str(tmp_path / "run" / "layer_3")} <= set(synced)


def test_a_writer_removes_its_own_stale_temps_never_a_siblings_in_progress(tmp_path):
    """x's writer deletes the temps a killed writer of x left; the temp of x.json's writer, at work
    in the same folder, matched its pattern (.x.*.tmp) and was deleted under it."""
    import tempfile

    sibling = Path(tempfile.mkdtemp(prefix=".x.json.", suffix=".tmp", dir=tmp_path))
    stale = Path(tempfile.mkdtemp(prefix=".x.", suffix=".tmp", dir=tmp_path))
    write_bytes_atomic(tmp_path / "x", b"data")
    assert sibling.is_dir() and not stale.exists()
    assert (tmp_path / "x").read_bytes() == b"data"


def test_a_failed_fsync_names_what_it_synced():
    """A quota on NFS or Lustre is often first reported by fsync; its bare OSError named no output.
    fsync of /dev/null fails (EINVAL) as one of a file over quota fails."""
    from actstore.io_utils import fsync_dir

    with pytest.raises(OSError, match="Invalid argument: '/dev/null'"):
        fsync_dir(Path("/dev/null"))
