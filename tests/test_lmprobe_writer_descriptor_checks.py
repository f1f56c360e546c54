"""lmprobe writer and verify, review 56: datasets the project's own writer built, damaged where only
verify's checks of the descriptor could notice, must be named by it."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from actstore.errors import FormatError
from actstore.formats import lmprobe
from test_lmprobe_verify_addressing import rewrite_index

FULL = {"storage": "full_sequence", "shard_bytes": 32 * 4 * 12}  # dim 32 float32: 3 last-token shards


def build(extracted, tmp_path: Path, options: dict) -> Path:
    _, extract_dir = extracted("gpt2")
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, options, progress=False)
    return out


def rewrite_hidden(root: Path, **values) -> Path:
    """Set lmprobe:tensors.hidden_layers `values` in the index, and its digest in SHA256SUMS, as a
    writer of that index would: what is left to notice them is verify's descriptor checks."""
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    metadata = dict(table.schema.metadata)
    tensors = json.loads(metadata[b"lmprobe:tensors"])
    tensors["hidden_layers"].update(values)
    metadata[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    return rewrite_index(root, table.replace_schema_metadata(metadata))


@pytest.mark.parametrize("options, key, value, allowed", [
    (FULL, "storage", "Full_sequence", ["pooled", "full_sequence"]),  # read as pooled: sequence shards unchecked
    ({"storage": "pooled"}, "storage", "sequence", ["pooled", "full_sequence"]),
    ({"storage": "pooled"}, "pooling", "mean", ["last_token"]),  # read as each prompt's last-token vector
    ({"storage": "pooled"}, "layout", "per_shard", ["per_layer"]),
])
def test_a_hidden_descriptor_value_no_reader_takes_is_named_by_verify(extracted, tmp_path, options, key, value,
                                                                       allowed):
    """Any hidden_layers.storage but full_sequence verified, and was read, as pooled; a pooling or
    layout other than the spec's only one verified, its vectors read as last-token per-layer rows."""
    root = build(extracted, tmp_path, options)
    assert lmprobe.verify(root) == []
    index = rewrite_hidden(root, **{key: value})
    assert lmprobe.verify(root) == [f"{index}: lmprobe:tensors.hidden_layers.{key} is {value!r}, not one of {allowed}"]


@pytest.mark.parametrize("fields", [("num_tokens", "meta_num_tokens"), ("meta_num_tokens", "num_tokens")])
def test_a_field_and_its_meta_name_are_refused_not_one_dropped(extracted, tmp_path, fields):
    """A field named as a column is stored as meta_<name>: with a field meta_<name> too, the later of
    the two replaced the other's column, and the index held one field's values under that name."""
    import tiny

    rows = [json.loads(line) for line in tiny.write_jsonl(tmp_path / "docs.jsonl", 4).read_text().splitlines()]
    for i, row in enumerate(rows):
        row.update({fields[0]: 100 + i, fields[1]: -i})
    data = tmp_path / "clash.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _, extract_dir = extracted("gpt2", data=data)
    with pytest.raises(FormatError, match=r"sample metadata fields '(meta_)?num_tokens' and '(meta_)?num_tokens' "
                                          r"would both be index column 'meta_num_tokens'"):
        lmprobe.write_dataset(extract_dir, tmp_path / "ds", {"storage": "pooled"}, progress=False)
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("labels, column, stored", [
    ([0, 1, 1, 0], "int32", [0, 1, 1, 0]),  # class ids: the spec's int32 label
    ([1, "a", 2.5, None], "string", ["1", "a", "2.5", None]),  # a number among names: its JSON text
])
def test_number_labels_are_stored_not_a_crash_of_the_finishing_job(extracted, tmp_path, labels, column, stored):
    """A JSONL or table of integer class labels (the commonest probing set) crashed the index job,
    after every tensor file was written, with a bare `ArrowTypeError: Expected bytes, got a 'int'
    object`: the label column was always string. Integer labels are the spec's int32 column."""
    import tiny

    rows = [json.loads(line) for line in tiny.write_jsonl(tmp_path / "docs.jsonl", 4).read_text().splitlines()]
    for row, label in zip(rows, labels):
        row["label"] = label
    data = tmp_path / "labels.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _, extract_dir = extracted("gpt2", data=data)
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, {"storage": "pooled", "prompt_ordering": "original"}, progress=False)
    table = pq.read_table(lmprobe.find_index(root))
    assert str(table.schema.field("label").type) == column and table.column("label").to_pylist() == stored
    assert lmprobe.verify(root) == []
    ds = lmprobe.open_dataset(root)
    names = json.loads(table.schema.metadata[b"lmprobe:dataset"])["labels"]
    assert [names[i] if i >= 0 else None for i in ds.labels] == labels
