"""validate's full pass reads each view as several streams at once (a layer's each where the format's files
are a layer's: zarr, lmprobe's last tokens; pickle's, every other shard, each inflated once for all its
layers). A pickle store's view was one thread's, inflating every shard once a layer: its validate job took
21 s on the demo where every other format's took 2-5 s, seven of its eight cores idle."""
from __future__ import annotations

import gzip
import hashlib
import json
import pickle
import threading
import time
from itertools import chain

import numpy as np
import pytest

from actstore import fingerprints, integrity
from actstore.formats.extract import open_extraction, synthetic_extraction
from test_extract import write_real_store

FIELDS = ("sums", "scales", "specials", "counts")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return synthetic_extraction(tmp_path_factory.mktemp("streams") / "x", 200_000, 2, 8, [1, 2, 3], tokens=(4, 10))


@pytest.mark.parametrize("name", ["pickle", "zarr"])
def test_a_views_streams_merged_are_its_one_streams_fingerprint(name, root, tmp_path, monkeypatch):
    """Few cells (each layer's ranges span many samples, of both parts' files) and small blocks, so that a
    cell's sum is of many blocks: the streams, read by three threads and merged, give the sums the view's rows
    give read in one stream; bit for bit where the streams are a layer's each (zarr), to the last bits where
    they share cells (pickle's streams of other shards), with the same counts and non-finite hashes."""
    monkeypatch.setattr(fingerprints, "MAX_CELLS", 6)
    monkeypatch.setattr(fingerprints, "BLOCK_BYTES", 2048)
    store = write_real_store(name, root, tmp_path / name)
    extraction = open_extraction(root)
    dtype = "float16" if name == "zarr" else "float32"
    with integrity.check_threads(3):
        passes = fingerprints.store_passes(name, store, dtype, extraction, 0)
        (view,) = fingerprints.store_views(name, store, dtype)
    one = fingerprints.store_fingerprint(chain(*view.streams), extraction, [1, 2, 3], 0, store)
    assert len(view.streams) == (3 if name == "zarr" else 2) and one.counts.sum() == 3 * extraction.n_tokens
    ((_, _, streamed),) = passes.views
    for field in FIELDS:
        mine, theirs = getattr(streamed, field), getattr(one, field)
        assert mine.dtype == theirs.dtype, field
        if name == "zarr" or field in ("specials", "counts"):
            assert np.array_equal(mine, theirs), field
        else:
            np.testing.assert_allclose(mine, theirs, rtol=1e-12, atol=0, err_msg=field)


def test_the_pickle_pass_inflates_each_shard_once(root, tmp_path, monkeypatch):
    """Every shard loaded once for its three layers (a stream a layer loaded each once a layer: 3x the
    inflating and unpickling of the store)."""
    from actstore.formats.pickle import read

    store = write_real_store("pickle", root, tmp_path / "pickle")
    shards = json.loads((store / "metadata.json").read_text())["shards"]
    loaded, load_shard = [], read.load_shard
    monkeypatch.setattr(read, "load_shard", lambda out, info, *a: loaded.append(info["filename"]) or load_shard(
        out, info, *a))
    with integrity.check_threads(3):
        passes = fingerprints.store_passes("pickle", store, "float32", open_extraction(root), 0)
    assert not isinstance(passes.views[0][2], str), passes.views
    assert sorted(loaded) == sorted(s["filename"] for s in shards) and len(shards) == 2


def test_a_shard_damaged_in_one_layer_is_named_by_the_view(root, tmp_path, monkeypatch):
    """A machine's pickle shard rewritten (its checksum and size too) without layer 2's last item: layers 1 and 3
    read well, layer 2's stream fails, and the view's result is its error, naming the shard; one stream read at a
    time, the failed one gives its turn to the next."""
    from actstore.formats.pickle import load_shard

    store = write_real_store("pickle", root, tmp_path / "pickle", parts=(0,))
    meta = json.loads((store / "metadata.json").read_text())
    info = meta["shards"][0]
    shard = load_shard(store, info)
    shard["layer_2"] = shard["layer_2"][:-1]
    data = gzip.compress(pickle.dumps(shard, protocol=5))
    (store / info["filename"]).write_bytes(data)
    info.update(size_bytes=len(data), checksum="sha256:" + hashlib.sha256(data).hexdigest())
    (store / "metadata.json").write_text(json.dumps(meta))
    monkeypatch.setattr(integrity, "memory_budget", lambda: 1)
    with integrity.check_threads(3):
        passes = fingerprints.store_passes("pickle", store, "float32", open_extraction(root), 0)
    ((label, _, why),) = passes.views
    assert label == "pickle" and isinstance(why, str), why
    assert why.startswith(f"{store / info['filename']}: ") and "layer_2" in why, why
    assert why.endswith("(pickle fingerprint not read)"), why


@pytest.mark.parametrize("shards_at_once", [1, 2])
def test_pickle_streams_read_at_once_stay_within_the_memory_budget(shards_at_once, root, tmp_path, monkeypatch):
    """A budget of `shards_at_once` shards counted twice, three threads, two shards: no more than that many
    streams hold a shard at once (each held long enough for the others to start), yet that many do."""
    from actstore.formats import pickle as pickle_format

    store = write_real_store("pickle", root, tmp_path / "pickle")
    meta = json.loads((store / "metadata.json").read_text())
    # a shard of 8-value rows: its file (pickle's fields, text previews) larger than its rows' 4-byte values
    largest = max(max(s["size_bytes"], s["num_tokens"] * 8 * 4 * len(s["layers"])) for s in meta["shards"])
    monkeypatch.setattr(integrity, "memory_budget", lambda: shards_at_once * 2 * largest + 1)
    open_now, peak, lock = [0], [0], threading.Lock()
    iter_layer_items = pickle_format.iter_layer_items

    def counted(*args, **kwargs):
        with lock:
            open_now[0] += 1
            peak[0] = max(peak[0], open_now[0])
        try:
            time.sleep(0.3)
            yield from iter_layer_items(*args, **kwargs)
        finally:
            with lock:
                open_now[0] -= 1

    monkeypatch.setattr(pickle_format, "iter_layer_items", counted)
    with integrity.check_threads(3):
        passes = fingerprints.store_passes("pickle", store, "float32", open_extraction(root), 0)
    assert not isinstance(passes.views[0][2], str), passes.views
    assert len(meta["shards"]) == 2 and peak[0] == shards_at_once
