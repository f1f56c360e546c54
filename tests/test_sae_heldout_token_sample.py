"""The sae and lut stages' held-out tokens on real extractions: eval_tokens of them are a seeded
uniform sample of the held-out tokens, not the first in storage order."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from actstore.formats.extract import open_extraction, synthetic_extraction, tensor_file
from actstore.sae import split_tokens, tensors
from actstore.sae.model import TopKSAE
from actstore.sae.train import evaluate


def two_class_extraction(root: Path) -> Path:
    """Three parts of layer_1 tokens, each [1, 0, ...] but the last part's, the other class's:
    [1, 100, ...], as the last class of a dataset sorted by label."""
    synthetic_extraction(root, 60 * 7 * 8 * 4, 3, 8, [1], tokens=(4, 10))
    for p, part in enumerate(open_extraction(root).parts):
        data = np.load(part.dir / tensor_file("layer_1"), mmap_mode="r+")
        data[:] = 0
        data[:, 0], data[:, 1] = 1, 100 if p == 2 else 0
        data.flush()
        del data
    return root


def test_the_heldout_report_of_eval_tokens_is_a_sample_of_every_heldout_token(tmp_path):
    """An image folder is stored sorted by label: the first eval_tokens held-out tokens in storage order
    were the first classes', so a latent firing on a later class only was reported dead. Here the last
    part is the other class (its tokens pick latent 1, every other token latent 0), and eval_tokens is
    the held-out tokens of the parts before it."""
    root = two_class_extraction(tmp_path / "x")
    extraction = open_extraction(root)
    split = split_tokens(extraction, 0.2, seed=0)
    before_last = sum(len(rows) for rows in split.heldout[:-1])
    assert before_last and len(split.heldout[-1])
    sae = TopKSAE.from_state({"encoder_weight": torch.eye(2, 8), "encoder_bias": torch.zeros(2),
                              "decoder_weight": torch.eye(2, 8), "decoder_bias": torch.zeros(8)}, 1)
    held = evaluate(sae, tensors(extraction, "layer_1"), split.heldout, limit=before_last)
    assert held["n_tokens"] == before_last
    assert held["dead_fraction"] == 0.0 and held["fires"][1] > 0


def test_the_lut_stages_heldout_tokens_are_a_sample_of_every_heldout_token(tmp_path):
    """The lut stage evaluated its tables on the first lut.eval_tokens held-out tokens in storage order
    too: the first classes' only. Now a seeded uniform sample of them, as the SAE's report."""
    from actstore.lut import heldout_inputs
    from actstore.sae import REPORT_FILE

    root = two_class_extraction(tmp_path / "x")
    split = split_tokens(open_extraction(root), 0.2, seed=0)
    before_last = sum(len(rows) for rows in split.heldout[:-1])
    (tmp_path / "sae").mkdir()
    (tmp_path / "sae" / REPORT_FILE).write_text(json.dumps({"hook": "layer_1"}))
    config = {"extract": {"parts": 3}, "sae": {"heldout_fraction": 0.2, "seed": 0}, "lut": {"eval_tokens": before_last}}
    x, samples = heldout_inputs(config, root, tmp_path / "sae")
    assert len(x) == before_last and samples == split.heldout_samples
    assert (x[:, 1] == 100).any() and (x[:, 1] == 0).any()  # both classes' tokens


def test_an_extraction_of_no_token_is_named(tmp_path):
    """A (hand-made) extraction whose parts hold no token stopped the sae stage with a bare
    StopIteration out of tensors()."""
    from actstore.errors import ConfigError

    root = synthetic_extraction(tmp_path / "x", 0, 1, 8, [1])
    with pytest.raises(ConfigError, match=f"^sae: the extraction at {re.escape(str(root))} holds no token"):
        tensors(open_extraction(root), "layer_1")
