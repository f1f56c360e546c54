"""io_utils' shared write helpers under a full disk (simulated with RLIMIT_FSIZE: Python ignores
SIGXFSZ, so a write past the limit fails with EFBIG, as one on a full disk fails with ENOSPC)."""
from __future__ import annotations

import subprocess
import sys

import pytest

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
