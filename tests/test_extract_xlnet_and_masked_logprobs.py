"""Review 58 of the extraction's capture and token log-probs: a hook inside a tokens-first model's
blocks (XLNet) is stored per sample and token like its blocks' outputs, and a head masking tokens with
-inf logits gives token log-probs instead of being refused as differing from its rerun by NaN."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny
from actstore.errors import ConfigError
from actstore.extract import run_part
from actstore.extract.logprobs import TokenLogprobs
from actstore.formats.extract import open_part
from actstore.models import load_model
from test_models_xlnet_encdec_bin_shards import build_xlnet

XLNET_HOOKS = ["transformer.layer.0.ff:output", "transformer.layer.1.rel_attn:input", "transformer.layer.1:output",
               "lm_loss:input"]


def module_tensors(loaded, hooks: list[str]) -> dict[str, torch.Tensor]:
    """hook spec -> its module's input or (first) output, as the model computed it, after each forward."""
    seen = {}
    for spec in hooks:
        path, _, io = spec.rpartition(":")
        loaded.model.get_submodule(path).register_forward_hook(
            lambda module, args, output, spec=spec, io=io: seen.__setitem__(
                spec, args[0] if io == "input" else output[0] if isinstance(output, tuple) else output))
    return seen


def test_xlnet_hooks_inside_its_blocks_are_stored_per_sample_and_token(text_jsonl, tmp_path):
    """XLNet's blocks and what is inside them compute on (tokens, batch, hidden): only the blocks'
    outputs were transposed, so a hook inside a block (or on a block, by hooks:) was stored laid over
    the wrong samples and tokens, silently in a batch of as many samples (30) as tokens. The LM head
    runs after the model transposes back: its input is (batch, tokens, hidden) as it was."""
    model = build_xlnet(tmp_path / "model")
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={
        "batch_size": 30, "max_seq_length": 30, "parts": 1, "layers": [1], "hooks": XLNET_HOOKS})
    run_part(config, 0, tmp_path / "part", progress=False)
    part = open_part(tmp_path / "part")
    assert max(row["num_tokens"] for row in part.samples) == len(part.samples) == 30
    loaded = load_model(model)
    seen = module_tensors(loaded, XLNET_HOOKS)
    for local in range(len(part.samples)):
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([part.token_ids(local).tolist()]))
        for spec in XLNET_HOOKS:
            reference = seen[spec][0] if spec == "lm_loss:input" else seen[spec][:, 0]  # one sample's tokens
            np.testing.assert_allclose(part.activations(spec, local), reference.numpy(), rtol=1e-5, atol=1e-5,
                                       err_msg=spec)
        np.testing.assert_array_equal(part.activations("layer_1", local),
                                      part.activations("transformer.layer.1:output", local))


def phi_with_head_bias(out, value: float):
    """A tiny seeded Phi (its LM head has a bias) whose head gives `value` for tokens 200 on."""
    model = tiny.build_family("phi", out)
    loaded = load_model(model)
    with torch.no_grad():
        loaded.model.lm_head.bias[200:] = value
    loaded.model.save_pretrained(model)
    return model


def test_a_head_masking_tokens_with_minus_inf_stores_the_models_token_logprobs(text_jsonl, tmp_path):
    """The first batch's check took the rerun's -inf logits minus the forward's -inf for NaN and
    refused the model ("differs by nan"); the log-probs are the model's own, -inf at a masked token."""
    model = phi_with_head_bias(tmp_path / "model", float("-inf"))
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"parts": 1, "layers": [0]})
    run_part(config, 0, tmp_path / "part", progress=False)
    part, loaded = open_part(tmp_path / "part"), load_model(model)
    masked = 0
    for local in range(len(part.samples)):
        ids = torch.from_numpy(part.token_ids(local).astype(np.int64))
        with torch.inference_mode():
            log_p = torch.log_softmax(loaded.model(input_ids=ids[None]).logits[0].float(), -1)
        expected = log_p[:-1].gather(1, ids[1:, None])[:, 0].numpy()
        np.testing.assert_allclose(part.token_logprob(local)[1:], expected, rtol=1e-4, atol=1e-4)
        masked += int(np.isneginf(expected).sum())
    assert masked  # the texts hold masked tokens


def first_batch(model):
    """A real TokenLogprobs after a forward of two texts: (it, final hidden states at each row's last
    token, the forward's logits there)."""
    loaded = load_model(model)
    logprobs = TokenLogprobs(loaded)
    ids = torch.tensor([[5, 17, 40, 41], [9, 120, 33, 2]])
    with logprobs.attached(), torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[:, -1]
        return logprobs, logprobs.base()[1].last_hidden_state[:, -1], logits


def test_the_head_check_still_refuses_a_real_difference_beside_minus_inf_logits(tmp_path):
    """Equal infinities count as equal, others not: nor does an -inf logit make the tolerance (a
    fraction of the largest logit) infinite."""
    logprobs, hidden, logits = first_batch(phi_with_head_bias(tmp_path / "model", float("-inf")))
    with torch.inference_mode():
        logprobs.check(hidden, logits)
        with pytest.raises(ConfigError, match=r"differs from the forward's logits by 1 \(largest logit"):
            logprobs.check(hidden, logits + 1.0)


def test_nan_in_the_models_own_logits_is_named_as_the_models(text_jsonl, tmp_path):
    model = phi_with_head_bias(tmp_path / "model", float("nan"))
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"parts": 1, "layers": [0]})
    with pytest.raises(ConfigError, match=r"PhiForCausalLM: its forward's logits .* hold NaN, computed by the model"):
        run_part(config, 0, tmp_path / "part", progress=False)
    assert not (tmp_path / "part").exists()
