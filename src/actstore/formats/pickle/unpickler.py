"""Safe unpickling of shards: a restricted unpickler that can only build dict/list/tuple/str/int/
float/bool/None and plain numeric numpy arrays, and a check of everything it built."""
from __future__ import annotations

import io
import pickle  # absolute import: the standard library, not this package
from typing import Any

import numpy as np
from isal import isal_zlib

from actstore.formats.pickle.layout import NUMERIC_KINDS
from actstore.integrity import memory_budget

MAX_DEPTH = 16


def _numeric_dtype(dtype: np.dtype, where: str) -> np.dtype:
    if dtype.kind not in NUMERIC_KINDS or dtype.hasobject or dtype.fields is not None or dtype.subdtype:
        raise pickle.UnpicklingError(f"{where}: dtype {dtype} is not a plain numeric dtype")
    return dtype


def _make_dtype(*args: Any) -> np.dtype:
    return _numeric_dtype(np.dtype(*args), "numpy.dtype")


class _NdarrayName:
    """What a shard's `numpy.ndarray` global loads as: numpy's pickles only pass it to _reconstruct.
    Called (a REDUCE of ndarray itself: ndarray((n,), dtype)) it refuses, where the real class would
    allocate n elements sized by the untrusted file, or hand back uninitialised memory."""

    def __new__(cls, *args: Any, **kwargs: Any) -> None:
        raise pickle.UnpicklingError("numpy.ndarray(...) called in a shard: numpy's pickles never call it")


def _reconstruct(subtype: Any, shape: Any, dtype_code: Any) -> np.ndarray:
    if subtype is not _NdarrayName:
        raise pickle.UnpicklingError(f"_reconstruct of {subtype!r}: only numpy.ndarray is admitted")
    # numpy's own pickles always start from an empty array and fill it from the state's bytes (whose
    # length numpy checks); any other shape would be an allocation sized by the untrusted file.
    if shape != (0,):
        raise pickle.UnpicklingError(f"_reconstruct of shape {shape!r} is not allowed: numpy pickles use (0,)")
    from numpy._core.multiarray import _reconstruct as real
    return real(np.ndarray, shape, _numeric_dtype(np.dtype(dtype_code), "_reconstruct"))


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    from numpy._core.numeric import _frombuffer as real
    return real(buf, _numeric_dtype(np.dtype(dtype), "_frombuffer"), shape, order)


# Exactly the globals numpy's own pickles of plain arrays name (protocols 3-5, numpy 1.x and 2.x
# module paths), each wrapped so that only numeric dtypes and plain ndarrays come out.
ALLOWED_GLOBALS = {
    ("numpy", "ndarray"): _NdarrayName,
    ("numpy", "dtype"): _make_dtype,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
}
PLAIN_TYPES = (str, int, float, bool, type(None))


class RestrictedUnpickler(pickle.Unpickler):
    """Refuses every global but the numpy array constructors above; never imports anything else."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a shard") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in a shard")


def _check_plain(obj: Any, depth: int = 0, checked: set[int] | None = None, path: set[int] | None = None) -> None:
    """After loading: only the admitted container/scalar types and numeric arrays remain, and no
    container holds itself. Each container is checked once however many others share it (`checked`):
    a pickle's memo lets a few bytes make a DAG with exponentially many paths."""
    checked, path = (set(), set()) if checked is None else (checked, path)
    if depth > MAX_DEPTH:
        raise pickle.UnpicklingError(f"nesting deeper than {MAX_DEPTH} levels")
    if isinstance(obj, np.ndarray):
        if type(obj) is not np.ndarray:
            raise pickle.UnpicklingError(f"array subclass {type(obj).__name__}")
        _numeric_dtype(obj.dtype, "array")
        return
    if type(obj) not in (dict, list, tuple):
        if type(obj) not in PLAIN_TYPES:
            raise pickle.UnpicklingError(f"object of type {type(obj).__name__} is not allowed in a shard")
        return
    if id(obj) in path:
        raise pickle.UnpicklingError(f"a {type(obj).__name__} that holds itself")
    if id(obj) in checked:
        return
    path.add(id(obj))
    for item in (item for pair in obj.items() for item in pair) if type(obj) is dict else obj:
        _check_plain(item, depth + 1, checked, path)
    path.discard(id(obj))
    checked.add(id(obj))


def gunzip_bounded(data: bytes, limit: int) -> bytes:
    """Every gzip member of `data`, refused once the output passes `limit` bytes (a gzip bomb
    expands about a thousandfold). One-shot calls of ISA-L's zlib-compatible inflate: several times
    faster than GzipFile, 1.4-1.7x zlib's (whichever compressor wrote the shard)."""
    out, size, rest = [], 0, data
    while rest:
        member = isal_zlib.decompressobj(wbits=31)
        try:
            out.append(member.decompress(rest, limit + 1 - size))
        except isal_zlib.error as exc:
            raise pickle.UnpicklingError(f"not gzip data ({exc})") from None
        size += len(out[-1])
        if size > limit or member.unconsumed_tail:
            raise pickle.UnpicklingError(f"decompresses to more than {limit:,} bytes")
        if not member.eof:
            raise pickle.UnpicklingError("truncated gzip data")
        rest = member.unused_data
    return b"".join(out)


def safe_loads(data: bytes, compressed: bool) -> Any:
    """Decompress (if gzip) and unpickle with the restricted unpickler; check what came out."""
    raw = gunzip_bounded(data, memory_budget()) if compressed else data
    obj = RestrictedUnpickler(io.BytesIO(raw)).load()
    _check_plain(obj)
    return obj
