"""The SAE's training data at scale, on synthetic extractions written like real ones: the split and an
epoch's order held in int32 (half the bytes a token), batches gathered without a pass over every part,
and the SAE trained from a config bit-identical to the one the int64, part-by-part data path made."""
from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from actstore.formats.extract import Extraction, open_extraction, synthetic_extraction
from actstore.sae import data
from actstore.sae.data import gather, split_tokens, stream_batches, tensors
from actstore.sae.train import train_sae

CFG = {"num_basis": 32, "k_active": 4, "steps": 40, "batch_size": 48, "lr": 0.003, "dead_tokens": 2000,
       "aux_k": None, "aux_coef": 1 / 32, "heldout_fraction": 0.2, "eval_tokens": None, "seed": 7, "device": "cpu"}


def many_parts(root: Path, parts: int = 23) -> Extraction:
    """About 60 samples of 4..10 tokens, width 8, in `parts` parts (the last ones empty)."""
    return open_extraction(synthetic_extraction(root, 60 * 7 * 8 * 4, parts, 8, [1], tokens=(4, 10)))


# The data path as it was (release before int32 indices): the reference the batches must equal.
def int64_split(extraction: Extraction, heldout_fraction: float, seed: int) -> data.TokenSplit:
    n = extraction.n_samples
    rng = np.random.default_rng(seed)
    n_held = min(n - 1, max(1, int(round(n * heldout_fraction)))) if n > 1 else 0
    held = np.zeros(n, dtype=bool)
    held[rng.permutation(n)[:n_held]] = True
    train, heldout = [], []
    for part in extraction.parts:
        is_held = np.repeat(held[part.sample_start:part.sample_start + part.info.n_samples], np.diff(part.offsets))
        rows = np.arange(int(part.offsets[-1]), dtype=np.int64)
        train.append(rows[~is_held])
        heldout.append(rows[is_held])
    return data.TokenSplit(train, heldout, [int(i) for i in np.flatnonzero(held)])


def masked_gather(arrays: list, rows: list[np.ndarray], picks: np.ndarray) -> np.ndarray:
    sizes = np.cumsum([0] + [len(r) for r in rows])
    out = []
    for p, (array, part_rows) in enumerate(zip(arrays, rows)):
        local = picks[(picks >= sizes[p]) & (picks < sizes[p + 1])] - sizes[p]
        if len(local):
            out.append(np.asarray(array[np.sort(part_rows[local])], dtype=np.float32))
    return np.concatenate(out)


def int64_batches(arrays: list, rows: list[np.ndarray], batch_size: int,
                  rng: np.random.Generator) -> Iterator[torch.Tensor]:
    total = sum(len(r) for r in rows)
    while True:
        order = rng.permutation(total)
        for start in range(0, total - batch_size + 1 if total >= batch_size else 1, batch_size):
            yield torch.from_numpy(masked_gather(arrays, rows, order[start:start + batch_size]))


def test_the_split_and_batches_are_the_int64_data_paths(tmp_path):
    extraction = many_parts(tmp_path / "x")
    split, reference = split_tokens(extraction, 0.2, 3), int64_split(extraction, 0.2, 3)
    assert split.heldout_samples == reference.heldout_samples
    for got, expect in zip(split.train + split.heldout, reference.train + reference.heldout):
        assert got.dtype == np.int32 and np.array_equal(got, expect)
    arrays = tensors(extraction, "layer_1")
    got = stream_batches(arrays, split.train, 48, np.random.default_rng(5))
    expect = int64_batches(arrays, reference.train, 48, np.random.default_rng(5))
    for _ in range(3 * split.n_train // 48):  # three epochs: three permutations
        assert torch.equal(next(got), next(expect))


def test_the_trained_sae_is_bit_identical_to_the_int64_data_paths(tmp_path, monkeypatch):
    extraction = many_parts(tmp_path / "x")
    sae, report = train_sae(extraction, "layer_1", CFG, progress=False)
    monkeypatch.setattr("actstore.sae.train.split_tokens", int64_split)
    monkeypatch.setattr("actstore.sae.train.stream_batches", int64_batches)
    reference, reference_report = train_sae(extraction, "layer_1", CFG, progress=False)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(sae.state_dict()[name], tensor), name
    assert report["loss_curve"] == reference_report["loss_curve"] and report["heldout"] == reference_report["heldout"]


def test_the_split_and_an_epochs_order_hold_8_bytes_a_training_token(tmp_path):
    """int64 row indices and permutation held 16 B a training token for the whole run: 16 GB at 1B
    tokens, beside the SAE's own."""
    extraction = open_extraction(synthetic_extraction(tmp_path / "x", 200_000 * 4, 4, 1, [1]))
    tracemalloc.start()
    try:
        split = split_tokens(extraction, 0.01, 0)
        batches = stream_batches(tensors(extraction, "layer_1"), split.train, 256, np.random.default_rng(0))
        next(batches)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held / extraction.n_tokens < 9


def test_an_index_past_int32_is_int64():
    assert data.index_dtype(2**31) is np.int32 and data.index_dtype(2**31 + 1) is np.int64


class CountedPicks(np.ndarray):
    """A batch's picks counting the array operations (ufuncs) made on them."""
    operations = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        CountedPicks.operations += 1
        plain = [x.view(np.ndarray) if isinstance(x, CountedPicks) else x for x in inputs]
        return CountedPicks.view_of(getattr(ufunc, method)(*plain, **kwargs))

    @staticmethod
    def view_of(result):
        return result.view(CountedPicks) if isinstance(result, np.ndarray) else result


def test_a_batch_is_cut_into_parts_in_operations_of_the_parts_it_reads(tmp_path):
    """Each part's picks were masked out of the batch: O(parts) array passes a batch, the prefetcher's
    pace past a thousand parts (37 batches/s of 4,096 at 2,048 parts, against 1,500 at 16)."""
    extraction = many_parts(tmp_path / "x", parts=60)
    split = split_tokens(extraction, 0.2, 0)
    arrays = tensors(extraction, "layer_1")
    picks = np.random.default_rng(0).permutation(split.n_train)[:4]
    expect = masked_gather(arrays, split.train, picks)
    CountedPicks.operations = 0
    got = gather(arrays, split.train, picks.view(CountedPicks))
    assert np.array_equal(got, expect)
    assert CountedPicks.operations <= 2 * len(picks)
