"""Extraction, review 60: activations the model itself computes as NaN or +-inf (a float16 model past
its range, a damaged weight) are stored as computed, but no longer silently: part.json counts them
(non_finite_count, absent where none), a warning in the rule's log says how many, and inspect sums
them over the parts."""
from __future__ import annotations

import json

import numpy as np
import torch

import tiny
from actstore.extract import run_part
from actstore.formats import extract as extract_format


def nan_bert(model_dir, folder):
    """The tiny BERT with one weight of block 1's output LayerNorm made NaN: block 1's output and
    everything after it hold NaN in that dimension."""
    import transformers as tf

    model = tf.BertModel.from_pretrained(model_dir("bert"))
    with torch.no_grad():
        model.encoder.layer[1].output.LayerNorm.weight[3] = float("nan")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir("bert") / name).is_file():
            (folder / name).write_bytes((model_dir("bert") / name).read_bytes())
    return folder


def test_the_models_own_nan_and_inf_are_counted_and_named(model_dir, text_jsonl, tmp_path, caplog):
    folder = nan_bert(model_dir, tmp_path / "nan-bert")
    config = tiny.make_config(tmp_path, folder, text_jsonl, extract={"parts": 1, "layers": [0, 1, 2]})
    with caplog.at_level("WARNING", logger="actstore.extract.run"):
        meta = run_part(config, 0, tmp_path / "part-0000", progress=False)
    stored = {f: int((~np.isfinite(np.load(tmp_path / "part-0000" / f))).sum())
              for f in ("layer_000.npy", "layer_001.npy", "layer_002.npy")}
    assert stored["layer_000.npy"] == 0 and stored["layer_001.npy"] > 0
    assert meta["non_finite_count"] == sum(stored.values())
    assert json.loads((tmp_path / "part-0000" / "part.json").read_text())["non_finite_count"] == sum(stored.values())
    assert f"part 0: {sum(stored.values())} activations the model computed are NaN or +-inf" in caplog.text
    assert extract_format.verify(tmp_path / "part-0000") == []
    assert extract_format.inspect(tmp_path / "part-0000")["non_finite_count"] == sum(stored.values())
    plain = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"parts": 1})
    assert "non_finite_count" not in run_part(plain, 0, tmp_path / "plain", progress=False)
    assert extract_format.inspect(tmp_path / "plain")["non_finite_count"] == 0


def test_a_part_json_count_that_is_not_a_whole_number_is_refused(model_dir, text_jsonl, tmp_path):
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"parts": 1})
    run_part(config, 0, tmp_path / "part-0000", progress=False)
    meta_path = tmp_path / "part-0000" / "part.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "non_finite_count": "many"}))
    problems = extract_format.verify(tmp_path / "part-0000")
    assert any("non_finite_count" in problem for problem in problems), problems
