"""Review 60 of the zarr and pickle readers (formats/zarr/read.py, formats/pickle/read.py), as a user
reading a store another machine wrote: an index of the wrong type read as another sample, a damaged
count that made the reader allocate without end, an intact shard named damaged."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import pickle as ps
from actstore.formats import zarr as zs
from test_pickle import store  # noqa: F401 (a fixture)
from test_zarr import bert_run, synthetic_shard  # noqa: F401 (bert_run: a fixture)
from tiny import traced_peak


@pytest.mark.parametrize("key", [1.5, True, (1.7, 0), (True, 0), (1, 0.0)])
def test_the_zarr_dataset_refuses_a_key_that_is_not_an_integer(tmp_path, key):
    """ZarrActivationDataset passed its keys through int(): a key of 1.5, True or (1.7, layer) read
    sample 1 with no error (a float index is a bug upstream, a mask's True is not sample 1)."""
    store = synthetic_shard(tmp_path, tmp_path / "s.zarr", lengths=(5, 3, 4))
    dataset = zs.ZarrActivationDataset(store)
    with pytest.raises(TypeError, match=rf"{re.escape(str(store))}: \w+ \S+ is not an integer"):
        dataset[key]
    np.testing.assert_array_equal(dataset[(1, 0)].numpy(), zs.ZarrStore(store).read(1, 0))


def test_a_zarr_shard_locates_dataset_rows_from_its_own_start(bert_run):  # noqa: F811
    """A single store answers locate() as a run does: dataset row -> (store, local index), from its
    global_index_start. read_vector's single-store path subtracted the start itself, so a row of True
    became local sample 1 - 0 (the bool never reached the check that refuses it)."""
    _, run_dir = bert_run
    run = zs.ZarrRun(run_dir)
    shard = zs.ZarrStore(run_dir / "shards" / "shard-0001.zarr")
    start = shard.attrs["global_index_start"]
    assert start == 15 and shard.locate(start + 2) == (shard, 2)
    store, local = shard.locate(start + 2)
    np.testing.assert_array_equal(store.read(local, run.layers[0]), run.read(start + 2, run.layers[0]))
    for row in (start - 1, start + shard.n_samples):  # the other shard's rows, never another local sample
        with pytest.raises(IndexError, match=rf"sample_idx {row} out of range \[15, 30\)"):
            shard.locate(row)
    first = zs.ZarrStore(run_dir / "shards" / "shard-0000.zarr")
    for row in (True, 1.0):
        with pytest.raises(TypeError, match="sample_idx .* is not an integer"):
            first.locate(row)


def test_a_zarr_store_claiming_millions_of_samples_is_refused_without_listing_them(tmp_path):
    """A .zattrs (and .zarray shapes) claiming millions of samples the store lacks: opening it listed the
    name of every seq_len chunk before reading the first (~75 bytes a name: memory without end at
    10^12), then was refused at the first missing chunk. It is refused there, the names made one at a
    time."""
    claimed = 4_000_000
    store = synthetic_shard(tmp_path, tmp_path / "s.zarr")
    consolidated = json.loads((store / ".zmetadata").read_text())
    meta = consolidated["metadata"]
    meta[".zattrs"]["num_samples"] = claimed
    for key, zarray in meta.items():
        if key.endswith("/.zarray"):
            zarray["shape"][0] = claimed
    (store / ".zmetadata").write_text(json.dumps(consolidated))
    def refused() -> None:
        with pytest.raises(FormatError, match=rf"{re.escape(str(store))}/arrays/seq_len/1: .*missing"):
            zs.ZarrStore(store)

    peak = traced_peak(refused)[1]
    assert peak < 16 << 20, f"opening the store took {peak >> 20} MiB"


@pytest.mark.parametrize("layer", [False, 2.0])
def test_a_pickle_layer_that_is_not_an_integer_is_refused_not_blamed_on_a_shard(store, layer):  # noqa: F811
    """The pickle readers found a layer with `in`: False == 0 and 2.0 == 2 passed, then no shard held
    "layer_False" or "layer_2.0", and an intact shard was named damaged ("holds a NoneType")."""
    _, _, out = store
    assert layer in ps.load_metadata(out)["extraction_config"]["layers_extracted"]  # what `in` let through
    for read in (lambda: ps.ActivationDataset(out, layer), lambda: next(ps.iter_activations(out, layer))):
        with pytest.raises(FormatError, match=rf"{re.escape(str(out))}: layer {layer!r} not stored; layers are"):
            read()
    assert next(ps.iter_activations(out, np.int64(int(layer))))["activation"].ndim == 2  # numpy's ints are ints


def test_a_pickle_dataset_refuses_a_bool_index(store):  # noqa: F811
    """ActivationDataset[True] served sample 1 (operator.index(True) is 1)."""
    _, _, out = store
    dataset = ps.ActivationDataset(out, 0)
    with pytest.raises(TypeError, match="sample index True is a bool"):
        dataset[True]
    assert dataset[1]["sample_idx"] == list(ps.iter_activations(out, 0))[1]["sample_idx"]


def moved_out(path, outside):
    """`path` moved to `outside` and a link to it left in its place."""
    path.rename(outside)
    path.symlink_to(outside)


@pytest.mark.parametrize("linked", ["chunk", "sample directory", "seq_len chunk"])
def test_a_zarr_store_never_reads_a_file_outside_it_through_a_link(tmp_path, linked):
    """A store copied from another machine with a chunk, or a sample's directory, linked to a file
    outside it of the chunk's size: ZarrStore read that file as activations (verify names such links,
    but a plain open_zarr verifies nothing). Each read names the link and what it leads to."""
    store = synthetic_shard(tmp_path, tmp_path / "s.zarr")
    inward = tmp_path / "s.zarr" / "elsewhere"
    moved_out(store / zs.ACTS / "1", inward)  # a link that stays inside the store is read as before
    path = {"chunk": store / zs.ACTS / "0/0/0/0", "sample directory": store / zs.ACTS / "0",
            "seq_len chunk": store / "arrays/seq_len/0"}[linked]
    moved_out(path, tmp_path / "outside")
    with pytest.raises(FormatError, match=r"leads outside .*s\.zarr.*through a link"):
        zs.ZarrStore(store).read(0, 0)
    if linked != "seq_len chunk":
        assert zs.ZarrStore(store).read(1, 0).shape == (3, 16)


@pytest.mark.parametrize("damage", ["text_preview missing", "activation 1-D"])
def test_a_pickle_item_the_readers_cannot_serve_is_named_with_its_shard(store, tmp_path, damage):  # noqa: F811
    """A shard's checksum proves only that these are the bytes its writer wrote. An item without
    text_preview made ActivationDataset raise a bare KeyError('text_preview'), and iter_activations
    yielded it; a 1-D activation was served as a sample. Both readers name the shard and the layer."""
    import pickle

    from test_pickle import copy_store
    from test_pickle_reader_shard_ids_dtypes import replant

    _, _, out = store
    copied = copy_store(out, tmp_path / "store")
    info = ps.load_metadata(copied)["shards"][0]
    shard = ps.load_shard(copied, info)
    item = shard["layer_0"][0]
    if damage == "text_preview missing":
        del item["text_preview"]
    else:
        item["activation"] = item["activation"][0]
    path = replant(copied, pickle.dumps(shard, protocol=5))
    named = rf"{re.escape(str(path))}: layer_0 (item lacks|sample \d+: activation)"
    with pytest.raises(FormatError, match=named):
        ps.ActivationDataset(copied, 0)[0]
    with pytest.raises(FormatError, match=named):
        next(ps.iter_activations(copied, 0))


def test_zarr_read_vector_on_a_shard_refuses_a_bool_row(bert_run):  # noqa: F811
    """read_vector on a single store subtracted its global_index_start from the row before anything
    checked its type: True (== 1) read row 1 of a shard starting at 0. It now asks the shard to locate
    the row, as a run does."""
    _, run_dir = bert_run
    shard = run_dir / "shards" / "shard-0000.zarr"
    assert zs.ZarrStore(shard).attrs["global_index_start"] == 0
    with pytest.raises(TypeError, match="sample_idx True is not an integer"):
        zs.read_vector(shard, True, 0, 0)
    np.testing.assert_array_equal(zs.read_vector(shard, 1, 0, 0), zs.ZarrStore(shard).read(1, 0)[0])
