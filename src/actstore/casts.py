"""float32 -> float16 and bfloat16 the way the writers store them, without torch (its import costs a
writer job seconds and ~150 MB): float16 with numpy's bits (round to nearest even, NaN payloads as
numpy keeps them), bfloat16 with torch's (round to nearest even, every NaN 0xFFFF), the bytes that
earlier releases wrote through torch."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from actstore.errors import FormatError
from actstore.io_utils import pread_into, write_with_hole

try:  # C casts (src/actstore/_casts.c): float16 by the CPU's F16C, ~15x numpy's; bfloat16 ~3x numpy's
    from actstore import _casts
except ImportError:  # built without a C compiler, or a CPU without F16C: numpy, the same bits
    _casts = None

F16_EXPONENT = 0x7C00  # float16 bits with every exponent bit set: +-inf or NaN
# values per step of the bfloat16 cast and of the overflow count: blocks that stay in cache, and the count's
# indices and copies stay ~1 MiB however many values are inf or NaN (a diverged layer: all of them)
BLOCK = 1 << 16


def to_float16(x: np.ndarray, out: np.ndarray) -> int:
    """out[...] = x (float32, out's shape) as float16; returns how many finite values overflowed to
    +-inf. Memory: nothing beyond out, unless x is not C-contiguous float32 (then one copy of it)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != out.shape or out.dtype != np.float16 or not out.flags.c_contiguous:
        raise ValueError(f"to_float16: float32 {x.shape} into {out.dtype} {out.shape}")
    if _casts is None:
        with np.errstate(over="ignore"):
            np.copyto(out, x, casting="same_kind")
        return _overflowed(x.reshape(-1), out.reshape(-1), redo=False)
    return _overflowed(x.reshape(-1), out.reshape(-1)) if _casts.f32_to_f16(x, out) else 0


def _overflowed(flat: np.ndarray, out: np.ndarray, redo: bool = True) -> int:
    """How many finite values of `flat` (float32) are +-inf in `out` (their float16 cast), found among
    the outputs that are inf or NaN; `redo`: first cast those few again with numpy, for its NaN
    payloads (F16C truncates them)."""
    overflowed = 0
    for lo in range(0, len(flat), BLOCK):
        block, cast = flat[lo:lo + BLOCK], out[lo:lo + BLOCK]
        special = np.flatnonzero(cast.view(np.uint16) & F16_EXPONENT == F16_EXPONENT)
        if redo:
            with np.errstate(over="ignore"):
                cast[special] = block[special].astype(np.float16)
        overflowed += int(np.isinf(cast[special]).sum() - np.isinf(block[special]).sum())
    return overflowed


@dataclass(frozen=True)
class RowFile:
    """An open file of rows of `width` values of storage dtype `dtype` (float32, bfloat16, float16)
    from byte `start`, named `name` in errors: what float16_file reads."""
    fd: int
    name: str
    start: int
    dtype: str
    width: int


def float16_file(source: RowFile, first: int, rows: int, wide: np.ndarray, out: np.ndarray,
                 directories: Sequence[str], path: str) -> int:
    """Rows [first, first + rows) of `source` cast into `out` (float16, zeros past them: the caller
    hashes it whole) and written as the new file `path` after making the new `directories` (at most
    4, in order): those values, then a hole for the rest of `out` (zeros read back, no disk blocks),
    the disk started on it. `wide`: room for the rows as float32 (unused for a float16 source).
    Returns how many finite values overflowed to +-inf. Errors name the file: FormatError when
    `source` ends first, OSError for the directory or file that could not be made.
    In C, one call without the GIL: a job's threads, each writing its own files, take the GIL twice a
    file (here and for its hash) instead of at each of a dozen system calls (py-spy, 2-core VM: a zarr
    shard job's 2 threads spent ~30 % of their samples waiting for it after those calls)."""
    n, flat = rows * source.width, out.reshape(-1)
    _check_buffers(source, first, n, wide, out, directories)
    offset = source.start + first * source.width * np.dtype(STORED[source.dtype]).itemsize
    if _casts is not None:
        special = _casts.f16_file(source.fd, source.name, offset, SOURCE_CODES[source.dtype], n, wide, out,
                                  directories, path)
        if special < 0:
            raise FormatError(f"{source.name}: ends before row {first + rows}")
        if not special:
            return 0
        overflowed = _overflowed(wide.reshape(-1)[:n], flat[:n])  # then made and written below, as without C
    else:
        overflowed = _read_and_cast(source, offset, n, wide, flat, first + rows)
        flat[n:] = 0
    for directory in directories:
        try:
            os.mkdir(directory)
        except OSError as exc:
            raise OSError(exc.errno, f"{directory}: {exc.strerror}") from exc
    write_with_hole(path, flat, 2 * n)
    return overflowed


def _check_buffers(source: RowFile, first: int, n: int, wide: np.ndarray, out: np.ndarray,
                   directories: Sequence[str]) -> None:
    """float16_file's refusals, before anything is read or made, alike with the C casts and without."""
    if source.dtype not in STORED:
        raise ValueError(f"{source.name}: storage dtype {source.dtype!r}, not one of {', '.join(STORED)}")
    if first < 0:  # else the bytes before the rows (a .npy header) were read as values
        raise ValueError(f"float16_file: row {first} of {source.name}, before its first")
    if len(directories) > MAX_DIRECTORIES:  # _casts.c's MAX_DIRS: the numpy path made them all
        raise ValueError(f"float16_file: {len(directories)} directories to make, at most {MAX_DIRECTORIES}")
    contiguous = out.flags.c_contiguous and wide.flags.c_contiguous  # else `out`'s reshape is a copy, not filled
    if not contiguous or out.dtype != np.float16 or wide.dtype != np.float32:
        raise ValueError(f"float16_file: wide {wide.dtype} and out {out.dtype} must be C-contiguous float32 and "
                         "float16")
    if n < 0 or n > out.size or (source.dtype != "float16" and n > wide.size):
        raise ValueError(f"float16_file: {n} values into {out.nbytes} float16 bytes ({wide.nbytes} float32 bytes "
                         "of room)")


def _read_and_cast(source: RowFile, offset: int, n: int, wide: np.ndarray, flat: np.ndarray, stop: int) -> int:
    """float16_file's read and cast without the C casts: n values at `offset`, up to row `stop`, into
    flat[:n]; returns the overflows."""
    landing = (flat if source.dtype != "float32" else wide.reshape(-1))[:n].view(STORED[source.dtype])
    try:
        read = pread_into(source.fd, landing, offset)
    except OSError as exc:
        raise OSError(exc.errno, f"{source.name}: {exc.strerror}") from exc
    if read < landing.nbytes:
        raise FormatError(f"{source.name}: ends before row {stop}")
    if source.dtype == "float16":
        return 0
    widened = landing if source.dtype == "float32" else to_float32(landing, source.dtype, wide.reshape(-1)[:n])
    return to_float16(widened, flat[:n])


SOURCE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}  # _casts.f16_file's src_dtype
MAX_DIRECTORIES = 4  # _casts.f16_file's most directories to make (MAX_DIRS)
STORED = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}  # a storage dtype's numpy view


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """x (float32) as bfloat16 bit patterns (uint16, numpy has no bfloat16): round to nearest even,
    as torch's cast does, and every NaN 0xFFFF, as torch's vectorised cast writes it."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16)
    if _casts is not None:
        _casts.f32_to_bf16(x, out)
        return out
    flat, dst = x.reshape(-1), out.reshape(-1)
    for lo in range(0, len(flat), BLOCK):  # blocks that stay in cache: 4x faster than whole arrays
        bits = flat[lo:lo + BLOCK].view(np.uint32)
        halves = bits.view(np.uint16)  # little-endian: [1::2] is each value's top half, no shifts
        biased = bits + np.uint32(0x7FFF)
        biased += halves[1::2] & np.uint16(1)  # ties to even: + 1 more when the kept lsb is 1
        dst[lo:lo + BLOCK] = biased.view(np.uint16)[1::2]
        nan = np.isnan(flat[lo:lo + BLOCK])
        if nan.any():
            dst[lo:lo + BLOCK][nan] = 0xFFFF
    return out


def bfloat16_bits_to_float32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bit patterns -> float32, exact (they are a float32's top half), into `out` (float32,
    bits' shape) when given: one pass, no temporary, no GIL (numpy's shift loop)."""
    bits = np.asarray(bits)
    if out is None:
        out = np.empty(bits.shape, np.float32)
    elif out.shape != bits.shape or out.dtype != np.float32:
        raise ValueError(f"bfloat16_bits_to_float32: {bits.shape} into {out.dtype} {out.shape}")
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def to_float32(values: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """Stored values of storage dtype `dtype` (float32, float16, or bfloat16 as its uint16 bits) as
    float32, exact for each, into `out` (float32, values' shape) when given; float32 without `out` is
    returned as is."""
    if dtype not in STORED:
        raise ValueError(f"to_float32: storage dtype {dtype!r}, not one of {', '.join(STORED)}")
    if dtype == "bfloat16":
        return bfloat16_bits_to_float32(values, out)
    if out is None:
        return np.asarray(values, dtype=np.float32)
    if out.shape != np.shape(values) or out.dtype != np.float32:  # else a row would be broadcast, silently
        raise ValueError(f"to_float32: {dtype} {np.shape(values)} into {out.dtype} {out.shape}")
    out[...] = values
    return out
