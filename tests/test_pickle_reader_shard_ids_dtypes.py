"""The pickle-shard reader on real stores: shard ids a naive merge repeats, a shard whose layer list
disagrees with its metadata entry, and a dtype mutated by its pickle's BUILD state."""
from __future__ import annotations

import gzip
import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import pickle as ps
from actstore.formats.pickle.layout import METADATA
from test_pickle import write_machines


@pytest.fixture(scope="module")
def machines(extracted, tmp_path_factory):
    """(layers, store dir): each machine's store written under machine-NNNN/, not merged."""
    config, extract_dir = extracted("bert")
    return config["extract"]["layers"], write_machines(config, extract_dir, tmp_path_factory.mktemp("pickle_review"))


def naive_merge(out: Path, dst: Path) -> Path:
    """What the spec's "merge metadata files after extraction" reads as, done by hand: the machines'
    shard lists concatenated, each machine's shard_id kept (so 1, 2, .. repeat), no shard moved."""
    import shutil
    shutil.copytree(out, dst)
    metas = [(m.name, ps.load_metadata(m)) for m in sorted(dst.glob("machine-*"))]
    merged = metas[0][1]
    merged["shards"] = [{**s, "filename": f"{name}/{s['filename']}"} for name, meta in metas for s in meta["shards"]]
    for key in ("total_shards", "total_samples", "total_size_bytes", "total_tokens"):
        merged["statistics"][key] = sum(meta["statistics"][key] for _, meta in metas)
    (dst / METADATA).write_text(json.dumps(merged))
    return dst


def test_repeated_shard_ids_never_serve_another_shards_samples(machines, tmp_path):
    """ActivationDataset found shards by shard_id: with two shard 1s, every index of the first machine's
    shard 1 read the second machine's, so samples 15.. came back twice and 0.. never, with no error."""
    layers, out = machines
    store = naive_merge(out, tmp_path / "store")
    ids = [s["shard_id"] for s in ps.load_metadata(store)["shards"]]
    assert len(set(ids)) < len(ids)  # the case at hand: shard ids repeat across machines
    try:
        dataset = ps.ActivationDataset(store, layers[0])
    except FormatError as exc:  # refusing is fine, if it names the file and the repeated id
        assert str(store / METADATA) in str(exc) and "shard_id" in str(exc)
        return
    wanted = list(ps.iter_activations(store, layers[0]))
    got = [dataset[i] for i in range(len(dataset))]
    assert [g["sample_idx"] for g in got] == [w["sample_idx"] for w in wanted] == list(range(30))
    for g, w in zip(got, wanted):
        np.testing.assert_array_equal(g["activation"], w["activation"])


def replant(store: Path, pickled: bytes) -> Path:
    """Replace the store's first shard by gzip of `pickled`, size and checksum fixed in its
    metadata.json (a writer's bug, or a hostile store: the checksums cannot show it); its path."""
    meta = ps.load_metadata(store)
    info = meta["shards"][0]
    path = store / info["filename"]
    path.write_bytes(gzip.compress(pickled))
    data = path.read_bytes()
    meta["statistics"]["total_size_bytes"] += len(data) - info["size_bytes"]
    info.update(size_bytes=len(data), checksum="sha256:" + hashlib.sha256(data).hexdigest())
    (store / METADATA).write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("damage", ["layer missing", "item missing", "item extra"])
def test_a_shard_whose_layer_disagrees_with_its_entry_is_named(machines, tmp_path, damage):
    """metadata.json says the shard holds the layer's num_samples items: iter_activations skipped a
    shard without the layer (or yielded too few, too many), ActivationDataset raised a bare KeyError
    or IndexError, or silently served too few."""
    import shutil
    layers, out = machines
    store = tmp_path / "store"
    shutil.copytree(out / "machine-0000", store)
    info = ps.load_metadata(store)["shards"][0]
    shard = ps.load_shard(store, info)
    key = f"layer_{layers[0]}"
    if damage == "layer missing":
        del shard[key]
    else:
        shard[key] = shard[key][1:] if damage == "item missing" else shard[key] + shard[key][:1]
    path = replant(store, pickle.dumps(shard, protocol=5))
    with pytest.raises(FormatError, match=f"{path}: .*{key}.*num_samples={info['num_samples']}"):
        list(ps.iter_activations(store, layers[0]))
    dataset = ps.ActivationDataset(store, layers[0])
    with pytest.raises(FormatError, match=f"{path}: .*{key}.*num_samples={info['num_samples']}"):
        dataset[0]


def test_a_dtype_its_build_state_marks_as_holding_objects_is_refused_naming_the_shard(machines, tmp_path):
    """numpy.dtype('f4') passes the restricted unpickler's check, then the pickle's BUILD state sets
    its flags to 63 (holds objects): numpy's ndarray.__setstate__ then failed with a bare SystemError,
    which load_shard let out unnamed and verify blamed on metadata.json."""
    import shutil
    _, out = machines
    store = tmp_path / "store"
    shutil.copytree(out / "machine-0000", store)
    act = np.frombuffer((0x4141414141414141).to_bytes(8, "little"), np.float32).reshape(1, 2).copy()
    pickled = pickle.dumps({"layer_0": [{"activation": act}]}, protocol=4)  # the _reconstruct path
    flags = b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK"  # the dtype state's elsize, alignment, flags opcode
    assert pickled.count(flags + b"\x00") == 1
    path = replant(store, pickled.replace(flags + b"\x00", flags + b"\x3f"))
    with pytest.raises(FormatError, match=f"{path}: refused to load shard"):
        ps.load_shard(store, ps.load_metadata(store)["shards"][0])
    assert [p for p in ps.verify(store) if str(path) in p]
