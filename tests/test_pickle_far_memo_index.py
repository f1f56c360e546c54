"""Review 55: the restricted unpickler against shard bytes that name a memo index far past its end."""
from __future__ import annotations

import pickle
import shutil
import struct

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import pickle as ps
from test_pickle import write_machines
from test_pickle_reader_shard_ids_dtypes import replant


@pytest.fixture(scope="module")
def machine(extracted, tmp_path_factory):
    """A real machine store (tiny bert extraction, small gzip shards) that tests copy and damage."""
    config, extract_dir = extracted("bert")
    return write_machines(config, extract_dir, tmp_path_factory.mktemp("review55")) / "machine-0000"


def test_a_put_naming_a_far_memo_index_is_refused_naming_the_shard(machine, tmp_path):
    """The C unpickler grows its memo to twice the index a PUT names, zeroing it: a 29-byte shard
    whose LONG_BINPUT named 2**26 took 1 GiB (2**30: 16 GiB) and loaded. Refused now, naming the
    shard; a protocol 3 pickle of a real shard (BINPUTs in order, as every pickler writes) loads."""
    store = shutil.copytree(machine, tmp_path / "store")
    info = ps.load_metadata(store)["shards"][0]
    shard = ps.load_shard(store, info)
    path = replant(store, b"\x80\x04}r" + struct.pack("<I", 2**22) + b".")  # {} put at memo 2**22
    with pytest.raises(FormatError, match=f"{path}: refused to load shard: LONG_BINPUT .* memo index 4194304"):
        ps.load_shard(store, ps.load_metadata(store)["shards"][0])

    replant(store, pickle.dumps(shard, protocol=3))
    again = ps.load_shard(store, ps.load_metadata(store)["shards"][0])
    assert list(again) == list(shard)
    for key in shard:
        for got, want in zip(again[key], shard[key], strict=True):
            np.testing.assert_array_equal(got["activation"], want["activation"])


def test_a_length_no_shard_has_is_named_with_what_it_passes(machine, tmp_path):
    """A BINBYTES8 declaring 16 TiB was allocated before its bytes were read: a MemoryError with no text,
    which left the message "refused to load shard: " saying nothing of why. The opcode check now
    refuses the length itself, past what a shard may decompress to, before the unpickler has it."""
    store = shutil.copytree(machine, tmp_path / "store")
    path = replant(store, b"\x80\x05\x8e" + struct.pack("<Q", 1 << 44) + b"x" * 100 + b".")
    with pytest.raises(FormatError, match=f"{path}: refused to load shard: BINBYTES8 at byte 2 has a length "
                                          f"{1 << 44} past what a shard may decompress to"):
        ps.load_shard(store, ps.load_metadata(store)["shards"][0])
