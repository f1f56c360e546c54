"""Families whose stored vectors depended on their batch, or that were refused only once their weights
had loaded: BigBird's block-sparse attention runs by the batch's width (a short text padded into a wide
batch got other vectors than alone, an odd-width batch came back block-padded and was refused); Reformer's
LSH attention draws new random rotations each forward; SqueezeBERT, FSMT and Gemma 3n failed after the
load (a hook that never fired, an unnamed AttributeError, a 4-dimensional block output)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import test_models_padding_sensitive
import tiny
from actstore.errors import ConfigError
from actstore.extract import preflight, run_part
from actstore.formats.extract import open_part
from actstore.models import load_model
from test_extract import REL_TOL, rel_err

# A block of 2 tokens and one random block: block-sparse attention runs on batches wider than
# (5 + 2 * 1) * 2 = 14 tokens, full attention on narrower ones. BigBird-Pegasus: its encoder runs.
BIG_BIRD = dict(block_size=2, num_random_blocks=1, attention_type="block_sparse")
BIG_BIRDS = {"big_bird": BIG_BIRD,
             "bigbird_pegasus": dict(BIG_BIRD, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64)}
FULL_ATTENTION_WIDTH = 14


def block_outputs_alone(loaded, ids: list[int], layers: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Blocks `layers`' outputs on the text `ids` alone, as a freshly loaded BigBird computes them (its
    forward switches itself to full attention for good on a narrow input), cut to the text's tokens."""
    outputs = {}
    handles = [loaded.blocks[i].register_forward_hook(
        lambda module, args, output, i=i: outputs.__setitem__(i, output[0] if isinstance(output, tuple) else output))
        for i in layers]
    loaded.model.set_attention_type(loaded.model.config.attention_type)
    with torch.inference_mode():
        loaded.model(input_ids=torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    return {i: outputs[i][0, :len(ids)].numpy() for i in layers}


def extracted_at_batch_sizes(model_type: str, settings: dict, monkeypatch, text_jsonl: Path,
                             tmp_path: Path) -> tuple[Path, dict]:
    """A tiny `model_type` encoder (test_models_padding_sensitive.build_encoder with `settings`) and its part of
    the texts extracted at batch size 1 and 8: {batch size: Part}."""
    monkeypatch.setitem(test_models_padding_sensitive.SETTINGS, model_type, settings)
    model = test_models_padding_sensitive.build_encoder(model_type, tmp_path / "model")
    return model, parts_at_batch_sizes(model, text_jsonl, tmp_path)


def parts_at_batch_sizes(model: Path, text_jsonl: Path, tmp_path: Path) -> dict:
    """The texts extracted by the model at `model` at batch size 1 and 8: {batch size: Part}."""
    parts = {}
    for batch_size in (1, 8):
        config = tiny.make_config(tmp_path / f"batch-{batch_size}", model, text_jsonl,
                                  extract={"batch_size": batch_size, "parts": 1, "max_seq_length": 64})
        run_part(config, 0, tmp_path / f"batch-{batch_size}" / "part-0000", progress=False)
        parts[batch_size] = open_part(tmp_path / f"batch-{batch_size}" / "part-0000")
    return parts


@pytest.mark.parametrize("model_type", sorted(BIG_BIRDS))
def test_big_bird_block_sparse_stores_each_texts_own_block_outputs(model_type, monkeypatch, text_jsonl, tmp_path):
    """Batches of 1 and of 8 store each vector as the block's output on its text alone. Texts of many
    lengths shared a batch, whose width chose block-sparse or full attention (0.56 to 0.72 off); a batch
    of odd width > 14 came back padded to the block size and the shape check refused it. The two batch
    sizes agree to rounding, not bit for bit: the CPU's matmul kernels differ in the last bits by the
    rows they multiply (an AMD EPYC without AVX-512, review 69)."""
    model, parts = extracted_at_batch_sizes(model_type, BIG_BIRDS[model_type], monkeypatch, text_jsonl, tmp_path)
    lengths = [row["num_tokens"] for row in parts[8].samples]
    assert any(n <= FULL_ATTENTION_WIDTH for n in lengths)  # full attention alone
    assert any(n > FULL_ATTENTION_WIDTH and n % 2 for n in lengths)  # block-sparse alone, padded to a block
    loaded = load_model(model)
    for local in range(len(lengths)):
        alone = block_outputs_alone(loaded, parts[8].token_ids(local).tolist(), (0, 2))
        for i in (0, 2):
            for batch_size, part in parts.items():
                stored = part.activations(f"layer_{i}", local)
                assert stored.shape == alone[i].shape and rel_err(stored, alone[i]) <= REL_TOL, (i, local, batch_size)


def refused_config(model_type: str) -> object:
    """A transformers config of `model_type`, tiny where its sizes matter."""
    import transformers as tf

    if model_type == "reformer":
        return tf.ReformerConfig(vocab_size=300, hidden_size=32, attn_layers=["local", "lsh"], pad_token_id=0)
    if model_type == "fsmt":
        return tf.FSMTConfig(langs=["en", "de"], src_vocab_size=300, tgt_vocab_size=300, d_model=32, encoder_layers=3,
                             decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=4)
    if model_type == "gemma3n":  # a Gemma 3n checkpoint: its language model (gemma3n_text) is what text runs
        config = tf.Gemma3nConfig()
        config.architectures = ["Gemma3nForConditionalGeneration"]
        return config
    if model_type == "nystromformer":  # landmark attention: fewer landmarks than segment_means_seq_len
        return tf.NystromformerConfig(num_landmarks=4, segment_means_seq_len=16, **tiny.FAMILY_COMMON)
    return tf.AutoConfig.for_model(model_type, **tiny.FAMILY_COMMON)


@pytest.mark.parametrize(("model_type", "named"), [("reformer", "reformer"), ("squeezebert", "squeezebert"),
                                                   ("fsmt", "fsmt"), ("gemma3n", "gemma3n_text"), ("canine", "canine"),
                                                   ("nystromformer", "nystromformer")])
def test_a_family_no_store_can_hold_is_refused_by_name_before_any_weight_loads(model_type, named, text_jsonl,
                                                                                 tmp_path):
    """The model folder holds config.json and a tokenizer, no weight: the checks before the load name the
    family. Each was refused, or failed naming nothing, only after its weights had loaded."""
    tiny.train_tokenizer(tmp_path / "model", causal=False)
    refused_config(model_type).save_pretrained(tmp_path / "model")
    config = tiny.make_config(tmp_path, tmp_path / "model", text_jsonl, extract={"parts": 1, "layers": [0]})
    with pytest.raises(ConfigError, match=rf"model.path: a {named} model's .*; actstore does not extract this family"):
        preflight(config, 0)
    with pytest.raises(ConfigError, match=rf"a {named} model's"):
        load_model(tmp_path / "model")
