"""Chat prompts: a list of {role, content} messages (or ShareGPT's {from, value}) rendered with the
tokenizer's own chat template. The rendered text is the prompt every format records; it already
holds the template's special tokens, so it is tokenized without adding any (the ids
apply_chat_template(tokenize=True) gives)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from actstore.datasets.core import check_unicode, json_spellings
from actstore.errors import ConfigError


def load_tokenizer(model_path: Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer extraction uses (models.load_tokenizer), so the rendered prompt is the one its
    class makes; `trust_remote_code`: model.trust_remote_code."""
    from actstore.models import load_tokenizer as load  # here: torch loads only when a chat is rendered

    return load(model_path, trust_remote_code)


def chat_renderer(tokenizer: Any, model_path: Path, add_generation_prompt: bool) -> Callable[[Any, str], str]:
    """(messages, where) -> the rendered prompt; ConfigError if the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"dataset.messages_field: the tokenizer at {model_path} has no chat template "
                          f"(chat_template in tokenizer_config.json or chat_template.jinja)")

    from jinja2 import TemplateError  # transformers' chat templates are Jinja

    def render(messages: Any, where: str) -> str:
        try:
            text = tokenizer.apply_chat_template(checked_messages(messages, where),
                                                 tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:  # the template's raise_exception: roles that do not alternate, a system turn
            raise ConfigError(f"{where}: the chat template of {model_path} refuses these messages ({exc})") from None
        check_unicode(text, where, "the rendered chat")
        return text
    return render


def checked_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """A row's messages as {role, content, ...} ones (_message); ConfigError naming `where` unless they
    are a non-empty list of them. The scan checks every row so, before any part's job renders one."""
    if not isinstance(messages, list):
        raise ConfigError(f"{where}: messages must be a list of {{role, content}} strings")
    if not messages:  # transformers' apply_chat_template raises a ValueError naming no row
        raise ConfigError(f"{where}: no messages (an empty list): there is no chat to render")
    return [_message(m, f"{where}: message {i}") for i, m in enumerate(messages)]


def refuse_repeated_message_keys(text: str, field: str, messages: list[dict[str, Any]], where: str) -> None:
    """ConfigError naming the message and key that one message of the row's `field` (its JSON `text`,
    `messages` as parsed) gives twice: json keeps the last value, so {"role": "user", "role":
    "assistant"} was an assistant turn without a word (core.refuse_repeated refuses a row's own keys
    so). `text` is parsed again, as pairs, only where a key's spellings appear more often than the
    messages holding it."""
    holding = Counter(key for message in messages for key in message)
    if all(sum(map(text.count, json_spellings(key))) <= n for key, n in holding.items()):
        return
    row = json.loads(text, object_pairs_hook=list)
    parsed = [value for key, value in row if key == field][-1]
    for i, pairs in enumerate(parsed):
        keys = [key for key, _ in pairs]
        if twice := next((key for key in keys if keys.count(key) > 1), None):
            raise ConfigError(f"{where}: message {i}: field {twice!r} appears twice in the message; a message's "
                              f"fields are distinct (which value is meant?)")


# ShareGPT's speakers (FastChat, axolotl's and LLaMA-Factory's `sharegpt` datasets) as chat roles.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


def _message(message: Any, where: str) -> dict[str, Any]:
    """A {role, content} message, or ShareGPT's {from, value} one as the same, its speaker mapped by
    SHAREGPT_ROLES, with its other keys: templates render tool_calls, tool_call_id, name or
    reasoning_content (Llama 3.1's, Qwen's, Mistral's), and a tool call was dropped, leaving an empty
    assistant turn. A key holding null or an empty list is left out, as absent (a Parquet struct's
    missing field; a dataset giving every turn its `tool_calls: []`): a template testing `'tool_calls'
    in message` (Llama 3.1's, Mistral's) took a plain turn for a call, refusing it or rendering an
    empty one in place of its content. ConfigError naming `where` otherwise."""
    if not isinstance(message, dict):
        raise ConfigError(f"{where}: a {type(message).__name__}, not a {{role, content}} object")
    present = {key: value for key, value in message.items() if value is not None and value != []}
    if isinstance(message.get("role"), str) and isinstance(message.get("content"), str):
        return present
    if isinstance(message.get("from"), str) and isinstance(message.get("value"), str):
        if message["from"] not in SHAREGPT_ROLES:
            raise ConfigError(f"{where}: a ShareGPT message from {message['from']!r}; the speakers that are chat "
                              f"roles: {', '.join(SHAREGPT_ROLES)}")
        others = {key: value for key, value in present.items() if key not in ("from", "value")}
        return {**others, "role": SHAREGPT_ROLES[message["from"]], "content": message["value"]}
    raise ConfigError(f"{where}: needs string role and content (or ShareGPT's from and value); it has "
                      f"{_described(message)}")


def _described(message: dict) -> str:
    """What a refused message holds, for its error: each key and its value's JSON type."""
    kinds = {str: "string", list: "list", dict: "object", bool: "bool", int: "number", float: "number",
             type(None): "null"}
    return ", ".join(f"{key}: {kinds.get(type(value), type(value).__name__)}"
                     for key, value in list(message.items())[:8]) or "no keys"
