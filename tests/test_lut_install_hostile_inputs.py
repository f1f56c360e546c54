"""LUT writer and runtime on hostile or mistaken inputs: a LUT written by write_lut for a tiny model of
real nn.Linear layers, installed with install_luts."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from actstore.errors import ConfigError, FormatError
from actstore.formats.lut import open_lut, precompute, write_lut
from actstore.lut_runtime import install_luts
from actstore.models import get_module

D_IN, D_OUT, BASIS, K = 16, 24, 32, 4
TARGETS = ("layers.0.q", "layers.0.k")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(D_IN, D_OUT), nn.Linear(D_IN, D_OUT, bias=False)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block()])


def sae_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"encoder_weight": torch.randn(BASIS, D_IN, generator=gen),
            "encoder_bias": torch.randn(BASIS, generator=gen) * 0.1,
            "decoder_weight": torch.randn(BASIS, D_IN, generator=gen) / 4,
            "decoder_bias": torch.randn(D_IN, generator=gen) * 0.1}


def tables_for(model: nn.Module, paths: tuple[str, ...] = TARGETS) -> dict[str, dict[str, torch.Tensor]]:
    sae, linears = sae_state(), {path: get_module(model, path) for path in paths}
    return {path: precompute(sae, linear.weight.detach().T, linear.bias) for path, linear in linears.items()}


@pytest.fixture
def model_and_lut(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    return model, write_lut(tmp_path, tables_for(model), K)


def test_a_failed_install_leaves_the_model_as_it_was(model_and_lut):
    """k's table no longer matches the model's k: the error names it, and q (checked first) is not
    left replaced, so a corrected second install is not refused as 'not nn.Linear'."""
    model, lut = model_and_lut
    with torch.no_grad():
        model.layers[0].k.weight.mul_(2)
    with pytest.raises(FormatError, match=r"layers\.0\.k\.lut\.safetensors.*layers\.0\.k"):
        install_luts(model, open_lut(lut))
    assert [type(m) for m in (model.layers[0].q, model.layers[0].k)] == [nn.Linear, nn.Linear]


def test_one_module_reached_by_two_paths_is_refused(tmp_path):
    """get_module finds a module by its path and by its base model's: two tables for one linear."""
    wrapper = nn.Module()
    wrapper.base_model = Tiny()
    lut = write_lut(tmp_path, tables_for(wrapper, ("base_model.layers.0.q", "layers.0.q")), K)
    with pytest.raises(ConfigError, match=r"'base_model\.layers\.0\.q' and 'layers\.0\.q' are one module"):
        install_luts(wrapper, open_lut(lut))


@pytest.mark.parametrize("budget", [-1, 1.5, True, "8", None])
def test_a_budget_that_is_no_whole_number_is_named(model_and_lut, budget):
    """-1 was a silent pure lookup (the least exact, where a user means 'all'), 1.5 and True 1."""
    model, lut = model_and_lut
    with pytest.raises(ConfigError, match="lut budget"):
        install_luts(model, open_lut(lut), budget=budget)
    assert isinstance(model.layers[0].q, nn.Linear)


def test_whole_budgets_still_install_and_set(model_and_lut):
    model, lut = model_and_lut
    installed = install_luts(model, open_lut(lut), budget=np.int64(8))
    assert installed["layers.0.q"].budget == 8
    installed["layers.0.q"].set_budget(10**9)  # more than input_dim: exact, as documented
    assert installed["layers.0.q"].budget == D_IN
    with pytest.raises(ConfigError, match="lut budget -1"):
        installed["layers.0.q"].set_budget(-1)


@pytest.mark.parametrize("crossover", ["10", -5, 2.5])
def test_a_crossover_that_is_no_whole_number_is_named_at_install(model_and_lut, crossover):
    """A string was a TypeError at the first forward; -5 made every call dense."""
    model, lut = model_and_lut
    with pytest.raises(ConfigError, match="lut crossover_tokens"):
        install_luts(model, open_lut(lut), runtime="auto", crossover_tokens=crossover)


@pytest.mark.parametrize("dtype", ["float16", torch.int8])
def test_a_dtype_that_is_no_floating_torch_dtype_is_named(model_and_lut, dtype):
    """'float16' was torch's 'Invalid device string', int8 torch.finfo's TypeError."""
    model, lut = model_and_lut
    with pytest.raises(ConfigError, match="lut dtype"):
        install_luts(model, open_lut(lut), dtype=dtype)


@pytest.mark.parametrize("module_path", ["../escape", "sub/dir"])
def test_write_refuses_a_module_path_that_is_no_bare_file_name(tmp_path, module_path):
    """'../escape' wrote escape.lut.safetensors beside lut/ (a store verify then refused); 'sub/dir'
    was a bare FileNotFoundError on a temp path."""
    tables = tables_for(Tiny(), ("layers.0.q",))
    with pytest.raises(FormatError, match="gives no bare file name"):
        write_lut(tmp_path / "out", {module_path: tables["layers.0.q"]}, K)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("k_active", [0, BASIS + 1])
def test_write_refuses_k_active_outside_the_basis(tmp_path, k_active):
    """A store whose own verify would refuse it (and a TopK that cannot run) is not written."""
    with pytest.raises(FormatError, match=f"k_active {k_active} is not within 1..num_basis {BASIS}"):
        write_lut(tmp_path / "out", tables_for(Tiny()), k_active)
    assert not (tmp_path / "out").exists()


def test_a_layer_the_model_lacks_is_named_with_the_luts_metadata(model_and_lut):
    """A LUT for another model: the missing module was named as an 'extract.hooks' one, a key the user
    never set for it; it is named with the LUT's metadata.json, where the path came from."""
    _, lut = model_and_lut
    other = nn.Module()
    other.layers = nn.ModuleList([nn.Module()])
    store = open_lut(lut)
    named = re.escape(f"{store.dir / 'metadata.json'} layers: module 'layers.0.q' does not exist")
    with pytest.raises(ConfigError, match=f"^{named}"):
        install_luts(other, store)
