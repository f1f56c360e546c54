"""Review 63 of the pickle-shard format, as an attacker sees the reader: a shard that nests a hashable
object a hundred thousand levels deep and hashes it (a dict key) crashed the whole process, a segfault
in C's recursive hash, before any check of what the shard built could refuse it; a length of 2**63 let
OverflowError escape naming nothing; an int too long to print broke every message naming it; a dtype's
BUILD state planted metadata; bytes after STOP went unread in silence; a refused dtype filled a line
with 400 KB."""
from __future__ import annotations

import gzip
import pickle
import pickletools
import re
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import pickle as ps
from test_pickle import write_machines
from test_pickle_reader_shard_ids_dtypes import replant

LEVELS = 100_000
STACK = 2 << 20  # the child's C stack: a smaller one than the usual 8 MiB crashes at fewer levels


@pytest.fixture(scope="module")
def machine(extracted, tmp_path_factory) -> Path:
    """A real machine store (tiny bert extraction) that tests copy and damage."""
    config, extract_dir = extracted("bert")
    return write_machines(config, extract_dir, tmp_path_factory.mktemp("review63")) / "machine-0000"


def _get(index: int) -> bytes:
    return b"j" + index.to_bytes(4, "little")  # LONG_BINGET


def _nested_tuple_key() -> bytes:
    """{((...((),)...),): None}: EMPTY_TUPLE wrapped by LEVELS TUPLE1s, a key of an empty dict."""
    return b"\x80\x04}" + b")" + b"\x85" * LEVELS + b"Ns."


def _chained_dtypes_key() -> bytes:
    """LEVELS numeric dtypes made as numpy's pickles make them, then from the last down each given a BUILD
    state whose one field is the dtype before it (numpy takes it), the last used as a dict key. Each BUILD
    changes a dtype that the state of the one after it already holds: no depth the stream shows grows."""
    out = bytearray(b"\x80\x04\x8c\x05numpy\x8c\x05dtype\x93\x94")  # the global, memo 0
    for _ in range(LEVELS):  # dtype k, memo k (1..LEVELS): numpy.dtype('f8', False, True)
        out += _get(0) + b"\x8c\x02f8\x89\x88\x87R\x94" + b"0"
    for k in range(LEVELS, 1, -1):  # BUILD dtype k with (3, '|', None, ('a',), {'a': (dtype k-1, 0)}, 8, 1, 0)
        out += _get(k) + b"(K\x03\x8c\x01|N\x8c\x01a\x85}\x8c\x01a" + _get(k - 1) + b"K\x00\x86sK\x08K\x01K\x00t"
        out += b"b0"
    return bytes(out + b"}" + _get(LEVELS) + b"Ns.")


def _load_in_child(store: Path) -> subprocess.CompletedProcess:
    """load_shard of the store's first shard in a child process with a STACK-byte C stack: a crash
    there is a return code, not the end of the test run."""
    code = ("import sys; from actstore.formats import pickle as ps; from actstore.errors import FormatError\n"
            "try:\n    ps.load_shard(sys.argv[1], ps.load_metadata(sys.argv[1])['shards'][0])\n"
            "except FormatError as exc:\n    print(exc)\n")
    return subprocess.run([sys.executable, "-c", code, str(store)], capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_STACK, (STACK, STACK)))


@pytest.mark.parametrize("pickled, refused", [
    (_nested_tuple_key, "nesting deeper than 64 levels at byte 68"),
    (_chained_dtypes_key, "BUILD at byte \\d+ changes an object another one already holds")])
def test_a_key_nested_past_what_hash_can_recurse_is_refused_naming_the_shard(machine, tmp_path, pickled, refused):
    """A shard whose dict key nests LEVELS deep killed the process (SIGSEGV: no error, no shard named,
    a Slurm job gone with its other shards' work) as the unpickler hashed the key: C's hash of a tuple,
    and numpy's of a dtype's fields, recurse without a limit. _check_plain's depth limit came too late.
    The stream is refused as it is read, before the unpickler builds the nesting."""
    store = shutil.copytree(machine, tmp_path / "store")
    path = replant(store, pickled())
    done = _load_in_child(store)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"{path}: refused to load shard: ")
    assert re.search(refused, done.stdout), done.stdout


@pytest.mark.parametrize("head", [b"\x8e", b"\x96", b"\x8d", b"\x95"])  # BINBYTES8, BYTEARRAY8, BINUNICODE8, FRAME
@pytest.mark.parametrize("length", [2**63, 2**62, 2**40])
def test_a_length_past_what_the_shard_can_hold_is_refused_naming_the_shard(machine, tmp_path, head, length):
    """An 8-byte length past what the shard holds: 2**63 or more (no object can be that long) raised
    OverflowError, 2**62 MemoryError (the C unpickler allocates the argument before reading it), each a
    bare traceback from load_shard naming no shard (read_vector, the dataset); 2**40 allocated a TB
    (virtual) first. A gzip shard's room is what a shard may decompress to, a plain pickle's its end."""
    store = shutil.copytree(machine, tmp_path / "store")
    pickled = b"\x80\x05" + head + length.to_bytes(8, "little") + b"x."
    path = replant(store, pickled)  # gzip
    with pytest.raises(FormatError, match=f"{path}: refused to load shard: .* at byte 2 has a length "
                                             f"{length} past what a shard may decompress to"):
        ps.load_shard(store, ps.load_metadata(store)["shards"][0])
    with pytest.raises(pickle.UnpicklingError, match=rf"at byte 2 has a length {length} past the end of the pickle "
                                                     rf"\(13 bytes\)"):
        ps.safe_loads(pickled, compressed=False)


def test_an_int_too_long_to_print_is_refused_naming_the_shard(machine, tmp_path):
    """A shard whose layer key (or sample_idx, token_count) is an int of 5,000 digits loaded, then every
    message naming it failed (Python prints no int past 4,300 digits): verify reported a ValueError
    against metadata.json, not the shard, and dropped every other shard's report; read_vector raised
    the bare ValueError."""
    store = shutil.copytree(machine, tmp_path / "store")
    path = replant(store, pickle.dumps({10**5000: []}, protocol=5))
    refused = f"{path}: refused to load shard: an int of 16610 bits"
    assert [p for p in ps.verify(store) if p.startswith(refused)]
    info = ps.load_metadata(store)["shards"][0]
    with pytest.raises(FormatError, match=refused):
        ps.read_vector(store, info["sample_id_range"][0], info["layers"][0], 0)


def test_a_dtype_given_metadata_by_its_build_state_is_refused_naming_the_shard(machine, tmp_path):
    """A dtype's BUILD state of version 4 carries a metadata dict, which numpy keeps: a shard loaded whose
    array's dtype.metadata held what the shard chose, here the unpickler's own numpy.ndarray global,
    past the check that only plain types and numeric arrays come out."""
    data = pickle.dumps({"layer_0": [np.arange(2, dtype=np.float32)]}, protocol=4)
    flags = b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00"  # the dtype state's elsize, alignment, flags
    state = b"(K\x03\x8c\x01<\x94NNN" + flags + b"t"
    planted = b"(K\x04\x8c\x01<\x94NNN" + flags + b"}\x8c\x01x\x8c\x05numpy\x8c\x07ndarray\x93st"
    frame = next(pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME")
    out = bytearray(data.replace(state, planted))
    (length,) = struct.unpack_from("<Q", out, frame + 1)
    struct.pack_into("<Q", out, frame + 1, length + len(planted) - len(state))
    store = shutil.copytree(machine, tmp_path / "store")
    path = replant(store, bytes(out))
    with pytest.raises(FormatError, match=f"{path}: refused to load shard: .*float32 .*metadata"):
        ps.load_shard(store, ps.load_metadata(store)["shards"][0])


def test_bytes_after_the_pickle_are_refused_naming_the_shard(machine, tmp_path):
    """A shard holding two pickles (a retry appended to the file, a second gzip member) loaded the first
    and never read the second, in silence: what follows STOP is refused, in any form."""
    store = shutil.copytree(machine, tmp_path / "store")
    info = ps.load_metadata(store)["shards"][0]
    first = pickle.dumps(ps.load_shard(store, info), protocol=5)
    second = pickle.dumps({"layer_0": []}, protocol=5)
    for blob, compressed in ((first + second, False), (gzip.compress(first + second), True),
                             (gzip.compress(first) + gzip.compress(second), True), (first + b"\0", False)):
        with pytest.raises(pickle.UnpicklingError, match=f"bytes after the pickle's end at byte {len(first)}"):
            ps.safe_loads(blob, compressed)
    assert ps.safe_loads(gzip.compress(first), True).keys() == ps.safe_loads(first, False).keys()
    path = replant(store, first + second)
    with pytest.raises(FormatError, match=f"{path}: refused to load shard: bytes after the pickle's end"):
        ps.load_shard(store, ps.load_metadata(store)["shards"][0])


RECONSTRUCT = b"\x80\x04\x8c\x16numpy._core.multiarray\x8c\x0c_reconstruct\x93"
NDARRAY = b"\x8c\x05numpy\x8c\x07ndarray\x93"
SPEC = ("i8," * 20_000).encode()
LONG_LIST = b"(" + b"K\x07" * 50_000 + b"l"


@pytest.mark.parametrize("data, refused", [
    (b"\x80\x04\x8c\x05numpy\x8c\x05dtype\x93X" + struct.pack("<I", len(SPEC)) + SPEC + b"\x85R.",
     "numpy.dtype: dtype .* is not a plain numeric dtype"),
    (RECONSTRUCT + NDARRAY + LONG_LIST + b"C\x01b\x87R.", "_reconstruct of shape .* is not allowed"),
    (RECONSTRUCT + LONG_LIST + b")C\x01b\x87R.", "_reconstruct of .*: only numpy.ndarray is admitted")])
def test_a_refused_shard_is_named_in_a_line_not_a_megabyte(data, refused):
    """A dtype of 20,000 fields (60 KB of the shard naming them), a shape or array type of 50,000 items,
    was refused with all of it in the message: verify's report carried a line of 100s of KB per shard."""
    with pytest.raises(pickle.UnpicklingError, match=refused) as exc:
        ps.safe_loads(data, compressed=False)
    assert len(str(exc.value)) < 200
