"""Safe unpickling of shards: a restricted unpickler that can only build dict/list/tuple/str/int/
float/bool/None and plain numeric numpy arrays, and a check of everything it built."""
from __future__ import annotations

import io
import pickle  # absolute import: the standard library, not this package
import pickletools
import threading
from contextlib import contextmanager
from typing import IO, Any, Callable, Iterator

import numpy as np
from isal import igzip, isal_zlib

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


class _Refused(Exception):
    """A gzip shard refused as it is streamed (_Gunzip, ByteBudget): raised through the unpickler as
    this, since it turns an UnpicklingError from the read of an opcode into "Ran out of input"."""


class BudgetHeldByOthers(Exception):
    """A shard would take more of a shared ByteBudget than is left while other shards hold some of
    it: not a fault of the shard, which is loaded again once it has the budget to itself."""


class ByteBudget:
    """Decompressed bytes that the shards loaded at once may hold together. verify's threads share
    one, so that shards whose metadata understates them cannot together hold more than it: each
    takes its bytes as they come out of the gzip stream, and gives them back when its check is done."""

    def __init__(self, total: int) -> None:
        self.total, self.taken, self.lock = total, 0, threading.Lock()

    @contextmanager
    def share(self) -> Iterator[Callable[[int], None]]:
        """One shard's share: a function taking `n` more bytes, which raises _Refused (safe_loads'
        UnpicklingError) when the shard alone would pass the total, BudgetHeldByOthers when others
        hold what it lacks. All it took is given back at the end of the block."""
        held = 0

        def take(n: int) -> None:
            nonlocal held
            with self.lock:
                if self.taken + n > self.total:
                    if self.taken == held:
                        raise _Refused(f"decompresses to more than {self.total:,} bytes")
                    raise BudgetHeldByOthers()
                self.taken, held = self.taken + n, held + n
        try:
            yield take
        finally:
            with self.lock:
                self.taken -= held


GUNZIP_BLOCK = 1 << 20  # what _Gunzip decompresses at a time: past a budget by at most this


class _Gunzip(io.RawIOBase):
    """The gzip members of `data` decompressed as they are read (ISA-L's igzip), every byte that
    comes out charged to `take`: the pickle is never held whole, only the objects built from it,
    and a gzip bomb is refused a block after its budget."""

    def __init__(self, data: bytes, take: Callable[[int], None]) -> None:
        self.gzip, self.take = igzip.GzipFile(fileobj=io.BytesIO(data)), take

    def readable(self) -> bool:
        return True

    def tell(self) -> int:  # the position pickletools.genops names an opcode by
        return self.gzip.tell()

    def readinto(self, buffer: Any) -> int:
        try:  # a block at a time: a read the pickle sizes itself is refused before it is filled
            n = self.gzip.readinto(memoryview(buffer)[:GUNZIP_BLOCK])
        except EOFError:
            raise _Refused("truncated gzip data") from None
        except (OSError, isal_zlib.error) as exc:
            raise _Refused(f"not gzip data ({exc})") from None
        self.take(n)
        return n


def _gunzip_stream(data: bytes, take: Callable[[int], None]) -> io.BufferedReader:
    return io.BufferedReader(_Gunzip(data, take), GUNZIP_BLOCK)


def _gunzip_load(data: bytes, take: Callable[[int], None]) -> Any:
    """The restricted unpickler's object from gzip `data`, streamed twice (_Gunzip): the opcode check
    reads all of it, the rest after STOP too (a truncated or bad gzip is refused as when it was
    whole), charging every byte to `take`; the unpickler then builds from those same bytes, already
    charged, so the pickle is never held whole and never charged twice."""
    try:
        with _gunzip_stream(data, take) as stream:
            _check_memo_puts(stream)
            while stream.read(GUNZIP_BLOCK):
                pass
        with _gunzip_stream(data, lambda n: None) as stream:
            return RestrictedUnpickler(stream).load()
    except _Refused as exc:
        raise pickle.UnpicklingError(str(exc)) from None


PUT_OPCODES = ("PUT", "BINPUT", "LONG_BINPUT")


def _check_memo_puts(stream: IO[bytes]) -> None:
    """Refuse a PUT that names any memo index but the next one, as every pickler writes them: the C
    unpickler grows its memo to twice the index named, zeroed, so 9 bytes naming 2**30 took 16 GiB
    before anything could refuse the shard."""
    entries = 0
    try:
        for opcode, arg, pos in pickletools.genops(stream):
            if opcode.name in PUT_OPCODES and arg != entries:
                raise pickle.UnpicklingError(f"{opcode.name} at byte {pos} names memo index {arg}, "
                                             f"not the next one ({entries})")
            entries += opcode.name in PUT_OPCODES or opcode.name == "MEMOIZE"
    except ValueError as exc:  # genops' word for bytes that are no pickle, or end before its STOP
        raise pickle.UnpicklingError(f"invalid load key or argument ({exc})") from None


def safe_loads(data: bytes, compressed: bool, take: Callable[[int], None] | None = None) -> Any:
    """Decompress (if gzip), check the memo indices (_check_memo_puts), unpickle with the restricted
    unpickler and check what came out. The decompressed bytes are charged to `take` (a ByteBudget
    share), by default a budget of memory_budget() of the shard's own."""
    if not compressed:
        _check_memo_puts(io.BytesIO(data))
        obj = RestrictedUnpickler(io.BytesIO(data)).load()
    elif take is None:
        with ByteBudget(memory_budget()).share() as own:
            obj = _gunzip_load(data, own)
    else:
        obj = _gunzip_load(data, take)
    _check_plain(obj)
    return obj
