"""The LUT runtime: nn.Linear replaced by SAE encode + lookup (tables from actstore.formats.lut).

Runtime, per spec: Step A values, indices = TopK(ReLU(x @ E.T + e)); Step B
out = sum_j values_j * P[indices_j] + bias_product (+ the linear's own bias, an extension).
Targets whose tables hold the same encoder share one LutEncoder, which encodes each input tensor once
per forward (q/k/v all see the same hidden_states object).

Online compensation, done soundly (the spec's sketch overwrites output columns with a partial product
over a subset of *input* dimensions, which is not a correction of anything): the LUT output equals
x_hat @ W where x_hat = sum_j values_j W_dec[indices_j] + b_dec is the TopK reconstruction, so the
exact output is LUT(x) + (x - x_hat) @ W. With a budget of s input dimensions per token we add that
residual term on the s dimensions with the largest |x - x_hat| (gather-based: s rows of W per token).
With s = input_dim the output is x @ W up to the float16 rounding of the stored tables.

Every weighted sum of table rows (Step B, the reconstruction x_hat, the compensation's rows of W) is
one torch.nn.functional.embedding_bag(mode="sum", per_sample_weights=...): it never materialises the
[rows, k, out] gather. It accumulates in float32 for float16/bfloat16 tables (CPU measured, CUDA by
its kernel's accumulate type) but writes its output in the table's dtype, so tables are held in the
dtype the model computes in: a float32 model upcasts 16-bit tables at load (otherwise its outputs
would be rounded to 16 bits), a bfloat16 model keeps bfloat16 tables as stored.

Runtime `auto` (lut.runtime): above a crossover token count a target runs the dense x @ W it replaced
(when that weight is present). The crossover is where the lookup stops reading fewer bytes than
dense (both are memory bound at small batches): see LutLinear.crossover_tokens.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn

from actstore.errors import ConfigError, FormatError
from actstore.formats.lut import LutStore

log = logging.getLogger(__name__)
RUNTIMES = ("lookup", "auto")


def weighted_rows(weights: torch.Tensor, indices: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """sum_j weights[n, j] * table[indices[n, j]] -> [n, table.shape[1]] in table's dtype, fused
    (no [n, k, out] temporary); weights are cast to the table's dtype, as embedding_bag requires."""
    return nn.functional.embedding_bag(indices, table, per_sample_weights=weights.to(table.dtype), mode="sum")


def _version(x: torch.Tensor) -> int | None:
    """In-place edit counter (a cached encoding is stale once x changed); inference tensors have none."""
    return None if x.is_inference() else x._version


class LutEncoder(nn.Module):
    """Spec Step A, shared by every target with the same SAE; caches the last input's encoding."""

    def __init__(self, tables: dict[str, torch.Tensor], k_active: int, dtype: torch.dtype):
        super().__init__()
        self.k_active = k_active
        for key in ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias"):
            self.register_buffer(key, tables[key].to(dtype), persistent=False)
        self.n_encodings = 0  # counted so tests and benches can see the sharing
        self.target_outputs: list[int] = []  # output_dim of every LutLinear sharing this encoding
        # (input, its version, its encoding, residual terms by budget) of the last input seen.
        self._last: tuple[Any, int | None, tuple[torch.Tensor, torch.Tensor], dict] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices) [N, k] for x [..., input_dim] flattened to N rows."""
        last, version = self._last, _version(x)
        if last is not None and last[0]() is x and last[1] == version:
            return last[2]
        flat = x.reshape(-1, x.shape[-1]).to(self.encoder_weight.dtype)
        pre = torch.relu(flat @ self.encoder_weight.T + self.encoder_bias)
        values, indices = torch.topk(pre, self.k_active, dim=-1)
        self.n_encodings += 1
        self._last = (weakref.ref(x), version, (values, indices), {})
        return values, indices

    def residual_top(self, x: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x - x_hat) on the `budget` dims S of largest |x - x_hat| per token, and S: computed once per
        input and budget for all targets sharing this encoder, like the encoding itself."""
        values, indices = self(x)
        cached = self._last[3]
        if budget not in cached:
            flat = x.reshape(-1, x.shape[-1]).to(self.decoder_weight.dtype)
            residual = flat - self.reconstruct(values, indices)
            top = torch.topk(residual.abs(), budget, dim=-1).indices
            cached[budget] = (residual.gather(1, top), top)
        return cached[budget]

    def reconstruct(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x_hat = sum_j values_j * W_dec[indices_j] + b_dec: what the lookup represents in input space."""
        return weighted_rows(values, indices, self.decoder_weight) + self.decoder_bias


class LutLinear(nn.Module):
    """Drop-in replacement for an nn.Linear: Step A (shared encoder) + Step B (+ compensation), or with
    runtime "auto" the dense x @ W above the crossover token count. `paths` counts which ran."""

    def __init__(self, encoder: LutEncoder, tables: dict[str, torch.Tensor], linear: nn.Linear | None,
                 budget: int = 0, dtype: torch.dtype = torch.float32, with_bias: bool = True,
                 runtime: str = "lookup"):
        super().__init__()
        if runtime not in RUNTIMES:
            raise ConfigError(f"lut.runtime {runtime!r}: expected one of {RUNTIMES}")
        self.encoder = encoder
        self.register_buffer("precomputed_products", tables["precomputed_products"].to(dtype), persistent=False)
        self.register_buffer("bias_product", tables["bias_product"].to(dtype), persistent=False)
        bias = tables.get("target_bias")
        if bias is None and linear is not None and linear.bias is not None:
            bias = linear.bias.detach()
        if not with_bias:
            bias = None
        self.register_buffer("target_bias", None if bias is None else bias.to(dtype), persistent=False)
        # W_target [in, out] (rows are what compensation sums), read by compensation and the dense path.
        w_target = None if linear is None else linear.weight.detach().T.contiguous().to(dtype)
        self.register_buffer("w_target", w_target, persistent=False)
        self.in_features = tables["decoder_weight"].shape[1]
        self.out_features = tables["precomputed_products"].shape[1]
        encoder.target_outputs.append(self.out_features)
        # Without W there is nothing to fall back to: auto is then the lookup.
        self.runtime = runtime if w_target is not None else "lookup"
        self.paths = {"lookup": 0, "dense": 0}
        self.budget = 0
        self.set_budget(budget)

    def set_budget(self, budget: int) -> None:
        """Input dims per token computed exactly online (0 = pure lookup, input_dim = exact)."""
        if budget and self.w_target is None:
            raise ConfigError("LUT compensation needs the original linear weight (W_target)")
        self.budget = max(0, min(int(budget), self.in_features))

    def crossover_tokens(self) -> int:
        """Most tokens for which encode + lookup (+ compensation) of every target sharing the encoder
        reads fewer table bytes than their dense x @ W. Dense reads in x sum(out) once per batch; the
        LUT reads the encoder (num_basis x in) once, then per token k rows of each table, and with
        compensation k decoder rows and `budget` rows of each W. Bytes, not FLOPs, because both sides
        are memory bound at the small batches where the lookup can win; 0 means dense always wins."""
        enc, outs = self.encoder, self.encoder.target_outputs
        k, d_in, total = enc.k_active, self.in_features, sum(outs)
        fixed = d_in * total - enc.encoder_weight.shape[0] * d_in
        per_token = k * total + (len(outs) * k * d_in + self.budget * total if self.budget else 0)
        return max(0, fixed // per_token)

    def lookup(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Spec Step B: sum_j values_j * P[indices_j] + bias_product."""
        return weighted_rows(values, indices, self.precomputed_products) + self.bias_product

    def compensation(self, x: torch.Tensor) -> torch.Tensor:
        """(x - x_hat)[:, S] @ W_target[S, :] for the `budget` dims S of largest |x - x_hat| per token."""
        return weighted_rows(*self.encoder.residual_top(x, self.budget), self.w_target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.runtime == "auto" and len(flat) > self.crossover_tokens():
            self.paths["dense"] += 1
            out = flat.to(self.w_target.dtype) @ self.w_target
        else:
            self.paths["lookup"] += 1
            values, indices = self.encoder(x)
            out = self.lookup(values, indices)
            if self.budget:
                out = out + self.compensation(x)
        if self.target_bias is not None:
            out = out + self.target_bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _parent(model: nn.Module, module_path: str) -> tuple[nn.Module, str]:
    from actstore.models import get_module

    parent_path, _, name = module_path.rpartition(".")
    return (get_module(model, parent_path) if parent_path else model), name


def install_luts(model: nn.Module, store: LutStore, budget: int = 0, dtype: torch.dtype | None = None,
                 runtime: str = "lookup") -> dict[str, LutLinear]:
    """Replace every layer of `store` in `model` by a LutLinear; same encoder tensors -> one LutEncoder.
    Tables are held in `dtype`, by default the dtype of the linear they replace (module docstring)."""
    from actstore.models import get_module

    encoders: dict[bytes, LutEncoder] = {}
    installed = {}
    for module_path, entry in store.layers.items():
        linear = get_module(model, module_path)
        if not isinstance(linear, nn.Linear):
            raise ConfigError(f"lut target {module_path!r} is a {type(linear).__name__}, not nn.Linear")
        if (linear.in_features, linear.out_features) != (entry["input_dim"], entry["output_dim"]):
            raise FormatError(f"{store.dir / entry['file']}: [{entry['input_dim']}, {entry['output_dim']}] does not "
                              f"fit {module_path} ({linear.in_features} -> {linear.out_features})")
        tables = store.load(module_path)
        held = dtype or linear.weight.dtype
        key = b"".join(tables[k].contiguous().view(torch.uint8).numpy().tobytes()
                       for k in ("encoder_weight", "encoder_bias"))
        if key not in encoders:
            encoders[key] = LutEncoder(tables, store.k_active, held).to(linear.weight.device)
        lut = LutLinear(encoders[key], tables, linear, budget, held, runtime=runtime).to(linear.weight.device)
        parent, name = _parent(model, module_path)
        setattr(parent, name, lut)
        installed[module_path] = lut
    return installed
