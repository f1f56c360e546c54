"""Atomic writes, checksums and the threads that write and hash, shared by every format writer."""
from __future__ import annotations

import abc
import bisect
import contextlib
import ctypes
import errno
import fcntl
import glob
import hashlib
import json
import logging
import math
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from actstore.errors import ConfigError, FormatError, WriteInProgressError

CHUNK = 1 << 22
# A PositionedFile starts the disk on its dirty pages every this many bytes. What is left unstarted
# when the run ends (up to this much per file, 16 files for a 16-layer part) is the final fsync's
# wait: 64 MiB left 0.11 s per 4 files at the end of a 1 GiB synthetic run, 16 MiB 0.02 s
# (bench_extract --synthetic-rate), with no loss at memory speed; 16 MiB is still whole Lustre RPCs.
WRITEBACK_BYTES = 16 << 20

log = logging.getLogger(__name__)


_LIBC = ctypes.CDLL(None, use_errno=True)  # the C library's own calls Python's os lacks


def _sync_file_range() -> Callable[[int], None]:
    """Start writing a file's dirty pages to disk without waiting (Linux sync_file_range with
    SYNC_FILE_RANGE_WRITE); elsewhere nothing, and the final fsync does all the work."""
    if not hasattr(_LIBC, "sync_file_range"):
        return lambda fd: None
    call = _LIBC.sync_file_range
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd: call(fd, 0, 0, 2)  # the whole file; 2 = SYNC_FILE_RANGE_WRITE


start_writeback = _sync_file_range()


def pread_into(fd: int, buffer: Any, offset: int) -> int:
    """Fill `buffer` from `fd` at byte `offset`, resuming after short reads; returns the bytes read,
    fewer than the buffer holds only where the file ends (the caller names the file)."""
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def bounded_lines(fh: IO[bytes], limit: int, path: str | os.PathLike) -> Iterator[bytes]:
    """Each line of `fh` from where it stands, its newline kept; a line of more than `limit` bytes (newline
    counted) is a FormatError naming `path` and the line (from 1 where reading began), holding at most
    limit + 1 of its bytes: iterating a file reads a line whole, and a hostile store's 5 GB line (its
    checksums rewritten to match) held 5 GB."""
    for number, line in enumerate(iter(lambda: fh.readline(limit + 1), b""), start=1):
        if len(line) > limit:
            raise FormatError(f"{path}: line {number} is longer than the {limit} bytes a line may take: not read")
        yield line


def _taken(count: int | None) -> int:
    """The bytes a write took, for the loops that resume short writes: a write that took none would be
    asked again forever, so it is an error: 0 (a file system that cannot take more) the full disk
    _casts.c's new_file takes it for, None (an unbuffered non-blocking file that would block) EAGAIN."""
    if count is None:
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
    if count == 0:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return count


def write_with_hole(path: str, data: Any, written: int) -> None:
    """A new file `path` of buffer `data`'s bytes, of which only the first `written` are written: the
    rest, zeros, are a hole (read back as zeros, never copied to the page cache or the disk). The
    disk is started on the file at once, so dirty memory stays bounded and the disk works while
    the caller goes on. Errors name the file."""
    view = memoryview(data).cast("B")
    try:  # every step's error named alike, the close's too (a network file system may report a write there)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            rest = view[:written]
            while rest:
                rest = rest[_taken(os.write(fd, rest)):]
            if written < len(view):
                os.ftruncate(fd, len(view))
            start_writeback(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise OSError(exc.errno, f"{path}: {exc.strerror}") from exc


def _syncfs() -> Callable[[Path], None]:
    """Write everything dirty on the filesystem holding a path to disk, metadata included, and wait
    (Linux syncfs: one call for a directory of thousands of files, where an fsync each would take as
    many journal commits); elsewhere sync, every filesystem."""
    if not hasattr(_LIBC, "syncfs"):
        return lambda path: os.sync()

    def syncfs(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if _LIBC.syncfs(fd) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"{path}: syncfs: {os.strerror(errno)}")
        finally:
            os.close(fd)
    return syncfs


sync_filesystem = _syncfs()


def sha256_file(path: str | os.PathLike | int) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB blocks; `path` may be a descriptor the caller
    opened (and keeps), read from its start. Errors name a path (a descriptor's caller names its file)."""
    digest = hashlib.sha256()
    if isinstance(path, int):
        os.lseek(path, 0, os.SEEK_SET)
    with _naming(path), open(path, "rb", closefd=not isinstance(path, int)) as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _naming(path: str | os.PathLike | int) -> contextlib.AbstractContextManager:
    """errors_naming(path) for a path: a read's error (EIO from a bad disk) names no file; nothing for a
    descriptor, whose name only its caller knows."""
    return contextlib.nullcontext() if isinstance(path, int) else errors_naming(path)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and compact separators: the text every hash in actstore is taken of."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def canonical_sha256(obj: Any) -> str:
    """sha256 hex of canonical_json(obj): a stage's hash, a dataset listing's digest."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def fsync_named(fd: int, path: str | os.PathLike) -> None:
    """os.fsync, its error naming `path`: a disk quota on NFS or Lustre is often first reported by
    fsync, and "[Errno 122] Disk quota exceeded" alone does not say which output hit it."""
    try:
        os.fsync(fd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_named(fd, path)
    finally:
        os.close(fd)


def make_dirs_durable(path: Path) -> None:
    """Create directory `path` and its missing parents, each new one's name fsynced into its parent:
    an fsync of a file or of the directory a rename lands in makes neither the directory's own name
    durable, so a crash could lose a new output directory with the files already renamed into it."""
    missing = []
    while path != path.parent and not path.is_dir():  # the root, or '.', ends it
        missing.append(path)
        path = path.parent
    for new in reversed(missing):
        new.mkdir(exist_ok=True)  # another job may create it at the same moment
        fsync_dir(new.parent)


TEMP_SUFFIX = ".tmp"  # atomic_path's temps: f".{final name}.<random>.tmp" beside the final path
# Beside each temp, f"{its name}.lock": its writer holds a POSIX record lock on it while it writes. The
# kernel drops a process's locks when it dies (on NFSv4, GPFS and Lustre across nodes too), so a temp
# whose lock no one holds is a killed writer's, and one whose lock is held a running writer's: another
# run of the same output, as two members' runs on a shared dump_to are (Snakemake locks a working
# directory, never a dump_to).
LOCK_SUFFIX = ".lock"
# mkdtemp's <random>: exactly 8 of these characters. A temp of a sibling whose name extends the final
# name (x.json beside x) then never matches the final name's pattern.
_TEMP_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"
_TEMP_RANDOM = "[a-z0-9_]" * 8
# lockf's errors on a file system without POSIX locks (NFS mounted nolock, some FUSE): no protection there
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# The lock files of this process's running writers: POSIX locks never conflict within one process, and
# closing any descriptor of a file drops every lock the process holds on it, so a sweep never opens these.
_HELD_LOCKS: set[str] = set()
_NO_LOCKS_NOTED: set[int] = set()  # the file systems (st_dev) without locks already logged


def is_temp(path: Path) -> bool:
    """An atomic_path temp or its lock file (or inside a temp): a writer's, never data."""
    return any(part.startswith(".") and part.endswith((TEMP_SUFFIX, TEMP_SUFFIX + LOCK_SUFFIX))
               for part in path.parts)


def _lock_of(temp: Path) -> Path:
    return temp.with_name(temp.name + LOCK_SUFFIX)


def _writer_temps(final: Path) -> list[Path]:
    """The atomic_path temps of `final`, and those its lock files name whose writer has not made its temp
    yet (never those of a sibling's writer)."""
    pattern = f".{glob.escape(final.name)}.{_TEMP_RANDOM}{TEMP_SUFFIX}"
    locks = final.parent.glob(pattern + LOCK_SUFFIX)
    return sorted(set(final.parent.glob(pattern)) | {lock.with_name(lock.name[:-len(LOCK_SUFFIX)]) for lock in locks})


@contextlib.contextmanager
def _writer_gone(temp: Path) -> Iterator[bool]:
    """Whether no running process writes `temp`: it has no lock file (an earlier release's temp, one
    made where the file system has no locks, one whose writer just finished), or no process holds its
    lock (its writer was killed), which is then held here through the block, so that a writer whose
    lock file this is, made an instant ago, cannot take it meanwhile. False for this process's writers."""
    lock = _lock_of(temp)
    if str(lock) in _HELD_LOCKS:
        yield False
        return
    try:  # read-only, for a shared lock: a member's lock file is writable by its owner alone under umask 0022
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        yield True
        return
    try:
        yield _lock_free(fd, lock)
    finally:
        os.close(fd)


def _lock_free(fd: int, lock: Path) -> bool:
    """Take a shared lock on `lock` (open as fd) unless a writer holds its exclusive one."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        if exc.errno not in _NO_LOCKS:
            raise OSError(exc.errno, f"{lock}: {exc.strerror}") from None
    return True


def stale_temps(final: Path) -> Iterator[Path]:
    """The atomic_path temps of `final` whose writer is gone (_writer_gone), each one's lock held here
    while the caller has it."""
    for temp in _writer_temps(final):
        with _writer_gone(temp) as gone:
            if gone:
                yield temp


def remove_stale_temps(final: Path) -> list[Path]:
    """Delete the temps of `final` whose writer is gone (a killed writer's debris), never the temp of a
    running writer of final nor of a sibling; return the running writers' temps."""
    live = []
    for temp in _writer_temps(final):
        with _writer_gone(temp) as gone:
            if gone:
                _remove(temp)
                _lock_of(temp).unlink(missing_ok=True)
            else:
                live.append(temp)
    return live


def _remove(temp: Path) -> None:
    if temp.is_dir() and not temp.is_symlink():
        shutil.rmtree(temp, ignore_errors=True)
    else:
        temp.unlink(missing_ok=True)


def discard(path: str | os.PathLike) -> None:
    """Delete the tree at `path` (a file: unlinked), set aside first in one rename to a temp name of its
    own: a kill while it is deleted leaves the rest under that name, for the next writer's sweep
    (atomic_path), never a part of it under `path`."""
    final = Path(path)
    if final.is_dir() and not final.is_symlink():
        aside = _temp_beside(final)
        os.replace(final, aside)  # a directory renamed over an empty one
        _remove(aside)
    else:
        final.unlink(missing_ok=True)


def _start_writing(final: Path) -> tuple[Path, int | None]:
    """A new temp name of `final`, once the temps of its writers that are gone are swept, and the
    descriptor holding its lock file's lock (None where the file system has no locks: then no lock
    file). WriteInProgressError, naming the temp, when another run writes `final` now."""
    while True:
        lock = final.parent / f".{final.name}.{''.join(random.choices(_TEMP_CHARS, k=8))}{TEMP_SUFFIX}{LOCK_SUFFIX}"
        with contextlib.suppress(FileExistsError):
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            break
    _HELD_LOCKS.add(str(lock))
    temp = lock.with_name(lock.name[:-len(LOCK_SUFFIX)])
    try:
        if not _take_lock(fd, lock, final):
            _stop_writing(lock, fd)
            fd = None
        # after the lock is taken: of two runs starting at once, each sees the other's (both stop: a tie)
        if live := [other for other in remove_stale_temps(final) if other != temp]:
            raise WriteInProgressError(f"{final}: another run is writing it now (its temp {live[0]}, whose lock "
                                       f"{_lock_of(live[0]).name} it holds){_WAIT}")
    except BaseException:
        _stop_writing(lock, fd)
        raise
    return temp, fd


_WAIT = (", e.g. a lab member's run on a shared dump_to: wait for it to finish, then run again: its output is "
         "reused")


def _take_lock(fd: int, lock: Path, final: Path) -> bool:
    """Take the exclusive lock on the writer's new lock file `lock`: True; False where the file system has
    no POSIX locks. WriteInProgressError when another writer of `final`, sweeping in the instant between
    the file's creation and its lock, took it first (and deletes it)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        taken = _still_named(fd, lock)
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            _note_no_locks(lock.parent)
            return False
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise OSError(exc.errno, f"{lock}: {exc.strerror}") from None
        taken = False
    if not taken:
        raise WriteInProgressError(f"{final}: another run began writing it at the same instant (its sweep took "
                                   f"this run's lock file {lock.name}){_WAIT}")
    return True


def _still_named(fd: int, lock: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(lock))
    except FileNotFoundError:
        return False


def _note_no_locks(directory: Path) -> None:
    device = os.stat(directory).st_dev
    if device not in _NO_LOCKS_NOTED:
        _NO_LOCKS_NOTED.add(device)
        log.debug("%s: the file system takes no POSIX locks: a run writing an output there cannot tell "
                  "another run writing it at the same time", directory)


def _stop_writing(lock: Path, fd: int | None) -> None:
    """Drop a writer's lock and its lock file, once its temp took the name or was deleted."""
    _HELD_LOCKS.discard(str(lock))
    if fd is not None:
        os.close(fd)
        lock.unlink(missing_ok=True)


_RENAMEAT2 = getattr(_LIBC, "renameat2", None)  # glibc 2.28 and later
if _RENAMEAT2 is not None:
    _RENAMEAT2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
_AT_FDCWD = -100  # renameat2's paths taken as they are (relative to the working directory)
_RENAME_EXCHANGE = 2


def _temp_beside(final: Path) -> Path:
    """A new empty directory named as atomic_path's temps of `final` (remove_stale_temps sweeps it)."""
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=TEMP_SUFFIX, dir=final.parent))


def _swap_directories(tmp: Path, final: Path) -> Path:
    """Put directory `tmp` under the name of directory `final`; returns the temp name of final's the old
    tree is left under, for the caller to delete. Linux swaps the two names in one step (renameat2
    RENAME_EXCHANGE), so a crash finds the whole old tree or the whole new one under the final name.
    Where the C library lacks it or the file system refuses it (EINVAL, ENOSYS: NFS, Lustre), the old
    tree is renamed aside first: a crash between the two renames leaves nothing under the final name,
    the old tree whole under its temp name; no sequence of plain renames closes that window."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_EXCHANGE) == 0:
            return tmp
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(code, f"{tmp} <-> {final}: renameat2: {os.strerror(code)}")
    aside = _temp_beside(final)
    os.replace(final, aside)  # a directory renamed over an empty one
    os.replace(tmp, final)
    return aside


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, undo: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success fsync and rename it into place, else delete it.
    `undo(temp)` runs first when it fails before the temp takes the name (the block, the sync, the
    rename): a caller that moved things in that are not its own to delete moves them back (an undo
    that fails leaves the temp as it is, for the caller's next run to recover from).

    Works for files and directories, so a crash never leaves something partly written under the
    final name, nor a directory partly deleted (one being replaced is swapped out whole, then deleted): a
    directory's files, the small ones its writer never fsynced included (a zarr shard's thousands of
    chunk files, metadata written by other libraries), are on disk before it takes the name, so a
    machine that goes down just after cannot leave a store of the right name and empty files.

    The writer holds a POSIX lock on a lock file beside its temp until the temp took the name or was
    deleted. Before the block runs it deletes the temps of `path` whose writer is gone (killed: its lock
    dropped), and raises WriteInProgressError, naming the temp, when another process writes `path` now
    (a lab member's run on a shared dump_to). Where the file system takes no POSIX locks there is no lock
    file, and a writer deletes every other temp of `path` as a killed writer's.
    """
    final = Path(path)
    make_dirs_durable(final.parent)
    tmp, lock_fd = _start_writing(final)
    named = False  # tmp holds the new tree until it takes the name (after a swap, the old one)
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as fh:  # fsync needs no write access: a umask of 0222 makes the temp read-only
                fsync_named(fh.fileno(), final)
        elif tmp.is_dir():
            sync_filesystem(tmp)
        if final.is_dir() and not final.is_symlink() and tmp.is_dir():  # a link: refused by rename
            old_tree = _swap_directories(tmp, final)
        else:
            os.replace(tmp, final)
            old_tree = None
        named = True
        fsync_dir(final.parent)
        if old_tree is not None:  # deleted once the new tree's name is durable; a crash while it goes
            _remove(old_tree)  # leaves it to the next writer's sweep (its lock dropped)
    except BaseException:
        if undo is not None and not named:
            undo(tmp)
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        raise
    finally:
        _stop_writing(_lock_of(tmp), lock_fd)


@contextlib.contextmanager
def scratch_beside(path: str | os.PathLike) -> Iterator[Path]:
    """A new empty directory named as atomic_path's temps of `path`, deleted when the block ends, never
    renamed: a one-job writer's scratch whose output another name takes. As atomic_path, the temps of
    `path` whose writer is gone are swept first, and WriteInProgressError names one still written."""
    final = Path(path)
    make_dirs_durable(final.parent)
    scratch, lock_fd = _start_writing(final)
    try:
        scratch.mkdir()
        yield scratch
    finally:
        _remove(scratch)
        _stop_writing(_lock_of(scratch), lock_fd)


@contextlib.contextmanager
def errors_naming(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise an OSError of the block that does not name its file as one naming `path`: a write or
    close (a buffered file's flush, numpy's, pyarrow's) reports a full disk, a quota or a file-size
    limit as "[Errno 122] Disk quota exceeded" alone, which does not say which output hit it."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or str(path) in str(exc):
            raise
        message = f"{path}: {exc.strerror or exc}"
        raise (OSError(exc.errno, message) if exc.errno else OSError(message)) from exc


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Write JSON through a temp file + rename. ValueError naming the file and the key of a NaN or
    infinity, before anything is written: json.dumps writes them as NaN and Infinity, which are not
    JSON (jq, JavaScript and read_json refuse the file)."""
    try:
        text = json.dumps(obj, indent=indent, sort_keys=indent is not None, allow_nan=False)
    except ValueError:
        json.dumps(obj)  # raises json's own error (a circular reference) where NaN is not the fault
        raise ValueError(f"{path}: {non_finite_at(obj)} is not a JSON number (JSON has no NaN or Infinity)") from None
    with atomic_path(path) as tmp, errors_naming(path):
        tmp.write_text(text + "\n")


def non_finite_at(obj: Any, at: str = "") -> str | None:
    """Where the first NaN or infinity in `obj` (dicts, their keys too, lists and tuples, no cycle)
    is, as its subscripts ("value nan at ['a'][1]"); None when there is none."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return f"value {obj} at {at or 'the top level'}"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        if where := non_finite_at(key, f"{at}[{key!r}], a key,") or non_finite_at(value, f"{at}[{key!r}]"):
            return where
    return None


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp, errors_naming(path):
        tmp.write_bytes(data)


def utc_now():
    """The time recorded as created_at in every format: now, or SOURCE_DATE_EPOCH when set (the
    reproducible-builds convention), so two runs of one config can be compared byte for byte."""
    import datetime as dt

    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:
        try:
            return dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc)
        except (ValueError, OverflowError, OSError) as exc:  # not an integer, or past what a datetime holds
            raise ConfigError(f"SOURCE_DATE_EPOCH={epoch!r}: not an integer count of seconds since 1970 "
                              f"({exc})") from None
    return dt.datetime.now(dt.timezone.utc)


class HashingWriter:
    """A binary file's write() that also feeds sha256, for streams written front to back (gzip,
    pickle): the digest of what was written, with no second read of the file. The writes and the
    hashing run on two threads behind the caller (a ThreadChain), so a compressor makes its next
    block while the last is written and hashed; each block must stay unchanged until the block ends
    (bytes do, and pickle's views of arrays that outlive the dump).

    The disk is started on the written bytes every WRITEBACK_BYTES, so the caller's closing fsync
    waits for the last of them only, not for the whole file.

    As a context manager: leaving the block waits for every write and raises the first error,
    naming the file; `digest` is complete then.
    """

    def __init__(self, raw: Any, what: str):
        self.raw = raw
        self.unsynced = 0  # bytes written since the disk was last started on them
        self.digest = hashlib.sha256()
        self.chain = ThreadChain([self._write, self.digest.update], what)

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.chain.__exit__(exc_type, exc, tb)

    def write(self, data: Any) -> int:
        self.chain.submit(data)
        return memoryview(data).nbytes

    def _write(self, data: Any) -> None:
        view = rest = memoryview(data).cast("B")
        while rest:  # an unbuffered file's write may take fewer bytes than given; the digest has them all
            rest = rest[_taken(self.raw.write(rest)):]
        self.unsynced += len(view)
        if self.unsynced >= WRITEBACK_BYTES:
            self.raw.flush()
            start_writeback(self.raw.fileno())
            self.unsynced = 0


class PositionedFile(abc.ABC):
    """A file of known size filled by positioned writes, each region once, in any order.

    Every WRITEBACK_BYTES the disk is started on the dirty pages, so it works while the model runs
    (the kernel would otherwise hold gigabytes dirty until the final fsync, a tail as long as the
    disk takes to write them all) and dirty memory, which a Slurm job's cgroup is charged for,
    stays bounded. Subclasses hash what is written (`_hash`) and say whether it is all there.
    """

    def __init__(self, path: str | os.PathLike, size: int):
        self.path = Path(path)
        self.size = size
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.read_back = 0  # bytes hashed from the page cache rather than from the caller's buffer
        self.unsynced = 0  # bytes written since the disk was last started on them

    def write(self, offset: int, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        self._put_named(offset, view)
        if len(view):
            self._hash(offset, view)

    def _write_head(self, head: bytes) -> None:
        """write(0, head) from a subclass's constructor, the file closed if it fails (a full disk): the
        caller never gets the object to close it."""
        try:
            self.write(0, head)
        except BaseException:
            self.abort()
            raise

    def _put(self, offset: int, view: memoryview) -> None:
        """The bytes of view written at offset; the disk started on them every WRITEBACK_BYTES."""
        done = 0
        while done < len(view):
            done += _taken(os.pwrite(self.fd, view[done:], offset + done))
        self.unsynced += len(view)
        if self.unsynced >= WRITEBACK_BYTES:
            start_writeback(self.fd)
            self.unsynced = 0

    def _put_named(self, offset: int, view: memoryview) -> None:
        """_put, its error (a full disk) naming the file: pwrite's names none. Not for a WriteBehind,
        whose thread's errors are named by its ThreadChain."""
        try:
            self._put(offset, view)
        except OSError as exc:
            raise OSError(exc.errno, f"{self.path}: {exc.strerror}") from exc

    def _read_back(self, start: int, stop: int, buf: bytearray) -> Iterator[memoryview]:
        """The written bytes start:stop again, from the page cache they were just written to."""
        while start < stop:
            n = os.preadv(self.fd, [memoryview(buf)[:min(len(buf), stop - start)]], start)
            if n == 0:
                raise OSError(f"{self.path}: ends at {start} bytes, {stop} were written")
            self.read_back += n
            start += n
            yield memoryview(buf)[:n]

    @abc.abstractmethod
    def _hash(self, offset: int, view: memoryview) -> None:
        """Hash the region just written at offset (the caller's bytes in view)."""

    @abc.abstractmethod
    def _missing(self) -> str | None:
        """What is not written yet, or None when every byte is."""

    @abc.abstractmethod
    def _hexdigest(self) -> str:
        """The file's digest, once every byte is written."""

    def close(self) -> str:
        """fsync, check every byte was written, close; return the hex digest."""
        try:
            if missing := self._missing():
                raise OSError(f"{self.path}: {missing}")
            fsync_named(self.fd, self.path)
        finally:
            self.abort()
        return self._hexdigest()

    def abort(self) -> None:
        """Close without checks (the caller deletes the half-written file)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class OrderedHashFile(PositionedFile):
    """A PositionedFile whose plain sha256 is taken as it is written (the formats whose specs record
    sha256). A region that lands at the hashed prefix's end is hashed from the caller's buffer at
    once; one that lands ahead of it is remembered, and hashed when the prefix reaches it, read back
    through the page cache. Nothing is held in memory but those region bounds."""

    def __init__(self, path: str | os.PathLike, size: int, head: bytes = b""):
        super().__init__(path, size)
        self.digest = hashlib.sha256()
        self.hashed = 0
        self.ahead: dict[int, int] = {}  # start -> stop of regions written past the hashed prefix
        self._write_head(head)

    def _hash(self, offset: int, view: memoryview) -> None:
        if offset != self.hashed:
            self.ahead[offset] = offset + len(view)
            return
        self.digest.update(view)
        self.hashed += len(view)
        if self.hashed in self.ahead:
            buf = bytearray(CHUNK)
            while self.hashed in self.ahead:
                stop = self.ahead.pop(self.hashed)
                for block in self._read_back(self.hashed, stop, buf):
                    self.digest.update(block)
                self.hashed = stop

    def _missing(self) -> str | None:
        if self.hashed != self.size or self.ahead:
            return f"{self.hashed} of {self.size} bytes written in order"
        return None

    def _hexdigest(self) -> str:
        return self.digest.hexdigest()


HELPER_NICE = 10  # how far below the job's own threads its helpers run: ~a tenth of a core's share when both want it


def lower_priority(*_: Any) -> None:
    """Run the calling thread (and the threads it starts) HELPER_NICE below the rest of the job: for
    helpers off the critical path, a part's hashing threads and its image-decoding workers, so that
    on a job's last free cores the thread that feeds the GPU is not the one waiting for a core (on
    the 2-core VM a main thread's loop of small torch ops beside a busy process and a hashing pool
    took 0.14-0.19 s at equal priority, 0.09-0.15 s with those below it, against 0.08-0.10 s beside
    the process alone). Linux keeps a nice value per thread; elsewhere it is the process's, which a
    helper thread must not lower, so nothing is done there. Takes any arguments: a DataLoader's
    worker_init_fn is given the worker's id."""
    if sys.platform.startswith("linux"):
        os.nice(HELPER_NICE)


BEHIND = 2  # items a ThreadChain holds unfinished: its caller fills a ring of BEHIND + 1 buffers


class ThreadChain:
    """Items handed down a chain of stages, each a function run by its own thread on every item in
    the order submitted, while the caller prepares the next item; the stages' work must release the
    GIL (pwrite, hashlib, file creation do). `submit` returns once at most BEHIND items are
    unfinished, so memory is what BEHIND + 1 items hold, and an item's buffers must stay unchanged
    until then: a ring of BEHIND + 1 buffers used in turn guarantees it.

    The first error a stage raises is kept; later work is skipped (every item still passes every
    stage, so nothing waits on a thread that stopped) and `submit` raises it: as an OSError naming
    `what`, or as it is when `what` is None (its stages name their files). As a context manager,
    leaving the block waits for every item, then raises that error unless the block itself raised.
    """

    def __init__(self, stages: list[Callable[..., None]], what: str | None = None):
        self.what = what
        self.error: BaseException | None = None
        self.unfinished = threading.Semaphore(BEHIND)
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in stages]
        self.threads = [threading.Thread(target=self._loop, args=(i, stage), daemon=True)
                        for i, stage in enumerate(stages)]
        for thread in self.threads:
            thread.start()

    def __enter__(self) -> ThreadChain:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.drain()
        if exc_type is None:
            self.raise_error()

    def submit(self, *item: Any) -> None:
        """Hand item (the first stage's arguments) down the chain; raise a stage's error."""
        self.unfinished.acquire()
        if self.error is not None:
            self.unfinished.release()
            self.raise_error()
        self.inboxes[0].put(item)

    def drain(self) -> None:
        """Wait for every item to pass every stage, and the threads to end."""
        for inbox, thread in zip(self.inboxes, self.threads):
            inbox.put(None)
            thread.join()

    def raise_error(self) -> None:
        if self.error is None:
            return
        if self.what is None:
            raise self.error
        raise OSError(f"{self.what}: {self.error}") from self.error

    def _loop(self, index: int, stage: Callable[..., None]) -> None:
        inbox, last = self.inboxes[index], index == len(self.inboxes) - 1
        while (item := inbox.get()) is not None:
            if self.error is None:
                try:
                    stage(*item)
                except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                    self.error = exc
            if last:
                self.unfinished.release()
            else:
                self.inboxes[index + 1].put(item)


class BufferWorkers:
    """`workers` threads, each running `work(buffer, *args)` on the next item submitted, in any order,
    while the caller fills the next buffer: for items whose outputs are independent (a file each),
    where a ThreadChain's one thread per stage is the limit (sha256 runs on one core per thread, and
    creating directories and files takes the filesystem's time per name). The caller fills one of
    workers + BEHIND buffers made by `make_buffer`: `buffer()` waits for a free one, `submit(buffer,
    *args)` hands it to a worker, and it is free again once work returns. Memory: those buffers.

    The first error work raises is kept; later items are skipped, and `buffer()` raises it (work
    names its files). As a context manager, leaving the block waits for every item, then raises that
    error unless the block itself raised.
    """

    def __init__(self, work: Callable[..., None], workers: int, make_buffer: Callable[[], Any]):
        self.work = work
        self.error: BaseException | None = None
        self.free: queue.Queue = queue.Queue()
        for _ in range(workers + BEHIND):
            self.free.put(make_buffer())
        self.todo: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(max(1, workers))]
        for thread in self.threads:
            thread.start()

    def __enter__(self) -> BufferWorkers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for _ in self.threads:
            self.todo.put(None)
        for thread in self.threads:
            thread.join()
        if exc_type is None and self.error is not None:
            raise self.error

    def buffer(self) -> Any:
        """A buffer no worker is using (waiting for one); raise a worker's error."""
        buffer = self.free.get()
        if self.error is not None:
            self.free.put(buffer)
            raise self.error
        return buffer

    def submit(self, buffer: Any, *args: Any) -> None:
        self.todo.put((buffer, args))

    def _loop(self) -> None:
        while (item := self.todo.get()) is not None:
            buffer, args = item
            if self.error is None:
                try:
                    self.work(buffer, *args)
                except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                    self.error = self.error or exc
            self.free.put(buffer)


class WriteBehind:
    """A PositionedFile filled behind its caller: `submit(offset, data)` hands the region to a thread
    that writes it, then to one that hashes it (a ThreadChain), so the caller gathers the next region
    while the disk and sha256 work on the ones before, where one thread would do the three in turn.
    A region is hashed only after it and every region before it are written, so an OrderedHashFile's
    read-back of regions written ahead finds their bytes.

    As a context manager: leaving the block normally waits for every region, raises the first error
    (naming the file) and closes the file (`digest` then holds its hex digest); leaving it on an
    exception, or after an error, closes the file without checks.
    """

    def __init__(self, sink: PositionedFile):
        self.sink = sink
        self.digest: str | None = None
        self.chain = ThreadChain([sink._put, self._hash], str(sink.path))

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.chain.drain()
        if exc_type is None and self.chain.error is None:
            self.digest = self.sink.close()
            return
        self.sink.abort()
        if exc_type is None:
            self.chain.raise_error()

    def submit(self, offset: int, data: memoryview | bytes | Any) -> None:
        """Queue the bytes of data (any contiguous buffer) for offset; raise a thread's error."""
        self.chain.submit(offset, memoryview(data).cast("B"))

    def _hash(self, offset: int, view: memoryview) -> None:
        if len(view):
            self.sink._hash(offset, view)


TREE_LEAF = 1 << 20  # the SHA-256 tree hash's leaf: 1 MiB, as Amazon S3 Glacier defines it
# TreeHashFile.write hashes a smaller write in the writing thread: each hand-off to a pool thread is a
# GIL switch that a launch-bound forward in the main thread waits on (bench/README.md `## extract`),
# for a gain of a leaf or two.
POOL_MIN_BYTES = 4 * TREE_LEAF
# A write's whole leaves go to the pool as at most this many runs, one task each: enough threads to
# hash them while the write's bytes go to the kernel (sha256 ~1.5 GB/s a thread; the copy into the
# page cache runs a few GB/s), few enough that a part's writers do not wake the pool's every thread at
# once beside the main thread and the decoding workers; and a task per run, not per leaf, takes the
# GIL once a leaf rather than four times (submit, start, result, hand-back).
HASH_TASKS_PER_WRITE = 4


def tree_root(leaves: list[bytes]) -> str:
    """The SHA-256 tree hash's root from its leaves' digests in file order: pairs hashed level by
    level, an odd last digest carried up as is (Amazon S3 Glacier's definition; one leaf = the file's
    plain sha256, none = the sha256 of nothing)."""
    if not leaves:
        return hashlib.sha256().hexdigest()
    while len(leaves) > 1:
        leaves = [hashlib.sha256(b"".join(leaves[i:i + 2])).digest() if i + 1 < len(leaves) else leaves[i]
                  for i in range(0, len(leaves), 2)]
    return leaves[0].hex()


def sha256_tree_file(path: str | os.PathLike | int, threads: int | None = None) -> str:
    """The SHA-256 tree hash (1 MiB leaves) of a file's bytes, its leaves read and hashed by the
    process's leaf hashers (hashlib and pread release the GIL), which a plain sha256, sequential by
    definition, cannot do; `threads` × 4 of its leaves are queued at a time (default: the CPUs this
    process may use). Memory: a leaf per hasher at work. `path` may be a descriptor the caller
    opened (and keeps); errors name a path."""
    threads = threads or len(os.sched_getaffinity(0))
    fd = path if isinstance(path, int) else os.open(path, os.O_RDONLY)
    pool, leaves, window = _leaf_hashers(), [], []
    try:
        with _naming(path):
            n_leaves = -(-os.fstat(fd).st_size // TREE_LEAF)
            for first in range(0, n_leaves, 4 * threads):  # a window, so futures stay few
                stop = min(first + 4 * threads, n_leaves)
                window = [pool.submit(_read_leaf_digest, fd, leaf) for leaf in range(first, stop)]
                leaves += [future.result() for future in window]
    finally:
        for future in window:  # after a failure: no leaf is read from fd once it is closed (or the caller's)
            future.cancel()
        wait(window)
        if fd is not path:
            os.close(fd)
    return tree_root(leaves)


# One pool of leaf hashers for the process, a thread a CPU: verify hashes several files at once from
# its own threads, and a pool a file made threads x CPUs threads and leaf buffers (1024 and 1 GiB
# under 8 verify threads on a 128-CPU node), every file's threads started anew.
_LEAF_HASHERS: ThreadPoolExecutor | None = None
_LEAF_HASHERS_LOCK = threading.Lock()


def _leaf_hashers() -> ThreadPoolExecutor:
    global _LEAF_HASHERS
    with _LEAF_HASHERS_LOCK:
        if _LEAF_HASHERS is None:
            _LEAF_HASHERS = ThreadPoolExecutor(len(os.sched_getaffinity(0)), thread_name_prefix="leaf-hash")
        return _LEAF_HASHERS


def _forget_leaf_hashers() -> None:
    """In a forked child: the parent's pool has no thread there, so a task given it would wait forever."""
    global _LEAF_HASHERS, _LEAF_HASHERS_LOCK
    _LEAF_HASHERS, _LEAF_HASHERS_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_leaf_hashers)


def _read_leaf_digest(fd: int, leaf: int) -> bytes:
    """sha256 of a leaf's bytes read from fd; a read that returns fewer bytes than asked (a network
    file system or a signal may) is resumed, or the leaf would be hashed from its first bytes only."""
    buf = bytearray(TREE_LEAF)
    return _leaf_digest(memoryview(buf)[:pread_into(fd, buf, leaf * TREE_LEAF)])


class TreeHashFile(PositionedFile):
    """A PositionedFile whose SHA-256 tree hash is taken as it is written: each 1 MiB leaf is hashed
    the moment its last byte arrives (from the caller's buffer when one write covers it, else read
    back through the page cache), so a file filled out of order (batches grouped by length) is all
    hashed when its last write returns, with no sequential hash left for the end of the run."""

    def __init__(self, path: str | os.PathLike, size: int, head: bytes = b"", pool: Executor | None = None):
        """pool: threads (the caller's, shared by its files) that hash the whole leaves of each write of
        POOL_MIN_BYTES or more at once (hashlib releases the GIL), where one thread's sha256 (~1.5 GB/s
        with SHA-NI) would bound a writer on a fast disk; `write` starts them before its bytes go to
        the kernel, a WriteBehind's hashing thread once they have."""
        super().__init__(path, size)
        n_leaves = -(-size // TREE_LEAF)
        self.filled = [0] * n_leaves  # bytes written into each leaf
        self.leaves: list[bytes | None] = [None] * n_leaves
        # leaf -> the sorted, disjoint (start, stop) ranges written into it, while it is partly filled:
        # a count alone lets bytes written twice make up for bytes never written
        self.pieces: dict[int, list[tuple[int, int]]] = {}
        self.buf = bytearray(TREE_LEAF)
        self.pool = pool
        self._write_head(head)

    def write(self, offset: int, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        started = self._start_hashes(offset, view)
        try:
            self._put_named(offset, view)
            if len(view):
                self._hash(offset, view, started)
        finally:
            wait({task for task, _ in started.values()})  # view's buffer is the caller's again once this returns

    def _start_hashes(self, offset: int, view: memoryview) -> dict[int, tuple[Future, int]]:
        """The digests of the leaves view covers whole, started on the pool when view is at least
        POOL_MIN_BYTES (none otherwise: _hash then takes them in its own thread), in at most
        HASH_TASKS_PER_WRITE runs of consecutive leaves: leaf -> (its run's task, its place in the run)."""
        if self.pool is None or len(view) < POOL_MIN_BYTES or offset + len(view) > self.size:
            return {}  # past the end: _hash names the fault
        whole = list(self._whole_leaves(offset, view))
        per_task, started = -(-len(whole) // HASH_TASKS_PER_WRITE), {}
        for first in range(0, len(whole), per_task):
            run = whole[first:first + per_task]
            task = self.pool.submit(_leaf_digests, [part for _, part in run])
            started.update({leaf: (task, i) for i, (leaf, _) in enumerate(run)})
        return started

    def _whole_leaves(self, offset: int, view: memoryview) -> Iterator[tuple[int, memoryview]]:
        """(leaf, its bytes in view) for each leaf that view covers whole."""
        stop = min(offset + len(view), self.size)
        for leaf in range(-(-offset // TREE_LEAF), -(-stop // TREE_LEAF)):
            start, end = leaf * TREE_LEAF, leaf * TREE_LEAF + self._leaf_size(leaf)
            if end <= stop:
                yield leaf, view[start - offset:end - offset]

    def hole(self, offset: int, length: int) -> None:
        """Count bytes offset..offset + length as written zeros without writing them: a hole the file
        already reads as zeros (it was truncated to its size past them)."""
        zeros, start, stop = memoryview(bytes(min(length, TREE_LEAF))), offset, offset + length
        while start < stop:  # leaf by leaf, so a leaf wholly in the hole is hashed from zeros, not read
            end = min(stop, (start // TREE_LEAF + 1) * TREE_LEAF)
            self._hash(start, zeros[:end - start])
            start = end

    def _leaf_size(self, leaf: int) -> int:
        return min(TREE_LEAF, self.size - leaf * TREE_LEAF)

    def _hash(self, offset: int, view: memoryview, started: dict[int, tuple[Future, int]] | None = None) -> None:
        """started: digests of this write's whole leaves already under way (write); else started here."""
        started = self._start_hashes(offset, view) if started is None else started
        stop = offset + len(view)
        if stop > self.size:
            raise OSError(f"{self.path}: a write ends at byte {stop}, past the file's {self.size}")
        in_view = {}  # leaf -> its bytes in view, for the leaves this write completes
        for leaf in range(offset // TREE_LEAF, -(-stop // TREE_LEAF)):
            start, end = leaf * TREE_LEAF, leaf * TREE_LEAF + self._leaf_size(leaf)
            low, high = max(start, offset), min(end, stop)
            if high - low < end - start:
                self._add_piece(leaf, low, high)
            self.filled[leaf] += high - low
            if self.filled[leaf] < end - start:
                continue
            self.pieces.pop(leaf, None)
            if self.filled[leaf] > end - start:
                raise OSError(f"{self.path}: bytes {start}..{end} written more than once")
            if start >= offset and end <= stop:
                in_view[leaf] = view[start - offset:end - offset]
            else:
                digest = hashlib.sha256()
                for block in self._read_back(start, end, self.buf):
                    digest.update(block)
                self.leaves[leaf] = digest.digest()
        # Hashed before returning: the caller may reuse view's buffer once this write returns.
        for leaf, part in in_view.items():
            if leaf in started:
                task, i = started[leaf]
                self.leaves[leaf] = task.result()[i]
            else:
                self.leaves[leaf] = _leaf_digest(part)

    def _add_piece(self, leaf: int, start: int, stop: int) -> None:
        """Record bytes start..stop, part of leaf, as written; raise if some of them already were."""
        pieces = self.pieces.setdefault(leaf, [])
        i = bisect.bisect(pieces, (start,))
        for low, high in pieces[max(i - 1, 0):i + 1]:
            if low < stop and start < high:
                raise OSError(f"{self.path}: bytes {max(low, start)}..{min(high, stop)} written more than once")
        if i and pieces[i - 1][1] == start:  # merged with touching neighbours: in-order writes keep one range
            start = pieces.pop(i - 1)[0]
            i -= 1
        if i < len(pieces) and pieces[i][0] == stop:
            stop = pieces.pop(i)[1]
        pieces.insert(i, (start, stop))

    def _missing(self) -> str | None:
        written = sum(self.filled)
        return None if written == self.size else f"{written} of {self.size} bytes written"

    def _hexdigest(self) -> str:
        return tree_root(self.leaves)


def _leaf_digest(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _leaf_digests(leaves: list[memoryview]) -> list[bytes]:
    return [_leaf_digest(leaf) for leaf in leaves]
