"""SAE training on synthetic extractions written like real ones: the held-out split, the data reader,
the TopK model and the held-out metrics against from-scratch references, and the runs refused by name
(non-finite activations, a batch of one token, a loss that is not finite) instead of a NaN SAE."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from actstore.errors import ConfigError, FormatError
from actstore.formats.extract import open_extraction, synthetic_extraction, tensor_file
from actstore.sae import data_mean, split_tokens, stream_batches, tensors
from actstore.sae.train import evaluate, train_sae

CFG = {"num_basis": 32, "k_active": 4, "steps": 30, "batch_size": 64, "lr": 0.003, "dead_tokens": 2000,
       "aux_k": None, "aux_coef": 1 / 32, "heldout_fraction": 0.2, "eval_tokens": None, "seed": 0, "device": "cpu"}


def extraction_of(root: Path, layers=(1,), parts: int = 3, scale: float = 1.0, dtype: str = "float32",
                  tokens=(4, 10)):
    """About 60 samples of 4..10 tokens, width 8, in `parts` parts."""
    return open_extraction(synthetic_extraction(root, 60 * 7 * 8 * 4 * len(layers), parts, 8, list(layers),
                                                tokens=tokens, scale=scale, dtype=dtype))


def labelled(extraction, name: str, sign: float = 1.0):
    """Column 0 of `name` set to sign * (global token row + 1) in the files, so a batch row says which
    token it was read from."""
    first = 0
    for part in extraction.parts:
        if part.info.n_tokens:
            data = np.load(part.dir / tensor_file(name), mmap_mode="r+")
            data[:, 0] = sign * (first + 1 + np.arange(len(data)))
            data.flush()
            del data
        first += part.info.n_tokens
    return open_extraction(extraction.dir)


def global_rows(extraction, rows: list[np.ndarray]) -> set[int]:
    starts = np.cumsum([0] + [p.info.n_tokens for p in extraction.parts])
    return {int(start + r) for start, part_rows in zip(starts, rows) for r in part_rows}


def test_split_is_disjoint_complete_by_sample_and_seeded(tmp_path):
    extraction = extraction_of(tmp_path / "x")
    split = split_tokens(extraction, 0.2, seed=3)
    train, held = global_rows(extraction, split.train), global_rows(extraction, split.heldout)
    assert not train & held and train | held == set(range(extraction.n_tokens))
    assert len(split.heldout_samples) == round(0.2 * extraction.n_samples)
    starts = np.cumsum([0] + [p.info.n_tokens for p in extraction.parts])
    for part, start in zip(extraction.parts, starts):
        for local in range(part.info.n_samples):
            rows = set(range(start + int(part.offsets[local]), start + int(part.offsets[local + 1])))
            assert rows <= (held if part.sample_start + local in split.heldout_samples else train)
    again = split_tokens(extraction, 0.2, seed=3)
    assert all((a == b).all() for a, b in zip(split.heldout + split.train, again.heldout + again.train))
    assert split_tokens(extraction, 0.2, seed=4).heldout_samples != split.heldout_samples


def test_batches_read_every_training_token_of_the_configured_layer_and_no_heldout_one(tmp_path):
    extraction = labelled(extraction_of(tmp_path / "x", layers=(1, 2)), "layer_2", sign=-1.0)
    extraction = labelled(extraction, "layer_1")
    split = split_tokens(extraction, 0.2, seed=0)
    train = {r + 1 for r in global_rows(extraction, split.train)}
    batches = stream_batches(tensors(extraction, "layer_2"), split.train, split.n_train, np.random.default_rng(0))
    epoch = next(batches)[:, 0].numpy()
    assert len(epoch) == split.n_train and set((-epoch).astype(int)) == train  # layer_2's values, each once
    small = stream_batches(tensors(extraction, "layer_2"), split.train, 10, np.random.default_rng(0))
    read = {int(-v) for _ in range(200) for v in next(small)[:, 0]}
    assert read == train


def test_fewer_training_tokens_than_a_batch_train_on_all_of_them(tmp_path):
    extraction = labelled(extraction_of(tmp_path / "x"), "layer_1")
    split = split_tokens(extraction, 0.2, seed=0)
    batch = next(stream_batches(tensors(extraction, "layer_1"), split.train, 10 * split.n_train,
                                np.random.default_rng(0)))
    assert sorted(batch[:, 0].numpy().astype(int)) == sorted(r + 1 for r in global_rows(extraction, split.train))


def reference_encode(sae, x: np.ndarray) -> np.ndarray:
    """Dense codes of ReLU(x W_enc^T + b_enc) keeping each row's k largest, in float64."""
    w, b = (getattr(sae, key).detach().double().numpy() for key in ("encoder_weight", "encoder_bias"))
    pre = np.maximum(x @ w.T + b, 0)
    keep = np.argsort(-pre, axis=1, kind="stable")[:, :sae.k_active]
    code = np.zeros_like(pre)
    np.put_along_axis(code, keep, np.take_along_axis(pre, keep, 1), 1)
    return code


def test_trained_sae_and_its_heldout_metrics_match_a_from_scratch_reference(tmp_path):
    extraction = extraction_of(tmp_path / "x")
    sae, report = train_sae(extraction, "layer_1", CFG, progress=False)
    assert torch.allclose(sae.decoder_weight.norm(dim=1), torch.ones(sae.num_basis), atol=1e-5)
    split = split_tokens(extraction, CFG["heldout_fraction"], CFG["seed"])
    x = np.concatenate([p.tensor("layer_1")[r] for p, r in zip(extraction.parts, split.heldout) if len(r)])
    x = x.astype(np.float64)
    code = reference_encode(sae, x)
    x_hat = code @ sae.decoder_weight.detach().double().numpy() + sae.decoder_bias.detach().double().numpy()
    with torch.no_grad():
        values, indices = sae.encode(torch.from_numpy(x).float())
        dense = torch.zeros(len(x), sae.num_basis).scatter(1, indices, values).double().numpy()
        decoded = sae(torch.from_numpy(x).float()).double().numpy()
    assert np.allclose(dense, code, atol=1e-5) and np.allclose(decoded, x_hat, atol=1e-4)
    held = report["heldout"]
    assert held["n_tokens"] == len(x) == report["n_heldout_tokens"]
    assert held["fvu"] == pytest.approx(((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum(), rel=1e-4)
    assert held["mse"] == pytest.approx(((x - x_hat) ** 2).mean(), rel=1e-4)
    assert held["dead_fraction"] == pytest.approx(((code > 0).sum(0) == 0).mean())


def test_a_non_finite_activation_is_named_not_trained_into_a_nan_sae(tmp_path):
    """A float16 capture past its range stores inf: one in a batch made every weight NaN, and the
    stage wrote that SAE (and its SAELens copy) with no error."""
    extraction = extraction_of(tmp_path / "x")
    part = extraction.parts[1]
    data = np.load(part.dir / tensor_file("layer_1"), mmap_mode="r+")
    row = int(part.offsets[3]) + 1  # the second token of the part's fourth sample
    data[row, 5] = np.inf
    data.flush()
    del data
    extraction = open_extraction(extraction.dir)
    named = f"{part.dir / tensor_file('layer_1')}: token row {row} (sample {part.sample_start + 3}) of layer_1"
    with pytest.raises(FormatError, match=re.escape(named)):
        train_sae(extraction, "layer_1", dict(CFG, heldout_fraction=0.01), progress=False)


def test_a_nan_heldout_activation_is_named_not_reported_as_a_nan_fvu(tmp_path):
    extraction = extraction_of(tmp_path / "x")
    sae, _ = train_sae(extraction, "layer_1", dict(CFG, steps=2), progress=False)
    split = split_tokens(extraction, CFG["heldout_fraction"], CFG["seed"])
    p = next(i for i, rows in enumerate(split.heldout) if len(rows))
    part, row = extraction.parts[p], int(split.heldout[p][-1])
    data = np.load(part.dir / tensor_file("layer_1"), mmap_mode="r+")
    data[row, 0] = np.nan
    data.flush()
    del data
    with pytest.raises(FormatError, match=re.escape(f"token row {row} ")):
        evaluate(sae, tensors(open_extraction(extraction.dir), "layer_1"), split.heldout)


def test_one_training_token_is_refused_not_trained_into_a_nan_sae(tmp_path):
    """The loss is normalised by the batch's variance and AuxK's by the residual's unbiased variance:
    with one row, NaN from the first step, and the NaN SAE was written with no error."""
    extraction = open_extraction(synthetic_extraction(tmp_path / "x", 2 * 8 * 4, 1, 8, [1], tokens=(1, 1)))
    assert extraction.n_tokens == 2  # one held out, one to train on
    with pytest.raises(ConfigError, match=re.escape("1 training token(s)")):
        train_sae(extraction, "layer_1", CFG, progress=False)


def test_a_batch_size_of_one_is_refused_by_the_schema():
    """sae.batch_size 1 trained a NaN SAE (one row has no variance); refused at parse time."""
    from actstore.config import load_config, validate_config

    config = load_config(tiny.REPO / "config" / "config.yaml")
    config["sae"]["batch_size"] = 1
    with pytest.raises(ConfigError, match=r"sae/batch_size: 1 is less than the minimum of 2"):
        validate_config(config)


def test_a_run_whose_loss_is_not_finite_is_named(tmp_path):
    """Activations of 1e20 are finite in float32, their squares are not: every step's loss was NaN, the
    SAE kept its initial weights and the report gave it a held-out FVU as if trained."""
    extraction = extraction_of(tmp_path / "x", scale=1e20)
    with pytest.raises(ConfigError, match=r"training loss was not finite from step 1 of 30"):
        train_sae(extraction, "layer_1", CFG, progress=False)


@pytest.mark.parametrize("eval_tokens, samples", [(None, 3), (1, 60)])
def test_the_heldout_fvu_of_one_token_is_none_not_its_error_over_1e_30(tmp_path, eval_tokens, samples):
    """Three one-token samples hold one out; so does sae.eval_tokens 1. A single token has no variance:
    the report gave FVU ~1e31, which the report plot and `actstore inspect` showed as a result."""
    extraction = open_extraction(synthetic_extraction(tmp_path / "x", samples * 8 * 4, 1, 8, [1], tokens=(1, 1)))
    _, report = train_sae(extraction, "layer_1", dict(CFG, eval_tokens=eval_tokens), progress=False)
    assert report["heldout"]["n_tokens"] == 1 and report["heldout"]["fvu"] is None
    assert report["heldout"]["mse"] > 0


def test_b_decs_start_is_the_mean_of_a_sample_from_every_part_not_the_first_rows(tmp_path):
    """With more training rows than its limit, data_mean took the first rows in storage order: in a
    dataset sorted by label, one class's tokens. Now a seeded uniform sample, the rows of every part;
    at or under the limit, every row, as before."""
    extraction = extraction_of(tmp_path / "x")
    labelled(extraction, "layer_1")
    arrays, split = tensors(extraction, "layer_1"), split_tokens(extraction, 0.2, seed=0)
    rows = np.array(sorted(global_rows(extraction, split.train))) + 1.0  # column 0 of each training row
    limit = len(rows) // 4
    sampled = data_mean(arrays, split.train, limit=limit, seed=0)[0].item()
    assert abs(sampled - rows.mean()) < 0.25 * rows.std()  # the first quarter's mean is 1.3 std below
    assert data_mean(arrays, split.train, limit=limit, seed=0)[0].item() == sampled
    assert data_mean(arrays, split.train, limit=limit, seed=1)[0].item() != sampled
    assert data_mean(arrays, split.train, limit=len(rows))[0].item() == pytest.approx(rows.mean())
