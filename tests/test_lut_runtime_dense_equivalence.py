"""Review 63 of the LUT runtime: LutLinear against the dense computation, the CUDA dispatch of float64
tables, a linear of another shape than its tables, and relative_errors on a zero target output."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from actstore import lut_runtime
from actstore.errors import ConfigError
from actstore.formats.lut import open_lut, precompute, write_lut
from actstore.lut import relative_errors
from actstore.lut_runtime import LutEncoder, LutLinear, embedding_bag_rows, topk_relu, weighted_rows

D, BASIS, OUT, K = 8, 16, 5, 3


def _sae(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"encoder_weight": torch.randn(BASIS, D, generator=g, dtype=torch.float64),
            "encoder_bias": torch.randn(BASIS, generator=g, dtype=torch.float64),
            "decoder_weight": torch.randn(BASIS, D, generator=g, dtype=torch.float64),
            "decoder_bias": torch.randn(D, generator=g, dtype=torch.float64)}


def _tables(linear: nn.Linear, seed: int = 0) -> dict[str, torch.Tensor]:
    tables = _sae(seed)
    weight = linear.weight.detach().T.to(torch.float64)
    tables["precomputed_products"] = tables["decoder_weight"] @ weight
    tables["bias_product"] = tables["decoder_bias"] @ weight
    return tables


def dense_reference(tables: dict[str, torch.Tensor], module: nn.Module, x: torch.Tensor, budget: int,
                    k: int) -> torch.Tensor:
    """x -> SAE encode -> top-k -> decode, plus (x - x_hat) on the `budget` dims of largest |x - x_hat|,
    -> the target module (an nn.Linear or a Conv1D, with its bias), computed densely: what the runtime
    computes."""
    flat = x.reshape(-1, x.shape[-1])
    pre = torch.relu(flat @ tables["encoder_weight"].T + tables["encoder_bias"])
    values, indices = torch.topk(pre, k)
    x_hat = torch.zeros_like(pre).scatter(1, indices, values) @ tables["decoder_weight"] + tables["decoder_bias"]
    residual = flat - x_hat
    kept = torch.zeros_like(residual)
    if budget:
        top = torch.topk(residual.abs(), min(budget, flat.shape[1])).indices
        kept = kept.scatter(1, top, residual.gather(1, top))
    out = module(x_hat + kept)
    return out.reshape(*x.shape[:-1], out.shape[-1])


@pytest.mark.parametrize("budget", [0, 1, D, D + 5])
@pytest.mark.parametrize("shape", [(4, D), (2, 3, D), (1, D), (0, D), (1, 1, D), (D,)])
@pytest.mark.parametrize("inference", [False, True])
def test_lut_linear_equals_the_dense_computation_at_every_budget(budget, shape, inference):
    """float64 tables: LutLinear's output is the dense encode -> top-k -> decode (+ compensation) -> linear
    to float64 rounding, for 2-D, 3-D, 1-D, one-token and empty inputs, with grad and in inference_mode;
    a budget of the input width or more is x @ W + b."""
    torch.manual_seed(1)
    linear = nn.Linear(D, OUT).double()
    tables = _tables(linear)
    lut = LutLinear(LutEncoder(tables, K, torch.float64), tables, linear, budget)
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.inference_mode(inference):
        out = lut(x)
    expect = dense_reference(tables, linear, x, budget, K)
    assert out.shape == expect.shape == (*shape[:-1], OUT)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
    if budget >= D:
        torch.testing.assert_close(out, linear(x), rtol=1e-12, atol=1e-12)


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the runtime's dispatch to the Triton kernels, seen on a CPU."""

    @property
    def is_cuda(self) -> bool:
        return True


class _Kernels:
    def __init__(self):
        self.calls = []

    def weighted_rows_triton(self, weights, indices, table):
        self.calls.append(("weighted_rows", table.dtype))
        return embedding_bag_rows(weights.as_subclass(torch.Tensor), indices.as_subclass(torch.Tensor),
                                  table.as_subclass(torch.Tensor))

    def topk_relu_triton(self, pre, k):
        self.calls.append(("topk_relu", pre.dtype))
        return torch.topk(pre.as_subclass(torch.Tensor).relu(), k, dim=-1)


@pytest.fixture
def fake_kernels(monkeypatch):
    kernels = _Kernels()
    monkeypatch.setattr(lut_runtime, "_lut_kernels", lambda: kernels)
    monkeypatch.setattr(lut_runtime, "TRITON_LOADED", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float64_tables_on_cuda_never_take_the_float32_triton_kernels(fake_kernels, dtype):
    """The Triton kernels sum in float32 (Step B) and sort float32 bits (Step A): a float64 model's tables
    (install_luts dtype=torch.float64, a HELD_DTYPES) on CUDA were summed to float32 precision, and in a
    graph capture its top-k values rounded to float32. float64 takes torch's ops; float32 still the kernels."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(30, 6, generator=g, dtype=dtype).as_subclass(_FakeCuda)
    indices = torch.randint(0, 30, (lut_runtime.DECODE_ROWS + 1, 4), generator=g)
    weights = torch.rand(len(indices), 4, generator=g, dtype=dtype)
    weighted_rows(weights, indices, table)
    topk_relu(torch.randn(2, 30, generator=g, dtype=dtype).as_subclass(_FakeCuda), 4)
    if dtype == torch.float64:
        assert fake_kernels.calls == []
    else:
        assert [call for call, _ in fake_kernels.calls] == ["weighted_rows", "topk_relu"]


def test_a_linear_of_another_shape_than_its_tables_is_refused():
    """LutLinear given a linear whose weight is not [out, in] of its tables: with a budget the compensation
    gathered the first `in` rows of another weight, and a group's later targets read this one's extra
    columns of W as theirs (silently wrong); named, before the group's tables change."""
    linear = nn.Linear(D, OUT).double()
    tables = _tables(linear)
    encoder = LutEncoder(tables, K, torch.float64)
    for other in (nn.Linear(D, OUT + 2), nn.Linear(D + 2, OUT)):
        with pytest.raises(ConfigError, match=r"tables need \[5, 8\]"):
            LutLinear(encoder, tables, other.double(), budget=2)
    assert encoder.n_targets == 0 and encoder.products.shape == (BASIS, 0)
    LutLinear(encoder, tables, linear, budget=2)  # its own linear installs


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, OUT)


def test_a_token_whose_target_output_is_zero_is_no_1e12_relative_error(tmp_path, caplog):
    """relative_errors divided each token's error by its exact output's norm floored at 1e-12: a held-out
    token whose x @ W is 0 (an all-zero activation) made mean_token_relative_error ~1e9 even at the full
    budget (the float16 tables' rounding over 1e-12). Its ratio is undefined: left out of the mean, counted
    (zero_output_tokens) and logged; every other value as before."""
    torch.manual_seed(0)
    model = _Model()
    state = {key: value.float() for key, value in _sae().items()}
    tables = {"proj": precompute(state, model.proj.weight.detach().T, model.proj.bias.detach(), "float16")}
    store = open_lut(write_lut(tmp_path, tables, K))
    x = torch.randn(6, D)
    plain = relative_errors(store, model, x, [0, D])
    with caplog.at_level(logging.WARNING):
        zeroed = relative_errors(store, model, torch.cat([x, torch.zeros(1, D)]), [0, D])
    for budget in ("0", str(D)):
        assert zeroed["proj"][budget]["mean_token_relative_error"] == pytest.approx(
            plain["proj"][budget]["mean_token_relative_error"], rel=1e-6)
        assert zeroed["proj"][budget]["zero_output_tokens"] == 1
        assert "zero_output_tokens" not in plain["proj"][budget]
    assert plain["proj"][str(D)]["mean_token_relative_error"] < 1e-2
    assert "1 held-out token(s)" in caplog.text and "proj" in caplog.text
