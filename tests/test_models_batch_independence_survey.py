"""Families surveyed for batch-independence, or refused only once their weights had loaded: Pegasus-X's
encoder pads its input to a multiple of its block_size, and its blocks' outputs were refused by the shape
check after the load; ProphetNet was refused as naming no block count (its config.json says
num_encoder_layers), and once run, clamped the positions past its table with no error; LiLT's past
its table were an IndexError after the load. LiLT, ProphetNet and Ministral (sliding windows narrower
than the batch) store the same vectors in batches of 1 and of 8."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from actstore.errors import ConfigError
from actstore.extract import preflight
from actstore.models import load_model
from test_extract import REL_TOL, rel_err
from test_models_batch_dependent_families import parts_at_batch_sizes

# {model_type: (causal, its config's settings)}: each family's own size names (ProphetNet has no
# num_hidden_layers to set); LiLT's layout embedding needs hidden_size / 4 divisible by 6.
SURVEYED = {
    "prophetnet": (False, dict(vocab_size=300, hidden_size=32, num_encoder_layers=3, num_decoder_layers=2,
                               num_encoder_attention_heads=4, num_decoder_attention_heads=4, encoder_ffn_dim=64,
                               decoder_ffn_dim=64, max_position_embeddings=128, ngram=2, num_buckets=8,
                               relative_max_distance=16)),
    "lilt": (False, dict(tiny.FAMILY_COMMON, hidden_size=48)),
    "ministral": (True, dict(tiny.FAMILY_COMMON, num_key_value_heads=2, head_dim=8, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def build(model_type: str, out: Path, **changes) -> Path:
    """A tiny seeded SURVEYED model (its settings with `changes`) saved with a tokenizer, as tiny.build_family
    saves its FAMILIES."""
    import transformers as tf

    causal, settings = SURVEYED[model_type]
    torch.manual_seed(0)
    tiny.train_tokenizer(out, causal=causal)
    config = tf.AutoConfig.for_model(model_type, **{**settings, **changes})
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    model = (tf.AutoModelForCausalLM if causal else tf.AutoModel).from_config(config).eval()
    for param in model.parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.2)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("model_type", sorted(SURVEYED))
def test_a_surveyed_familys_stored_vectors_do_not_depend_on_its_batch(model_type, text_jsonl, tmp_path):
    """Batches of 1 and of 8 mixed-length texts store the same vectors of blocks 0 and 2, each the block's
    output on its text alone. ProphetNet was refused before (no block count under the names looked for)."""
    model = build(model_type, tmp_path / "model")
    parts = parts_at_batch_sizes(model, text_jsonl, tmp_path)
    assert len({row["num_tokens"] for row in parts[8].samples}) >= 10  # batches of 8 mix lengths
    loaded = load_model(model)
    for local in range(len(parts[8].samples)):
        alone = block_outputs_alone(loaded, parts[8].token_ids(local).tolist())
        for i in (0, 2):
            batched, single = (parts[size].activations(f"layer_{i}", local) for size in (8, 1))
            assert batched.shape == single.shape == alone[i].shape, (model_type, i, local)
            assert rel_err(batched, single) <= REL_TOL and rel_err(single, alone[i]) <= REL_TOL, (i, local)


def block_outputs_alone(loaded, ids: list[int]) -> dict[int, np.ndarray]:
    """Blocks 0 and 2's outputs as the run model (an encoder-decoder's encoder) computes them on `ids`
    alone (by hooks: a causal LM's last hidden_states entry comes after its final norm)."""
    outputs = {}
    handles = [loaded.blocks[i].register_forward_hook(
        lambda module, args, output, i=i: outputs.__setitem__(i, output[0] if isinstance(output, tuple) else output))
        for i in (0, 2)]
    with torch.inference_mode():
        loaded.model(input_ids=torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    return {i: output[0].numpy() for i, output in outputs.items()}


@pytest.mark.parametrize("model_type", ["lilt", "prophetnet"])
def test_max_seq_length_past_learned_positions_is_refused(model_type, text_jsonl, tmp_path):
    """Both learn their positions as a table: LiLT's lookup past it was an IndexError once the weights had
    loaded, ProphetNet's clamps (tokens past it were given its last position's embedding, with no
    error). Refused at the parse-time checks, naming the limit: LiLT's counts from pad_token_id (0) + 1,
    as RoBERTa's, so its table of 16 holds 15 tokens (review 63; 16 was an IndexError)."""
    model = build(model_type, tmp_path / "model", max_position_embeddings=16)
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"parts": 1, "max_seq_length": 24})
    limit = 15 if model_type == "lilt" else 16
    with pytest.raises(ConfigError, match=rf"model_type {model_type}\) has learned positions for {limit} tokens"):
        preflight(config, 0)


def test_pegasus_x_is_refused_by_name_before_any_weight_loads(text_jsonl, tmp_path):
    """The model folder holds config.json and a tokenizer, no weight: the checks before the load name
    the family. Its blocks output the input padded to a block_size multiple (512 tokens for any text
    shorter), which the shape check refused only after the weights had loaded."""
    import transformers as tf

    tiny.train_tokenizer(tmp_path / "model", causal=False)
    tf.PegasusXConfig(vocab_size=300, d_model=32, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4).save_pretrained(tmp_path / "model")
    config = tiny.make_config(tmp_path, tmp_path / "model", text_jsonl, extract={"parts": 1, "layers": [0]})
    refusal = r"model.path: a pegasus_x model's encoder pads .*; actstore does not extract this family"
    with pytest.raises(ConfigError, match=refusal):
        preflight(config, 0)
    with pytest.raises(ConfigError, match=refusal):
        load_model(tmp_path / "model")
