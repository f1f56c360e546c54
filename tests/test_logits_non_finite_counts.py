"""The logits and log-probs a model computes as NaN (or +inf) are counted in part.json
(non_finite_logits_count) and logged, as its NaN activations are: they were stored silently."""
from __future__ import annotations

import json

import numpy as np
import torch

import tiny
from actstore.extract import run_part
from actstore.formats import extract as extract_format
from actstore.models import load_model

from test_extract_xlnet_and_masked_logprobs import phi_with_head_bias


def non_finite_logits(part_dir) -> int:
    """NaN or +inf top-k values, NaN log-probs past each text's first token, as the part stores them."""
    values = np.load(part_dir / "topk_values.npy")
    counted = int((np.isnan(values) | np.isposinf(values)).sum())
    if (part_dir / "token_logprob.npy").is_file():
        n_samples = json.loads((part_dir / "part.json").read_text())["n_samples"]
        counted += int(np.isnan(np.load(part_dir / "token_logprob.npy")).sum()) - n_samples
    return counted


def test_nan_top_k_logits_are_counted_and_logged(text_jsonl, tmp_path, caplog):
    """A head giving NaN for tokens 200 on, token_logprobs false: topk_values.npy held NaN on every row,
    and neither part.json nor the log said so."""
    model = phi_with_head_bias(tmp_path / "model", float("nan"))
    config = tiny.make_config(tmp_path, model, text_jsonl,
                              extract={"parts": 1, "layers": [0], "token_logprobs": False, "logits_topk": 5})
    with caplog.at_level("WARNING", logger="actstore.extract.run"):
        meta = run_part(config, 0, tmp_path / "part-0000", progress=False)
    stored = non_finite_logits(tmp_path / "part-0000")
    assert stored > 0 and meta["non_finite_logits_count"] == stored
    assert "non_finite_count" not in meta  # the activations are finite
    assert f"part 0: {stored} top-k logits or token log-probs the model computed are NaN" in caplog.text
    assert extract_format.verify(tmp_path / "part-0000") == []
    assert extract_format.inspect(tmp_path / "part-0000")["non_finite_logits_count"] == stored


def test_nan_log_probs_after_the_first_batch_are_counted(tmp_path):
    """The first batch's check refuses a model whose logits there hold NaN; a later batch's NaN went to
    token_logprob.npy and topk_values.npy uncounted. Token 7's embedding is NaN, and only the shortest
    text (the last batch: batches run longest first) holds it; the others' log-probs stay finite."""
    model = tiny.build_family("phi", tmp_path / "model")
    loaded = load_model(model)
    with torch.no_grad():
        loaded.model.get_input_embeddings().weight[7] = float("nan")
    loaded.model.save_pretrained(model)
    rows = [{"ids": [5, 6, 8, 9, 10, 11]}, {"ids": [12, 13, 14, 15, 16]}, {"ids": [17, 7, 18]}]
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tiny.make_config(tmp_path, model, data, dataset={"path": str(data), "tokens_field": "ids"},
                              extract={"parts": 1, "layers": [0], "batch_size": 1, "logits_topk": 3})
    meta = run_part(config, 0, tmp_path / "part-0000", progress=False)
    logprobs = np.load(tmp_path / "part-0000" / "token_logprob.npy")
    assert np.isnan(logprobs).sum() > len(rows)  # past the three first tokens
    assert meta["non_finite_logits_count"] == non_finite_logits(tmp_path / "part-0000")
    plain = tiny.make_config(tmp_path, tiny.build_family("phi", tmp_path / "plain-model"), data,
                             dataset={"path": str(data), "tokens_field": "ids"}, extract={"parts": 1, "layers": [0]})
    assert "non_finite_logits_count" not in run_part(plain, 0, tmp_path / "plain", progress=False)


def test_top_k_ranks_minus_zero_and_zero_as_the_tie_they_are():
    """-0.0 == +0.0, yet the monotone bits put +0.0 first whatever the ids: token 5's +0.0 ranked
    above token 3's -0.0, against "ties ranked by lower token id". The values stay the logits' own."""
    from actstore.extract.run import top_tokens

    logits = torch.full((2, 8), -1.0)
    logits[0, 3], logits[0, 5] = -0.0, 0.0
    logits[1, 3], logits[1, 5] = 0.0, -0.0
    values, indices = top_tokens(logits, 2)
    assert indices.tolist() == [[3, 5], [3, 5]]
    assert [[float(v).hex() for v in row] for row in values] == [["-0x0.0p+0", "0x0.0p+0"], ["0x0.0p+0", "-0x0.0p+0"]]
