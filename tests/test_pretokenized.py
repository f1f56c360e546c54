"""Pre-tokenized datasets (dataset.tokens_field), as SAELens' pretokenize and most token-level corpora
ship them: every row's ids run as given, from JSONL and tables alike; bad ids are named."""
from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

import tiny
from actstore.datasets import check_dataset, load_dataset, scan_dataset
from actstore.errors import ConfigError
from actstore.extract import run_part
from actstore.formats.extract import open_extraction, write_index
from actstore.models import load_model

LENGTHS = [5, 40, 12, 24, 31, 3, 17, 26, 9, 24, 50, 2]  # rows past extract.max_seq_length (24) are cut
MAX_SEQ = 24


def token_rows(model) -> list[dict]:
    """Rows of ids cut from the stdlib corpus tokenized end to end, each document with its BOS, as
    pretokenizers concatenate documents; labels alternate."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    stream = itertools.chain.from_iterable(tokenizer(row["text"])["input_ids"] for row in tiny.corpus_rows(40))
    return [{"input_ids": list(itertools.islice(stream, n)), "label": ["even", "odd"][i % 2]}
            for i, n in enumerate(LENGTHS)]


def write_store(kind: str, rows: list[dict], tmp_path):
    """The rows as a JSONL file, Parquet shards (list<int32>, as the Hub's Sequence(int32)) or a
    save_to_disk folder (large_list<int64>)."""
    if kind == "jsonl":
        path = tmp_path / "ids.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    ids_type = pa.list_(pa.int32()) if kind == "parquet" else pa.large_list(pa.int64())
    table = pa.table({"input_ids": pa.array([r["input_ids"] for r in rows], ids_type),
                      "label": [r["label"] for r in rows]})
    if kind == "parquet":
        return tiny.write_parquet(tmp_path / "ids", table, shards=2, row_group_size=4)
    return tiny.write_hf_disk(tmp_path / "ids", {"train": table}, {})


def extracted_files(config, out) -> list[dict[str, bytes]]:
    for part in range(config["extract"]["parts"]):
        run_part(config, part, out / f"part-{part:04d}", progress=False)
    write_index(out, out / "extract.json")
    return [{p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "part.json"}
            for d in sorted(out.glob("part-*"))]


def test_token_ids_run_as_given_and_store_the_models_own_outputs(model_dir, tmp_path):
    model = model_dir("llama")
    rows = token_rows(model)
    config = tiny.make_config(tmp_path, model, write_store("jsonl", rows, tmp_path),
                              dataset={"tokens_field": "input_ids"}, extract={"layers": [0, 1]})
    check_dataset(config["dataset"])
    out = tmp_path / "extract"
    extracted_files(config, out)
    loaded, tokenizer = load_model(model), AutoTokenizer.from_pretrained(model)
    extraction = open_extraction(out)
    assert extraction.n_samples == len(rows)
    assert sum(part.meta["n_truncated_samples"] for part in extraction.parts) == sum(n > MAX_SEQ for n in LENGTHS) > 0
    for part, local, row in extraction.iter_samples():
        given = rows[row["sample_idx"]]["input_ids"][:MAX_SEQ]
        assert part.token_ids(local).tolist() == given  # no BOS added, cut like the tokenizer's truncation
        assert row["text"] == tokenizer.decode(given) and row["num_tokens"] == len(given)
        assert row["label"] == rows[row["sample_idx"]]["label"] and row["metadata"] == {}
        with torch.inference_mode():
            hidden = loaded.model(input_ids=torch.tensor([given]), output_hidden_states=True).hidden_states
        for layer in (0, 1):  # layer i = the output of block i = hidden_states[i + 1] (the last is normed)
            reference = hidden[layer + 1][0].numpy()
            stored = part.activations(f"layer_{layer}", local)
            assert np.abs(stored - reference).max() <= 1e-5 * np.abs(reference).max()


def test_the_tokenizers_own_ids_extract_the_bytes_of_the_texts(model_dir, text_jsonl, tmp_path):
    """A corpus pre-tokenized with the model's tokenizer stores what the texts store: the same token
    ids, activations and log-probs, bit for bit (samples.jsonl differs: decoded text, no metadata)."""
    model = model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [json.loads(line) for line in text_jsonl.read_text().splitlines()]
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": tokenizer(row["text"], truncation=True, max_length=MAX_SEQ)
                                       ["input_ids"], "label": row["label"]}) + "\n" for row in texts))
    stored = [extracted_files(tiny.make_config(tmp_path / name, model, path, dataset=dataset), tmp_path / name)
              for name, path, dataset in (("text", text_jsonl, {}), ("ids", ids, {"tokens_field": "input_ids"}))]
    for text_part, ids_part in zip(*stored):
        assert {*text_part} == {*ids_part} and len(text_part) > 5
        assert {k: v for k, v in text_part.items() if k != "samples.jsonl"} == \
            {k: v for k, v in ids_part.items() if k != "samples.jsonl"}


@pytest.mark.parametrize("kind", ["parquet", "hf_disk"])
def test_table_token_ids_extract_the_jsonl_bytes(kind, model_dir, tmp_path):
    model = model_dir("llama")
    rows = token_rows(model)
    stored = []
    for store in ("jsonl", kind):
        config = tiny.make_config(tmp_path / store, model, write_store(store, rows, tmp_path),
                                  dataset={"tokens_field": "input_ids"})
        stored.append(extracted_files(config, tmp_path / store / "extract"))
    assert stored[0] == stored[1]


def test_fixed_size_lists_and_parts_read_the_rows_they_hold(tmp_path):
    ids = np.arange(6 * 8, dtype=np.int16).reshape(6, 8)
    path = tiny.write_arrow_stream(tmp_path / "ids.arrow", pa.table({
        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), 8), "n": range(6)}), batch_rows=4)
    whole = load_dataset(path, tokens_field="tokens", keep_fields=["n"])
    assert whole.pretokenized and [s.text for s in whole.samples] == [""] * 6  # decoded when extracted
    assert [s.tokens.tolist() for s in whole.samples] == ids.tolist()
    assert all(s.tokens.dtype == np.int64 and s.metadata == {"n": s.sample_idx} for s in whole.samples)
    part = load_dataset(path, tokens_field="tokens", parts=(2, 1))
    assert [s.sample_idx for s in part.samples] == [3, 4, 5] and part.samples[0].tokens.tolist() == ids[3].tolist()


@pytest.mark.parametrize("value, shown", [
    ("12 7 3", '"12 7 3"'), ([], "[]"), ([4, -1], "[4, -1]"), ([4, True], "[4, true]"), ([4, 2.0], "[4, 2.0]"),
    (None, "null")])
def test_a_jsonl_row_that_is_not_token_ids_is_named_by_the_scan(value, shown, tmp_path):
    path = tmp_path / "ids.jsonl"
    row = {"label": 1} if value is None else {"input_ids": value}
    path.write_text(json.dumps({"input_ids": [1, 2]}) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError) as error:
        scan_dataset(path, tokens_field="input_ids")
    assert str(error.value) == (f"{path}:3: field 'input_ids' (dataset.tokens_field) must be a non-empty list of "
                                f"token ids, whole numbers from 0, got {shown}")


@pytest.mark.parametrize("values, ids_type, message", [
    ([[1, 2], None], pa.list_(pa.int64()), "train-00000-of-00001.parquet#1, column 'input_ids': null where "
                                           "a prompt is needed"),
    ([[1, 2], [3, None]], pa.list_(pa.int64()), "#1, column 'input_ids' (dataset.tokens_field): a null token id"),
    ([[1, 2], []], pa.list_(pa.int64()), "#1, column 'input_ids' (dataset.tokens_field): no token ids"),
    ([[1, -7]], pa.list_(pa.int8()), "#0, column 'input_ids' (dataset.tokens_field): token id -7 is not a whole "
                                     "number from 0"),
    ([[1, 2**64 - 1]], pa.list_(pa.uint64()), f"token id {2**64 - 1} is not a whole number from 0"),
    ([["1", "2"]], pa.list_(pa.string()), "column 'input_ids' (dataset.tokens_field) is list<element: string>, "
                                          "expected a list of integers (token ids)")])
def test_a_table_row_that_is_not_token_ids_is_named(values, ids_type, message, tmp_path):
    path = tiny.write_parquet(tmp_path / "ids", pa.table({"input_ids": pa.array(values, ids_type)}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_dataset(path, tokens_field="input_ids")


def test_an_id_past_the_vocabulary_is_named_before_the_weights_load(model_dir, tmp_path, monkeypatch):
    import actstore.extract.run as run

    model = model_dir("llama")
    rows = token_rows(model)
    vocab = load_model(model).model.get_input_embeddings().num_embeddings
    rows[7]["input_ids"][3] = vocab
    config = tiny.make_config(tmp_path, model, write_store("jsonl", rows, tmp_path),
                              dataset={"tokens_field": "input_ids"}, extract={"parts": 1})
    monkeypatch.setattr(run, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(ConfigError, match=f"dataset row 7: token id {vocab} is outside the model's vocabulary "
                                          f"of {vocab} \\(dataset.tokens_field\\)"):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    assert not (tmp_path / "part-0000").exists()


def test_token_ids_read_as_text_point_to_tokens_field(tmp_path):
    path = tiny.write_parquet(tmp_path / "ids", pa.table({"attention_mask": [[1, 1], [1]], "input_ids": [[1, 2], [3]]}))
    with pytest.raises(ConfigError, match=re.escape("no column 'text' (dataset.text_field); columns: attention_mask, "
                                                    "input_ids (token ids in 'input_ids': set dataset.tokens_field)")):
        check_dataset({"path": str(path)})
    lines = tmp_path / "ids.jsonl"
    lines.write_text(json.dumps({"tokens": [5, 6]}) + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"{lines}:1: line has no string field 'text' (token ids in "
                                                    f"'tokens': set dataset.tokens_field)")):
        scan_dataset(lines)


def test_token_ids_with_messages_images_or_csv_are_refused_at_parse_time(image_folder, tmp_path):
    lines = tmp_path / "ids.jsonl"
    lines.write_text(json.dumps({"input_ids": [1, 2], "messages": []}) + "\n")
    csv = tmp_path / "ids.csv"
    csv.write_text("input_ids\n1 2\n")
    cases = [({"path": str(lines), "messages_field": "messages"},
              "dataset.tokens_field: a row's token ids are its whole input; unset dataset.messages_field"),
             ({"path": str(image_folder)}, f"dataset.tokens_field: {image_folder} is image folder, which holds images"),
             ({"path": str(csv)}, f"{csv}: column 'input_ids' (dataset.tokens_field) is string, expected a list of integers")]
    for section, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_dataset({**section, "tokens_field": "input_ids"})


def test_the_scan_reads_no_token_ids_where_the_footer_counts_no_null(tmp_path, monkeypatch):
    """A pre-tokenized corpus in Parquet is most of its bytes in the ids column: the scan's null
    check takes the row groups' null counts of its one leaf column (ids.list.element), which count
    null and empty lists too, and reads only a row group that has some."""
    import pyarrow.parquet as pq

    values = [[i, i + 1] for i in range(40)]
    values[33] = []
    path = tiny.write_parquet(tmp_path / "ids", pa.table({"input_ids": values}), row_group_size=8)
    read = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, **k: read.append(i) or original(self, i, **k))
    message = re.escape("train-00000-of-00001.parquet#33, column 'input_ids' (dataset.tokens_field): no token ids")
    with pytest.raises(ConfigError, match=message):  # named by the scan, as its part's job names it
        scan_dataset(path, tokens_field="input_ids")
    assert read == [4]  # rows 32-39 alone: the footer counts the empty list as a null
    with pytest.raises(ConfigError, match=message):
        load_dataset(path, tokens_field="input_ids", parts=(2, 1))
