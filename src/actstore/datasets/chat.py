"""Chat prompts: a list of {role, content} messages rendered with the tokenizer's own chat template.
The rendered text is the prompt every format records; it already holds the template's special
tokens, so it is tokenized without adding any (the ids apply_chat_template(tokenize=True) gives)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from actstore.errors import ConfigError


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def chat_renderer(tokenizer: Any, model_path: Path, add_generation_prompt: bool) -> Callable[[Any, str], str]:
    """(messages, where) -> the rendered prompt; ConfigError if the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"dataset.messages_field: the tokenizer at {model_path} has no chat template "
                          f"(chat_template in tokenizer_config.json or chat_template.jinja)")

    def render(messages: Any, where: str) -> str:
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ConfigError(f"{where}: messages must be a list of {{role, content}} strings")
        return tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                             tokenize=False, add_generation_prompt=add_generation_prompt)
    return render
