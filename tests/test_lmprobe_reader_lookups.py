"""The lmprobe reader on real datasets: a prompt counted from the end, one token read alone, an
integer label column, and a key pattern the spec's reader cannot format."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.errors import FormatError
from actstore.formats import lmprobe
from actstore.formats.lmprobe.read import LmprobeDataset

SMALL = {"shard_bytes": 32 * 4 * 12}  # tiny models: dim 32 float32; 3 last-token shards for 30 prompts


def build(extracted, kind: str, tmp_path: Path, **options) -> Path:
    _, extract_dir = extracted(kind)
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, options, progress=False)
    return out


def test_a_negative_prompt_reads_that_prompts_tokens(extracted, tmp_path):
    """A prompt's tokens lie between offsets[prompt] and offsets[prompt + 1]: tokens(-2) read the last
    prompt's and tokens(-1) none, so get(-2, layer, 0) was the last prompt's first token."""
    ds = lmprobe.open_dataset(build(extracted, "llama", tmp_path, storage="full_sequence", **SMALL))
    last = ds.num_prompts - 1
    assert np.array_equal(ds.tokens(-1, 0), ds.tokens(last, 0))
    assert np.array_equal(ds.tokens(-2, 2), ds.tokens(last - 1, 2))
    assert np.array_equal(ds.get(-2, 0, 0), ds.tokens(last - 1, 0)[0])
    named = rf"{re.escape(str(ds.index_path))}: prompt -?\d+ out of range \(30 prompts\)"
    for read in (lambda: ds.get(ds.num_prompts, 0), lambda: ds.tokens(-ds.num_prompts - 1, 0)):
        with pytest.raises(IndexError, match=named):
            read()


def test_one_token_reads_that_token_alone(extracted, tmp_path, monkeypatch):
    """get(prompt, layer, token) read every token of the prompt to return one (num_tokens x dim floats:
    512 MiB for 8k tokens of dim 16384, per call of `actstore locate`)."""
    ds = lmprobe.open_dataset(build(extracted, "llama", tmp_path, storage="full_sequence", **SMALL))
    prompt = int(np.argmax(ds.num_tokens))
    want = ds.tokens(prompt, 0)
    rows_read = []
    rows = LmprobeDataset.rows_at

    def counted(self, layer, shards, *args):
        rows_read.append(len(shards))
        return rows(self, layer, shards, *args)

    monkeypatch.setattr(LmprobeDataset, "rows_at", counted)
    for token in (0, 3, -2):
        assert np.array_equal(ds.get(prompt, 0, token), want[token])
    assert rows_read == [1, 1, 1]


def test_an_integer_label_column_is_the_label(extracted, tmp_path):
    """The spec's label is int32 or string: integer labels were renumbered by rank, so a split whose
    labels are all 1 read as all 0, and labels 1..K as 0..K-1, with no error."""
    root = build(extracted, "gpt2", tmp_path, storage="pooled", **SMALL)
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    ids = table.column("label_id").to_pylist()
    labels = [None if i is None else i + 1 for i in ids[:-1]] + [None]
    table = table.drop(["label_id"])
    table = table.set_column(table.schema.get_field_index("label"), pa.field("label", pa.int32()),
                             pa.array(labels, pa.int32()))
    pq.write_table(table, index)
    ds = lmprobe.open_dataset(root)
    assert ds.labels.tolist() == [-1 if x is None else x for x in labels]
    assert ds.torch_dataset()[0]["label"] == labels[0]


def test_a_key_pattern_with_a_shard_field_is_named(extracted, tmp_path):
    """The spec's reader formats key_pattern with the layer alone: one naming {shard} passed the
    descriptor check, then every read raised a bare KeyError: 'shard' and verify aborted on it."""
    root = build(extracted, "gpt2", tmp_path, storage="pooled", **SMALL)
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    meta = dict(table.schema.metadata)
    tensors = json.loads(meta[b"lmprobe:tensors"])
    tensors["hidden_layers"]["key_pattern"] = "hidden.layer_{layer}.shard_{shard}"
    meta[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    pq.write_table(table.replace_schema_metadata(meta), index)
    with pytest.raises(FormatError, match=r"hidden_layers\.key_pattern is malformed: 'hidden\.layer_\{layer\}"):
        lmprobe.open_dataset(root)
    problems = lmprobe.verify(root, checksums=False)
    assert any("hidden_layers.key_pattern is malformed" in p for p in problems), problems


def test_a_file_pattern_without_a_shard_field_over_several_shards_is_named(extracted, tmp_path):
    """hidden_layers.file_pattern with no {shard} names one file for every shard: each shard's rows were
    read from that one file's (only verify's row count could notice)."""
    root = build(extracted, "gpt2", tmp_path, storage="pooled", **SMALL)
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    meta = dict(table.schema.metadata)
    tensors = json.loads(meta[b"lmprobe:tensors"])
    assert len(tensors["hidden_layers"]["shards"]) > 1
    first = re.sub(r"\{shard[^}]*\}", "00000", tensors["hidden_layers"]["file_pattern"])
    tensors["hidden_layers"]["file_pattern"] = first  # every shard: one file
    meta[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    pq.write_table(table.replace_schema_metadata(meta), index)
    with pytest.raises(FormatError, match=r"hidden_layers\.file_pattern .* has no \{shard\} field for its \d+ shards"):
        lmprobe.open_dataset(root)
