"""lmprobe writer and verify, review 59: a label column naming one class two ways, a top-k shard's
`file` other than its pattern's, and a layer stored twice."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

import tiny
from actstore.errors import ConfigError
from actstore.formats import lmprobe
from test_lmprobe_verify_addressing import rewrite_index

POOLED = {"storage": "pooled", "prompt_ordering": "original", "token_strings": False}


def test_a_class_read_two_ways_is_stored_as_one_label(extracted, tmp_path):
    """JSONL labels 1 and 1.0 are one class to the extraction (dataset.labels [1, ...], one label_id),
    but a string label column stored each row's own text, "1" and "1.0": lmprobe's label readers (the
    `label` column) saw two classes, and verify passed. Each row now stores its class's label."""
    rows = [json.loads(line) for line in tiny.write_jsonl(tmp_path / "docs.jsonl", 4).read_text().splitlines()]
    for row, label in zip(rows, ["a", 1, 1.0, "b"]):
        row["label"] = label
    data = tmp_path / "labels.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _, extract_dir = extracted("gpt2", data=data)
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, POOLED, progress=False)
    table = pq.read_table(lmprobe.find_index(root))
    assert table.column("label").to_pylist() == ["a", "1", "1", "b"]
    assert table.column("label_id").to_pylist() == [1, 0, 0, 2]
    assert json.loads(table.schema.metadata[b"lmprobe:dataset"])["labels"] == [1, "a", "b"]


def with_tensors(root, edit) -> None:
    """The index of `root` rewritten (SHA256SUMS too) with its lmprobe:tensors changed by `edit`."""
    table = pq.read_table(lmprobe.find_index(root))
    metadata = dict(table.schema.metadata)
    tensors = json.loads(metadata[b"lmprobe:tensors"])
    edit(tensors)
    metadata[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    rewrite_index(root, table.replace_schema_metadata(metadata))


@pytest.mark.parametrize("file", ["tensors/logits_topk_001.safetensors", "../outside.safetensors"])
def test_a_logits_shard_file_other_than_its_patterns_is_named(extracted, tmp_path, file):
    """lmprobe's own loader opens each top-k shard by its descriptor's `file`, every other reader by
    file_pattern: a `file` naming another shard, or a file outside the dataset, passed verify."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, {**POOLED, "shard_bytes": 20 * 12 * 10}, progress=False)
    assert lmprobe.verify(root) == []

    def edit(tensors):
        tensors["logits_topk"]["shards"][0]["file"] = file
    with_tensors(root, edit)
    assert lmprobe.verify(root) == [
        f"{lmprobe.find_index(root)}: lmprobe:tensors.logits_topk.shards[0].file {file!r} is not "
        "'tensors/logits_topk_000.safetensors', the name its file_pattern gives"]


def test_a_layer_asked_for_twice_is_refused_before_any_file(extracted, tmp_path):
    """write_dataset with layers [2, 0, 2] wrote hidden_layer002 twice at once (two threads, one path)
    and recorded layers [0, 2, 2]: verify passed, and ProbeDataset (as lmprobe's loader, which
    concatenates each listed layer's shards) took layer 2's vectors twice."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    with pytest.raises(ConfigError, match=r"lmprobe.layers: \[2\] given more than once"):
        lmprobe.write_dataset(extract_dir, root, {**POOLED, "layers": [2, 0, 2]}, progress=False)
    assert not root.exists()


def test_a_layer_listed_twice_is_named_by_verify(extracted, tmp_path):
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, POOLED, progress=False)

    def edit(tensors):
        tensors["hidden_layers"]["layers"] += tensors["hidden_layers"]["layers"][:1]
    with_tensors(root, edit)
    assert lmprobe.verify(root) == [f"{lmprobe.find_index(root)}: lmprobe:tensors.hidden_layers.layers [0, 2, 0] "
                                    "names a layer more than once"]
