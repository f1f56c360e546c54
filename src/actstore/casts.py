"""float32 -> float16 and bfloat16 the way the writers store them, without torch (its import costs a
writer job seconds and ~150 MB): float16 with numpy's bits (round to nearest even, NaN payloads as
numpy keeps them), bfloat16 with torch's (round to nearest even, every NaN 0xFFFF), the bytes that
earlier releases wrote through torch."""
from __future__ import annotations

import numpy as np

try:  # C casts (src/actstore/_casts.c): float16 by the CPU's F16C, ~15x numpy's; bfloat16 ~3x numpy's
    from actstore import _casts
except ImportError:  # built without a C compiler, or a CPU without F16C: numpy, the same bits
    _casts = None

F16_EXPONENT = 0x7C00  # float16 bits with every exponent bit set: +-inf or NaN
BLOCK = 1 << 16  # values per step of the bfloat16 cast


def to_float16(x: np.ndarray, out: np.ndarray) -> int:
    """out[...] = x (float32, out's shape) as float16; returns how many finite values overflowed to
    +-inf. Memory: nothing beyond out, unless x is not C-contiguous float32 (then one copy of it)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != out.shape or out.dtype != np.float16 or not out.flags.c_contiguous:
        raise ValueError(f"to_float16: float32 {x.shape} into {out.dtype} {out.shape}")
    flat = x.reshape(-1)
    if _casts is None:
        with np.errstate(over="ignore"):
            np.copyto(out, x, casting="same_kind")
        special = np.flatnonzero(out.reshape(-1).view(np.uint16) & F16_EXPONENT == F16_EXPONENT)
    elif _casts.f32_to_f16(x, out):
        # inf or NaN: numpy's bits for those few (F16C truncates NaN payloads)
        special = np.flatnonzero(out.reshape(-1).view(np.uint16) & F16_EXPONENT == F16_EXPONENT)
        with np.errstate(over="ignore"):
            out.reshape(-1)[special] = flat[special].astype(np.float16)
    else:
        return 0
    return int(np.isinf(out.reshape(-1)[special]).sum() - np.isinf(flat[special]).sum())


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
    float32, exact for each, into `out` when given; float32 without `out` is returned as is."""
    if dtype == "bfloat16":
        return bfloat16_bits_to_float32(values, out)
    if out is None:
        return np.asarray(values, dtype=np.float32)
    out[...] = values
    return out
