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
