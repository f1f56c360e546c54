"""Review 56: the restricted unpickler's memo check, run on the bytes as the unpickler reads them
(a gzip shard inflated once), and a frame cut inside an opcode, which the C unpickler reads from
other bytes than the check saw."""
from __future__ import annotations

import gzip
import io
import pickle
import pickletools
import shutil
import struct

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import pickle as ps
from actstore.formats.pickle import unpickler
from actstore.formats.pickle.write import dump_shard
from test_pickle import write_machines
from test_pickle_reader_shard_ids_dtypes import replant
from tiny import traced_peak


@pytest.fixture(scope="module")
def machine(extracted, tmp_path_factory):
    """A real machine store (tiny bert extraction, small gzip shards) that tests copy and damage."""
    config, extract_dir = extracted("bert")
    return write_machines(config, extract_dir, tmp_path_factory.mktemp("review56")) / "machine-0000"


def _shard(samples: int) -> dict:
    """A shard as shard_items builds one: arrays past pickle's 64 KiB frames, and short fields in them."""
    rng = np.random.default_rng(0)
    items = [{"sample_idx": i, "activation": rng.standard_normal((40 + i, 512), dtype=np.float32),
              "shape": (40 + i, 512), "text_preview": f"sample {i}\nsecond line",
              "metadata": {"token_count": 40 + i, "dataset_idx": i, "machine_id": 0, "label": None, "label_id": None}}
             for i in range(samples)]
    return {"layer_0": items, "layer_1": items[::-1]}


def test_a_gzip_shard_is_inflated_once(tmp_path, monkeypatch):
    """The memo check read a gzip shard's opcodes from one inflate of it and the unpickler built from a
    second: twice the inflate (0.15 -> 0.31 s on a 49 MB shard). Every byte now comes out once."""
    path = tmp_path / "shard_0001.pkl.gz"
    dump_shard(_shard(6), path, compressed=True, compresslevel=1, compressor="isal")
    data = path.read_bytes()
    inflated, readinto = [], unpickler._Gunzip.readinto
    monkeypatch.setattr(unpickler._Gunzip, "readinto",
                        lambda self, buffer: inflated.append(n := readinto(self, buffer)) or n)
    shard = ps.safe_loads(data, compressed=True)
    assert sum(inflated) == len(gzip.decompress(data))
    for got, want in zip(shard["layer_1"], _shard(6)["layer_1"], strict=True):
        assert got["text_preview"] == want["text_preview"] and got["shape"] == want["shape"]
        np.testing.assert_array_equal(got["activation"], want["activation"])


# FRAME of 5 bytes: EMPTY_DICT, then LONG_BINPUT and 3 of its 4 index bytes. Read from a file, the C
# unpickler drops those 3 and takes the index from the 4 bytes after the frame: 0x2e2900. A check
# reading the bytes in order sees index 0 (as the memo's next), EMPTY_TUPLE, STOP.
FRAME_CUT = b"\x80\x04\x95" + struct.pack("<Q", 5) + b"}r\x00\x00\x00" + b"\x00)." + b"\x00" + b"."


def test_a_frame_that_ends_inside_an_opcode_is_refused_naming_the_shard(machine, tmp_path):
    """FRAME_CUT loaded: the memo check passed it and the unpickler grew its memo to 2 * 0x2e2900
    entries (48 MB; the next byte after STOP, up to 2**32 entries: 64 GiB). Refused now, as pickle's
    Python unpickler refuses it; the shards a pickler writes (frames end between opcodes) load."""
    assert pickle.Unpickler(io.BytesIO(FRAME_CUT)).load() == {}  # the C unpickler reads it as described
    with pytest.raises(pickle.UnpicklingError, match="runs past the end of the frame ending at byte 16"):
        ps.safe_loads(FRAME_CUT, compressed=False)
    store = shutil.copytree(machine, tmp_path / "store")
    path = replant(store, FRAME_CUT)
    with pytest.raises(FormatError, match=f"{path}: refused to load shard: an opcode runs past the end of the frame"):
        ps.load_shard(store, ps.load_metadata(store)["shards"][0])
    assert [p for p in ps.verify(store) if str(path) in p]
    nested = b"\x80\x04\x95" + struct.pack("<Q", 10) + b"\x95" + struct.pack("<Q", 1) + b"}" + b"."
    with pytest.raises(pickle.UnpicklingError, match="FRAME at byte 11 begins before the frame ending at byte 21"):
        ps.safe_loads(nested, compressed=False)


@pytest.mark.parametrize("protocol", range(6))
def test_every_protocol_loads_through_the_check_read_in_any_pieces(protocol):
    """The check reads opcodes from whatever pieces the unpickler asks for (an opcode, its argument,
    a frame, an array's bytes, a line): protocols 0-5 load as pickle.loads does, and fed a byte at a
    time or in uneven pieces the check counts the memo entries pickletools counts."""
    shared = ["shared\nline", 2**70, -5]
    obj = {"a": [1, 2.5, None, True, "x\ny", shared, shared, (1, 2, (3,)), 10**30, -1, 255, 65536],
           "text": "\u00e9\n" * 300, "long": "z" * 70000, "d": {str(i): i for i in range(300)}}
    if protocol >= 3:  # numpy pickles arrays' bytes as bytes, which protocols 0-2 write as _codecs.encode
        obj |= {"small": np.arange(5000, dtype=np.float32).reshape(50, 100), "big": np.ones(40000, np.int16)}
    data = pickle.dumps(obj, protocol=protocol)
    for loaded in (ps.safe_loads(data, compressed=False), ps.safe_loads(gzip.compress(data), compressed=True)):
        assert loaded.keys() == obj.keys() and loaded["a"] == obj["a"] and loaded["d"] == obj["d"]
        assert loaded["a"][5] is loaded["a"][6]
        for key in ("small", "big"):
            if key in obj:
                np.testing.assert_array_equal(loaded[key], obj[key])
    memo = sum(op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE") for op, _, _ in pickletools.genops(data))
    for sizes in ([1], [1, 7, 2, 64, 3, 1000]):
        check, pos = unpickler._MemoChecked(io.BytesIO(), lambda n: None, len(data), "its end"), 0
        while pos < len(data):
            size = sizes[pos % len(sizes)]
            check._check(memoryview(bytearray(data[pos:pos + size])))
            pos += size
        assert check.stopped and check.entries == memo and not check.head


@pytest.mark.parametrize("put", [b"p1\n", b"q\x01", b"r\x01\x00\x00\x00"])
def test_a_put_past_the_next_memo_index_is_refused_in_every_form(put):
    """PUT (a text index), BINPUT and LONG_BINPUT naming index 1 of an empty memo, plain and gzip."""
    data = b"\x80\x02}" + put + b"."
    for blob, compressed in ((data, False), (gzip.compress(data), True)):
        with pytest.raises(pickle.UnpicklingError, match="at byte 3 names memo index 1, not the next one \\(0\\)"):
            ps.safe_loads(blob, compressed)


def test_a_shard_of_many_small_objects_is_refused_within_its_budget(machine, tmp_path, monkeypatch):
    """The budget counted a gzip shard's decompressed bytes (an uncompressed shard's, nothing), not
    what its opcodes build: 2 KB of gzip, 2 MB of EMPTY_DICT, built 2 million dicts, 271 MiB, under
    a budget of 64 MiB (a 1 MB shard: 140 GB). Each opcode is charged as it is read: refused, naming
    the shard, before they are built; the store's real shards load under that budget."""
    monkeypatch.setattr(unpickler, "memory_budget", lambda: 64 << 20)
    store = shutil.copytree(machine, tmp_path / "store")
    real = ps.load_shard(store, ps.load_metadata(store)["shards"][0])
    dicts = b"\x80\x04}\x8c\x07layer_0(" + b"}" * 2_000_000 + b"ls."  # {"layer_0": [{}, {}, ...]}
    path = replant(store, dicts)
    refused = "decompresses to more than 67,108,864 bytes with the objects its opcodes build"

    def load() -> None:
        with pytest.raises(FormatError, match=f"{path}: refused to load shard: {refused}"):
            ps.load_shard(store, ps.load_metadata(store)["shards"][0])
    assert traced_peak(load)[1] < 64 << 20
    with pytest.raises(pickle.UnpicklingError, match=refused):
        ps.safe_loads(dicts, compressed=False)
    assert real.keys() and all(len(items) for items in real.values())
