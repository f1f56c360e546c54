"""Review 62 of the casts and io_utils helpers: the memory a cast of many inf/NaN values takes, buffers and
dtypes casts refuse rather than fill wrongly, errors that name their file or variable, an atomic write
under a read-only umask, and a hashed file closed when its head cannot be written."""
import os
import subprocess
import sys

import numpy as np
import pytest

from actstore import casts
from actstore.io_utils import sha256_file, sha256_tree_file
from test_casts import cast_path  # noqa: F401 (a fixture)
from tiny import traced_peak


def test_casting_values_that_are_all_nan_or_overflow_takes_little_memory_beyond_out(cast_path):
    """to_float16's docstring: nothing beyond out. A diverged model's layer (every value NaN) or one
    past float16's range made the count of overflows take 7x out's bytes (indices, copies, masks)."""
    x = np.full(1 << 22, np.nan, np.float32)
    x[::3] = 1e6  # overflows float16
    out = np.empty(x.shape, np.float16)
    overflowed, peak = traced_peak(lambda: casts.to_float16(x, out))
    with np.errstate(over="ignore"):
        assert out.view(np.uint16).tolist() == x.astype(np.float16).view(np.uint16).tolist()
    assert overflowed == len(x[::3])
    assert peak < out.nbytes // 2, f"{peak} bytes beyond out's {out.nbytes}"


def test_a_read_error_while_hashing_names_the_file(tmp_path):
    """/proc/self/mem opens, and its read at offset 0 fails (EIO), as a bad disk's does: the error named
    no file. A directory given as a file to tree-hash failed alike (EISDIR, nothing named)."""
    with pytest.raises(OSError, match="/proc/self/mem: Input/output error"):
        sha256_file("/proc/self/mem")
    with pytest.raises(IsADirectoryError, match=f"{tmp_path}: Is a directory"):
        sha256_tree_file(tmp_path)


def test_a_hash_of_a_descriptor_still_reads_the_file_and_names_nothing_it_does_not_know(tmp_path):
    """The caller that passes a descriptor names the file itself: its digest is the path's."""
    path = tmp_path / "x.bin"
    path.write_bytes(os.urandom(3 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert sha256_file(fd) == sha256_file(path)
        assert sha256_tree_file(fd) == sha256_tree_file(path)
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_to_float32_refuses_a_target_of_another_shape(dtype):
    """One stored row into a 3-row target: float32 and float16 filled all three rows by broadcasting
    (wrong values, silently), where bfloat16 refused."""
    stored = {"float32": np.ones((1, 4), np.float32), "float16": np.ones((1, 4), np.float16),
              "bfloat16": casts.to_bfloat16_bits(np.ones((1, 4), np.float32))}[dtype]
    with pytest.raises(ValueError, match=r"\(1, 4\) into float32 \(3, 4\)"):
        casts.to_float32(stored, dtype, np.zeros((3, 4), np.float32))
    out = np.zeros((1, 4), np.float32)
    assert casts.to_float32(stored, dtype, out) is out and (out == 1).all()


def test_to_float32_refuses_a_storage_dtype_it_does_not_know():
    """An int8 (or a misspelt) storage dtype was read as if its values were floats."""
    with pytest.raises(ValueError, match="'int8'"):
        casts.to_float32(np.arange(4, dtype=np.int8), "int8")


def test_an_atomic_file_write_under_a_read_only_umask_succeeds(tmp_path):
    """A user whose umask makes new files read-only (0222, outputs guarded against edits) could write
    no file through atomic_path: its fsync reopened the temp for writing, EACCES naming the temp. As
    root the permission is not checked, so the writer runs as nobody, in a folder open to it (by a
    relative path: the folders above tmp_path are root's alone)."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    code = ("import os\nfrom actstore.io_utils import write_bytes_atomic\n"
            "if os.getuid() == 0:\n    os.setgid(65534)\n    os.setuid(65534)\n"
            "os.umask(0o222)\nwrite_bytes_atomic('x', b'data')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=out, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "x").read_bytes() == b"data" and os.listdir(out) == ["x"]


def test_float16_file_refuses_buffers_it_would_not_fill(cast_path, tmp_path):
    """The caller hashes `out` whole as the file's bytes: an `out` that is not contiguous float16 was
    filled through a copy by numpy (the file right, `out` and so its hash not), or refused by C with a
    BufferError naming nothing; a `wide` that is not float32 was read back as its own dtype."""
    source = tmp_path / "rows.bin"
    source.write_bytes(np.arange(32, dtype=np.float32).tobytes())
    fd = os.open(source, os.O_RDONLY)
    try:
        row_file = casts.RowFile(fd, str(source), 0, "float32", 8)
        good_wide, good_out = np.empty((4, 8), np.float32), np.empty((4, 8), np.float16)
        for wide, out in [(good_wide, np.empty((4, 16), np.float16)[:, ::2]), (good_wide, np.empty((4, 8), np.int16)),
                          (np.empty((4, 8), np.float64), good_out)]:
            with pytest.raises(ValueError, match="float16_file: "):
                casts.float16_file(row_file, 0, 4, wide, out, [], str(tmp_path / "never"))
        assert not (tmp_path / "never").exists()
        assert casts.float16_file(row_file, 0, 4, good_wide, good_out, [], str(tmp_path / "0")) == 0
        assert (tmp_path / "0").read_bytes() == good_out.tobytes() == np.arange(32, dtype=np.float16).tobytes()
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["TreeHashFile", "OrderedHashFile"])
def test_a_hashed_file_whose_head_cannot_be_written_is_closed(kind, tmp_path):
    """The constructor writes the head: on a full disk (RLIMIT_FSIZE here, EFBIG as ENOSPC) it raised with
    the file still open, and no caller held the object to close it: a descriptor leaked per failed file."""
    target = tmp_path / "head.bin"
    code = (f"import os, resource\nresource.setrlimit(resource.RLIMIT_FSIZE, ({1 << 20}, {1 << 20}))\n"
            f"from actstore.io_utils import {kind}\nbefore = len(os.listdir('/proc/self/fd'))\n"
            f"try:\n    {kind}({str(target)!r}, {4 << 20}, head=bytes({2 << 20}))\n"
            "except OSError as exc:\n    print(exc)\nprint(len(os.listdir('/proc/self/fd')) - before)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == [f"[Errno 27] {target}: File too large", "0"], proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("epoch", ["2024-01-01", "1.7e9", "99999999999999999"])
def test_a_malformed_source_date_epoch_is_named(epoch, monkeypatch):
    """A date, a float or a year past 9999 raised int()'s or datetime's bare error ("invalid literal for
    int()", "year is out of range"), which did not say it came from the environment variable."""
    from actstore.errors import ConfigError
    from actstore.io_utils import utc_now

    monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
    with pytest.raises(ConfigError, match=f"SOURCE_DATE_EPOCH={epoch!r}: "):
        utc_now()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert utc_now().isoformat() == "2023-11-14T22:13:20+00:00"


def test_float16_file_names_the_source_of_a_storage_dtype_it_cannot_read(cast_path, tmp_path):
    """A RowFile of dtype float64 raised a bare KeyError('float64'), naming neither the file nor the field."""
    source = tmp_path / "rows.bin"
    source.write_bytes(bytes(256))
    fd = os.open(source, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match=f"{source}: storage dtype 'float64'"):
            casts.float16_file(casts.RowFile(fd, str(source), 0, "float64", 8), 0, 2, np.empty(16, np.float32),
                               np.empty(16, np.float16), [], str(tmp_path / "never"))
    finally:
        os.close(fd)
    assert not (tmp_path / "never").exists()
