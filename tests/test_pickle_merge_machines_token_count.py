"""Review 57: a merge of some machines only (written, then refused by verify), the Dataset's index of
a tuple per sample, an item's metadata.token_count that verify never compared with its rows, and a
refused shard whose dtype, altered by its BUILD state, made numpy print a traceback as it was freed."""
from __future__ import annotations

import gc
import io
import json
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
from actstore.formats.pickle.layout import METADATA
from test_pickle_reader_shard_ids_dtypes import replant
from test_pickle_merge_ranges_layers import _copy, _edit, machines  # noqa: F401 (machines: a fixture)
from tiny import traced_peak


def test_a_merge_of_some_machines_is_refused_naming_the_missing_ones(machines, tmp_path):
    """Merging machine 1 of 2 wrote a metadata.json that verify then refused (total_machines = 2 but
    1 machine listed): the merge refuses it, naming the machine missing, and writes nothing."""
    dirs = _copy(machines, tmp_path / "store")
    shutil.rmtree(dirs[0])
    with pytest.raises(FormatError, match=r"store: refused to merge machines \[1\]: not the machines 0\.\.1 .*"
                                          r"machine-0001/metadata\.json.*\(missing \[0\]\)"):
        ps.merge_machines(dirs[1:], tmp_path / "store")
    assert not (tmp_path / "store" / METADATA).exists()


def test_machines_that_disagree_on_their_total_are_refused(machines, tmp_path):
    dirs = _copy(machines, tmp_path / "store")
    _edit(dirs[1], lambda meta: meta["distributed_config"].update(total_machines=3))
    with pytest.raises(FormatError, match=r"machine-0001/metadata\.json: distributed_config\.total_machines = 3 "
                                          r"differs from .*machine-0000/metadata\.json's 2"):
        ps.merge_machines(dirs, tmp_path / "store")
    assert not (tmp_path / "store" / METADATA).exists()


def test_the_dataset_index_is_the_spec_index_held_per_shard(machines, tmp_path):
    """ActivationDataset.index held a tuple per sample (96 MB per million samples, before any shard is
    read). It holds a count per shard now and answers as the spec's list of (shard_id, item_idx)."""
    dirs = _copy(machines, tmp_path / "store")
    ps.merge_machines(dirs, tmp_path / "store")
    meta = ps.load_metadata(tmp_path / "store")
    layer = meta["extraction_config"]["layers_extracted"][0]
    spec_index = [(s["shard_id"], i) for s in meta["shards"] if layer in s["layers"] for i in range(s["num_samples"])]
    dataset = ps.ActivationDataset(tmp_path / "store", layer)
    n = len(spec_index)
    assert len(dataset) == len(dataset.index) == n
    assert [dataset.index[i] for i in range(-n, n)] == spec_index + spec_index
    assert list(dataset.index) == spec_index and dataset.index.index(spec_index[-1]) == n - 1
    for idx in (n, -n - 1):
        with pytest.raises(IndexError):
            dataset.index[idx]
    assert [item["sample_idx"] for item in dataset] == list(range(n))  # a plain `for` ends at the IndexError

    def widen(meta):  # the last shard lists a million samples, as a large store's shards do together
        last = meta["shards"][-1]
        last["num_samples"] += 1_000_000
        last["sample_id_range"][1] += 1_000_000
        meta["statistics"]["total_samples"] += 1_000_000
    _edit(dirs[0], widen)
    big, peak = traced_peak(lambda: ps.ActivationDataset(dirs[0], layer))
    assert len(big) > 1_000_000 and big.index[-1][1] == ps.load_metadata(dirs[0])["shards"][-1]["num_samples"] - 1
    assert peak < 5_000_000, peak  # the tuples held 96 MB


def _rewrite_first_item(store: Path, edit) -> Path:
    """Load the store's first shard, edit its first item, dump it back as the writer dumps shards
    (size and checksum fixed in metadata.json: the checksums cannot show a writer's bug); its path."""
    meta = ps.load_metadata(store)
    info = meta["shards"][0]
    shard = ps.load_shard(store, info)
    edit(next(iter(shard.values()))[0])
    path = store / info["filename"]
    sha256 = ps.dump_shard(shard, path, compressed=True, compresslevel=1, compressor="isal")
    meta["statistics"]["total_size_bytes"] += path.stat().st_size - info["size_bytes"]
    info.update(size_bytes=path.stat().st_size, checksum="sha256:" + sha256)
    (store / METADATA).write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("ours, change, refused", [(True, 5, True), (True, -1, True),
                                                   (False, 5, True), (False, -1, False)])
def test_an_item_token_count_that_does_not_count_its_rows_fails_verify(machines, tmp_path, ours, change, refused):
    """An item's metadata.token_count other than its activation rows passed verify. Our writer stores
    samples unpadded: they must be equal. The spec's example pads to max_seq_length (token_count 487 of
    512 rows): a store without our `actstore` block may count fewer than its rows, never more."""
    store = shutil.copytree(machines / "machine-0000", tmp_path / "store")
    if not ours:
        _edit(store, lambda meta: meta.pop("actstore"))
    assert ps.verify(store) == []
    path = _rewrite_first_item(store, lambda item: item["metadata"].update(
        token_count=item["metadata"]["token_count"] + change))
    problems = ps.verify(store)
    assert bool(problems) == refused, problems
    if refused:
        assert len(problems) == 1 and problems[0].startswith(f"{path}: layer_")
        assert "metadata.token_count" in problems[0] and "activation rows" in problems[0]
        meta = ps.load_metadata(store)
        first = meta["shards"][0]
        with pytest.raises(FormatError, match="metadata.token_count"):
            ps.read_vector(store, first["sample_id_range"][0], first["layers"][0], 0)


def _dtype_built_after_fill(shard: dict, protocol: int) -> bytes:
    """`shard` pickled, then its array's dtype taken from the memo and given a BUILD state whose flags
    (63) say it holds objects: after the array is filled, where the restricted unpickler's checks of
    numpy.dtype() and of the fill have passed."""
    data = pickle.dumps(shard, protocol=protocol)
    reader = pickle._Unpickler(io.BytesIO(data))  # our own bytes: the Python unpickler shows its memo
    reader.load()
    index = next(i for i, value in reader.memo.items() if isinstance(value, np.dtype))
    state = b"(K\x03X\x01\x00\x00\x00<NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x3ft"
    extra = b"j" + struct.pack("<I", index) + state + b"b0"  # LONG_BINGET, the state, BUILD, POP
    frames = [pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME"]
    out = bytearray(data[:-1] + extra + b".")
    if frames:  # the last frame holds STOP: it grows by what is put before it
        (length,) = struct.unpack_from("<Q", out, frames[-1] + 1)
        struct.pack_into("<Q", out, frames[-1] + 1, length + len(extra))
    return bytes(out)


@pytest.mark.parametrize("when", ["after the fill 3", "after the fill 4", "before the fill"])
def test_a_dtype_made_to_hold_objects_is_refused_without_a_traceback(machines, tmp_path, monkeypatch, when):
    """A shard whose array's dtype a BUILD state marks as holding objects was refused, and then numpy
    freed the array by clearing its floats as objects: a RuntimeError traceback ("get_clear_loop not
    set") on stderr beside verify's report. The dtypes a refused shard made are disarmed first."""
    store = shutil.copytree(machines / "machine-0000", tmp_path / "store")
    act = np.frombuffer((0x4141414141414141).to_bytes(8, "little"), np.float32).reshape(1, 2).copy()
    if when == "before the fill":
        pickled = pickle.dumps({"layer_0": [{"activation": act}]}, protocol=4)  # the _reconstruct path
        flags = b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK"  # the dtype state's elsize, alignment, flags opcode
        pickled = pickled.replace(flags + b"\x00", flags + b"\x3f")
    else:
        pickled = _dtype_built_after_fill({"layer_0": [{"activation": act}]}, int(when[-1]))
    path = replant(store, pickled)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(FormatError, match=f"{path}: refused to load shard"):
        ps.load_shard(store, ps.load_metadata(store)["shards"][0])
    gc.collect()
    assert [p for p in ps.verify(store) if str(path) in p]
    gc.collect()
    assert [str(u.exc_value) for u in unraisable] == []
