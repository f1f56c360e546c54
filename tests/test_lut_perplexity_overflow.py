"""Review 63 of the LUT stage's evaluation: a perplexity past a float."""
from __future__ import annotations

import math

import torch

from actstore.lut import Comparison


def test_a_perplexity_past_a_float_is_recorded_as_null_not_an_overflow():
    """LUT logits that put the next tokens ~1e4 nats down (a broken table): exp of the mean NLL raised
    OverflowError, ending the stage before its report; it is null, the other metrics as computed."""
    ids = torch.tensor([[1, 2, 3, 0]])
    reference = torch.zeros(1, 4, 5)
    broken = torch.zeros(1, 4, 5)
    broken[..., 0] = 1e4  # every position sure of token 0, the next tokens 1e4 nats below
    inputs = {"input_ids": ids, "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    comparison = Comparison("causal")
    comparison.add(reference, broken, inputs)
    report = comparison.result()
    assert math.isclose(report["perplexity_original"], 5, rel_tol=1e-6)  # uniform over 5 tokens
    assert report["perplexity_lut"] is None and report["perplexity_change"] is None
    assert math.isfinite(report["kl_mean"]) and report["kl_mean"] > 1e3
