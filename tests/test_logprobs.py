"""What extraction stores for texts is what the model itself computes: token_ids are the tokenizer's
own output (BPE, sentencepiece-like, WordPiece), token log-probs and top-k the model's own full
logits of each row alone, whatever the batch size and the padding it brings."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import tiny
from actstore.errors import ConfigError
from actstore.extract import run_part
from actstore.extract.inputs import length_batches
from actstore.formats.extract import open_part
from actstore.models import load_model

MAX_SEQ = 16
# Unicode a byte-level BPE splits into bytes and a WordPiece/sentencepiece vocabulary maps to unknowns,
# near-empty texts, texts cut at MAX_SEQ; lengths out of order, so batching by length reorders them.
TEXTS = ["héllo wörld — ünïcode ✓ 漢字 🙂", " ", "a", "x " * 200, "The quick brown fox.\n\tTabs and  spaces",
         "Return the number of items in a container.", "😀" * 30, "ok", "Zero-width\u200bjoiner\u00a0nbsp"]


def write_texts(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def sentencepiece_llama(model_dir, out):
    """The tiny Llama with a sentencepiece-style tokenizer (metaspace pieces, <unk>, a BOS on every text)
    in place of its byte-level BPE one."""
    from tokenizers import SentencePieceBPETokenizer
    from transformers import LlamaTokenizerFast

    shutil.copytree(model_dir("llama"), out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).unlink(missing_ok=True)
    pieces = SentencePieceBPETokenizer()
    pieces.train_from_iterator([r["text"] for r in tiny.corpus_rows(400)], vocab_size=300,
                               special_tokens=["<unk>", "<s>", "</s>"])
    LlamaTokenizerFast(tokenizer_object=pieces._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                       add_bos_token=True).save_pretrained(out)
    return out


def extract(tmp_path, model, data, batch_size):
    config = tiny.make_config(tmp_path / f"run-{batch_size}", model, data,
                              extract={"layers": [0], "parts": 1, "batch_size": batch_size, "max_seq_length": MAX_SEQ})
    run_part(config, 0, tmp_path / f"part-{batch_size}", progress=False)
    return open_part(tmp_path / f"part-{batch_size}")


@pytest.mark.parametrize("tokenizer", ["gpt2", "sentencepiece", "bert"])
def test_token_ids_are_the_tokenizers_own(tokenizer, model_dir, tmp_path):
    """Special tokens as the tokenizer adds them (none, a BOS, CLS and SEP), cut on the right at
    max_seq_length with the tokenizer's own truncation, no padding; an empty text is its special tokens."""
    model = sentencepiece_llama(model_dir, tmp_path / "sp") if tokenizer == "sentencepiece" else model_dir(tokenizer)
    texts = TEXTS + ([""] if tokenizer != "gpt2" else [])  # GPT-2 adds no token to an empty text: refused
    part = extract(tmp_path, model, write_texts(tmp_path / "t.jsonl", texts), 4)
    own = AutoTokenizer.from_pretrained(model)
    assert [s["sample_idx"] for s in part.samples] == list(range(len(texts)))
    for local, text in enumerate(texts):
        expected = own(text, truncation=True, max_length=MAX_SEQ)["input_ids"]
        assert part.token_ids(local).tolist() == expected and part.samples[local]["num_tokens"] == len(expected)
    assert part.meta["n_truncated_samples"] == sum(len(own(t)["input_ids"]) > MAX_SEQ for t in texts) > 0
    if tokenizer == "sentencepiece":  # every row begins with its BOS; the BOS-only row has no prediction
        assert all(part.token_ids(i)[0] == own.bos_token_id for i in range(len(texts)))
        assert np.isnan(part.token_logprob(len(texts) - 1)).tolist() == [True]


def causal_model(model_type, model_dir, tmp_path):
    if model_type in tiny.TEXT_KINDS:
        return model_dir(model_type)
    model = tiny.build_family(model_type, tmp_path / model_type)
    if model_type == "gemma2":  # a cap below the logits' size, so that the soft-capping shows
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 2.0}))
    return model


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2", "gemma3_text", "opt", "phi"])
def test_token_logprobs_and_topk_are_the_models_own(model_type, model_dir, tmp_path):
    """log p(token t | tokens < t) at every stored token equals log_softmax of the row's own full logits
    (NaN at the first token), top-k equals torch.topk of its last token's logits, and a batch of 4
    rows of mixed lengths stores what batches of one do, up to float rounding."""
    model = causal_model(model_type, model_dir, tmp_path)
    data = write_texts(tmp_path / "t.jsonl", TEXTS)
    parts = [extract(tmp_path, model, data, batch_size) for batch_size in (1, 4)]
    loaded = load_model(model)
    for local in range(len(TEXTS)):
        ids = torch.from_numpy(parts[0].token_ids(local))
        with torch.inference_mode():
            logits = loaded.model(input_ids=ids[None]).logits[0].float()
        reference = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0].numpy()
        top = torch.topk(logits[-1], parts[0].meta["logits_topk"])
        for part in parts:
            logprob = part.token_logprob(local)
            assert np.isnan(logprob[0]) and not np.isnan(logprob[1:]).any()
            np.testing.assert_allclose(logprob[1:], reference, rtol=1e-5, atol=1e-5)
            values, indices = part.topk(local)
            np.testing.assert_allclose(values, top.values.numpy(), rtol=1e-5, atol=1e-5)
            assert indices.tolist() == top.indices.tolist()
        np.testing.assert_allclose(parts[1].token_logprob(local), parts[0].token_logprob(local), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(parts[1].activations("layer_0", local), parts[0].activations("layer_0", local),
                                   rtol=1e-5, atol=1e-5)


def test_length_batches_take_every_sample_once_longest_first():
    lengths = [5, 9, 1, 9, 3, 7, 7, 2]
    batches = length_batches(lengths, 3)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert batches == [[1, 3, 5], [6, 0, 4], [7, 2]]  # ties keep sample order


def test_longformer_blocks_line_up_with_batches_of_any_width(tmp_path):
    """Longformer pads its inputs to a multiple of attention_window (4) inside its forward: batches are
    padded so too (mask 0), and every row's stored blocks equal its own forward's, at batch size 1 and 4."""
    model = tiny.build_family("longformer", tmp_path / "longformer")
    data = tiny.write_jsonl(tmp_path / "docs.jsonl", 8)
    loaded = load_model(model)
    for batch_size in (1, 4):
        config = tiny.make_config(tmp_path / f"run-{batch_size}", model, data, extract={
            "layers": [0, 2], "parts": 1, "batch_size": batch_size, "max_seq_length": 23})
        run_part(config, 0, tmp_path / f"part-{batch_size}", progress=False)
        part = open_part(tmp_path / f"part-{batch_size}")
        assert {len(part.token_ids(i)) % 4 for i in range(8)} != {0}
        for local in range(8):
            ids = torch.from_numpy(part.token_ids(local))[None]
            with torch.inference_mode():
                hidden = loaded.model(input_ids=ids, output_hidden_states=True).hidden_states
            for layer in (0, 2):
                reference = hidden[layer + 1][0, :ids.shape[1]].numpy()
                np.testing.assert_allclose(part.activations(f"layer_{layer}", local), reference, rtol=1e-5, atol=1e-5)


def test_a_pad_token_past_the_embedding_pads_nothing_it_cannot_embed(model_dir, text_jsonl, tmp_path):
    """A pad token added to the tokenizer only (id 300 of a 300-token embedding) faulted the embedding's
    lookup on every padded batch; padding is masked and never stored, so the part is the one the model's
    own pad id (0) gives, byte for byte."""
    model = tmp_path / "added-pad"
    shutil.copytree(model_dir("llama"), model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    tokenizer.save_pretrained(model)
    assert tokenizer.pad_token_id == 300
    stored = []
    for name, path in (("own", model_dir("llama")), ("added", model)):
        config = tiny.make_config(tmp_path / name, path, text_jsonl, extract={"layers": [0, 2], "parts": 1})
        run_part(config, 0, tmp_path / name / "part", progress=False)
        stored.append({p.name: p.read_bytes() for p in (tmp_path / name / "part").glob("*.npy")})
    assert len(stored[0]) >= 5 and stored[0] == stored[1]


def test_a_text_holding_a_token_the_model_cannot_embed_is_named_before_the_weights_load(model_dir, tmp_path):
    """A token added to the tokenizer only (a tool token, id 300 of a 300-token embedding) faulted the
    embedding's lookup after the weights loaded (IndexError on a CPU, a device assert on a GPU): the
    row holding it is named, as a pre-tokenized id past the vocabulary is."""
    model = tmp_path / "added-token"
    shutil.copytree(model_dir("llama"), model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tokenizer.save_pretrained(model)
    (model / "model.safetensors").unlink()  # refused before any weight is read
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": text}) + "\n" for text in ("plain words", "call <|tool|> now")))
    config = tiny.make_config(tmp_path / "run", model, texts, extract={"layers": [0], "parts": 1})
    with pytest.raises(ConfigError, match=r"dataset row 1: token id 300 is outside the model's vocabulary of 300 "
                                          r"\(a token of the tokenizer past the model's embedding\)"):
        run_part(config, 0, tmp_path / "part", progress=False)
