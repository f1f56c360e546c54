"""Review of the extraction's text path and part records: stored rows, log-probs and top-k against
the model's own forward of each text alone; verify naming a part whose records disagree."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import tiny
from actstore.extract import logprobs, run_part
from actstore.formats.extract import open_part, verify, write_index
from actstore.io_utils import sha256_file, sha256_tree_file
from actstore.models import load_model

MAX_LEN = 24


def test_left_padding_tokenizer_short_and_max_length_texts_store_each_texts_own_outputs(model_dir, tmp_path,
                                                                                          monkeypatch):
    """A tokenizer saved with padding_side left, texts of 1 token beside texts cut at max_seq_length
    in one batch, log-probs in chunks of 5 tokens: every row is the model's own output of that text
    run alone (no padding, no position shift), as are its log-probs and last-token top-k."""
    model = tmp_path / "llama"
    shutil.copytree(model_dir("llama"), model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": "left"}))
    long_text = " ".join(row["text"] for row in tiny.corpus_rows(3))
    texts = ["a", long_text, "def", long_text[40:], "x y", long_text[:30]]
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    monkeypatch.setattr(logprobs, "LOGPROB_ELEMENTS", 300 * 5)  # vocabulary 300: 5 tokens a chunk
    config = tiny.make_config(tmp_path, model, data, extract={"parts": 1, "batch_size": 6, "layers": [0, 2],
                                                              "max_seq_length": MAX_LEN})
    meta = run_part(config, 0, tmp_path / "part", progress=False)
    part, loaded = open_part(tmp_path / "part"), load_model(model)
    lengths = [len(loaded.preprocessor(text)["input_ids"]) for text in texts]
    assert min(lengths) == 1 and meta["n_truncated_samples"] == sum(n > MAX_LEN for n in lengths) > 0
    for local, text in enumerate(texts):
        ids = torch.tensor([loaded.preprocessor(text)["input_ids"][:MAX_LEN]])  # the text's first tokens, alone
        blocks = {}
        handles = [loaded.blocks[i].register_forward_hook(
            lambda module, args, output, i=i: blocks.__setitem__(i, output[0] if isinstance(output, tuple) else output))
            for i in (0, 2)]
        with torch.inference_mode():
            logits = loaded.model(input_ids=ids).logits[0].float()
        for handle in handles:
            handle.remove()
        assert np.array_equal(part.token_ids(local), ids[0].numpy())
        for i in (0, 2):
            np.testing.assert_allclose(part.activations(f"layer_{i}", local), blocks[i][0].numpy(), rtol=0, atol=1e-5)
        # token t's log-prob of token t under the logits at t - 1; NaN at the first token
        want = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0].numpy()
        got = part.token_logprob(local)
        assert np.isnan(got[0]) and len(got) == len(ids[0])
        np.testing.assert_allclose(got[1:], want, rtol=0, atol=1e-5)
        values, indices = part.topk(local)
        top = torch.topk(logits[-1], len(values))
        np.testing.assert_allclose(values, top.values.numpy(), rtol=0, atol=1e-5)
        assert np.array_equal(indices, top.indices.numpy())


@pytest.fixture(scope="module")
def extraction(model_dir, text_jsonl, tmp_path_factory):
    """A real two-part extraction of the tiny Llama, with its extract.json."""
    out = tmp_path_factory.mktemp("review") / "extract"
    config = tiny.make_config(out.parent, model_dir("llama"), text_jsonl, extract={"parts": 2, "layers": [0]})
    for part in range(2):
        run_part(config, part, out / f"part-{part:04d}", progress=False)
    write_index(out, out / "extract.json")
    assert verify(out) == []
    return out


def rewritten_samples(extraction, tmp_path, change) -> tuple:
    """A copy of the extraction whose part 1 samples.jsonl rows went through `change(rows)`, its
    part.json and extract.json recording the new bytes (as a writer that wrote them would have)."""
    copy = tmp_path / "extract"
    shutil.copytree(extraction, copy)
    part_dir = copy / "part-0001"
    rows = [json.loads(line) for line in (part_dir / "samples.jsonl").read_text().splitlines()]
    change(rows)
    (part_dir / "samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    meta = json.loads((part_dir / "part.json").read_text())
    meta["files"]["samples.jsonl"] = {"bytes": (part_dir / "samples.jsonl").stat().st_size,
                                      "sha256_tree": sha256_tree_file(part_dir / "samples.jsonl")}
    (part_dir / "part.json").write_text(json.dumps(meta))
    index = json.loads((copy / "extract.json").read_text())
    index["parts"][1]["part_json_sha256"] = sha256_file(part_dir / "part.json")
    (copy / "extract.json").write_text(json.dumps(index))
    return copy, part_dir


def test_verify_names_a_samples_line_whose_token_count_is_not_offsets(extraction, tmp_path):
    """The Zarr writer stores each line's num_tokens as seq_len: one that disagrees with offsets.npy
    is named by its line, in the extraction and in the part alone."""
    def recount(rows):
        rows[1]["num_tokens"] += 1
    copy, part_dir = rewritten_samples(extraction, tmp_path, recount)
    for path in (copy, part_dir):
        problems = verify(path)
        assert len(problems) == 1 and f"{part_dir / 'samples.jsonl'}: line 2 says" in problems[0], problems
        assert "tokens" in problems[0]


def test_verify_of_one_part_names_a_repeated_sample_idx(extraction, tmp_path):
    """A part verified alone, its line 3 repeating line 2's sample_idx: named by its line."""
    def repeat(rows):
        rows[2]["sample_idx"] = rows[1]["sample_idx"]
    _, part_dir = rewritten_samples(extraction, tmp_path, repeat)
    start = open_part(part_dir).sample_start
    problems = verify(part_dir)
    assert len(problems) == 1 and f"line 3 says sample_idx {start + 1}" in problems[0], problems
    assert f"say sample_idx {start + 2}" in problems[0]


def test_a_part_json_duration_that_is_not_a_number_is_named_not_a_type_error(extraction, tmp_path):
    """extract.json sums the parts' extraction_duration_seconds: a null there was a bare TypeError out
    of verify (and write_index)."""
    copy = tmp_path / "extract"
    shutil.copytree(extraction, copy)
    part_json = copy / "part-0001" / "part.json"
    part_json.write_text(json.dumps({**json.loads(part_json.read_text()), "extraction_duration_seconds": None}))
    index = json.loads((copy / "extract.json").read_text())
    index["parts"][1]["part_json_sha256"] = sha256_file(part_json)
    (copy / "extract.json").write_text(json.dumps(index))
    problems = verify(copy)
    assert problems and all("extraction_duration_seconds" in p and str(part_json) in p for p in problems), problems


def test_logits_topk_past_the_vocabulary_is_named_before_the_weights_load(model_dir, tmp_path):
    """extract.logits_topk 400 on a 300-token vocabulary failed the first batch's top-k after the
    weights loaded, a bare RuntimeError naming no key; now preflight (and the Snakefile's parse,
    rules/common.smk) names it."""
    from actstore.errors import ConfigError
    from actstore.extract.run import preflight

    data = tmp_path / "texts.jsonl"
    data.write_text(json.dumps({"text": "a short text"}) + "\n")
    config = tiny.make_config(tmp_path, model_dir("llama"), data, extract={"parts": 1, "logits_topk": 400})
    with pytest.raises(ConfigError, match=r"^extract\.logits_topk 400: the model's vocabulary has 300 tokens"):
        preflight(config, 0)
    config["extract"]["logits_topk"] = 300
    preflight(config, 0)
