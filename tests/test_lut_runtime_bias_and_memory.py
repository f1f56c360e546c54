"""Review of the LUT runtime: a LUT written by write_lut for the tiny model of real nn.Linear layers
of test_lut_install_hostile_inputs, installed with install_luts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from actstore.errors import ConfigError
from actstore.formats.lut import open_lut, precompute, write_lut
from actstore.lut_runtime import install_luts
from test_lut_install_hostile_inputs import K, Tiny, sae_state, tables_for


def test_auto_dense_path_adds_the_linears_own_bias_not_its_16_bit_rounding(tmp_path):
    """A q bias of a few hundred (Qwen2's q/k/v hold such) is 0.2 off in bfloat16 tables: the dense
    path of runtime auto, the exact one, must equal the nn.Linear it replaced."""
    torch.manual_seed(0)
    model = Tiny()
    q = model.layers[0].q
    with torch.no_grad():
        q.bias.mul_(300)
    tables = {"layers.0.q": precompute(sae_state(), q.weight.detach().T, q.bias.detach(), "bfloat16")}
    x = torch.randn(64, q.in_features)
    with torch.no_grad():
        exact = q(x)
    installed = install_luts(model, open_lut(write_lut(tmp_path, tables, K)), runtime="auto", crossover_tokens=0)
    with torch.no_grad():
        dense = model.layers[0].q(x)
    assert installed["layers.0.q"].paths == {"lookup": 0, "dense": 1}
    assert torch.equal(dense, exact)


def test_a_target_without_weights_is_named_and_the_model_left_as_it_was(tmp_path):
    """A target on the meta device (a model_skeleton, a layer accelerate offloads) has no weights to
    check the tables against: the error names it, not torch's 'Tensor.item() cannot be called on meta
    tensors'."""
    torch.manual_seed(0)
    model = Tiny()
    lut = write_lut(tmp_path, tables_for(model), K)
    model.layers[0].k.to("meta")
    with pytest.raises(ConfigError, match=r"'layers\.0\.k' holds no weights \(meta device"):
        install_luts(model, open_lut(lut))
    assert isinstance(model.layers[0].q, nn.Linear)


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (tuple, list, set)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def test_what_a_group_computed_for_an_input_is_freed_with_the_input(tmp_path):
    """As in a decoder layer under torch.no_grad (generate's mode), the targets' input is a local freed
    once the layer returns: its encoding and residuals (tokens x budget) were held until the group's
    next input, in every layer at once (24 MB here for 100,000 tokens at budget 16)."""
    torch.manual_seed(0)
    model = Tiny()
    installed = install_luts(model, open_lut(write_lut(tmp_path, tables_for(model), K)), budget=16)
    encoder = installed["layers.0.q"].encoder

    def layer(tokens: int) -> list[torch.Tensor]:
        x = torch.randn(tokens, model.layers[0].q.in_features)
        return [model.layers[0].q(x), model.layers[0].k(x)]

    with torch.no_grad():
        outputs = layer(100_000)
    assert encoder.counts["encodings"] == 1 and len(outputs) == 2
    assert _tensor_bytes(encoder._last) == 0


def test_calibration_leaves_the_callers_seeded_random_stream_alone(tmp_path):
    """runtime auto times random inputs at install: drawn from the global generator, they moved a
    seeded caller's stream (sampling, dropout) by as many draws as the time bound let it time."""
    torch.manual_seed(0)
    model = Tiny()
    lut = open_lut(write_lut(tmp_path, tables_for(model), K))
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    installed = install_luts(model, lut, runtime="auto")
    assert installed["layers.0.q"].calibration["rows"]
    assert torch.equal(torch.rand(3), expected)
