"""Families whose blocks actstore read wrong: XLNet's blocks compute on (tokens, batch, hidden), so a
batch of as many samples as tokens was stored laid over the wrong samples and tokens; an
encoder-decoder that keeps its encoder's settings in config.json's `encoder` (T5Gemma, bert2bert)
was refused as naming no block count, and bert2bert's learned positions went unchecked; a .bin
checkpoint's shard index naming a shard outside the folder was loaded from there, and a FIFO shard
blocked the load."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from actstore.checkpoint import BIN_INDEX, check_checkpoint_files
from actstore.errors import ConfigError
from actstore.extract import run_part
from actstore.formats.extract import open_part
from actstore.model_config import check_sequence_length, model_params, read_model_config
from actstore.models import load_model

ENCODER = dict(vocab_size=300, num_attention_heads=4, intermediate_size=64, max_position_embeddings=128)
DECODER_WIDTH = 48  # the decoder's settings differ from the encoder's, which extraction runs (32 wide)


def build_xlnet(out: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    tiny.train_tokenizer(out, causal=True)
    config = tf.XLNetConfig(vocab_size=300, d_model=32, n_layer=3, n_head=4, d_inner=64, bos_token_id=0,
                            eos_token_id=0, pad_token_id=0)
    tf.XLNetLMHeadModel(config).eval().save_pretrained(out)
    return out


def build_encoder_decoder(kind: str, out: Path) -> Path:
    """A tiny T5Gemma or bert2bert (EncoderDecoderModel): config.json holds each side's settings in
    `encoder` and `decoder`, none at the top level."""
    import transformers as tf

    torch.manual_seed(0)
    tiny.train_tokenizer(out, causal=False)
    if kind == "t5gemma":
        model = tf.T5GemmaModel(tf.T5GemmaConfig(
            encoder=dict(ENCODER, hidden_size=32, num_hidden_layers=3, num_key_value_heads=2, head_dim=8),
            decoder=dict(ENCODER, hidden_size=DECODER_WIDTH, num_hidden_layers=2, num_key_value_heads=2, head_dim=8),
            pad_token_id=0, bos_token_id=0, eos_token_id=0))
    else:
        model = tf.EncoderDecoderModel(
            encoder=tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=3, **ENCODER)),
            decoder=tf.BertLMHeadModel(tf.BertConfig(hidden_size=DECODER_WIDTH, num_hidden_layers=2, is_decoder=True,
                                                     add_cross_attention=True, **ENCODER)))
        model.config.decoder_start_token_id = model.config.pad_token_id = 0
    model.eval().save_pretrained(out)
    return out


def test_xlnet_blocks_computing_tokens_first_are_stored_per_sample_and_token(text_jsonl, tmp_path):
    """30 texts in one batch, each cut to 30 tokens or fewer: the (tokens, batch, hidden) block output is
    (30, 30, 32), which the shape check took for (batch, tokens, hidden) and stored transposed."""
    model = build_xlnet(tmp_path / "model")
    config = tiny.make_config(tmp_path, model, text_jsonl,
                              extract={"batch_size": 30, "max_seq_length": 30, "parts": 1, "layers": [0, 2]})
    run_part(config, 0, tmp_path / "part-0000", progress=False)
    part = open_part(tmp_path / "part-0000")
    assert max(row["num_tokens"] for row in part.samples) == len(part.samples) == 30  # batch as wide as long
    loaded = load_model(model)
    outputs = {}
    handles = [loaded.blocks[i].register_forward_hook(
        lambda module, args, output, i=i: outputs.__setitem__(i, output[0] if isinstance(output, tuple) else output))
        for i in (0, 2)]
    for local in range(len(part.samples)):
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([part.token_ids(local).tolist()]))
        for i in (0, 2):
            reference = outputs[i][:, 0].numpy()  # XLNet's block output: (tokens, batch=1, hidden)
            np.testing.assert_allclose(part.activations(f"layer_{i}", local), reference, rtol=1e-5, atol=1e-5)
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("kind", ["t5gemma", "bert2bert"])
def test_an_encoder_decoder_keeping_its_encoders_settings_apart_stores_its_encoder_blocks(kind, text_jsonl,
                                                                                           tmp_path):
    model = build_encoder_decoder(kind, tmp_path / "model")
    assert model_params(read_model_config(model)) == {"hidden_size": 32, "num_hidden_layers": 3,
                                                      "num_attention_heads": 4, "vocab_size": 300}
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"batch_size": 8, "parts": 1, "layers": [0, 1]})
    run_part(config, 0, tmp_path / "part-0000", progress=False)
    part = open_part(tmp_path / "part-0000")
    assert part.meta["model"]["n_blocks"] == 3
    loaded = load_model(model)
    for local in range(len(part.samples)):
        with torch.inference_mode():
            hidden = loaded.model(input_ids=torch.tensor([part.token_ids(local).tolist()]),
                                  output_hidden_states=True).hidden_states
        for i in (0, 1):  # the encoder's hidden_states[i + 1] is its block i's output
            np.testing.assert_allclose(part.activations(f"layer_{i}", local), hidden[i + 1][0].numpy(),
                                       rtol=1e-5, atol=1e-5)


def test_a_text_past_a_bert2bert_encoders_learned_positions_is_refused(tmp_path):
    model = build_encoder_decoder("bert2bert", tmp_path / "model")
    with pytest.raises(ConfigError, match=r"extract.max_seq_length 200: .*learned positions for 128 tokens"):
        check_sequence_length(200, read_model_config(model), model)
    check_sequence_length(128, read_model_config(model), model)


def save_bin_shards(model_folder: Path, out: Path) -> dict[str, str]:
    """The tiny model's weights as a two-shard .bin checkpoint (as transformers 4 saved them) in `out`,
    beside the folder's other files; its index's weight_map returned."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_folder, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    weights = AutoModelForCausalLM.from_pretrained(model_folder, local_files_only=True).state_dict()
    names = sorted(weights)
    shards = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for file, keys in shards.items():
        torch.save({key: weights[key].clone() for key in keys}, out / file)
    weight_map = {key: file for file, keys in shards.items() for key in keys}
    (out / BIN_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_a_bin_shard_index_naming_a_file_outside_the_folder_is_refused(model_dir, tmp_path):
    weight_map = save_bin_shards(model_dir("llama"), tmp_path / "model")
    (tmp_path / "elsewhere").mkdir()
    shard = sorted(set(weight_map.values()))[0]
    shutil.move(tmp_path / "model" / shard, tmp_path / "elsewhere" / shard)
    moved = {key: f"../elsewhere/{shard}" if file == shard else file for key, file in weight_map.items()}
    (tmp_path / "model" / BIN_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": moved}))
    with pytest.raises(ConfigError, match=rf"{BIN_INDEX} weight_map gives .* '\.\./elsewhere/{shard}'"):
        load_model(tmp_path / "model")


def test_a_bin_shard_that_is_a_fifo_is_named_not_opened(model_dir, tmp_path):
    weight_map = save_bin_shards(model_dir("llama"), tmp_path / "model")
    shard = tmp_path / "model" / sorted(set(weight_map.values()))[1]
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(ConfigError, match=rf"{shard.name} is not a regular file"):
        check_checkpoint_files(tmp_path / "model")


def test_a_bin_index_beside_a_safetensors_checkpoint_is_not_read(model_dir, tmp_path):
    """A safetensors download that took every *.json (the .bin index, not its shards) loads: from_pretrained
    reads the safetensors file first."""
    save_bin_shards(model_dir("llama"), tmp_path / "model")
    for shard in (tmp_path / "model").glob("*.bin"):
        shard.unlink()
    shutil.copy(model_dir("llama") / "model.safetensors", tmp_path / "model")
    check_checkpoint_files(tmp_path / "model")
    assert len(load_model(tmp_path / "model").blocks) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine where torch sees no GPU")
@pytest.mark.parametrize(("device", "message"), [  # "gpu": refused by the schema (test_config_schema_load_refusals)
    ("cuda", r"extract.device cuda: torch .* sees no GPU here")])
def test_a_device_torch_cannot_use_is_named_by_its_key(device, message, model_dir, text_jsonl, tmp_path):
    """Was torch's AssertionError (Torch not compiled with CUDA enabled) or its list of device types,
    naming no key, from a job sent to a CPU node or a typo."""
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl, extract={"parts": 1, "device": device})
    with pytest.raises(ConfigError, match=message):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
