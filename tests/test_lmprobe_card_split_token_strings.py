"""lmprobe writer and verify, review 57: the dataset card's split, token strings of ids the tokenizer
lacks, sample fields named as columns the dataset lacks, and verify(checksums=False) on names it trusts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import tiny
from actstore.formats import lmprobe
from test_lmprobe_verify_addressing import rewrite_index

POOLED = {"storage": "pooled", "token_strings": False}


@pytest.mark.parametrize("split", ["train", "yes", "1", "null", "a: b", "x #y"])
def test_the_card_reads_back_the_split_the_dataset_records(extracted, tmp_path, split):
    """The split was written into the card's YAML as it is: huggingface_hub's card parser (and
    `datasets`, reading configs:) read `yes` as True, `1` as 1, `null` as None, `x #y` as `x`,
    and failed on `a: b`. A plain name is written as before."""
    from huggingface_hub import DatasetCard

    _, extract_dir = extracted("gpt2", dataset={"split": split})
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, POOLED, progress=False)
    card = DatasetCard.load(out / "README.md").data.to_dict()
    assert card["configs"] == [{"config_name": "default",
                                "data_files": [{"split": split, "path": "index/train-00000-of-00001.parquet"}]}]
    assert lmprobe.read_info(lmprobe.find_index(out))["dataset"]["split"] == split
    if split == "train":  # the bytes written before
        assert (out / "README.md").read_text().startswith(
            "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
            "    path: index/train-00000-of-00001.parquet\n---\n# lmprobe 2.0 activations of ")


def test_a_field_named_as_a_column_the_dataset_lacks_is_not_stored_in_its_place(extracted, tmp_path):
    """An encoder's pooled dataset without token strings has no token_strings, perplexity, token_shard_ids
    or logits columns: a sample field of one of those names was stored under it, and lmprobe readers
    (and verify, which passed it) took the user's values for the spec's column."""
    rows = [json.loads(line) for line in tiny.write_jsonl(tmp_path / "docs.jsonl", 4).read_text().splitlines()]
    fields = {"token_strings": ["user", "tags"], "perplexity_mean": 5.0, "token_shard_ids": [9],
              "shard_index_logits": 3, "token_logprob": [0.5]}
    data = tmp_path / "fields.jsonl"
    data.write_text("".join(json.dumps({**row, **fields}) + "\n" for row in rows))
    _, extract_dir = extracted("bert", data=data)
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, POOLED, progress=False)
    table = pq.read_table(lmprobe.find_index(out))
    assert not set(fields) & set(table.column_names)
    row = table.slice(0, 1).to_pylist()[0]
    assert {key: row[f"meta_{key}"] for key in fields} == fields
    assert lmprobe.verify(out) == []


def write_with_padded_vocabulary(tmp_path: Path, model: Path, extra: int) -> Path:
    """A copy of tiny gpt2 whose embedding has `extra` rows past its tokenizer's vocabulary, as many
    released models pad theirs (Pythia, Qwen2.5, Phi-2)."""
    import transformers as tf

    padded = tmp_path / "padded-gpt2"
    shutil.copytree(model, padded)
    net = tf.GPT2LMHeadModel.from_pretrained(padded)
    net.resize_token_embeddings(net.config.vocab_size + extra, mean_resizing=False)
    net.save_pretrained(padded)
    return padded


def test_token_strings_of_ids_the_tokenizer_lacks_are_null_not_empty(model_dir, tmp_path):
    """Pre-tokenized ids up to the model's vocab_size run, and ids past the tokenizer's vocabulary
    decoded as "": a token_strings entry indistinguishable from a token that decodes to nothing."""
    from transformers import AutoTokenizer

    from actstore.extract import run_part
    from actstore.formats.extract import write_index
    from actstore.hashing import stage_dir

    model = write_with_padded_vocabulary(tmp_path, model_dir("gpt2"), 10)
    tokenizer = AutoTokenizer.from_pretrained(model)
    past = len(tokenizer)  # the model's vocab_size is past + 10
    rows = [{"input_ids": [5, 6, past, 7, past + 9], "label": "a"}, {"input_ids": [8, 9], "label": "b"}]
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tiny.make_config(tmp_path, model, data, dataset={"tokens_field": "input_ids"}, extract={"parts": 1})
    extract_dir = stage_dir(config, "extract")
    run_part(config, 0, extract_dir / "part-0000", progress=False)
    write_index(extract_dir, extract_dir / "extract.json")
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, {"storage": "pooled", "prompt_ordering": "original"}, progress=False)
    table = pq.read_table(lmprobe.find_index(out), columns=["token_ids", "token_strings"]).to_pylist()
    assert table[0]["token_ids"] == rows[0]["input_ids"]
    assert table[0]["token_strings"] == [tokenizer.decode([5]), tokenizer.decode([6]), None,
                                         tokenizer.decode([7]), None]
    assert table[1]["token_strings"] == [tokenizer.decode([8]), tokenizer.decode([9])]


def add_listed_file(root: Path, rel: str) -> None:
    """`rel` listed in lmprobe:files and SHA256SUMS alike (the index's digest rewritten as a writer
    would), no such file in the dataset."""
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    metadata = dict(table.schema.metadata)
    files = json.loads(metadata[b"lmprobe:files"])
    files[rel] = {"bytes": 10, "sha256": "0" * 64}
    metadata[b"lmprobe:files"] = json.dumps(files).encode()
    rewrite_index(root, table.replace_schema_metadata(metadata))
    sums = root / "SHA256SUMS"
    sums.write_text(sums.read_text() + f"{'0' * 64}  {rel}\n")


@pytest.mark.parametrize("rel, problem", [
    ("tensors/extra.safetensors", "{root}/tensors/extra.safetensors: missing (listed in SHA256SUMS)"),
    ("../elsewhere/README.md", "{root}/SHA256SUMS: '../elsewhere/README.md' is not a relative path inside {root}")])
def test_verify_without_checksums_names_a_trusted_file_missing_or_outside(extracted, tmp_path, rel, problem):
    """verify(checksums=False) took a SHA256SUMS line whose file lmprobe:files lists on its digest alone:
    a file no descriptor names (so no size or header check) passed missing, or named outside the dataset,
    where verify with checksums named both."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, POOLED, progress=False)
    add_listed_file(root, rel)
    expected = problem.format(root=root)
    assert expected in lmprobe.verify(root)
    problems = lmprobe.verify(root, checksums=False)  # also named as lmprobe:files lists it
    assert expected in problems and all(rel.lstrip("./") in problem for problem in problems), problems


def test_a_fifo_in_the_index_place_is_named_not_waited_on(extracted, tmp_path):
    """find_index took any index/*.parquet entry: a FIFO there was opened by pyarrow, which waited for
    a writer forever, and verify, detect and inspect hung. (find_index is asked first: before the fix
    it returned the FIFO, where the calls after it would hang.)"""
    import os

    from actstore.errors import FormatError

    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, POOLED, progress=False)
    index = lmprobe.find_index(root)
    index.unlink()
    os.mkfifo(index)
    with pytest.raises(FormatError, match="no index/\\*.parquet"):
        lmprobe.find_index(root)
    assert lmprobe.verify(root) == [f"{index}: missing (listed in SHA256SUMS)",
                                    f"{root}: no index/*.parquet; not an lmprobe dataset"]
    assert not lmprobe.detect(root)


@pytest.mark.parametrize("number, text", [(1, "1"), (2.5, "2.5")])
def test_labels_stored_as_one_text_are_refused_before_any_file(extracted, tmp_path, number, text):
    """A JSONL dataset's labels 1 and "1" are two classes (two label_ids), but lmprobe's string label
    column stored both as "1" (booleans mix with nothing): refused when the dataset is planned, naming both, before any file."""
    from actstore.errors import ConfigError

    rows = [json.loads(line) for line in tiny.write_jsonl(tmp_path / "docs.jsonl", 4).read_text().splitlines()]
    data = tmp_path / "labels.jsonl"
    labels = [number, text, "other", number]
    data.write_text("".join(json.dumps({**row, "label": label}) + "\n" for row, label in zip(rows, labels)))
    _, extract_dir = extracted("bert", data=data, lmprobe={"enabled": False})  # else refused by the extraction
    out = tmp_path / "ds"
    with pytest.raises(ConfigError, match=rf"labels .* and .* would both be stored as label '{text}'"):
        lmprobe.write_dataset(extract_dir, out, POOLED, progress=False)
    assert not out.exists()
