"""Review 64, a new user's journey (chat LLM, all stages): faults found by following the docs."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

import tiny
from actstore.datasets import load_dataset, scan_dataset
from actstore.errors import ConfigError

# A tool-use template as Llama 3.1's, Qwen 2.5's and Mistral's render them: an assistant turn's
# `tool_calls` and a tool turn's `tool_call_id` are keys of the message beside role and content.
TOOL_TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}"
                 "{% for call in m.get('tool_calls', []) %}[call {{ call['function']['name'] }}]{% endfor %}"
                 "{% if m.get('tool_call_id') %}[for {{ m['tool_call_id'] }}]{% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|endoftext|>assistant:{% endif %}")

TOOL_CHAT = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "id": "c1",
                              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "18 C", "tool_call_id": "c1"}]


def test_chat_prompt_is_the_templates_rendering_of_the_whole_messages(model_dir, tmp_path):
    """dataset.messages_field renders a row "with the model tokenizer's own chat template
    (apply_chat_template)" (config/README.md): the recorded prompt must be what apply_chat_template
    makes of the row's messages. Keys beside role and content (tool_calls, tool_call_id, name,
    reasoning_content) were dropped before rendering, so a tool-use conversation was stored as an
    empty assistant turn, its call gone, with nothing said."""
    from transformers import AutoTokenizer

    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama")
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(chat_model)
    lines = tmp_path / "tools.jsonl"
    lines.write_text(json.dumps({"messages": TOOL_CHAT}) + "\n")
    expected = tokenizer.apply_chat_template(TOOL_CHAT, tokenize=False, add_generation_prompt=True)
    assert "[call get_weather]" in expected and "[for c1]" in expected
    text = load_dataset(lines, model_path=chat_model, messages_field="messages").samples[0].text
    assert text == expected


def test_a_table_chats_null_struct_fields_are_absent_keys_to_the_template(model_dir, tmp_path):
    """A Parquet column of messages is a list of structs: a message without tool_calls holds it as null.
    Passed to the template as a key, a template testing `'tool_calls' in m` (Llama 3.1's) iterated None;
    it is left out, so the table renders as the same rows in JSON lines do."""
    from transformers import AutoTokenizer

    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama")
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = TOOL_TEMPLATE.replace("m.get('tool_calls', [])", "(m['tool_calls'] if 'tool_calls' in m "
                                                    "else [])")
    tokenizer.save_pretrained(chat_model)
    rows = [TOOL_CHAT, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]]
    table = tiny.write_parquet(tmp_path / "chats", pa.table({"messages": rows}))
    lines = tmp_path / "chats.jsonl"
    lines.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    texts = [[s.text for s in load_dataset(path, model_path=chat_model, messages_field="messages").samples]
             for path in (table, lines)]
    assert texts[0] == texts[1] == [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                                    for m in rows]


def test_a_message_that_is_no_chat_message_is_named_with_its_place_and_keys(tmp_path):
    """OpenAI's tool-call turn (content null) and a content of parts are refused naming the message and
    what it holds: the line alone left the user to find which of a long chat's turns it was."""
    lines = tmp_path / "chat.jsonl"
    turn = {"role": "assistant", "content": None, "tool_calls": []}
    lines.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, turn]}) + "\n")
    with pytest.raises(ConfigError, match=r"chat\.jsonl:1: message 1: needs string role and content \(or ShareGPT's "
                                          r"from and value\); it has role: string, content: null, tool_calls: list"):
        scan_dataset(lines, messages_field="messages")
