"""Review 57 of the extraction's model inputs: tokenizing a part's texts holds bounded host memory."""
from __future__ import annotations

from typing import Any

import numpy as np

import tiny
from actstore.datasets import Sample
from actstore.extract import inputs


class CountingTokenizer:
    """The real tokenizer, recording the characters each call hands it."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, texts: list[str], **kwargs):
        self.calls.append([len(text) for text in texts])
        return self.tokenizer(texts, **kwargs)


def test_tokenize_hands_the_tokenizer_a_bounded_number_of_characters_a_call(tmp_path, monkeypatch):
    """The tokenizer encodes each text whole before cutting it to max_seq_length (~100 B a character),
    and tokenize handed it TOKENIZE_TOKENS // max_seq_length texts a call whatever their length (at
    max_seq_length 16, 65,536 texts): a part of books took tens of GB of host memory to keep 16 tokens
    of each. A call now holds at most TOKENIZE_CHARS characters, or one longer text; the ids and the
    truncation count are each text's own."""
    tokenizer = tiny.train_tokenizer(tmp_path / "tokenizer", causal=True)
    text = " ".join(row["text"] for row in tiny.corpus_rows(40))
    samples = [Sample(i, text[i * 100:]) for i in range(6)] + [Sample(6, text * 3), Sample(7, "short")]
    monkeypatch.setattr(inputs, "TOKENIZE_CHARS", 2 * len(text))
    counting = CountingTokenizer(tokenizer)
    token_ids = inputs.tokenize(counting, samples, 16)
    assert all(sum(call) <= inputs.TOKENIZE_CHARS or len(call) == 1 for call in counting.calls), counting.calls
    assert sum(map(len, counting.calls)) == len(samples)
    for i, sample in enumerate(samples):
        alone = tokenizer(sample.text, truncation=True, max_length=16)["input_ids"]
        np.testing.assert_array_equal(token_ids[i], alone)
    assert token_ids.truncated == 7


def test_bfloat16_topk_is_the_same_whatever_the_batch(model_dir, text_jsonl, tmp_path):
    """bfloat16 logits tie often, and torch.topk leaves tied tokens' order (and which of them make the
    k) to its selection, which changed with the batch a text ran in: the same text stored other
    topk_indices at batch_size 1 than at 32, with the same values (rows whose values the batch's
    matmul rounded otherwise are not compared). Ties now rank by lower token id."""
    from actstore.extract import run_part
    from actstore.formats.extract import open_part

    topk = {}
    for batch_size in (1, 32):
        config = tiny.make_config(tmp_path / f"b{batch_size}", model_dir("llama"), text_jsonl,
                                  model={"torch_dtype": "bfloat16"},
                                  extract={"layers": [0], "parts": 1, "batch_size": batch_size, "logits_topk": 20})
        part_dir = tmp_path / f"b{batch_size}" / "part-0000"
        run_part(config, 0, part_dir, progress=False)
        part = open_part(part_dir)
        topk[batch_size] = [part.topk(local) for local in range(len(part.samples))]
    ties = 0
    for (values_1, indices_1), (values_32, indices_32) in zip(topk[1], topk[32]):
        if values_1.tobytes() != values_32.tobytes():  # the batch's matmul rounded this row's logits otherwise
            continue
        assert indices_1.tolist() == indices_32.tolist()
        ties += len(np.unique(values_1)) < len(values_1)
        order = np.lexsort((indices_1, -values_1))  # by value down, then token id up
        assert (order == np.arange(len(order))).all()
    assert ties  # the test's texts tie in their top-k
