"""Review 58 of the SAE's data feed, on the real Prefetcher and sampler: a closed Prefetcher ends at
once (a loop that closed it on an error and then drained it waited forever), and a large held-out
sample is drawn without a permutation of every held-out row."""
from __future__ import annotations

import itertools

import numpy as np
import torch

from actstore.sae.data import PERMUTED_ROWS, Prefetcher, sampled_rows
from test_sae_prefetcher_end_fold_overflow import finished_within
from tiny import traced_peak


def test_a_closed_prefetcher_of_an_endless_source_ends_at_once():
    """try: train; except: prefetcher.close(); finally: drain it. The stopped producer puts nothing
    more, and the drain waited for its next batch forever."""
    prefetcher = Prefetcher((torch.full((2, 3), float(i)) for i in itertools.count()), torch.device("cpu"))
    assert next(prefetcher).tolist() == [[0.0] * 3] * 2
    prefetcher.close()
    finished, drained = finished_within(lambda: list(prefetcher))
    assert finished, "iterating a closed Prefetcher never ended"
    assert drained == []
    finished, outcome = finished_within(lambda: next(prefetcher))
    assert finished and isinstance(outcome, StopIteration)


def test_a_large_heldout_sample_is_drawn_in_memory_of_the_sample_not_of_the_rows():
    """sampled_rows took numpy's choice, which permutes every row (8 B each) when the sample is above
    1/50 of them: sae.eval_tokens 10M of 200M held-out tokens took 1.6 GB more than the split held."""
    total, limit = PERMUTED_ROWS + (1 << 20), 500_000
    rows = [np.arange(total // 2, dtype=np.int32), np.arange(total - total // 2, dtype=np.int32)]
    picked, peak = traced_peak(lambda: sampled_rows(rows, limit, seed=3))
    assert peak < 10 * limit * 8, f"{peak / 1e6:.0f} MB to draw {limit} rows of {total}"
    assert sum(len(p) for p in picked) == limit
    for part, part_rows in zip(picked, rows):
        assert np.all(np.diff(part) > 0) and part[0] >= 0 and part[-1] < len(part_rows)
    # Uniform over the rows: each part (half of them) gets about half the sample.
    assert abs(len(picked[0]) - limit / 2) < 5 * np.sqrt(limit / 4)
    again = sampled_rows(rows, limit, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(picked, again))
    assert not np.array_equal(sampled_rows(rows, limit, seed=4)[0], picked[0])
