"""Zarr logger review 63: the training sampler refuses arguments it cannot draw with (no layer per
sample, a negative seed or count, a bool or float) when it is made, not at its first batch; the
Dataset names a tuple key that is no (sample, layer) pair; write_manifest refuses shards that are
not one run's consecutive stores instead of writing a manifest no reader opens; our reads equal
zarr's own of the same stores, shards and merged, with samples of no token and a T_chunk of 1."""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.formats.zarr.layout import MANIFEST


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run of two shards (2 layers, hidden 8, 0-3 tokens: some samples of none, T_chunk 1) and its
    merged store."""
    base = tmp_path_factory.mktemp("review63")
    extract = synthetic_extraction(base / "extract", 3000, 2, 8, [0, 2], tokens=(0, 3))
    stores = [base / "run" / "shards" / zs.shard_name(k) for k in range(2)]
    for part, store in zip(open_extraction(extract).parts, stores):
        zs.write_shard(part.dir, store, t_chunk=1, progress=False)
    zs.merge_stores(stores, base / "run" / "merged", progress=False)
    zs.write_manifest(base / "run", stores, base / "run" / "merged")
    return base / "run"


@pytest.mark.parametrize("store", ["shards/shard-0000.zarr", "shards/shard-0001.zarr", "merged"])
def test_reads_equal_zarrs_own(run, store):
    """Every (sample, layer) our reader returns is zarr.open_consolidated's slice to seq_len, zero past it."""
    import zarr
    reader = zs.ZarrStore(run / store)
    assert (reader.seq_len == 0).any() and reader.t_chunk == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_consolidated(str(run / store), mode="r")
        acts = group["arrays/activations"][:]
    assert acts.shape == (reader.n_samples, 2, reader.t_max, 8)
    for i in range(reader.n_samples):
        for l, layer in enumerate(reader.layers):
            x = reader.read(i, layer)
            np.testing.assert_array_equal(acts[i, l, : len(x)], x)
            assert not acts[i, l, len(x):].any()
    for name in reader.vector_names:
        np.testing.assert_array_equal(group[f"arrays/{name}"][:], reader.vector(name))


@pytest.mark.parametrize("change", [
    {"layers_per_sample": 0}, {"layers_per_sample": -1}, {"layers_per_sample": True},
    {"num_batches": -2}, {"num_batches": 2.5}, {"batch_samples": True}, {"batch_samples": 2.0},
    {"seed": -1}, {"seed": 1.5}, {"seed": None}, {"layers": [1, 1, 2]}, {"n_samples": 10.0},
], ids=str)
def test_the_sampler_refuses_arguments_it_cannot_draw_with(change):
    """layers_per_sample 0 drew empty batches (collate_padded then failed on []); the others failed
    only at the first batch, in numpy's or Python's words (a negative len, 'expected non-negative
    integer'); a layer listed twice could be drawn twice for one sample."""
    args = {"n_samples": 10, "layers": [1, 2, 3], "batch_samples": 2, "num_batches": 2, "seed": 0, **change}
    with pytest.raises(ValueError, match=next(iter(change))):
        zs.TrainingPatternSampler(**args)


def test_the_sampler_takes_numpy_integers():
    sampler = zs.TrainingPatternSampler(np.int64(10), np.array([1, 2]), np.int32(2), np.int64(2), np.int64(3),
                                        np.uint8(7))
    batches = list(sampler)
    assert len(batches) == len(sampler) == 3 and all(len(batch) == 4 for batch in batches)


@pytest.mark.parametrize("key", [(1,), (1, 0, 0), ()], ids=str)
def test_the_dataset_names_a_tuple_key_that_is_no_pair(run, key):
    dataset = zs.ZarrActivationDataset(run)
    with pytest.raises(TypeError, match=f"{run}: key .* is not a \\(sample, layer\\) pair"):
        dataset[key]


def test_the_dataset_reads_negative_and_numpy_keys_as_the_reader_does(run):
    dataset = zs.ZarrActivationDataset(run)
    np.testing.assert_array_equal(dataset[np.int64(3)].numpy(), zs.ZarrRun(run).read(1, 2))
    with pytest.raises(IndexError, match="out of range"):
        dataset[-1]
    with pytest.raises(TypeError):
        dataset[(True, 0)]


def test_write_manifest_refuses_shards_out_of_order(run, tmp_path):
    """Shards given out of order (or one left out) made a manifest.json every ZarrRun refused."""
    copy = shutil.copytree(run, tmp_path / "run")
    before = (copy / MANIFEST).read_bytes()
    shards = sorted((copy / "shards").iterdir())
    for wrong in (shards[::-1], shards[1:]):
        with pytest.raises(FormatError, match="global_index_start"):
            zs.write_manifest(copy, wrong, copy / "merged")
        assert (copy / MANIFEST).read_bytes() == before
    zs.write_manifest(copy, shards, copy / "merged")
    assert zs.ZarrRun(copy, merged=True).n_samples == zs.ZarrRun(copy).n_samples



@pytest.mark.parametrize("t_chunk", [0, -4, True, 2.5, "8"], ids=repr)
def test_a_t_chunk_that_is_no_positive_integer_is_refused(tmp_path, t_chunk):
    """write_shard made t_chunk 0 or -4 a T_chunk of 1, True 1 and 2.5 2, silently (the config's
    schema refuses them; a library caller's went through)."""
    extract = synthetic_extraction(tmp_path / "extract", 2000, 1, 8, [0], tokens=(1, 4))
    with pytest.raises(ValueError, match=f"t_chunk={t_chunk!r}"):
        zs.write_shard(open_extraction(extract).parts[0].dir, tmp_path / "store.zarr", t_chunk=t_chunk,
                       progress=False)
    assert not (tmp_path / "store.zarr").exists()
    with pytest.raises(ValueError, match="t_chunk"):
        zs.choose_t_chunk(128, 8, t_chunk)


@pytest.mark.parametrize("tokens", [(0, 0), (5, 3), (-1, 4)])
def test_synthetic_extraction_refuses_a_token_range_that_reaches_no_byte(tokens, tmp_path):
    """Samples of 0 tokens never reach n_bytes: synthetic_extraction looped forever, its memory growing."""
    from actstore.formats.extract import synthetic_extraction

    with pytest.raises(ValueError, match=r"tokens=\("):
        synthetic_extraction(tmp_path / "x", 1000, 1, 8, [1], tokens=tokens)
    assert not (tmp_path / "x").exists()
