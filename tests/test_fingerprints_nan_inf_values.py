"""Review 60 of validate's full pass (actstore.fingerprints): NaN and inf values the model computed."""
from __future__ import annotations

import numpy as np

import tiny
from actstore.formats.extract import synthetic_extraction
from test_extract import write_real_store
from test_fingerprints import problems_of, zarr_chunk


def test_a_shift_of_a_samples_tokens_each_holding_an_inf_is_named(tmp_path):
    """Every token of sample 1 holds +inf at one coordinate (a massive activation past float16's range):
    its tokens shifted by one in the zarr store are named, as the rows' finite values are still summed.
    (A row with a NaN or inf was summed by its kind alone: each token still held such a row, and the
    shift passed.)"""
    root = synthetic_extraction(tmp_path / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))
    layer = np.load(root / "part-0000" / "layer_001.npy", mmap_mode="r+")
    offsets = np.load(root / "part-0000" / "offsets.npy")
    layer[offsets[1]:offsets[2], 3] = np.inf
    layer.flush()
    tiny.rerecord(root / "part-0000", "layer_001.npy")
    store = write_real_store("zarr", root, tmp_path / "zarr")
    assert problems_of("zarr", store, root)[0] == []
    chunk = zarr_chunk(store, 1, 0)
    seq_len = int(offsets[2] - offsets[1])
    rows = np.fromfile(chunk, np.float16).reshape(-1, 8)
    assert np.isposinf(rows[:seq_len, 3]).all()
    rows[:seq_len] = np.roll(rows[:seq_len], 1, axis=0)
    rows.tofile(chunk)
    problems, _ = problems_of("zarr", store, root)
    assert len(problems) == 1 and "(zarr): layer 1, samples 1..1: holds other vectors" in problems[0], problems


def test_nan_rows_agree_exactly_in_any_order_and_blocks():
    """300,000 NaN rows of one sample folded in order and in 7 shuffled blocks: their hash sums are
    equal (an exact sum mod 2**64), where float sums of weights differ by roundings that grow with
    the row count; one row's token moved is named."""
    from actstore.fingerprints import Fingerprint

    n = 300_000
    tokens, vectors = np.arange(n), np.full((n, 2), np.nan, np.float32)
    in_order, shuffled, moved = (Fingerprint(1, [0], np.array([0.5, -1.0])) for _ in range(3))
    in_order.add(0, np.zeros(n, np.int64), tokens, vectors)
    for block in np.array_split(np.random.default_rng(0).permutation(n), 7):
        shuffled.add(0, np.zeros(len(block), np.int64), tokens[block], vectors[block])
    assert in_order.specials[0, 0] == shuffled.specials[0, 0] and shuffled.differences(in_order, "x") == []
    moved.add(0, np.zeros(n, np.int64), np.where(tokens == 5, n, tokens), vectors)
    assert "NaN or inf rows elsewhere" in moved.differences(in_order, "x")[0]
