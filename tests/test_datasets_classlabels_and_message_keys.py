"""Review 65, dataset leads on real files: every Parquet/Arrow shard's ClassLabel agreeing, a README's
ClassLabel applying to a Hub folder (not to a file or glob in it, as `datasets` reads them), and a chat
message's keys given twice."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.datasets import load_dataset, scan_dataset
from actstore.errors import ConfigError

README = """---
dataset_info:
  features:
  - name: text
    dtype: string
  - name: label
    dtype:
      class_label:
        names:
          '0': pos
          '1': neg
---
"""


def hf_metadata(names: list[str]) -> dict[bytes, bytes]:
    """The `huggingface` schema metadata datasets writes in a Parquet shard of a ClassLabel `label`."""
    features = {"text": {"dtype": "string", "_type": "Value"}, "label": {"names": names, "_type": "ClassLabel"}}
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def shard(path, names: list[str] | None, labels=(0, 1)) -> None:
    table = pa.table({"text": [f"{path.stem} {i}" for i in range(len(labels))], "label": list(labels)})
    pq.write_table(table.replace_schema_metadata(hf_metadata(names)) if names else table, path)


@pytest.mark.parametrize("first, second", [(["neg", "pos"], ["pos", "neg"]), (["neg", "pos"], None),
                                           (None, ["neg", "pos"])])
def test_shards_whose_classlabels_differ_are_refused_naming_both(tmp_path, first, second):
    shard(tmp_path / "train-0.parquet", first)
    shard(tmp_path / "train-1.parquet", second)
    with pytest.raises(ConfigError) as error:
        scan_dataset(tmp_path)
    message = str(error.value)
    assert "train-0.parquet" in message and "train-1.parquet" in message and "'label'" in message


def test_shards_of_one_classlabel_are_numbered_by_it(tmp_path):
    shard(tmp_path / "train-0.parquet", ["neg", "pos"])
    shard(tmp_path / "train-1.parquet", ["neg", "pos"], labels=(1, 1))
    dataset = load_dataset(tmp_path)
    assert dataset.labels == ["neg", "pos"]
    assert [s.label for s in dataset.samples] == ["neg", "pos", "pos", "pos"]


def test_readme_classlabel_takes_shards_without_metadata_and_refuses_other_names(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "README.md").write_text(README)
    shard(tmp_path / "data" / "train-00000-of-00002.parquet", None)
    shard(tmp_path / "data" / "train-00001-of-00002.parquet", ["pos", "neg"])
    dataset = load_dataset(tmp_path)
    assert dataset.labels == ["pos", "neg"]
    assert [s.label for s in dataset.samples] == ["pos", "neg", "pos", "neg"]
    shard(tmp_path / "data" / "train-00001-of-00002.parquet", ["neg", "pos"])
    with pytest.raises(ConfigError, match=r"train-00001-of-00002\.parquet.*README\.md"):
        scan_dataset(tmp_path)


def test_readme_numbers_a_hub_folder_but_not_a_file_or_glob_in_it(tmp_path):
    """As datasets: load_dataset(folder) reads the README's dataset_info, load_dataset("json",
    data_files=...) does not (docs/extraction.md)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "README.md").write_text(README)
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "a", "label": "neg"}\n{"text": "b", "label": "pos"}\n')
    assert scan_dataset(tmp_path).labels == ["pos", "neg"]
    assert scan_dataset(tmp_path / "data" / "train.jsonl").labels == ["neg", "pos"]
    assert scan_dataset(str(tmp_path / "data" / "*.jsonl")).labels == ["neg", "pos"]


def chat_line(*messages: str) -> str:
    return '{"messages": [' + ", ".join(messages) + "]}\n"


@pytest.mark.parametrize("message, key", [('{"role": "user", "role": "assistant", "content": "hi"}', "role"),
                                          ('{"role": "user", "content": "hi", "content": "bye"}', "content"),
                                          ('{"from": "human", "value": "hi", "from": "gpt"}', "from")])
def test_a_message_key_given_twice_is_refused_naming_line_message_and_key(tmp_path, message, key):
    path = tmp_path / "chat.jsonl"
    path.write_text(chat_line('{"role": "system", "content": "be brief"}') + chat_line(
        '{"role": "system", "content": "x"}', message))
    with pytest.raises(ConfigError) as error:
        scan_dataset(path, messages_field="messages")
    assert f"chat.jsonl:2: message 1: field {key!r} appears twice" in str(error.value)


def test_a_message_key_given_twice_in_a_json_array_element_is_refused(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text('[{"messages": [{"role": "user", "role": "assistant", "content": "hi"}]}]')
    with pytest.raises(ConfigError, match=r"chat\.json: element 1: message 0: field 'role' appears twice"):
        scan_dataset(path, messages_field="messages")


def test_a_key_name_as_a_value_is_no_repeated_key(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(chat_line('{"role": "user", "content": "role"}', '{"role": "assistant", "content": "content"}'))
    assert scan_dataset(path, messages_field="messages").n_samples == 1
