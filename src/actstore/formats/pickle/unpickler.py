"""Safe unpickling of shards: a restricted unpickler that can only build dict/list/tuple/str/int/
float/bool/None and plain numeric numpy arrays, and a check of everything it built."""
from __future__ import annotations

import io
import pickle  # absolute import: the standard library, not this package
import pickletools
import re
import struct
import threading
from contextlib import contextmanager
from functools import partial
from typing import IO, Any, Callable, Iterator

import numpy as np
from isal import igzip, isal_zlib

from actstore.formats.pickle.layout import NUMERIC_KINDS
from actstore.integrity import memory_budget

MAX_DEPTH = 16
# The widest int a shard may hold: no field holds one near it, and Python prints no int past 4,300 digits
# (14,284 bits), so every message naming one failed (verify blamed metadata.json, readers a bare ValueError)
MAX_INT_BITS = 4096


def _numeric_dtype(dtype: np.dtype, where: str) -> np.dtype:
    if dtype.kind not in NUMERIC_KINDS or dtype.hasobject or dtype.fields is not None or dtype.subdtype:
        # cut: a structured dtype of 10**5 fields names every one
        raise pickle.UnpicklingError(f"{where}: dtype {dtype!s:.80} is not a plain numeric dtype")
    if dtype.metadata is not None:  # a BUILD state's (version 4): any object the shard chose, kept by numpy
        raise pickle.UnpicklingError(f"{where}: dtype {dtype} carries metadata, which numpy's pickles never give")
    return dtype


def _make_dtype(made: list[np.dtype], *args: Any) -> np.dtype:
    """numpy.dtype(*args), a plain numeric one, kept in `made` (for _disarm)."""
    made.append(dtype := _numeric_dtype(np.dtype(*args), "numpy.dtype"))
    return dtype


class _Admitted:
    """A global a shard may name, called as `function`. A BUILD of it is refused: its state's items were
    set as attributes of this module's own objects, kept for every later load in the process (memory no
    budget counts, as much as a shard's BUILDs put there)."""

    def __init__(self, name: str, function: Callable[..., Any]) -> None:
        self.name, self.function = name, function

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)

    def __repr__(self) -> str:  # as messages name it: "_reconstruct of numpy.dtype"
        return self.name

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"BUILD of the global {self.name} in a shard: numpy's pickles never build one")


def _ndarray_called(*args: Any) -> None:
    """What a shard's `numpy.ndarray` global does, called (a REDUCE of ndarray itself: ndarray((n,),
    dtype)): refuse, where the real class would allocate n elements sized by the untrusted file, or hand
    back uninitialised memory. numpy's pickles only pass it to _reconstruct."""
    raise pickle.UnpicklingError("numpy.ndarray(...) called in a shard: numpy's pickles never call it")


NDARRAY = _Admitted("numpy.ndarray", _ndarray_called)  # what a shard's `numpy.ndarray` global loads as


def _reconstruct(subtype: Any, shape: Any, dtype_code: Any) -> np.ndarray:
    if subtype is not NDARRAY:
        raise pickle.UnpicklingError(f"_reconstruct of {subtype!r:.80}: only numpy.ndarray is admitted")
    # numpy's own pickles always start from an empty array and fill it from the state's bytes (whose
    # length numpy checks); any other shape would be an allocation sized by the untrusted file.
    if shape != (0,):
        raise pickle.UnpicklingError(f"_reconstruct of shape {shape!r:.80} is not allowed: numpy pickles use (0,)")
    from numpy._core.multiarray import _reconstruct as real
    return real(np.ndarray, shape, _numeric_dtype(np.dtype(dtype_code), "_reconstruct"))


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    from numpy._core.numeric import _frombuffer as real
    return real(buf, _numeric_dtype(np.dtype(dtype), "_frombuffer"), shape, order)


# Exactly the globals numpy's own pickles of plain arrays name (protocols 3-5, numpy 1.x and 2.x
# module paths), each wrapped so that only numeric dtypes and plain ndarrays come out; and numpy.dtype,
# which each RestrictedUnpickler answers with its own _make_dtype (keeping the dtypes it made).
ALLOWED_GLOBALS = {
    ("numpy", "ndarray"): NDARRAY,
    ("numpy._core.multiarray", "_reconstruct"): _Admitted("_reconstruct", _reconstruct),
    ("numpy.core.multiarray", "_reconstruct"): _Admitted("_reconstruct", _reconstruct),
    ("numpy._core.numeric", "_frombuffer"): _Admitted("_frombuffer", _frombuffer),
    ("numpy.core.numeric", "_frombuffer"): _Admitted("_frombuffer", _frombuffer),
}
DTYPE_GLOBAL = ("numpy", "dtype")
PLAIN_TYPES = (str, int, float, bool, type(None))


class RestrictedUnpickler(pickle.Unpickler):
    """Refuses every global but the numpy array constructors above; never imports anything else."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.dtypes: list[np.dtype] = []  # every dtype the shard made, for _disarm
        # not a bound method: the memo holds the global, and a bound method would hold the unpickler,
        # a cycle that kept everything it built alive until the garbage collector ran
        self.numpy_dtype = _Admitted("numpy.dtype", partial(_make_dtype, self.dtypes))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == DTYPE_GLOBAL:
            return self.numpy_dtype
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
        if type(obj) is int and obj.bit_length() > MAX_INT_BITS:
            raise pickle.UnpicklingError(f"an int of {obj.bit_length()} bits (at most {MAX_INT_BITS} allowed)")
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


def _disarm(dtypes: list[np.dtype]) -> None:
    """Clear the flags of the dtypes a refused shard made (a numeric dtype has none). A BUILD state
    can set them after numpy.dtype() admitted the dtype, before or after an array is filled with it,
    saying it holds objects: numpy then frees the array by clearing its numbers as objects, which
    fails and printed a RuntimeError traceback on stderr beside the error that refused the shard."""
    for dtype in dtypes:
        dtype.__setstate__((3, dtype.byteorder, None, None, None, -1, -1, 0))


class _Refused(Exception):
    """A shard refused as it is streamed (_MemoChecked, _Gunzip, ByteBudget): raised through the
    unpickler as this, since it turns an UnpicklingError from the read of an opcode into "Ran out of
    input"."""


class BudgetHeldByOthers(Exception):
    """A shard would take more of a shared ByteBudget than is left while other shards hold some of
    it: not a fault of the shard, which is loaded again once it has the budget to itself."""


class ByteBudget:
    """Decompressed bytes that the shards loaded at once may hold together, with what their opcodes
    build (OPCODE_BYTES each). verify's threads share one, so that shards whose metadata understates
    them cannot together hold more than it: each takes its bytes as they come out of the gzip stream,
    and gives them back when its check is done."""

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
    """The restricted unpickler's object from gzip `data`, inflated once as it is read (_Gunzip): the
    unpickler builds from it through the opcode check (_MemoChecked), which reads on to the end of the
    gzip stream (a truncated or bad gzip is refused as when it was whole), every byte charged to `take`."""
    with _gunzip_stream(data, take) as stream:
        return _MemoChecked(stream, take, memory_budget(), "what a shard may decompress to").load()


PUT_OPCODES = ("PUT", "BINPUT", "LONG_BINPUT")
GET_OPCODES = ("GET", "BINGET", "LONG_BINGET")
INDEXED = (*PUT_OPCODES, *GET_OPCODES)  # the opcodes whose argument is a memo index
# The struct format of a counted argument's length, by pickletools' word for where its length is
COUNT_FORMATS = {pickletools.TAKEN_FROM_ARGUMENT1: "<B", pickletools.TAKEN_FROM_ARGUMENT4: "<i",
                 pickletools.TAKEN_FROM_ARGUMENT4U: "<I", pickletools.TAKEN_FROM_ARGUMENT8U: "<Q"}


def _layout(opcode: pickletools.OpcodeInfo) -> tuple[pickletools.OpcodeInfo, int, str | None, int, bool]:
    """How the opcode lies in the stream (pickletools' table): the bytes of its head (the opcode, a
    fixed argument or the length of a counted one), the struct format of that length, the lines of
    a text argument (protocol 0: GLOBAL and INST take two), and whether _complete reads its head."""
    n = opcode.arg.n if opcode.arg else 0
    checked = n in COUNT_FORMATS or opcode.name in (*INDEXED, "FRAME")
    if n == pickletools.UP_TO_NEWLINE:
        return opcode, 1, None, 2 if opcode.arg is pickletools.stringnl_noescape_pair else 1, checked
    if n in COUNT_FORMATS:
        return opcode, 1 + struct.calcsize(COUNT_FORMATS[n]), COUNT_FORMATS[n], 0, checked
    return opcode, 1 + n, None, 0, checked


LAYOUTS = {opcode.code.encode("latin-1")[0]: _layout(opcode) for opcode in pickletools.opcodes}
NEWLINE = re.compile(b"\n")  # searches a memoryview (readinto's bytes) without copying it
# What an opcode may build beyond the bytes it counts, at most: an empty set (232), a dict's item (a
# key and value opcode each), a memo or stack slot. '}' is 88 bytes of dict and list slot for 1 byte.
OPCODE_BYTES = 256


# What an opcode does to the stack (pickletools' table): "change" the object below what it takes (which
# goes into it), "mark", "memo" (the memo shares the top), "get", "dup", "make" a new object of what it
# takes or "drop" what it takes (POP, POP_MARK, STOP); whether it takes what lies above its MARK; how
# many slots it takes besides (the object it changes among them).
CHANGES = ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD")
NAMED_KINDS = {"MARK": "mark", "DUP": "dup", "MEMOIZE": "memo", **dict.fromkeys(PUT_OPCODES, "memo"),
               **dict.fromkeys(GET_OPCODES, "get"), **dict.fromkeys(CHANGES, "change")}


def _effect(opcode: pickletools.OpcodeInfo) -> tuple[str, bool, int]:
    before = [slot.name for slot in opcode.stack_before]
    kind = NAMED_KINDS.get(opcode.name, "make" if opcode.stack_after else "drop")
    return kind, "mark" in before, before.index("mark") if "mark" in before else len(before)


EFFECTS = {opcode.name: _effect(opcode) for opcode in pickletools.opcodes}
# The opcodes _check_opcodes follows inline: those making a scalar or an empty container of a fixed
# argument it does not check (a third of a shard's opcodes), and BINGET (a quarter)
SCALARS = frozenset(code for code, (opcode, _, _, lines, checked) in LAYOUTS.items()
                    if EFFECTS[opcode.name] == ("make", False, 0) and not lines and not checked)
BINGET, STOP = (pickletools.code2op[code].code.encode("latin-1")[0] for code in "h.")
# How deep the stream may nest what it builds: numpy's arrays are a few levels deeper here (their
# arguments and state) than _check_plain counts them, and C's hash of a tuple recurses unchecked
STREAM_DEPTH = 4 * MAX_DEPTH


class _Nesting:
    """How deep the objects of a stream nest, followed opcode by opcode before the unpickler builds them:
    a dict key nested 100,000 levels (a 100 KB shard of TUPLE1s, or numeric dtypes each BUILT with the
    last in its fields) crashed the process (a segfault) as C hashed it, before _check_plain saw it.
    A stack slot holds its object's depth: an int while it alone holds the object, a [depth, held] cell
    once the memo (or DUP) shares it. An object is changed (APPEND, SETITEM, BUILD...) only until another
    holds it, as picklers write them: after that, the depths of what holds it would be stale."""

    def __init__(self) -> None:
        self.stack: list[int | list] = []
        self.marks: list[int] = []  # the stack's length at each open MARK
        self.memo: list[list] = []

    def step(self, name: str, at: int, index: int | None) -> None:
        """The stack after opcode `name` at byte `at` (`index`: a GET's memo index); _Refused where the
        unpickler would fail on it (no MARK, too few slots, an unset memo index) or as said above."""
        kind, marked, takes = EFFECTS[name]
        if kind == "mark":
            self.marks.append(len(self.stack))
        elif kind == "get":
            if not 0 <= index < len(self.memo):  # a text GET's -1 would have named the last
                raise _Refused(f"{name} at byte {at} names memo index {index}, which no PUT has set")
            self.stack.append(self.memo[index])
        elif kind in ("memo", "dup"):
            (self.memo if kind == "memo" else self.stack).append(self._shared(name, at))
        elif kind == "change":
            self._change(name, at, self._take(name, at, marked, 0 if marked else takes - 1))
        elif marked or takes:
            taken = self._take(name, at, marked, takes)
            if kind == "make":
                self.stack.append(self._deepest(self._depth(taken), at))
        elif kind == "make":  # a scalar or an empty container (most opcodes): nothing taken
            self.stack.append(0)

    def _fence(self, name: str, at: int, n: int) -> None:
        """Refused unless the stack holds `n` slots above its last MARK (as the unpickler refuses)."""
        if len(self.stack) - n < (self.marks[-1] if self.marks else 0):
            raise _Refused(f"{name} at byte {at}: unpickling stack underflow")

    def _take(self, name: str, at: int, marked: bool, n: int) -> list[int | list]:
        """The slots an opcode takes off the stack: those above its MARK, or its last `n`."""
        if marked and not self.marks:
            raise _Refused(f"{name} at byte {at}: no MARK before it")
        if not marked:
            self._fence(name, at, n)
        start = self.marks.pop() if marked else len(self.stack) - n
        taken = self.stack[start:]
        del self.stack[start:]
        return taken

    def _shared(self, name: str, at: int) -> list:
        """The top slot, made a cell (the memo or DUP shares it)."""
        self._fence(name, at, 1)
        if isinstance(top := self.stack[-1], int):
            top = self.stack[-1] = [top, False]
        return top

    def _change(self, name: str, at: int, items: list[int | list]) -> None:
        """The top slot's object with `items` put into it."""
        self._fence(name, at, 1)
        target = self.stack[-1]
        if isinstance(target, list) and target[1]:
            raise _Refused(f"{name} at byte {at} changes an object another one already holds (picklers "
                           f"build each object, a dtype or an array, whole before they use it)")
        depth = self._deepest(max(target if isinstance(target, int) else target[0], self._depth(items)), at)
        if isinstance(target, int):
            self.stack[-1] = depth
        else:
            target[0] = depth

    @staticmethod
    def _depth(slots: list[int | list]) -> int:
        """The depth of an object holding `slots` (0: none), which are held by it from now on."""
        for slot in slots:
            if isinstance(slot, list):
                slot[1] = True
        return 1 + max((slot if isinstance(slot, int) else slot[0] for slot in slots), default=-1)

    @staticmethod
    def _deepest(depth: int, at: int) -> int:
        """`depth`, refused past STREAM_DEPTH."""
        if depth > STREAM_DEPTH:
            raise _Refused(f"nesting deeper than {STREAM_DEPTH} levels at byte {at}")
        return depth


class _MemoChecked:
    """The stream the unpickler reads, each opcode checked as its bytes pass, before the unpickler has
    them: a PUT must name the next memo index, as every pickler writes them. The C unpickler grows
    its memo to twice the index named, zeroed, so 9 bytes naming 2**30 took 16 GiB before anything
    could refuse the shard. Frames are checked (_check) and opcodes charged to the budget (_charge)
    on the way. One pass over the bytes (a check reading them first inflated a gzip shard twice); no
    peek(), so the unpickler reads nothing it has not been handed, checked. `room`: the most bytes the
    stream can hold, `room_is` what that is, for messages."""

    def __init__(self, stream: IO[bytes], take: Callable[[int], None], room: int, room_is: str) -> None:
        self.stream, self.take, self.room, self.room_is = stream, take, room, room_is
        self.offset = 0  # of the first byte of the next read, for messages
        self.head = bytearray()  # the opcode being read and as much of its argument as it needs
        self.skip = 0  # bytes of a counted argument (a string, an array's data) still to pass
        self.frame_end = 0  # the byte after the frame being read, if one is
        self.nesting = _Nesting()
        self.stopped = False

    @property
    def entries(self) -> int:
        """The memo's size: the index the next PUT must name."""
        return len(self.nesting.memo)

    def load(self) -> Any:
        """The restricted unpickler's object, checked (_check_plain), as are the dtypes it made and the end of
        the stream (nothing may follow STOP). A refused shard's dtypes are disarmed (_disarm) while the
        unpickler still holds what it built; then it is let go, as the C unpickler alone was: held by the
        traceback, its arrays outlived the budget share they took."""
        unpickler = RestrictedUnpickler(self)
        try:
            obj = unpickler.load()
            self.read(1)  # the end of the stream, or bytes after STOP, which _check refuses
            _check_plain(obj)
            # a BUILD state can alter a dtype after numpy.dtype() admitted it, its array then dropped: no
            # check of `obj` sees it, and numpy printed a traceback freeing the array with the unpickler
            for dtype in unpickler.dtypes:
                _numeric_dtype(dtype, "numpy.dtype after its BUILD")
        except BaseException:
            _disarm(unpickler.dtypes)
            del unpickler
            raise
        return obj

    def read(self, n: int = -1) -> bytes:
        data = self.stream.read(n)
        self._check(data)
        return data

    def readline(self) -> bytes:
        line = self.stream.readline()
        self._check(line)
        return line

    def readinto(self, buffer: Any) -> int:
        n = self.stream.readinto(buffer)
        self._check(memoryview(buffer)[:n])
        return n

    def _check(self, data: Any) -> None:
        """Read the opcodes in `data`, a frame at a time: the C unpickler drops what is left of a
        frame when an opcode, its argument or a line runs past the frame's end, and reads them from
        the bytes after it, so a shard cut that way would have it build from other bytes than these.
        Refused, as pickle's Python unpickler does (no pickler writes one)."""
        pos, end, opcodes = 0, len(data), 0
        while pos < end and not self.stopped:
            in_frame = self.frame_end > self.offset + pos
            pos, more = self._check_opcodes(data, pos, min(end, self.frame_end - self.offset) if in_frame else end)
            opcodes += more
            if in_frame and self.offset + pos == self.frame_end and (self.head or self.skip):
                raise _Refused(f"an opcode runs past the end of the frame ending at byte {self.frame_end}")
        if pos < end:  # a second pickle (a retry appended to the file) would never be read, in silence
            raise _Refused(f"bytes after the pickle's end at byte {self.offset + pos}")
        self.offset += end
        self._charge(opcodes)

    def _charge(self, opcodes: int) -> None:
        """Charge to the budget what `opcodes` may build before the unpickler has them: a gzip shard's
        budget counted only its bytes, and 2 KB of gzip (2 MB of '}') built 285 MB of dicts."""
        try:
            self.take(opcodes * OPCODE_BYTES)
        except _Refused as exc:
            raise _Refused(f"{exc} with the objects its opcodes build ({OPCODE_BYTES} bytes counted "
                           f"for each)") from None

    def _check_opcodes(self, data: Any, pos: int, end: int) -> tuple[int, int]:
        """Check the opcodes in data[pos:end] (this loop runs once for every opcode of a shard);
        returns where it stopped and how many opcodes it read whole."""
        head, opcodes = self.head, 0
        while pos < end and not self.stopped:
            if self.skip:
                step = min(self.skip, end - pos)
                self.skip, pos = self.skip - step, pos + step
                continue
            if (code := head[0] if head else data[pos]) not in LAYOUTS:  # raised as _Refused: see it
                raise _Refused(f"invalid load key {bytes([code])!r} at byte {self.offset + pos}")
            opcode, size, count_format, lines, checked = LAYOUTS[code]
            if code in SCALARS and not head and pos + size <= end:  # the most frequent opcodes, inline
                self.nesting.stack.append(0)
                pos, opcodes = pos + size, opcodes + 1
                continue
            if code == BINGET and not head and pos + size <= end:  # a shared dtype or key, each sample
                self.nesting.step("BINGET", self.offset + pos, data[pos + 1])
                pos, opcodes = pos + size, opcodes + 1
                continue
            if not head and not lines and pos + size <= end:  # whole here (most): no copy unless checked
                if checked:
                    head += data[pos:pos + size]
                    self._complete(opcode, count_format, self.offset + pos)
                    head.clear()
                else:  # its stack step alone
                    self.nesting.step(opcode.name, self.offset + pos, None)
                    self.stopped = code == STOP
                pos, opcodes = pos + size, opcodes + 1
                continue
            if lines and head:  # a text argument: up to its next newline
                newline = NEWLINE.search(data, pos, end)
                stop = newline.end() if newline else end
            else:  # the opcode, and its fixed argument or the length of its counted one
                stop = min(end, pos + size - len(head))
            head += data[pos:stop]
            pos = stop
            if (head.count(b"\n") == lines) if lines else len(head) == size:
                self._complete(opcode, count_format, self.offset + pos - len(head))
                head.clear()
                opcodes += 1
        return pos, opcodes

    def _complete(self, opcode: pickletools.OpcodeInfo, count_format: str | None, at: int) -> None:
        """The whole head of the opcode at byte `at` (only its first byte unless LAYOUTS says it is checked):
        its counted bytes to pass, its memo index checked, its step of the stack followed (_Nesting)."""
        if count_format:
            (self.skip,) = struct.unpack_from(count_format, self.head, 1)
            self._check_length(opcode.name, at, self.skip)
        index = None
        if opcode.name in INDEXED:
            try:
                index = opcode.arg.reader(io.BytesIO(self.head[1:]))
            except ValueError as exc:  # a text index that is no number
                raise _Refused(f"{opcode.name} at byte {at}: {exc}") from None
        if opcode.name in PUT_OPCODES and index != self.entries:
            raise _Refused(f"{opcode.name} at byte {at} names memo index {index}, not the next one ({self.entries})")
        if opcode.name == "FRAME":
            self._begin_frame(at)
        self.nesting.step(opcode.name, at, index)
        self.stopped = opcode.name == "STOP"

    def _begin_frame(self, at: int) -> None:
        """The frame whose FRAME opcode is at byte `at`; one may begin only where the last ended (as
        in _check, the C unpickler would drop the rest of the last)."""
        if self.frame_end > at + len(self.head):
            raise _Refused(f"FRAME at byte {at} begins before the frame ending at byte {self.frame_end} ends")
        (length,) = struct.unpack_from("<Q", self.head, 1)
        self._check_length("FRAME", at, length)
        self.frame_end = at + len(self.head) + length

    def _check_length(self, name: str, at: int, length: int) -> None:
        """The length of the opcode at byte `at`, refused past the stream's room: the C unpickler allocates
        a counted argument before reading it, so a length of 2**62 was a MemoryError naming no shard (past
        sys.maxsize, an OverflowError, as bare: neither is an error a hostile shard is expected to raise)."""
        if length < 0:
            raise _Refused(f"{name} at byte {at} has a negative length {length}")
        if at + len(self.head) + length > self.room:
            raise _Refused(f"{name} at byte {at} has a length {length} past {self.room_is} ({self.room:,} bytes)")


def _load(data: bytes, compressed: bool, take: Callable[[int], None]) -> Any:
    if compressed:
        return _gunzip_load(data, take)
    return _MemoChecked(io.BytesIO(data), take, len(data), "the end of the pickle").load()


def safe_loads(data: bytes, compressed: bool, take: Callable[[int], None] | None = None) -> Any:
    """Decompress (if gzip), check the memo indices (_MemoChecked), unpickle with the restricted
    unpickler and check what came out. The decompressed bytes, and OPCODE_BYTES for each opcode, are
    charged to `take` (a ByteBudget share), by default a budget of memory_budget() of the shard's own."""
    try:
        if take is None:
            with ByteBudget(memory_budget()).share() as own:
                obj = _load(data, compressed, own)
        else:
            obj = _load(data, compressed, take)
    except _Refused as exc:
        raise pickle.UnpicklingError(str(exc)) from None
    return obj
