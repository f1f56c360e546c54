"""The files of a model folder's safetensors checkpoint, checked before from_pretrained reads them: a
shard the index names outside the folder, missing or not a regular file, and a folder holding a
single-file checkpoint beside shards of another, are ConfigErrors naming the file. A max_seq_length
past a learned-position model's table (BART, Longformer, ESM-1) is refused at parse time."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiny
from actstore.checkpoint import INDEX, SINGLE, checkpoint_names
from actstore.errors import ConfigError
from actstore.model_config import check_sequence_length, read_model_config
from actstore.models import load_model

HANG_GUARD_S = 120  # before the fix from_pretrained blocked in open() on a FIFO forever: the child is killed


def save_sharded(model_folder: Path, out: Path, shift: float = 0.0) -> dict[str, str]:
    """The model folder's checkpoint (every weight plus `shift`) saved in ~50 kB shards into `out`,
    which holds the folder's other files (tokenizer, processors); its index's weight_map returned."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    auto = {"LlamaForCausalLM": AutoModelForCausalLM, "LlavaForConditionalGeneration": AutoModelForImageTextToText}
    architecture = json.loads((model_folder / "config.json").read_text())["architectures"][0]
    model = auto.get(architecture, AutoModel).from_pretrained(model_folder, local_files_only=True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(shift)
    model.save_pretrained(out, max_shard_size=50_000)
    for path in model_folder.iterdir():
        if not (out / path.name).exists() and path.name != SINGLE:
            shutil.copy(path, out / path.name)
    return json.loads((out / INDEX).read_text())["weight_map"]


def rewrite_index(folder: Path, weight_map: dict[str, str]) -> None:
    index = json.loads((folder / INDEX).read_text())
    (folder / INDEX).write_text(json.dumps({**index, "weight_map": weight_map}))


def test_an_index_naming_a_shard_outside_the_folder_is_refused(model_dir, tmp_path):
    """from_pretrained joins the index's names to the folder: `../elsewhere/...` loaded weights that the
    folder's model_files record never held, so a change to them went unseen."""
    folder = tmp_path / "sharded"
    weight_map = save_sharded(model_dir("llama"), folder)
    moved = sorted(set(weight_map.values()))[0]
    (tmp_path / "elsewhere").mkdir()
    shutil.move(folder / moved, tmp_path / "elsewhere" / moved)
    rewrite_index(folder, {name: f"../elsewhere/{file}" if file == moved else file
                           for name, file in weight_map.items()})
    with pytest.raises(ConfigError, match=f"{INDEX} weight_map gives .* the file '../elsewhere/{moved}'"):
        load_model(folder, device="cpu")


@pytest.mark.parametrize("damage", ["missing", "a folder"])
def test_a_shard_missing_or_not_a_regular_file_is_named(damage, model_dir, tmp_path):
    """A shard that is gone or no regular file (a folder; a FIFO, below) is a ConfigError naming it,
    before from_pretrained opens any: it was a FileNotFoundError or IsADirectoryError out of the load."""
    folder = tmp_path / "sharded"
    shard = sorted(set(save_sharded(model_dir("llama"), folder).values()))[-1]
    os.remove(folder / shard)
    if damage == "a folder":
        (folder / shard).mkdir()
    with pytest.raises(ConfigError, match=f"model.path {folder}: {shard}"):
        load_model(folder, device="cpu")


@pytest.mark.parametrize("tower", [None, "vision"])
def test_shards_saved_over_a_single_file_checkpoint_are_refused(tower, model_dir, tmp_path):
    """save_pretrained in shards over a single-file checkpoint leaves model.safetensors: from_pretrained
    read those old weights for the language model while the tower, read by the index, had the new."""
    folder = tmp_path / "llava"
    shutil.copytree(model_dir("llava"), folder)
    save_sharded(model_dir("llava"), folder, shift=1.0)
    assert (folder / SINGLE).is_file()
    with pytest.raises(ConfigError, match=f"holds both {SINGLE} and {INDEX}"):
        load_model(folder, device="cpu", tower=tower)


def test_a_shard_that_is_a_fifo_is_named_not_opened(model_dir, tmp_path):
    """The whole model's load, in a child process (before the fix it blocked opening the FIFO forever)."""
    folder = tmp_path / "sharded"
    shard = sorted(set(save_sharded(model_dir("llama"), folder).values()))[-1]
    os.remove(folder / shard)
    os.mkfifo(folder / shard)
    script = f"from actstore.models import load_model\nload_model({str(folder)!r}, device='cpu')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert f"ConfigError: model.path {folder}: {shard} is not a regular file" in done.stderr


@pytest.mark.parametrize("family", ["bart", "longformer", "esm"])
def test_a_text_past_learned_positions_is_refused_at_parse_time(family, tmp_path):
    """BART's encoder, Longformer and ESM-1 learn their positions: a max_seq_length past them passed the
    parse, then the first batch longer than the table was an IndexError naming no key. Longformer's and
    ESM's count from pad_token_id + 1, as RoBERTa's (review 63: a table of 128, pad 0, holds 127)."""
    folder = tiny.build_family(family, tmp_path / family)
    config = read_model_config(folder)
    limit = config["max_position_embeddings"] - (0 if family == "bart" else config["pad_token_id"] + 1)
    expected = rf"extract.max_seq_length {2 * limit}: .* \(model_type {family}\) has learned positions for {limit}"
    with pytest.raises(ConfigError, match=expected):
        check_sequence_length(2 * limit, config, folder)
    check_sequence_length(limit // 2, config, folder)


def test_an_index_naming_only_the_single_file_is_one_checkpoint(model_dir, tmp_path):
    """Some repositories ship model.safetensors with an index mapping every weight to it: one checkpoint,
    loaded as before."""
    import json

    folder = tmp_path / "llama"
    shutil.copytree(model_dir("llama"), folder)
    names = checkpoint_names(folder)
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": names}))
    assert checkpoint_names(folder) == names and set(names.values()) == {SINGLE}
    load_model(folder, device="cpu")


# llava-hf/llava-1.5-7b-hf's config.json as the Hub serves it (saved by transformers 4.36): its text_config
# leaves out the settings equal to LlamaConfig's defaults, Vicuna-7B's 32 blocks of width 4096 among them.
LLAVA_15_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}


def test_a_text_config_saved_without_its_default_sizes_reads_them_from_its_class(tmp_path):
    """LLaVA 1.5's language model: its text extraction was refused as naming no block count, and the
    resources took its width for 1024."""
    from actstore.model_config import check_layers, config_int, num_blocks, vision_tower_config

    (tmp_path / "config.json").write_text(json.dumps(LLAVA_15_CONFIG))
    config = read_model_config(tmp_path)
    assert (num_blocks(config), config_int(config, "hidden_size"), config_int(config, "num_attention_heads")) \
        == (32, 4096, 32)
    assert config["text_config"]["intermediate_size"] == 11008
    check_layers([0, 31], config)
    with pytest.raises(ConfigError):
        check_layers([32], config)
    assert num_blocks(vision_tower_config(config)) == 24  # what the file gives is kept


def test_a_vision_config_saved_without_its_default_patch_size_reads_it_from_its_class(tmp_path):
    """A CLIP vision_config left out patch_size (32, CLIPVisionConfig's default): saev's labels and the
    patch-count check had none."""
    from actstore.model_config import config_patches, vision_tower_config

    config = {**LLAVA_15_CONFIG, "vision_config": {
        key: value for key, value in LLAVA_15_CONFIG["vision_config"].items() if key not in ("patch_size", "image_size")}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tower = vision_tower_config(read_model_config(tmp_path))
    assert (tower["patch_size"], tower["image_size"], tower["hidden_size"]) == (32, 224, 1024)
    assert config_patches(tower) == (224 // 32) ** 2
