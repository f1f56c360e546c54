"""Families whose padding changes the real tokens' outputs (model_config.PADDING_SENSITIVE_TYPES): their
batches each hold one token length, so every stored vector is still the sample's own block output."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiny
from actstore.extract import length_batches, run_part
from actstore.formats.extract import open_part
from actstore.models import load_model
from test_extract import REL_TOL, rel_err

# model_config.PADDING_SENSITIVE_TYPES, each with its own settings on top of tiny.FAMILY_COMMON (encoders,
# loaded with AutoModel).
SETTINGS = {"mobilebert": dict(embedding_size=16, true_hidden_size=32, intra_bottleneck_size=32,
                               num_feedforward_networks=1),
            "convbert": dict(embedding_size=32), "fnet": {}, "yoso": {}}


def build_encoder(model_type: str, out: Path) -> Path:
    """A tiny seeded encoder of `model_type` saved with its tokenizer, as tiny.build_family saves its FAMILIES."""
    import transformers as tf

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    tiny.train_tokenizer(out, causal=False)
    config = tf.AutoConfig.for_model(model_type, **{**tiny.FAMILY_COMMON, **SETTINGS[model_type]})
    config.pad_token_id = 0
    model = tf.AutoModel.from_config(config).eval()
    for param in model.parameters():
        if param.dim() > 1:
            param.data.normal_(0, 0.2)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("model_type", sorted(SETTINGS))
def test_padding_sensitive_familys_stored_vectors_are_its_unbatched_block_outputs(model_type, text_jsonl, tmp_path):
    """Texts of many lengths, 8 a batch: each stored vector of blocks 0 and 2 equals the block's output
    on the sample alone. Padded batches gave the short texts vectors 0.15 to 1.6 off (relative)."""
    model = build_encoder(model_type, tmp_path / "model")
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"batch_size": 8, "parts": 1, "max_seq_length": 64})
    run_part(config, 0, tmp_path / "part-0000", progress=False)
    part = open_part(tmp_path / "part-0000")
    assert [row["sample_idx"] for row in part.samples] == list(range(30))
    assert len({row["num_tokens"] for row in part.samples}) >= 10  # batches of 8 would mix lengths
    loaded = load_model(model)
    for local in range(len(part.samples)):
        outputs = {}

        def keep(module, args, output):  # returns None: the block's output goes on unchanged
            outputs[module] = output[0] if isinstance(output, tuple) else output
        handles = [loaded.blocks[i].register_forward_hook(keep) for i in (0, 2)]
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([part.token_ids(local).tolist()]))
        for handle in handles:
            handle.remove()
        for i in (0, 2):
            stored, ref = part.activations(f"layer_{i}", local), outputs[loaded.blocks[i]][0].numpy()
            assert stored.shape == ref.shape and rel_err(stored, ref) <= REL_TOL, (model_type, i, local)


def test_a_padding_sensitive_family_batches_one_length_at_a_time(caplog):
    """Longest first and every sample once, as for any family, but never two lengths in one batch."""
    lengths = [5, 9, 1, 9, 3, 7, 7, 2, 7, 7]
    with caplog.at_level("INFO", logger="actstore.extract.inputs"):
        batches = length_batches(lengths, 3, "fnet")
    assert batches == [[1, 3], [5, 6, 8], [9], [0], [4], [7], [2]]  # ties keep sample order
    assert caplog.text.count("model_type fnet: padding changes its real tokens' outputs") == 1


def test_other_families_batch_across_lengths_as_before(caplog):
    lengths = [5, 9, 1, 9, 3, 7, 7, 2, 7, 7]
    with caplog.at_level("INFO", logger="actstore.extract.inputs"):
        batches = length_batches(lengths, 3, "bert")
    assert batches == length_batches(lengths, 3) == [[1, 3, 5], [6, 8, 9], [0, 4, 7], [2]]
    assert "padding changes" not in caplog.text
