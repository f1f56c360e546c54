"""Review 62 of the pickle-shard format: read_vector given a bool, float or str index, a shard that altered
its own dtype by a BUILD state (loaded as if sound while numpy printed a traceback), inspect reporting
statistics the shards disagree with, and a BUILD of an admitted global changing the unpickler's module."""
from __future__ import annotations

import gc
import json
import io
import pickle
import pickletools
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import pickle as ps
from test_pickle import write_machines
from test_pickle_reader_shard_ids_dtypes import replant


@pytest.fixture(scope="module")
def store(extracted, tmp_path_factory) -> Path:
    """A merged store of a real extraction (tiny bert, two machines)."""
    config, extract_dir = extracted("bert")
    out = write_machines(config, extract_dir, tmp_path_factory.mktemp("review62"))
    ps.merge_machines([out / ps.machine_dirname(p) for p in range(config["extract"]["parts"])], out)
    return out


@pytest.mark.parametrize("arg, value", [("sample_idx", True), ("sample_idx", 1.0), ("layer_idx", "0"),
                                        ("layer_idx", 0.0), ("token_idx", True), ("token_idx", 1.0)])
def test_read_vector_refuses_an_index_that_is_no_integer_naming_the_store(store, arg, value):
    """True read sample 1 (True == 1), token True returned the whole (1, rows, d) activation (numpy's
    boolean index), layer "0" returned None as if not stored (0.0: a KeyError), token 1.0 an IndexError
    naming nothing."""
    layer = ps.load_metadata(store)["shards"][0]["layers"][0]
    args = {"sample_idx": 1, "layer_idx": layer, "token_idx": 0} | {arg: value}
    with pytest.raises(TypeError, match=f"{store}: {arg} {value!r} is not an integer"):
        ps.read_vector(store, **args)


def test_read_vector_takes_numpy_integers(store):
    layer = ps.load_metadata(store)["shards"][0]["layers"][0]
    want = ps.read_vector(store, 1, layer, 2)
    got = ps.read_vector(store, np.int64(1), np.int32(layer), np.uint8(2))
    assert want.shape == got.shape and want.ndim == 1
    np.testing.assert_array_equal(got, want)


def _dtype_poisoned_then_dropped(shard: dict) -> bytes:
    """`shard` pickled (protocol 4: the dtype and the array in the memo), then its array's dtype given a
    BUILD state whose flags (63) say it holds objects, and the whole object dropped for an empty dict: nothing
    the shard returns holds the array, so no check of what it returns sees the dtype."""
    data = pickle.dumps(shard, protocol=4)
    reader = pickle._Unpickler(io.BytesIO(data))  # our own bytes: the Python unpickler shows its memo
    reader.load()
    index = next(i for i, value in reader.memo.items() if isinstance(value, np.dtype))
    state = b"(K\x03X\x01\x00\x00\x00<NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x3ft"
    extra = b"j" + struct.pack("<I", index) + state + b"b00}"  # LONG_BINGET, state, BUILD, POP x2, {}
    frames = [pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME"]
    out = bytearray(data[:-1] + extra + b".")
    (length,) = struct.unpack_from("<Q", out, frames[-1] + 1)  # the last frame holds STOP
    struct.pack_into("<Q", out, frames[-1] + 1, length + len(extra))
    return bytes(out)


def test_a_shard_that_alters_its_dtype_is_refused_without_a_traceback(store, tmp_path, monkeypatch):
    """A shard that made its array's dtype say it holds objects, then returned something else, was
    loaded (a shard of no layers) and numpy, freeing the array held in the memo, printed a RuntimeError
    traceback ("get_clear_loop not set"): _disarm ran only when the shard was refused."""
    copy = shutil.copytree(store / "machine-0000", tmp_path / "store")
    act = np.frombuffer((0x4141414141414141).to_bytes(8, "little"), np.float32).reshape(1, 2).copy()
    path = replant(copy, _dtype_poisoned_then_dropped({"layer_0": [{"activation": act}]}))
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(FormatError, match=f"{path}: refused to load shard: .*dtype"):
        ps.load_shard(copy, ps.load_metadata(copy)["shards"][0])
    gc.collect()
    assert [str(u.exc_value) for u in unraisable] == []


@pytest.mark.parametrize("key, value", [("total_samples", 999), ("total_samples", "x"), ("total_tokens", 1),
                                        ("total_shards", 0)])
def test_inspect_refuses_statistics_the_shards_disagree_with(store, tmp_path, key, value):
    """inspect reported statistics.total_samples (n_examples) and total_tokens as metadata.json gave them,
    unchecked: 999 samples, or "x", of a store whose shards hold 30."""
    copy = shutil.copytree(store, tmp_path / "store")
    meta = ps.load_metadata(copy)
    meta["statistics"][key] = value
    (copy / "metadata.json").write_text(json.dumps(meta))
    named = rf"{copy / 'metadata.json'}: statistics\.{key} = {value} but the shards sum to \d+"
    with pytest.raises(FormatError, match=named):
        ps.inspect(copy)


GLOBALS = {"numpy.ndarray": b"\x8c\x05numpy\x8c\x07ndarray\x93",
           "_reconstruct": b"\x8c\x16numpy._core.multiarray\x8c\x0c_reconstruct\x93",
           "_frombuffer": b"\x8c\x13numpy._core.numeric\x8c\x0b_frombuffer\x93",
           "numpy.dtype": b"\x8c\x05numpy\x8c\x05dtype\x93"}


@pytest.mark.parametrize("name", GLOBALS)
@pytest.mark.parametrize("state", ["dict", "slots"])
def test_a_build_of_an_admitted_global_is_refused_and_changes_nothing(store, tmp_path, name, state):
    """BUILD on a global the unpickler admits set the state's items as attributes of the module's own
    objects: a shard loaded, and what it planted (here 10 MB, held by no budget) stayed for every later
    load in the process. A shard of any number of such BUILDs left that much behind."""
    from actstore.formats.pickle.unpickler import ALLOWED_GLOBALS

    payload = b"\x8e" + (10 << 20).to_bytes(8, "little") + b"\0" * (10 << 20)  # BINBYTES8 of 10 MB
    key = b"\x8c\x0fplanted_by_r62_"
    build = (b"}" + key + payload + b"s" if state == "dict" else b"N}" + key + payload + b"s\x86")
    copy = shutil.copytree(store / "machine-0000", tmp_path / "store")
    path = replant(copy, b"\x80\x05" + GLOBALS[name] + build + b"b0}.")  # BUILD, POP, then a shard of {}
    with pytest.raises(FormatError, match=f"{path}: refused to load shard: BUILD of the global {name} "):
        ps.load_shard(copy, ps.load_metadata(copy)["shards"][0])
    targets = {*ALLOWED_GLOBALS.values(), *(getattr(g, "function", None) for g in ALLOWED_GLOBALS.values())}
    assert not [t for t in targets if hasattr(t, "planted_by_r62_")]


def test_a_merge_of_no_machines_is_refused_naming_the_store(tmp_path):
    """merge_machines([], out) failed with a bare IndexError (list index out of range), naming nothing."""
    with pytest.raises(FormatError, match=f"{tmp_path}: no machine stores to merge"):
        ps.merge_machines([], tmp_path)
    assert not (tmp_path / "metadata.json").exists()


def test_a_vector_read_is_the_callers_own_and_never_changes_the_next_read(store):
    """read_vector returned a view of the shard it keeps loaded: a caller that scaled or zeroed the vector
    in place changed what every later read_vector of that token returned, silently."""
    layer = ps.load_metadata(store)["shards"][0]["layers"][0]
    first = ps.read_vector(store, 1, layer, 0)
    want = first.copy()
    first[:] = 0
    np.testing.assert_array_equal(ps.read_vector(store, 1, layer, 0), want)
    assert want.any()
