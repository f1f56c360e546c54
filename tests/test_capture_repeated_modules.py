"""Review of capture on modules that run more than once in one forward: ALBERT's shared layer groups,
a hooked module the forward calls twice, and the token log-probs' head reruns beside an LM-head hook."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny
from actstore.errors import ConfigError
from actstore.extract import logprobs, run_part
from actstore.formats.extract import open_part
from actstore.models import load_model


def albert(out, **sizes):
    """A tiny seeded ALBERT (3 blocks) saved like a user's checkpoint; `sizes`: its layer grouping."""
    import transformers as tf

    torch.manual_seed(0)
    out.mkdir()
    tiny.train_tokenizer(out, causal=False)
    tf.AlbertModel(tf.AlbertConfig(vocab_size=300, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                   num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                                   **sizes)).save_pretrained(out)
    return out


@pytest.mark.parametrize("sizes", [{}, {"inner_group_num": 3}])
def test_albert_blocks_sharing_a_layer_group_are_refused_by_name_before_the_weights_load(tmp_path, sizes):
    """ALBERT as released runs one layer group for every block; with inner_group_num 3 that group holds
    a ModuleList of 3 layers, which was taken for the blocks and stored each layer's last call of the
    three as "layer i". Both are named by config.json before a weight is read (none is there)."""
    model = albert(tmp_path / "albert", **sizes)
    (model / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="num_hidden_groups 1 < num_hidden_layers 3"):
        load_model(model)


def test_albert_with_a_layer_group_per_block_stores_each_blocks_output(tmp_path, text_jsonl):
    model = albert(tmp_path / "albert", num_hidden_groups=3)
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"parts": 1, "layers": [0, 1, 2]})
    run_part(config, 0, tmp_path / "part", progress=False)
    part, loaded = open_part(tmp_path / "part"), load_model(model)
    ids = torch.from_numpy(part.token_ids(0).astype(np.int64))[None]
    with torch.inference_mode():
        hidden = loaded.model(input_ids=ids, output_hidden_states=True).hidden_states
    for i in range(3):
        np.testing.assert_allclose(part.activations(f"layer_{i}", 0), hidden[i + 1][0].numpy(), rtol=0, atol=1e-5)


def test_a_hook_on_a_module_run_twice_in_one_forward_is_refused_naming_it(model_dir, text_jsonl, tmp_path):
    """T5's encoder runs its dropout on the embeddings and again on the final output: the hook kept
    the final output and stored it as dropout:output, which reads as the embeddings'."""
    config = tiny.make_config(tmp_path, model_dir("t5"), text_jsonl,
                              extract={"parts": 1, "layers": [0], "hooks": ["dropout:output", "embed_tokens:output"]})
    with pytest.raises(ConfigError, match=r"extract.hooks 'dropout:output': its module ran 2 times in one forward"):
        run_part(config, 0, tmp_path / "part", progress=False)
    assert not (tmp_path / "part").exists()


def test_token_logprob_head_reruns_are_not_counted_as_the_lm_head_hooks_calls(model_dir, text_jsonl, tmp_path,
                                                                             monkeypatch):
    """The log-probs run the causal LM's forward again for each chunk of tokens, after the batch is
    packed: each is a forward of its own, so a hook on the head sees one call per forward."""
    monkeypatch.setattr(logprobs, "LOGPROB_ELEMENTS", 300 * 5)  # vocabulary 300: 5 tokens a chunk
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl,
                              extract={"parts": 1, "layers": [0], "hooks": ["lm_head:input"]})
    run_part(config, 0, tmp_path / "part", progress=False)
    part = open_part(tmp_path / "part")
    assert not np.isnan(part.token_logprob(0)[1:]).any()
    assert part.activations("lm_head:input", 0).shape == part.activations("layer_0", 0).shape
