"""Session review 64: regressions found in the session's own changes, each pinned where it was."""
from __future__ import annotations

import json

from transformers import AutoTokenizer

import tiny
from actstore.datasets import load_dataset

# Llama 3.1's message loop, its branch conditions verbatim: a turn holding the key `tool_calls` is a
# tool call, and it must hold exactly one.
LLAMA31_TOOL_BRANCH = (
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|endoftext|>' + message['role'] + ': ' + message['content'] | trim + '\\n' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if not message.tool_calls|length == 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{{- '<|endoftext|>call ' + message.tool_calls[0]['function']['name'] + '\\n' }}"
    "{%- endif %}{%- endfor %}")


def test_a_turns_empty_tool_calls_is_no_tool_call(model_dir, tmp_path):
    """A dataset giving every turn `tool_calls: []` (no call) rendered each as a plain turn before its
    other keys went to the template; passed as a key, Llama 3.1's template took every turn for a tool
    call and refused the row (Mistral's rendered an empty call in place of the content). An empty list
    is left out as null is."""
    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama")
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = LLAMA31_TOOL_BRANCH
    tokenizer.save_pretrained(chat_model)
    chat = [{"role": "user", "content": "hi", "tool_calls": []},
            {"role": "assistant", "content": "hello", "tool_calls": []}]
    lines = tmp_path / "chats.jsonl"
    lines.write_text(json.dumps({"messages": chat}) + "\n")
    text = load_dataset(lines, model_path=chat_model, messages_field="messages").samples[0].text
    assert text == "<|endoftext|>user: hi\n<|endoftext|>assistant: hello\n"


def test_a_float_label_column_under_a_readme_classlabel_reads_whole_floats_as_ids(tmp_path):
    """pandas writes an integer label column with a missing value as floats ([0.0, None, 2.0]); under a
    Hub README's ClassLabel it was refused ("is double, but the features make it a ClassLabel") where,
    before the README was read, it scanned, and datasets reads it: whole floats are class ids, a null or
    NaN no label, and a float that is no id is named with its row."""
    import math

    import pyarrow as pa
    import pytest

    from actstore.datasets import load_dataset, scan_dataset
    from actstore.errors import ConfigError
    from test_datasets_readme_classlabel_tables import hub_folder

    root = hub_folder(tmp_path / "ok", splits={"train": [0.0, 1.0, 2.0], "test": [0.0, None, 2.0, math.nan]},
                      label_type=pa.float64())
    dataset = load_dataset(root, split="test")
    assert [s.label for s in dataset.samples] == ["cat", None, "person", None]
    assert scan_dataset(root, split="test").labels == dataset.labels
    bad = hub_folder(tmp_path / "bad", splits={"train": [0.0], "test": [0.0, 1.5]}, label_type=pa.float64())
    with pytest.raises(ConfigError, match=r"test-00000-of-00001\.parquet#1: field 'label': 1\.5 is no class id or "
                                          r"name of its ClassLabel \(.*README\.md: features\)"):
        scan_dataset(bad, split="test")
