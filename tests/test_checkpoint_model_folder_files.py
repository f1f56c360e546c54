"""The model folder as the parse and the extract job read it: a shard index names only files of the
folder itself, a shard that is no regular file is named instead of opened, and the chat templates
transformers loads from `additional_chat_templates/` are among the model files an extraction records."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import tiny
from actstore.checkpoint import INDEX, load_weights, tensor_bytes
from actstore.datasets.chat import chat_renderer
from actstore.errors import ConfigError
from actstore.model_identity import model_files
from actstore.models import load_tokenizer

SHARD = "model-00001-of-00001.safetensors"
HANG_GUARD_S = 120  # a regression blocks forever in open(); the child is killed, the test fails, the suite goes on


def sharded_linear(folder: Path, shard: str = SHARD) -> nn.Linear:
    """A Linear(2, 2) whose tensors `folder`'s shard index says `shard` holds (the caller saves them)."""
    linear = nn.Linear(2, 2)
    folder.mkdir()
    (folder / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(("weight", "bias"), shard)}))
    return linear


def assert_named_in_a_child(model: Path, call: str, fifo: str) -> None:
    """`call` on `model` in a child process (a regression blocks in open() forever) ends in a ConfigError
    naming `fifo` as no regular file."""
    script = (f"from pathlib import Path\nfrom torch import nn\nfrom actstore.checkpoint import load_weights, tensor_bytes\n"
              f"model = Path({str(model)!r})\n{call}\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 1
    assert f"ConfigError: model.path {model}: {fifo} is not a regular file" in done.stderr


@pytest.mark.parametrize("shard", ["../outside.safetensors", "OUTSIDE", "sub/../../outside.safetensors",
                                   "x\0.safetensors"])
def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(tmp_path, shard):
    outside = tmp_path / "outside.safetensors"
    linear = nn.Linear(2, 2)
    save_file({name: tensor.detach() for name, tensor in linear.state_dict().items()}, outside)
    model = tmp_path / "model"
    sharded_linear(model, str(outside) if shard == "OUTSIDE" else shard)
    expected = rf"{INDEX} weight_map gives '(weight|bias)' the file .* not a file name of the folder"
    with pytest.raises(ConfigError, match=expected):
        tensor_bytes(model)
    with pytest.raises(ConfigError, match=expected):
        load_weights(nn.Linear(2, 2), model, "tower")


@pytest.mark.parametrize("call", ["tensor_bytes(model)", "load_weights(nn.Linear(2, 2), model, 'tower')"])
def test_a_shard_that_is_a_fifo_is_named_not_opened(tmp_path, call):
    model = tmp_path / "model"
    sharded_linear(model)
    os.mkfifo(model / SHARD)
    assert_named_in_a_child(model, call, SHARD)


@pytest.mark.parametrize("fifo", [INDEX, "model.safetensors"])
def test_an_index_or_single_file_that_is_a_fifo_is_named(tmp_path, fifo):
    """Skipped as no checkpoint, a FIFO index ended in "weight not in checkpoint" for every weight."""
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / fifo)
    assert_named_in_a_child(model, "tensor_bytes(model)", fifo)


def test_a_plain_shard_index_still_loads(tmp_path):
    model = tmp_path / "model"
    linear = sharded_linear(model)
    save_file({name: tensor.detach() for name, tensor in linear.state_dict().items()}, model / SHARD)
    assert tensor_bytes(model) == {"weight": 16, "bias": 8}
    loaded = nn.Linear(2, 2)
    load_weights(loaded, model, "linear")
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in linear.state_dict().items())


def test_a_template_of_additional_chat_templates_is_a_model_file(model_dir, tmp_path):
    """transformers loads additional_chat_templates/default.jinja as the chat template a chat is rendered
    with (over chat_template.jinja): editing it changes an extraction's tokens, so the record must change."""
    model = tiny.add_chat_template(model_dir("gpt2"), tmp_path / "model")
    top_level = model_files(model)
    templates = model / "additional_chat_templates"
    templates.mkdir()
    (templates / "default.jinja").write_text("{% for m in messages %}A:{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    assert chat_renderer(load_tokenizer(model), model, False)(messages, "row 0") == "A:hi"
    before = model_files(model)
    assert before.keys() - top_level.keys() == {"additional_chat_templates/default.jinja"}
    (templates / "default.jinja").write_text("{% for m in messages %}B:{{ m['content'] }}{% endfor %}!")
    assert chat_renderer(load_tokenizer(model), model, False)(messages, "row 0") == "B:hi!"
    assert model_files(model)["additional_chat_templates/default.jinja"] != before["additional_chat_templates/default.jinja"]
