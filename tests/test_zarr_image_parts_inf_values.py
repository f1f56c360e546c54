"""Zarr logger review 57: an image part whose tokens pass extract.max_seq_length (which cuts texts only)
is stored whole, and `inspect` reports the activations the float16 store made +-inf."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import layer_tensor, synthetic_extraction
from test_zarr import build_run
from test_zarr_merged_sample_count import edited


def test_an_image_part_whose_tokens_pass_max_seq_length_is_stored_whole(extracted, tmp_path):
    """Images are never cut to extract.max_seq_length (a ViT-B/16's 197 tokens pass the default 128):
    every shard job refused such a part ("more than the part's max_seq_length"), after an extraction
    that had succeeded. T_max now holds an image's tokens; our reader and zarr-python read the
    extraction's values, zeros past them."""
    _, extract_dir = extracted("dinov2", extract={"max_seq_length": 8})
    extraction = build_run(extract_dir, tmp_path / "run", t_chunk=4)
    tokens = {len(part.activations(layer_tensor(0), i)) for part, i, _ in extraction.iter_samples()}
    assert len(tokens) == 1 and tokens.pop() > extraction.parts[0].info.max_seq_length == 8
    run = zs.ZarrRun(tmp_path / "run")
    assert zs.verify(tmp_path / "run") == []
    for store in run.stores:
        acts = zarr.open_group(str(store.path), mode="r")["arrays/activations"]
        assert store.t_max == acts.shape[2] == max(store.seq_len)
    for part, local, row in extraction.iter_samples():
        store, i = run.locate(row["sample_idx"])
        acts = zarr.open_group(str(store.path), mode="r")["arrays/activations"]
        for l, layer in enumerate(run.layers):
            want = part.activations(layer_tensor(layer), local).astype(np.float16)
            np.testing.assert_array_equal(run.read(row["sample_idx"], layer), want)
            np.testing.assert_array_equal(acts[i, l, : len(want)], want)
            assert not acts[i, l, len(want):].any()


@pytest.fixture(scope="module")
def overflowing_run(tmp_path_factory) -> Path:
    """A run of two shards whose extraction (float32, standard deviation 40000) holds values past
    float16's 65504."""
    root = tmp_path_factory.mktemp("review57")
    extract = synthetic_extraction(root / "extract", 30_000, 2, 16, [1, 2], tokens=(3, 20), scale=40_000.0)
    build_run(extract, root / "run", t_chunk=8, merged=False)
    return root / "run"


def test_inspect_reports_the_values_stored_as_inf(overflowing_run):
    """The writer counts them in the attrs and `actstore inspect` prints float16_overflow_count when a
    store lost any: zarr's inspect gave none, so a run holding infinities printed as clean."""
    run = zs.ZarrRun(overflowing_run)
    stored = sum(int(np.isinf(store.read(i, layer)).sum()) for store in run.stores
                 for i in range(store.n_samples) for layer in store.layers)
    assert stored > 0
    assert zs.inspect(overflowing_run)["float16_overflow_count"] == stored
    shard = run.stores[1].path
    assert zs.inspect(shard)["float16_overflow_count"] == run.stores[1].attrs["float16_overflow_count"] > 0


def test_a_float16_overflow_count_that_is_no_whole_number_is_named(overflowing_run, tmp_path):
    store = tmp_path / "store.zarr"
    shutil.copytree(zs.ZarrRun(overflowing_run).stores[0].path, store)
    edited(store, ".zattrs", lambda attrs: attrs.update(float16_overflow_count="many"))
    with pytest.raises(FormatError, match=rf"{store}/.zattrs: float16_overflow_count='many', expected a whole"):
        zs.inspect(store)


def test_read_vector_of_a_shard_takes_the_dataset_row(overflowing_run):
    """read_vector (the Format protocol: `sample_idx` is the dataset row, as the pickle format's) read a
    single shard's local sample instead: row 15 of a shard starting at 15 was "out of range [0, 15)",
    and where a shard holds more samples than its start, another row's vector."""
    run = zs.ZarrRun(overflowing_run)
    shard = run.stores[1]
    start = shard.attrs["global_index_start"]
    assert start > 0
    for row in (start, start + shard.n_samples - 1):
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(zs.read_vector(shard.path, row, 2, 1), run.read(row, 2)[1].astype(np.float32))
    with pytest.raises(IndexError):
        zs.read_vector(shard.path, start - 1, 2, 1)
