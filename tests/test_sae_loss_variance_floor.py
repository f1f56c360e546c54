"""Review 63 of the sae stage, on real synthetic extractions: the training loss is normalised by the
batch's variance with a floor relative to the batch's scale (a fixed 1e-8 made the loss curve of
small activations their error over 1e-8, not their FVU), and training tokens without variance (a
constant hook) are refused by name before training (their loss was rounding noise over 1e-8,
reported as an FVU of millions)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tiny
import torch

from actstore.errors import ConfigError
from actstore.formats.extract import open_extraction, synthetic_extraction, tensor_file
from actstore.sae import TopKSAE, auxk_loss, init_sae
from actstore.sae.train import train_sae

CFG = {"num_basis": 32, "k_active": 4, "steps": 1, "batch_size": 64, "lr": 0.003, "dead_tokens": 2000,
       "aux_k": None, "aux_coef": 1 / 32, "heldout_fraction": 0.2, "eval_tokens": None, "seed": 0, "device": "cpu"}


def extraction_of(root: Path, scale: float = 1.0):
    """About 60 samples of 4..10 tokens, width 8, in 3 parts, normal of standard deviation `scale`."""
    return open_extraction(synthetic_extraction(root, 60 * 7 * 8 * 4, 3, 8, [1], tokens=(4, 10), scale=scale))


def constant(extraction, row: np.ndarray, varied_rows: int = 0):
    """Every token row of layer_1 set to `row`, but the first `varied_rows` of the first part."""
    for part in extraction.parts:
        data = np.load(part.dir / tensor_file("layer_1"), mmap_mode="r+")
        data[varied_rows if part is extraction.parts[0] else 0:] = row
        data.flush()
        del data
        tiny.rerecord(part.dir, tensor_file("layer_1"))  # as if extracted so: train_sae checks its part files
    return open_extraction(extraction.dir)


def test_the_loss_curve_of_small_activations_is_their_fvu_not_their_error_over_1e_8(tmp_path):
    """The initial SAE (b_dec the mean, encoder = decoder) scales with its data: its first batch's FVU
    is the same at any scale. At standard deviation 1e-5 (width 8: variance 8e-10) the curve's first
    point was 0.07 (the error over 1e-8), not 0.93."""
    first = [train_sae(extraction_of(tmp_path / str(scale), scale), "layer_1", CFG, progress=False)[1]
             ["loss_curve"][0]["fvu"] for scale in (1.0, 1e-5)]
    assert first[1] == pytest.approx(first[0], rel=1e-3)


@pytest.mark.parametrize("value", [0.1, 1000.3])
def test_training_tokens_without_variance_are_refused_naming_the_hook_before_training(tmp_path, value):
    """A constant hook (token type embeddings): the curve gave FVUs of millions (rounding noise over
    1e-8), the SAE was trained on that noise, and the report's held-out FVU was None."""
    extraction = constant(extraction_of(tmp_path / "x"), value * np.linspace(1, 2, 8, dtype=np.float32))
    with pytest.raises(ConfigError, match=r"^sae\.hook 'layer_1': the \d+ training tokens sampled are all equal"):
        train_sae(extraction, "layer_1", dict(CFG, steps=3), progress=False)


def test_training_tokens_with_some_variance_train(tmp_path):
    """Two tokens of all the others' value are enough variance to train on."""
    extraction = constant(extraction_of(tmp_path / "x"), np.ones(8, np.float32), varied_rows=2)
    _, report = train_sae(extraction, "layer_1", dict(CFG, steps=3), progress=False)
    assert report["loss_curve"][-1]["step"] == 3


@torch.no_grad()
def test_the_auxk_loss_of_small_activations_is_their_normalised_error_not_their_error_over_1e_8():
    """AuxK divides by the residual's variance: with the same fixed floor, the AuxK loss (and its
    gradient to dead latents) of a residual of standard deviation 1e-5 was its error over 1e-8."""
    g = torch.Generator().manual_seed(0)
    sae = TopKSAE(8, 32, 4)
    init_sae(sae, torch.zeros(8), seed=0)
    x, x_hat = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    dead = torch.arange(32) % 2 == 0
    losses = [auxk_loss(sae, x * scale, x_hat * scale, sae.pre_acts(x * scale), dead, 8).item()
              for scale in (1.0, 1e-5)]
    assert losses[0] > 0 and losses[1] == pytest.approx(losses[0], rel=1e-4)
