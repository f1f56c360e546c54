"""Review 61 of models.py / model_config.py: families refused for why no block output can be stored,
and config.json sizes that are no block count (a bool, zero, negative, absurdly large)."""
from __future__ import annotations

import json
import re

import pytest
import torch
import transformers as tf

from actstore.errors import ConfigError
from actstore.model_config import num_blocks, read_model_config
from actstore.models import find_model_blocks, model_skeleton

REFUSED = {
    "funnel": (tf.FunnelConfig(vocab_size=300, d_model=32, block_sizes=[1, 1, 1], n_head=4, d_head=8, d_inner=64),
               r"a funnel model's encoder pools its tokens .*; actstore does not extract this family"),
    "perceiver": (tf.PerceiverConfig(d_model=32, d_latents=32, num_latents=8, num_self_attends_per_block=3),
                  r"a perceiver model's blocks run on its num_latents latent vectors.*"
                  "; actstore does not extract this family"),
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_funnel_and_perceiver_are_refused_saying_why(model_type, tmp_path):
    """Their config.json names no num_hidden_layers, and the refusal said only that (no block count),
    not why no store can hold their blocks: Funnel's pool the tokens between block groups, Perceiver's run
    on latents. Refused by name from the real config.json its config class writes."""
    config, why = REFUSED[model_type]
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=why):
        num_blocks(read_model_config(tmp_path))


@pytest.mark.parametrize("config_class", [tf.XLMConfig, tf.FlaubertConfig])
def test_xlm_refusal_names_the_module_whose_output_is_block_i(config_class, tmp_path):
    """XLM's and Flaubert's blocks are four parallel lists, refused; the error told the user that
    extract.hooks can capture a named module, but the model is refused whole, hooks and all (a hook on
    layer_norm2.2 got this same error). It now names the module whose output is block i's (layer_norm2.i
    ends each post-norm block), checked against the model's own hidden states on a tiny seeded model."""
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(config_class(vocab_size=300, emb_dim=32, n_layers=3, n_heads=4)).eval()
    model.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"block i's output is layer_norm2\.i's, which ends each block") as refused:
        find_model_blocks(model_skeleton(tmp_path), read_model_config(tmp_path))
    assert "extract.hooks" not in str(refused.value)
    outputs = {}
    for i, norm in enumerate(model.layer_norm2):
        norm.register_forward_hook(lambda module, args, output, i=i: outputs.__setitem__(i, output))
    with torch.no_grad():
        hidden = model(input_ids=torch.randint(5, 300, (2, 7)), output_hidden_states=True).hidden_states
    assert all(torch.equal(outputs[i], hidden[i + 1]) for i in range(3))


@pytest.mark.parametrize("value", [True, 0, -2, 10**12])
def test_a_block_count_that_is_none_is_named(value, tmp_path):
    """n_layer true was read as 1 block, 0 or -2 gave "blocks 0..-3", 10**12 was taken and the weightless
    model built with that many blocks (hours); each is a ConfigError naming the file and the field."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                      "n_layer": value}))
    with pytest.raises(ConfigError, match=rf"config.json n_layer {value!r} is no block count"):
        num_blocks(read_model_config(tmp_path))


@pytest.mark.parametrize("field, value", [("architectures", 5), ("architectures", [5]),
                                          ("architectures", "GPT2LMHeadModel"), ("model_type", 5),
                                          ("model_type", ["gpt2"])])
def test_a_config_json_naming_its_class_with_a_wrong_type_is_named(field, value, tmp_path):
    """architectures 5 or [5] was a TypeError or AttributeError traceback out of model_kind; a bare string
    was read as its letters, none ending in LMHeadModel, so a causal LM was run as an encoder (no logits,
    no use_cache=False). Each is a ConfigError naming the file and the field."""
    file = tmp_path / "config.json"
    file.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 3,
                                field: value}))
    with pytest.raises(ConfigError, match=re.escape(f"{file} holds {field} {value!r}, not a")):
        read_model_config(tmp_path)


def test_a_pre_norm_flaubert_refusal_names_no_block_output(tmp_path):
    """A pre-norm Flaubert's layer_norm2 normalizes its feed-forward's input, so no list's output is its
    block's: its refusal names none."""
    tf.FlaubertConfig(vocab_size=300, emb_dim=32, n_layers=3, n_heads=4, pre_norm=True).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"does not extract this architecture's layers$"):
        find_model_blocks(model_skeleton(tmp_path), read_model_config(tmp_path))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", 5, "model.bin"])
def test_a_weights_name_outside_the_folder_or_of_no_safetensors_is_named(name, tmp_path):
    """config.json's transformers_weights names the file from_pretrained reads: one outside the folder, an
    absolute path, a number or no safetensors name was a ValueError or AttributeError traceback out of
    from_pretrained, after the parse-time checks had passed. A ConfigError naming the file and field."""
    torch.manual_seed(0)
    tf.GPT2Model(tf.GPT2Config(vocab_size=300, n_embd=32, n_layer=3, n_head=4)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "transformers_weights": name}))
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'config.json'} holds transformers_weights {name!r}")):
        read_model_config(tmp_path)


def test_a_weights_name_inside_the_folder_loads(tmp_path):
    """The check passes what from_pretrained reads: weights moved into a subfolder and named there load."""
    torch.manual_seed(0)
    model = tf.GPT2Model(tf.GPT2Config(vocab_size=300, n_embd=32, n_layer=3, n_head=4))
    model.save_pretrained(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "model.safetensors").rename(tmp_path / "sub" / "weights.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "transformers_weights": "sub/weights.safetensors"}))
    assert read_model_config(tmp_path)["transformers_weights"] == "sub/weights.safetensors"
    loaded = tf.GPT2Model.from_pretrained(tmp_path)
    assert torch.equal(loaded.h[2].mlp.c_fc.weight, model.h[2].mlp.c_fc.weight)


def test_an_audio_model_is_refused_before_its_weights_load(tmp_path):
    """Whisper's config.json is an encoder-decoder's, run as a text encoder: its encoder takes
    input_features (audio), and the first batch was a TypeError traceback once the weights had loaded.
    Refused on the weightless model, naming what it takes; with its weights gone the error is the same."""
    from actstore.models import load_model

    torch.manual_seed(0)
    tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=300, d_model=32, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0)).save_pretrained(tmp_path)
    refusal = r"WhisperEncoder's forward takes input_features, not input_ids \(text\)"
    with pytest.raises(ConfigError, match=refusal):
        load_model(tmp_path, device="cpu")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=refusal):
        load_model(tmp_path, device="cpu")
