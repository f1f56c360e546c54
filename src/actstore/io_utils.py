"""Atomic writes and checksums shared by every format writer."""
from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

CHUNK = 1 << 22
WRITEBACK_BYTES = 64 << 20  # OrderedHashFile starts the disk on its dirty pages every this many bytes


def _sync_file_range() -> Callable[[int], None]:
    """Start writing a file's dirty pages to disk without waiting (Linux sync_file_range with
    SYNC_FILE_RANGE_WRITE); elsewhere nothing, and the final fsync does all the work."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "sync_file_range"):
        return lambda fd: None
    call = libc.sync_file_range
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd: call(fd, 0, 0, 2)  # the whole file; 2 = SYNC_FILE_RANGE_WRITE


start_writeback = _sync_file_range()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and compact separators: the text every hash in actstore is taken of."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TEMP_SUFFIX = ".tmp"  # atomic_path's temps: f".{final name}.<random>.tmp" beside the final path


def is_temp(path: Path) -> bool:
    """An atomic_path temp (or inside one): debris of a killed writer, never data."""
    return any(part.startswith(".") and part.endswith(TEMP_SUFFIX) for part in path.parts)


def remove_stale_temps(final: Path) -> None:
    """Delete the temps a killed writer of `final` left (a job owns its output: Snakemake locks it)."""
    for stale in final.parent.glob(f".{glob.escape(final.name)}.*{TEMP_SUFFIX}"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success fsync and rename it into place, else delete it.

    Works for files and directories, so a crash never leaves something under the final name.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=TEMP_SUFFIX, dir=final.parent))
    tmp.rmdir()
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        if final.is_dir() and tmp.is_dir():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Write JSON through a temp file + rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=indent, sort_keys=indent is not None) + "\n")


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def utc_now():
    """The time recorded as created_at in every format: now, or SOURCE_DATE_EPOCH when set (the
    reproducible-builds convention), so two runs of one config can be compared byte for byte."""
    import datetime as dt

    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:
        return dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc)
    return dt.datetime.now(dt.timezone.utc)


class OrderedHashFile:
    """A file filled by positioned writes in any order, whose sha256 is taken as it is written.

    Each region is written once. A region that lands at the hashed prefix's end is hashed from the
    caller's buffer at once; one that lands ahead of it is remembered, and hashed when the prefix
    reaches it, read back through the page cache it was just written to (batches grouped by length
    fill a token-packed file out of order). Nothing is held in memory but those region bounds.

    Every WRITEBACK_BYTES the disk is started on the dirty pages, so it works while the model runs
    (the kernel would otherwise hold gigabytes dirty until the final fsync, a tail as long as the
    disk takes to write them all) and dirty memory, which a Slurm job's cgroup is charged for,
    stays bounded.
    """

    def __init__(self, path: str | os.PathLike, size: int, head: bytes = b""):
        self.path = Path(path)
        self.size = size
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.digest = hashlib.sha256()
        self.hashed = 0
        self.ahead: dict[int, int] = {}  # start -> stop of regions written past the hashed prefix
        self.read_back = 0  # bytes hashed from the page cache rather than from the caller's buffer
        self.unsynced = 0  # bytes written since the disk was last started on them
        self.write(0, head)

    def write(self, offset: int, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)
        self.unsynced += len(view)
        if self.unsynced >= WRITEBACK_BYTES:
            start_writeback(self.fd)
            self.unsynced = 0
        if offset == self.hashed:
            self.digest.update(view)
            self.hashed += len(view)
            self._catch_up()
        elif len(view):
            self.ahead[offset] = offset + len(view)

    def _catch_up(self) -> None:
        if self.hashed not in self.ahead:
            return
        with open(self.path, "rb", buffering=0) as reader:
            buf = bytearray(CHUNK)
            while self.hashed in self.ahead:
                stop = self.ahead.pop(self.hashed)
                while self.hashed < stop:
                    n = os.preadv(reader.fileno(), [memoryview(buf)[:min(CHUNK, stop - self.hashed)]], self.hashed)
                    self.digest.update(memoryview(buf)[:n])
                    self.hashed += n
                    self.read_back += n

    def close(self) -> str:
        """fsync, check every byte was written, close; return the hex sha256."""
        try:
            if self.hashed != self.size or self.ahead:
                raise OSError(f"{self.path}: {self.hashed} of {self.size} bytes written in order")
            os.fsync(self.fd)
        finally:
            self.abort()
        return self.digest.hexdigest()

    def abort(self) -> None:
        """Close without checks (the caller deletes the half-written file)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
