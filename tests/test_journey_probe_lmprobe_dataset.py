"""Review 65, journey G: a probing researcher reads an lmprobe 2.0 dataset as the spec says and checks it
against the model's own hidden states, the dataset's rows and labels (docs/formats/lmprobe.md)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

import tiny
from actstore.extract import run_part
from actstore.formats import lmprobe
from actstore.formats.extract import write_index
from actstore.formats.lmprobe.read import open_dataset
from actstore.hashing import stage_dir

MAX_LEN = 32
INDEX = "index/train-00000-of-00001.parquet"
WORDS = {"pos": ["great", "wonderful", "loved it", "superb acting"], "neg": ["terrible", "boring", "hated it", "dull"]}


def review_rows() -> list[dict]:
    """16 sentiment-like reviews, string labels, a train/test split field; lengths from 1 token to
    well past MAX_LEN, so some are truncated."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(16):
        label = ("pos", "neg")[i % 3 == 0]
        words = [WORDS[label][j] for j in rng.integers(0, 4, size=1 + (i * 5) % 9)]
        rows.append({"text": "The film was " + ", ".join(words) + ".", "label": label,
                     "split": "train" if i < 12 else "test"})
    rows[5]["text"] = "ok"  # 2 tokens: the shortest
    return rows


@pytest.fixture(scope="module")
def journey(tmp_path_factory, model_dir):
    """A tiny Llama's extraction (2 parts, batches of 4: padded) of the reviews, written as a bfloat16
    full_sequence dataset with top-k logits and as a pooled dataset in original order."""
    tmp = tmp_path_factory.mktemp("journey-probe")
    rows = review_rows()
    data = tmp / "reviews.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = model_dir("llama")
    config = tiny.make_config(tmp, model, data, extract={"layers": [0, 1, 2], "max_seq_length": MAX_LEN,
                                                          "batch_size": 4, "parts": 2})
    out = stage_dir(config, "extract")
    for part in range(2):
        run_part(config, part, out / f"part-{part:04d}", progress=False)
    write_index(out, out / "extract.json")
    full = tmp / "bf16"
    lmprobe.write_dataset(out, full, {"storage": "full_sequence", "dtype": "bfloat16", "logits_topk": 5,
                                      "layers": [0, 2], "shard_bytes": 64 * 5}, progress=False)
    pooled = tmp / "pooled"
    lmprobe.write_dataset(out, pooled, {"storage": "pooled", "prompt_ordering": "original"}, progress=False)
    return {"rows": rows, "model": model, "full": full, "pooled": pooled}


def spec_index(root: Path):
    """The index as a DataFrame and its `lmprobe:` metadata, read as the spec's snippet reads them."""
    table = pq.read_table(root / INDEX)
    info = {k.decode().removeprefix("lmprobe:"): json.loads(v)
            for k, v in table.schema.metadata.items() if k.decode().startswith("lmprobe:")}
    return table.to_pandas(), info


def spec_row(root: Path, hidden: dict, layer: int, shard: int, offset: int) -> torch.Tensor:
    with safe_open(root / hidden["file_pattern"].format(layer=layer, shard=shard), framework="pt") as f:
        return f.get_tensor(hidden["key_pattern"].format(layer=layer))[offset]


def block_outputs(model_path: Path, text: str, layers: list[int]) -> tuple[list[int], dict[int, torch.Tensor]]:
    """The text alone through the model: its token ids (truncated at MAX_LEN) and each block's output,
    checked equal to output_hidden_states[i + 1] below the last block (whose hidden state has the norm)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    ids = tok(text, return_tensors="pt", truncation=True, max_length=MAX_LEN).input_ids
    caught = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda mod, args, out, i=i: caught.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0]))
        for i in layers]
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    for hook in hooks:
        hook.remove()
    for i in layers:
        if i < len(model.model.layers) - 1:
            assert torch.equal(states[i + 1][0], caught[i])
    return ids[0].tolist(), caught


def test_bf16_tokens_equal_model_hidden_states_bitwise(journey):
    """Every token of every prompt (shortest and longest included), read through token_shard_ids, and
    the last-token vector through shard_index/row_offset, is the model's own block output rounded to
    bfloat16, bit for bit; the docs' numpy recipe for BF16 and the reader give the same floats."""
    root = journey["full"]
    df, info = spec_index(root)
    hidden = info["tensors"]["hidden_layers"]
    assert hidden["dtype"] == "bfloat16" and hidden["layers"] == [0, 2]
    assert (int(df.num_tokens.min()), int(df.num_tokens.max())) == (2, MAX_LEN)
    reader = open_dataset(root)
    for prompt, row in enumerate(df.itertuples()):
        ids, blocks = block_outputs(journey["model"], row.text, hidden["layers"])
        assert list(row.token_ids) == ids and row.num_tokens == len(ids)
        for layer in hidden["layers"]:
            seq = torch.stack([spec_row(root, hidden, layer, s, o)
                               for s, o in zip(row.token_shard_ids, row.token_shard_offsets)])
            assert seq.dtype == torch.bfloat16
            assert torch.equal(seq.view(torch.int16), blocks[layer].to(torch.bfloat16).view(torch.int16))
            last = spec_row(root, hidden, layer, row.shard_index, row.row_offset)
            assert torch.equal(last.view(torch.int16), seq[-1].view(torch.int16))
            u16 = seq.view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal((u16.astype(np.uint32) << 16).view(np.float32), reader.tokens(prompt, layer))


def test_rows_labels_split_and_tokens_line_up_with_the_dataset(journey):
    """Index row r is dataset row permutation[r] (seed recorded): its text, label, label_id and split
    field are that row's; the sequence shards hold exactly the prompts' tokens (no padding row)."""
    df, info = spec_index(journey["full"])
    rows = journey["rows"]
    assert info["num_prompts"] == len(df) == len(rows)
    order = np.random.default_rng(info["prompt_ordering_seed"]).permutation(len(rows))
    assert info["prompt_ordering"] == "random" and list(df.sample_idx) == order.tolist()
    assert info["dataset"]["labels"] == ["neg", "pos"]
    for row in df.itertuples():
        source = rows[row.sample_idx]
        assert (row.text, row.label, row.split) == (source["text"], source["label"], source["split"])
        assert info["dataset"]["labels"][row.label_id] == source["label"]
    hidden = info["tensors"]["hidden_layers"]
    sequence = hidden["shards"][hidden["last_token_shards"]:]
    assert sum(s["num_tokens"] for s in sequence) == int(df.num_tokens.sum())
    assert np.array_equal(open_dataset(journey["full"]).labels, df.label_id.to_numpy())


def test_pooled_original_order_agrees_with_the_random_order_dataset(journey):
    """The pooled float32 dataset in original order (row = sample_idx): the reader's last-token fast path
    equals the spec's addressing, its labels are the dataset's, and each vector rounded to bfloat16 is
    the bfloat16 full_sequence dataset's last-token vector of the same sample_idx."""
    root = journey["pooled"]
    df, info = spec_index(root)
    hidden = info["tensors"]["hidden_layers"]
    assert (hidden["storage"], hidden["pooling"], hidden["dtype"]) == ("pooled", "last_token", "float32")
    features = np.stack([spec_row(root, hidden, 2, s, o).numpy() for s, o in zip(df.shard_index, df.row_offset)])
    reader = open_dataset(root)
    assert np.array_equal(features, reader.last_tokens(2))
    assert list(df.sample_idx) == list(range(len(df)))
    assert reader.labels.tolist() == [int(r["label"] == "pos") for r in journey["rows"]]
    full, full_info = spec_index(journey["full"])
    full_hidden = full_info["tensors"]["hidden_layers"]
    for row in full.itertuples():
        last = spec_row(journey["full"], full_hidden, 2, row.shard_index, row.row_offset)
        pooled = torch.from_numpy(features[row.sample_idx]).to(torch.bfloat16)
        assert torch.equal(last.view(torch.int16), pooled.view(torch.int16))


def test_truncated_prompts_are_recorded_in_the_dataset(journey):
    """Each prompt the tokenizer cut at MAX_LEN is flagged in the index column `truncated` (the others
    false), counted in lmprobe:dataset, and holds MAX_LEN tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(journey["model"])
    df, info = spec_index(journey["full"])
    cut = [len(tok(text).input_ids) > MAX_LEN for text in df.text]
    assert any(cut) and not all(cut)
    assert df.truncated.tolist() == cut and info["dataset"]["n_truncated_samples"] == sum(cut)
    assert info["dataset"]["max_seq_length"] == MAX_LEN and set(df.num_tokens[df.truncated]) == {MAX_LEN}


def test_card_of_original_order_names_no_python_none(journey):
    """The card of an original-order dataset (no seed) printed "(seed None)", a Python repr."""
    card = (journey["pooled"] / "README.md").read_text()
    assert "prompt ordering `original`" in card and "None" not in card
