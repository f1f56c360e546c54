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
