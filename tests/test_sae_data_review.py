"""The sae stage's data path on real extractions: the held-out report of eval_tokens tokens is of a
seeded uniform sample of the held-out tokens, not the first in storage order."""
from __future__ import annotations

import numpy as np
import torch

from actstore.formats.extract import open_extraction, synthetic_extraction, tensor_file
from actstore.sae import split_tokens, tensors
from actstore.sae.model import TopKSAE
from actstore.sae.train import evaluate


def test_the_heldout_report_of_eval_tokens_is_a_sample_of_every_heldout_token(tmp_path):
    """An image folder is stored sorted by label: the first eval_tokens held-out tokens in storage order
    were the first classes', so a latent firing on a later class only was reported dead. Here the last
    part is the other class (its tokens pick latent 1, every other token latent 0), and eval_tokens is
    the held-out tokens of the parts before it."""
    root = synthetic_extraction(tmp_path / "x", 60 * 7 * 8 * 4, 3, 8, [1], tokens=(4, 10))
    for p, part in enumerate(open_extraction(root).parts):
        data = np.load(part.dir / tensor_file("layer_1"), mmap_mode="r+")
        data[:] = 0
        data[:, 0], data[:, 1] = 1, 100 if p == 2 else 0
        data.flush()
        del data
    extraction = open_extraction(root)
    split = split_tokens(extraction, 0.2, seed=0)
    before_last = sum(len(rows) for rows in split.heldout[:-1])
    assert before_last and len(split.heldout[-1])
    sae = TopKSAE.from_state({"encoder_weight": torch.eye(2, 8), "encoder_bias": torch.zeros(2),
                              "decoder_weight": torch.eye(2, 8), "decoder_bias": torch.zeros(8)}, 1)
    held = evaluate(sae, tensors(extraction, "layer_1"), split.heldout, limit=before_last)
    assert held["n_tokens"] == before_last
    assert held["dead_fraction"] == 0.0 and held["fires"][1] > 0
