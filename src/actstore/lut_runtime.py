"""The LUT runtime: an nn.Linear (or a transformers Conv1D: GPT-2's projections) replaced by SAE
encode + lookup (tables from actstore.formats.lut).

Runtime, per spec: Step A values, indices = TopK(ReLU(x @ E.T + e)); Step B
out = sum_j values_j * P[indices_j] + bias_product (+ the linear's own bias, an extension).
Targets whose tables hold the same SAE (encoder and decoder) share one LutEncoder, which encodes each
input tensor once per forward (q/k/v all see the same hidden_states object), and runs Step B, the
compensation and runtime auto's dense x @ W once for all of them: it holds their P (and W) side by
side as one [B, sum of outs] ([in, sum of outs]) table, so one lookup reads each selected row of every
target at once and each target takes its columns. At decode-sized batches a lookup is mostly per-call
overhead, which this pays once per group instead of once per target (bench/README.md `## lut`); every
lookup column is the same sum as a lookup in the target's own table, bit for bit.

Online compensation, done soundly (the spec's sketch overwrites output columns with a partial product
over a subset of *input* dimensions, which is not a correction of anything): the LUT output equals
x_hat @ W where x_hat = sum_j values_j W_dec[indices_j] + b_dec is the TopK reconstruction, so the
exact output is LUT(x) + (x - x_hat) @ W. With a budget of s input dimensions per token we add that
residual term on the s dimensions with the largest |x - x_hat| (gather-based: s rows of W per token).
With s = input_dim the output is x @ W up to the float16 rounding of the stored tables.

Every weighted sum of table rows (Step B, the reconstruction x_hat, the compensation's rows of W) is
one fused call (weighted_rows) that never materialises the [rows, k, out] gather: on the CPU
torch.nn.functional.embedding_bag(mode="sum", per_sample_weights=...), on CUDA the Triton kernel of
actstore.lut_kernels (on an H100 2.2-2.3x faster than embedding_bag from 64 tokens on; at decode
sizes only inside a CUDA graph capture, where its launch costs nothing: DECODE_ROWS; embedding_bag
where triton is not installed). Both accumulate in
float32 for float16/bfloat16 tables but write their output in the table's dtype, so tables are held
in the dtype the model computes in: a float32 model upcasts 16-bit tables at load (otherwise its
outputs would be rounded to 16 bits), a bfloat16 model keeps bfloat16 tables as stored. Step A's
ReLU and top-k are torch's ops, or on CUDA at decode sizes in a graph capture one Triton kernel pair
(lut_kernels.topk_relu_triton: the same values; 4x faster there, slower eagerly and on more rows).

Runtime `auto` (lut.runtime): above a crossover token count a target runs the dense x @ W it replaced
(when that weight is present). The crossover is measured, not modelled: `calibrate` times, on the
device and dtype the tables are held in, the lookup path of every target sharing an encoder (one
encoding + each lookup + compensation at its budget) against their dense matmuls at a few token
counts, and `crossover_from` turns those times into the threshold (a bytes model picked the lookup
on an H100 where it was 1.1-1.8x slower than dense: bench/README.md `## lut`). It is measured when
install_luts installs (not on the first forward, which may be traced or captured into a CUDA graph
and where nobody expects seconds of timing), or pinned by the caller.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from actstore.errors import ConfigError, FormatError
from actstore.formats.lut import BIAS_KEY, REQUIRED_KEYS, LutStore
from actstore.integrity import whole_number

log = logging.getLogger(__name__)
RUNTIMES = ("lookup", "auto")
# The dtypes tables can be held in: torch's matmul, top-k and embedding_bag compute in these (not in float8).
HELD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CALIBRATION_TOKENS = (1, 8, 64, 512, 2048)
CALIBRATION_SECONDS = 2.0  # per group of targets sharing an encoder (see calibrate)
# Activations one calibration call may hold beside the loaded model: larger token counts are not timed.
CALIBRATION_BYTES = 512 * 2**20
CALIBRATION_REPEATS = 3  # best of, after one warm-up call
# Decode-sized calls (at most DECODE_ROWS rows) on CUDA run the Triton kernels (Step A's ReLU + top-k,
# Step B) only inside a CUDA graph capture, where their launches cost nothing. On an H100 (Llama-8B gate +
# up, 16384 latents, k 32, bfloat16), in graphs at 1-8 rows (2026-11-27): Triton ReLU + top-k 0.015-0.016
# ms against ReLU + torch.topk's 0.068-0.071 (two torch.topk stages, the runtime's before: 0.043-0.050),
# Step B 0.009-0.018 against embedding_bag's 0.012-0.023; called eagerly (2026-11-26), Triton's launch
# made Step B 0.080-0.088 ms against embedding_bag's 0.041-0.060. At 512 rows the Triton top-k took 0.308
# ms against torch.topk's 0.130; Triton's Step B beats embedding_bag from 64 rows on, eagerly too.
DECODE_ROWS = 8
# install_luts checks this many rows of each table's P against its linear (check_products), reading the
# linear's weight in float32 pieces of at most CHECK_CHUNK_BYTES.
CHECK_ROWS = 8
CHECK_CHUNK_BYTES = 64 * 2**20
# The dtypes the Triton kernels compute in: they sum (Step B) and sort (Step A) in float32, so float64
# tables (HELD_DTYPES) take torch's ops, which keep float64.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_LOADED: set[tuple] = set()  # the signatures whose Triton kernel an eager call ran (in_graph)
TRITON_WARNED: set[tuple] = set()


def target_weight(module: nn.Module, what: str) -> torch.Tensor:
    """W_target [in, out] of a LUT target, detached: an nn.Linear's weight [out, in] transposed (it
    computes x @ weight.T + bias), a transformers Conv1D's as stored (GPT-2's projections: x @ weight +
    bias; transposing it too would be another map, of the same shape when in == out). ConfigError
    naming `what` (the target) and the type of any other module."""
    # Imported here: verify and the SAE import this module, and need not pay for importing transformers.
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
        return module.weight.detach().T
    if isinstance(module, Conv1D):
        return module.weight.detach()
    raise ConfigError(f"{what} is a {type(module).__name__}, not nn.Linear nor a transformers Conv1D: "
                      f"list the linear maps that read the SAE's hook tensor")


def weighted_rows(weights: torch.Tensor, indices: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """sum_j weights[n, j] * table[indices[n, j]] -> [n, table.shape[1]] in table's dtype, fused (no
    [n, k, out] temporary), float32 sums (float64 for float64 tables): on CUDA by the Triton kernel when
    triton imports and the table is not float64 (TRITON_DTYPES; at decode sizes only in a CUDA graph
    capture: DECODE_ROWS; in_graph), else by embedding_bag_rows. Not
    differentiable on CUDA (the runtime's tables are constants)."""
    if table.is_cuda and table.dtype in TRITON_DTYPES and (kernels := _lut_kernels()) is not None:
        def triton() -> torch.Tensor:
            return kernels.weighted_rows_triton(weights, indices, table)
        signature = ("weighted_rows", table.device, table.dtype, weights.dtype, indices.shape[1], table.shape,
                     table.stride(), table.data_ptr() % 16)
        if len(indices) > DECODE_ROWS and not torch.cuda.is_current_stream_capturing():
            TRITON_LOADED.add(signature)
            return triton()
        if in_graph(signature, triton):
            return triton()
    return embedding_bag_rows(weights, indices, table)


def in_graph(signature: tuple, triton: Callable[[], Any]) -> bool:
    """Whether a call of this signature (what its Triton kernel is compiled for) runs its Triton kernel
    inside the CUDA graph capture under way. Loading a compiled kernel is not permitted while a stream
    captures (cuModuleLoadData), so an eager call runs the kernel once per signature beforehand, as a
    graph's warm-up call does (its result unused: eager decode-size calls take torch's ops); a capture
    of a signature no eager call ran takes torch's ops, with a warning."""
    if not torch.cuda.is_current_stream_capturing():
        if signature not in TRITON_LOADED:
            triton()
            TRITON_LOADED.add(signature)
        return False
    if signature not in TRITON_LOADED and signature not in TRITON_WARNED:
        TRITON_WARNED.add(signature)
        log.warning("LUT runtime: a CUDA graph captured a call no eager call had made at that size (%s), so "
                    "its Triton kernel could not load there and torch's ops run in the graph instead: call the "
                    "model once at the size before capturing it", signature[0])
    return signature in TRITON_LOADED


@functools.cache
def _lut_kernels() -> Any:
    """actstore.lut_kernels, or None without triton: imported on the first CUDA call, so that CPU runs
    never pay for importing triton (a CUDA build of torch installs it)."""
    try:
        from actstore import lut_kernels
    except ImportError:
        return None
    return lut_kernels


def embedding_bag_rows(weights: torch.Tensor, indices: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """weighted_rows by torch.embedding_bag (differentiable); weights are cast to the table's dtype, as
    embedding_bag requires. The op functional.embedding_bag calls for 2-D indices (bags of k from each
    row's start): at decode-sized batches the wrapper's checks cost about as much as the kernel. The
    offsets are made anew each call (a cached tensor measured no faster, and one first made inside a
    CUDA graph capture would hold its values only after a replay)."""
    if weights.dtype != table.dtype:
        weights = weights.to(table.dtype)
    rows, k = indices.shape
    offsets = torch.arange(0, rows * k, k, device=indices.device)
    flat_weights = weights.reshape(-1)
    return torch.embedding_bag(table, indices.reshape(-1), offsets, False, 0, False, flat_weights, False, None)[0]


def topk_relu(pre: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of each row of ReLU(pre) [rows, width], descending (pre is
    consumed): on CUDA at decode sizes (DECODE_ROWS) inside a graph capture by the Triton kernels of
    lut_kernels.topk_relu_triton (not for float64: TRITON_DTYPES), else by torch's ReLU and topk. Both
    give the same values; the indices may differ among tied values (ReLU's zeros, whenever fewer than
    k latents fire), where the weights are equal. NaN, which torch.topk ranks first, is a zero to the kernels."""
    if pre.is_cuda and len(pre) <= DECODE_ROWS and pre.dtype in TRITON_DTYPES and (kernels := _lut_kernels()):
        def triton() -> tuple[torch.Tensor, torch.Tensor]:
            return kernels.topk_relu_triton(pre, k)
        signature = ("topk_relu", pre.device, pre.dtype, k, pre.shape[1], pre.stride(), pre.data_ptr() % 16)
        if in_graph(signature, triton):
            return triton()
    return torch.topk(pre.relu_(), k, dim=-1)


def _version(x: torch.Tensor) -> int | None:
    """In-place edit counter (a cached encoding is stale once x changed); inference tensors have none
    (LutEncoder.begin)."""
    return None if x.is_inference() else x._version


class LutEncoder(nn.Module):
    """Spec Step A, shared by every target with the same SAE, and every sum over all those targets at
    once (Step B, the compensation, the dense x @ W): add_target appends each target's P and W to the
    group's tables (module docstring). What it computes for an input is kept for that input only."""

    def __init__(self, tables: dict[str, torch.Tensor], k_active: int, dtype: torch.dtype):
        super().__init__()
        self.k_active = k_active
        for key in ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias"):
            self.register_buffer(key, tables[key].to(dtype), persistent=False)
        basis, weight = self.encoder_weight.shape[0], self.encoder_weight
        self.register_buffer("products", weight.new_empty(basis, 0), persistent=False)
        self.register_buffer("bias_products", weight.new_empty(0), persistent=False)
        # Every target's W_target [in, out] side by side, or None when the targets come without their linear.
        self.register_buffer("weights", None, persistent=False)
        self.n_targets = 0
        # Encodings and lookups, counted so tests and benches can see the sharing (in a dict: setting a
        # Module's attribute costs microseconds, as much as the lookup itself at one token).
        self.counts = {"encodings": 0, "lookups": 0}
        # Per path, the last input it saw: (input, its version, what was computed for it). "lookup": the
        # encoding, residual terms by budget, the group's lookup and compensation; "dense": the group's
        # x @ W (group sums with the targets that took their columns). Separate, so that a dense call
        # between two calls on one input does not make the second encode again. "served": the targets
        # the input was served to in this forward (begin).
        self._last: dict[str, tuple[Any, int | None, dict[Any, Any]]] = {}

    def add_target(self, products: torch.Tensor, bias_product: torch.Tensor, weight: torch.Tensor | None) -> slice:
        """Append a target's P [B, out], bias_product [out] and W_target [in, out] (None: no linear) to
        the group's tables, in the encoder's dtype and device; returns its columns. Called once per
        target when it is installed; the targets of a group all have their W or none has."""
        if self.n_targets and (weight is None) != (self.weights is None):
            raise ConfigError("LUT targets sharing an encoder must all come with their linear weight, or none")
        # [in, out] of the tables: a W of another shape would be read by rows and columns that are not its
        # (the compensation's rows of x's dims, the group's later targets' columns).
        need = (self.decoder_weight.shape[1], products.shape[1])
        if weight is not None and tuple(weight.shape) != need:
            raise ConfigError(f"a LUT target's linear maps {weight.shape[0]} inputs to {weight.shape[1]} outputs, its "
                              f"tables need [{need[1]}, {need[0]}] as an nn.Linear's weight (nn.Linear({need[0]}, "
                              f"{need[1]})), [{need[0]}, {need[1]}] as a Conv1D's: install the LUT on the linear it "
                              f"was built from")
        start = self.products.shape[1]
        self.products = torch.cat([self.products, products.to(self.products)], dim=1)
        self.bias_products = torch.cat([self.bias_products, bias_product.to(self.bias_products)])
        if weight is not None:
            held = [] if self.weights is None else [self.weights]
            self.weights = torch.cat([*held, weight.to(self.products)], dim=1)
        self.n_targets += 1
        self.forget()
        return slice(start, self.products.shape[1])

    def _results(self, x: torch.Tensor, path: str = "lookup") -> dict[Any, Any]:
        """What `path` computed for x, or a new empty record when x is not its last input (or was edited).
        The record is emptied when x is freed: a decoder layer's normed input is gone once the layer
        returns, and its encoding and residuals (N x budget) would otherwise stay until the group's next
        input, every layer's at once. Emptied, not removed: a weakref callback may run amid a dict walk."""
        last, version = self._last.get(path), _version(x)
        if last is None or last[0]() is not x or last[1] != version:
            results: dict[Any, Any] = {}
            self._last[path] = last = (weakref.ref(x, lambda _: results.clear()), version, results)
        return last[2]

    def forget(self) -> None:
        """Drop what was computed for the last inputs, so that the next call encodes (calibration times
        each encoding)."""
        self._last = {}

    def begin(self, x: torch.Tensor, columns: slice) -> None:
        """Before a target computes on x. What was computed for x serves only the group's targets of one
        forward: an inference tensor has no version counter, and a tensor sharing memory with a numpy
        array (torch.from_numpy) refilled between two forwards keeps its version, so neither edit can be
        seen. A target that was served x already begins another forward, so x's records are dropped
        first (end drops them once every target was served)."""
        served = self._results(x, "served")
        if columns.start in served:
            self._forget_input(x)
            served = self._results(x, "served")
        served[columns.start] = True

    def end(self, x: torch.Tensor) -> None:
        """After a target computed on x: x's records are dropped once every target of the group was
        served it (begin)."""
        if len(self._results(x, "served")) == self.n_targets:
            self._forget_input(x)

    def _forget_input(self, x: torch.Tensor) -> None:
        self._last = {path: last for path, last in self._last.items() if last[0]() is not x}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices) [N, k] for x [..., input_dim] flattened to N rows."""
        results = self._results(x)
        if "encoding" not in results:
            weight = self.encoder_weight
            flat = x.reshape(-1, x.shape[-1])
            flat = flat if flat.dtype == weight.dtype else flat.to(weight.dtype)
            # In place: the same sums without two more [N, B] temporaries (134 MB each for 2048 tokens
            # over 16384 latents in float32).
            pre = (flat @ weight.T).add_(self.encoder_bias)
            results["encoding"] = topk_relu(pre, self.k_active)
            self.counts["encodings"] += 1
        return results["encoding"]

    def lookup(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Spec Step B of every target: sum_j values_j * P[indices_j] + bias_product, [N, sum of outs]."""
        self.counts["lookups"] += 1
        return weighted_rows(values, indices, self.products) + self.bias_products

    def residual_top(self, x: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x - x_hat) on the `budget` dims S of largest |x - x_hat| per token, and S: computed once per
        input and budget for all targets sharing this encoder, like the encoding itself."""
        values, indices = self(x)
        results = self._results(x)
        if ("residual", budget) not in results:
            flat = x.reshape(-1, x.shape[-1]).to(self.decoder_weight.dtype)
            residual = flat - self.reconstruct(values, indices)
            top = torch.topk(residual.abs(), budget, dim=-1).indices
            results["residual", budget] = (residual.gather(1, top), top)
        return results["residual", budget]

    def target_lookup(self, x: torch.Tensor, columns: slice) -> torch.Tensor:
        """One target's Step B for x: its columns of the group's lookup."""
        return self._columns_of(x, "lookup", lambda: self.lookup(*self(x)), columns)

    def target_compensation(self, x: torch.Tensor, budget: int, columns: slice) -> torch.Tensor:
        """One target's (x - x_hat)[:, S] @ W_target[S, :], S the `budget` dims of largest |x - x_hat|
        per token: its columns of the group's sum of S rows of every W (targets of one group at
        different budgets each pay a whole group's sum)."""
        return self._columns_of(x, ("compensation", budget),
                                lambda: weighted_rows(*self.residual_top(x, budget), self.weights), columns)

    def target_dense(self, x: torch.Tensor, columns: slice) -> torch.Tensor:
        """One target's x @ W_target: its columns of one matmul for the whole group (never encodes)."""
        def dense() -> torch.Tensor:
            return x.reshape(-1, x.shape[-1]).to(self.weights.dtype) @ self.weights
        return self._columns_of(x, "dense", dense, columns, path="dense")

    def _columns_of(self, x: torch.Tensor, key: Any, compute: Callable[[], torch.Tensor], columns: slice,
                    path: str = "lookup") -> torch.Tensor:
        """`columns` of x's result `key` for all targets, computed on the first target's call. It is
        dropped once every target has taken its columns, so no group holds an [N, outs] beyond its
        forward (a target called again with the same x then computes it again)."""
        results = self._results(x, path)
        if key not in results:
            results[key] = (compute(), set())
        out, taken = results[key]
        taken.add(columns.start)
        if len(taken) == self.n_targets:
            del results[key]
        return out[:, columns]

    def reconstruct(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x_hat = sum_j values_j * W_dec[indices_j] + b_dec: what the lookup represents in input space."""
        return weighted_rows(values, indices, self.decoder_weight) + self.decoder_bias


def count(value: Any, what: str) -> int:
    """`value` as a whole number (an int or numpy integer of at least 0): ConfigError naming `what`
    otherwise, where int() would turn -1 into a pure lookup, 1.5 or True into 1, and a string into a
    TypeError at the first forward."""
    if not whole_number(value):
        raise ConfigError(f"{what} {value!r}: expected a whole number (an int of at least 0)")
    return int(value)


class LutLinear(nn.Module):
    """Drop-in replacement for an nn.Linear or a transformers Conv1D (`linear`, its W_target as
    target_weight reads it): Step A (shared encoder) + Step B (+ compensation), or with runtime "auto"
    the dense x @ W above `crossover_tokens` (calibrated or pinned by install_luts). `paths` counts
    which ran; `calibration` is the measured table the crossover came from."""

    def __init__(self, encoder: LutEncoder, tables: dict[str, torch.Tensor], linear: nn.Module | None,
                 budget: int = 0, with_bias: bool = True, runtime: str = "lookup"):
        super().__init__()
        if runtime not in RUNTIMES:
            raise ConfigError(f"lut.runtime {runtime!r}: expected one of {RUNTIMES}")
        self.encoder = encoder
        # W_target [in, out]: rows are what compensation sums.
        self.columns = encoder.add_target(tables["precomputed_products"], tables["bias_product"],
                                          None if linear is None else target_weight(linear, "a LUT target"))
        # The linear's own bias when the linear is given (exact): the table's target_bias is that bias
        # rounded to the tables' 16 bits (0.2 off a bias of a few hundred, as Qwen2's q/k/v hold, in
        # bfloat16), and auto's dense path is to equal the module it replaced.
        bias = (linear.bias if linear is not None else tables.get(BIAS_KEY)) if with_bias else None
        self.register_buffer("target_bias", None if bias is None else bias.detach().to(encoder.products),
                             persistent=False)
        self.in_features = tables["decoder_weight"].shape[1]
        self.out_features = tables["precomputed_products"].shape[1]
        # Without W there is nothing to fall back to: auto is then the lookup.
        self.runtime = runtime if linear is not None else "lookup"
        self.paths = {"lookup": 0, "dense": 0}
        self.crossover_tokens: int | None = None
        self.calibration: dict[str, Any] | None = None
        self.budget = 0
        self.set_budget(budget)

    def set_budget(self, budget: int) -> None:
        """Input dims per token computed exactly online (0 = pure lookup, input_dim or more = exact);
        ConfigError for anything but a whole number (-1 is no "all"). A crossover measured at another
        budget no longer holds: calibrate_auto measures it again (a pinned one stays)."""
        budget = min(count(budget, "lut budget"), self.in_features)
        if budget and self.w_target is None:
            raise ConfigError("LUT compensation needs the original linear weight (W_target)")
        if self.calibration is not None and budget != self.budget:
            self.crossover_tokens = self.calibration = None
        self.budget = budget

    @property
    def precomputed_products(self) -> torch.Tensor:
        """This target's P [B, out]: its columns of the group's table."""
        return self.encoder.products[:, self.columns]

    @property
    def w_target(self) -> torch.Tensor | None:
        """This target's W_target [in, out] (its columns of the group's), None without its linear."""
        return None if self.encoder.weights is None else self.encoder.weights[:, self.columns]

    def lookup_path(self, x: torch.Tensor) -> torch.Tensor:
        """Step A (cached per input, shared) + Step B (+ compensation): [N, out], without target_bias."""
        out = self.encoder.target_lookup(x, self.columns)
        return out + self.encoder.target_compensation(x, self.budget, self.columns) if self.budget else out

    def dense_path(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W_target (one matmul for the targets sharing the encoder): [N, out], without target_bias."""
        return self.encoder.target_dense(x, self.columns)

    def runs_dense(self, tokens: int) -> bool:
        """Runtime auto above the crossover (a lookup-only target never does)."""
        if self.runtime == "lookup":
            return False
        if self.crossover_tokens is None:
            raise ConfigError("lut.runtime auto: no crossover for this budget; call calibrate_auto(installed) "
                              "after set_budget, or pin crossover_tokens")
        return tokens > self.crossover_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = "dense" if self.runs_dense(x.numel() // x.shape[-1]) else "lookup"
        self.paths[path] += 1
        self.encoder.begin(x, self.columns)
        out = self.dense_path(x) if path == "dense" else self.lookup_path(x)
        self.encoder.end(x)
        if self.target_bias is not None:
            out = out + self.target_bias
        # Columns of the group's result made a tensor of their own, as an nn.Linear's output is: a view
        # would keep the group's whole [N, outs] alive (a KV cache holds k and v) and refuse some .view()s.
        out = out.reshape(*x.shape[:-1], self.out_features)
        return (out if out.dtype == x.dtype else out.to(x.dtype)).contiguous()


# ---------------------------------------------------------------- auto: the measured crossover

def crossover_from(rows: list[dict[str, float]]) -> int:
    """The most tokens for which auto runs the lookup, from rows {tokens, lookup_ms, dense_ms} at
    increasing token counts. Rule: take the largest measured count where the lookup was faster; if a
    larger count was measured (where it was not), move the threshold to where the straight line
    between the two points' time differences crosses zero (both paths' times are close to affine in
    the token count between neighbouring points). 0 if the lookup never won. Never beyond the
    largest measured count: there is no evidence there, and dense is the exact path."""
    won = [i for i, row in enumerate(rows) if row["lookup_ms"] < row["dense_ms"]]
    if not won:
        return 0
    i = won[-1]
    if i + 1 == len(rows):
        return int(rows[i]["tokens"])
    here, there = rows[i], rows[i + 1]
    gain, loss = here["dense_ms"] - here["lookup_ms"], there["lookup_ms"] - there["dense_ms"]
    return int(here["tokens"] + (there["tokens"] - here["tokens"]) * gain / (gain + loss))


def call_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of fn after one warm-up (lazy init, allocator, caches);
    CUDA by events around the call, the CPU by perf_counter."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return times


def token_bytes(luts: list[LutLinear]) -> int:
    """Activation bytes per token that one calibration call holds: the input and residual, the
    pre-activations over the basis, every target's lookup and dense output."""
    table = luts[0].precomputed_products
    d_in, basis, outs = luts[0].in_features, table.shape[0], sum(lut.out_features for lut in luts)
    return table.element_size() * (2 * d_in + basis + 2 * outs)


def calibrate(luts: list[LutLinear], tokens: tuple[int, ...] = CALIBRATION_TOKENS,
              max_seconds: float = CALIBRATION_SECONDS) -> dict[str, Any]:
    """Time the lookup path of targets sharing one encoder (one encoding, then every target's lookup
    and compensation at its budget: how forward runs them) against their dense x @ W, on the tables'
    device and dtype, at each of `tokens` whose activations fit CALIBRATION_BYTES; best of
    CALIBRATION_REPEATS. Time bound: a count is skipped (with every larger one) when the time so
    far plus its cost predicted linearly from the previous count exceeds max_seconds; the first
    count is always measured, and the time counts from after one call of both paths on one token
    (the kernels' first use: Triton compiled Step A's top-k in ~5 s on an H100, which left time for
    no second count). Returns rows {tokens, lookup_ms, dense_ms}, crossover_tokens and seconds (all
    of it)."""
    encoder, table = luts[0].encoder, luts[0].precomputed_products
    counts = [n for n in tokens if n * token_bytes(luts) <= CALIBRATION_BYTES]
    rows: list[dict[str, float]] = []
    began, encodings = time.perf_counter(), encoder.counts["encodings"]

    def lookup_all(x: torch.Tensor) -> list[torch.Tensor]:
        encoder.forget()  # every call pays the encoding, as every new input does
        return [lut.lookup_path(x) for lut in luts]

    # Inputs from a generator of its own: draws from the global one would move a caller's seeded stream
    # by as many calls as the time bound allowed, so a seeded run after install_luts would not repeat.
    generator = torch.Generator(table.device).manual_seed(0)

    def inputs(n: int) -> torch.Tensor:
        return torch.randn(n, luts[0].in_features, generator=generator, device=table.device, dtype=table.dtype)

    with torch.inference_mode():
        first = inputs(1)
        lookup_all(first)
        for lut in luts:
            lut.dense_path(first)
        start = time.perf_counter()
        for n in counts:
            if rows and time.perf_counter() - start + predicted_seconds(rows[-1], n) > max_seconds:
                break
            x = inputs(n)
            lookup = min(call_seconds(lambda: lookup_all(x), table.device, CALIBRATION_REPEATS))
            dense = min(call_seconds(lambda: [lut.dense_path(x) for lut in luts], table.device, CALIBRATION_REPEATS))
            rows.append({"tokens": n, "lookup_ms": lookup * 1e3, "dense_ms": dense * 1e3})
    encoder.forget()
    encoder.counts["encodings"] = encodings  # the calibration's encodings are not the model's
    return {"device": str(table.device), "dtype": str(table.dtype).removeprefix("torch."),
            "budgets": [lut.budget for lut in luts], "rows": rows, "crossover_tokens": crossover_from(rows),
            "seconds": time.perf_counter() - began}


def predicted_seconds(previous: dict[str, float], tokens: int) -> float:
    """Cost of timing `tokens` (warm-up + repeats of both paths), scaled linearly from the previous
    row: an overestimate where per-call overhead dominates, close where the work does."""
    per_call = (previous["lookup_ms"] + previous["dense_ms"]) / 1e3 * tokens / previous["tokens"]
    return (1 + CALIBRATION_REPEATS) * per_call


def calibrate_auto(installed: dict[str, LutLinear], max_seconds: float = CALIBRATION_SECONDS) -> list[dict[str, Any]]:
    """Calibrate each group of runtime-auto targets sharing an encoder that has no crossover yet (just
    installed, or its budget changed) and set their crossover_tokens; every group's table, with its
    targets (pinned crossovers have none)."""
    groups: dict[LutEncoder, dict[str, LutLinear]] = {}
    for name, lut in installed.items():
        if lut.runtime == "auto":
            groups.setdefault(lut.encoder, {})[name] = lut
    tables = []
    for members in groups.values():
        luts = list(members.values())
        if any(lut.crossover_tokens is None for lut in luts):
            table = {"targets": list(members), **calibrate(luts, max_seconds=max_seconds)}
            for lut in luts:
                lut.crossover_tokens, lut.calibration = table["crossover_tokens"], table
        if luts[0].calibration is not None:
            tables.append(luts[0].calibration)
    return tables


def parent_module(model: nn.Module, module_path: str) -> tuple[nn.Module, str]:
    from actstore.models import get_module

    parent_path, _, name = module_path.rpartition(".")
    return (get_module(model, parent_path) if parent_path else model), name


def _sae_digest(tables: dict[str, torch.Tensor]) -> bytes:
    """sha256 of a table file's encoder and decoder bytes: targets whose digests match share one
    LutEncoder, whose decoder reconstructs x_hat for every target's compensation (the encoder alone
    would let a table with another decoder be compensated with the first one's). A digest, not the
    bytes, as the key: an 8B model's encoder is 134 MB a layer, held per distinct SAE."""
    digest = hashlib.sha256()
    for key in ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias"):
        digest.update(tables[key].contiguous().view(torch.uint8).numpy())
    return digest.digest()


def _rounding(*dtypes: torch.dtype) -> float:
    """Sum of the machine epsilons of `dtypes`: a relative tolerance for one rounding to nearest (half
    an epsilon) to each of them, twice (check_products)."""
    return sum(torch.finfo(dtype).eps for dtype in dtypes)


def _products(rows: torch.Tensor, w_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows @ w_target and |rows| @ |w_target| (the second bounds the rounding of the first) in
    float64: on a GPU where a caller allowed TF32, float32 matmuls round their inputs to 10 bits, as
    coarse as float16 tables. Over CHECK_CHUNK_BYTES of columns at a time: a float64 copy of a whole
    weight would multiply the largest layer's memory."""
    step = max(1, CHECK_CHUNK_BYTES // (8 * w_target.shape[0]))
    exact, scale = [], []
    for chunk in w_target.split(step, dim=1):
        chunk = chunk.double()
        exact.append(rows @ chunk)
        scale.append(rows.abs() @ chunk.abs())
    return torch.cat(exact, dim=1), torch.cat(scale, dim=1)


def check_products(tables: dict[str, torch.Tensor], linear: nn.Module, file: Path, module_path: str) -> None:
    """FormatError naming `file` and `module_path` unless the tables were built from this linear: up
    to CHECK_ROWS rows of P (spread over the basis) and bias_product against decoder_weight and
    decoder_bias times the live weight, and target_bias against its bias. Sizes alone let
    another checkpoint's tables install, whose lookup is then wrong at every budget (the compensation
    uses the live W). Allowed, relative to |rows| @ |W| (the worst case over a row's sum): half an
    epsilon of the tables' dtype for P's rounding from float32 and half for the decoder's, and an
    epsilon of the weight's dtype (the tables may come from this weight before a cast to the model's
    dtype). Products computed in another precision than float32 may not pass."""
    dtype = tables["precomputed_products"].dtype
    eps, tiny = _rounding(dtype, linear.weight.dtype), torch.finfo(dtype).tiny
    basis = tables["decoder_weight"].shape[0]
    picked = torch.linspace(0, basis - 1, min(CHECK_ROWS, basis)).round().long()
    device = linear.weight.device
    rows = torch.cat([tables["decoder_weight"][picked], tables["decoder_bias"][None]]).to(device, torch.float64)
    kept = torch.cat([tables["precomputed_products"][picked], tables["bias_product"][None]]).to(device, torch.float64)
    exact, scale = _products(rows, target_weight(linear, f"lut target {module_path!r}"))
    error, allowed = (kept - exact).abs(), eps * scale + tiny
    row, column = divmod(int((error - allowed).argmax()), error.shape[1])
    if error[row, column] > allowed[row, column]:
        what, source = (("bias_product", "decoder_bias") if row == len(picked) else
                        (f"precomputed_products row {int(picked[row])}", f"decoder_weight[{int(picked[row])}]"))
        w_target = f"{module_path}.weight" + (".T" if isinstance(linear, nn.Linear) else "")  # a Conv1D's is [in, out]
        raise FormatError(f"{file}: {what} differs from {source} @ {w_target} by "
                          f"{error[row, column].item():.3g} (rounding allows {allowed[row, column].item():.3g}): "
                          f"the tables were built from other weights than this model's {module_path}; build the "
                          f"LUT from this model")
    _check_bias(tables.get(BIAS_KEY), linear, file, module_path)


def _check_bias(target_bias: torch.Tensor | None, linear: nn.Module, file: Path, module_path: str) -> None:
    """A table's target_bias (when it has one) against the linear's bias, within both dtypes' rounding."""
    if target_bias is None:
        return
    if linear.bias is None:
        raise FormatError(f"{file}: has a target_bias but {module_path} has no bias: the tables were built for "
                          f"another layer; build the LUT from this model")
    bias = linear.bias.detach().float()
    allowed = _rounding(target_bias.dtype, linear.bias.dtype) * bias.abs() + torch.finfo(target_bias.dtype).tiny
    if ((target_bias.to(bias) - bias).abs() > allowed).any():
        raise FormatError(f"{file}: target_bias differs from {module_path}.bias beyond rounding: the tables were "
                          f"built from other weights than this model's {module_path}; build the LUT from this model")


def held_tables(tables: dict[str, torch.Tensor], held: torch.dtype, file: Path,
                module_path: str) -> dict[str, torch.Tensor]:
    """The spec's tensors (and target_bias) of one table file in `held`, the dtype the runtime computes
    in (module docstring). ConfigError naming the file when a finite stored value becomes inf there:
    bfloat16 tables (precompute's advice when float16 would overflow) in a float16 model would make
    every lookup through them inf."""
    converted = {key: tables[key].to(held) for key in (*REQUIRED_KEYS, BIAS_KEY) if key in tables}
    for key, value in converted.items():
        if torch.finfo(held).max < torch.finfo(tables[key].dtype).max:  # only a narrower range overflows
            overflow = int((value.isinf() & tables[key].isfinite()).sum())
            if overflow:
                raise ConfigError(f"{file}: {overflow} values of {key} exceed {_name(held)}'s range (largest "
                                  f"{tables[key].abs().max().item():.4g}), the dtype {module_path} computes in: "
                                  f"pass install_luts dtype=torch.float32 (or torch.{_name(tables[key].dtype)}) "
                                  f"to hold the tables in a dtype that fits, or load the model in one")
    return converted


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def install_luts(model: nn.Module, store: LutStore, budget: int = 0, dtype: torch.dtype | None = None,
                 runtime: str = "lookup", crossover_tokens: int | None = None) -> dict[str, LutLinear]:
    """Replace every layer of `store` in `model` (an nn.Linear or a transformers Conv1D) by a LutLinear;
    same SAE tensors -> one LutEncoder.
    Each table is checked against its linear first (check_products), and the model is changed only
    once every table passed: an error leaves it as it was (not half its targets replaced, which a
    second call would refuse as not nn.Linear nor Conv1D). Tables are held in `dtype`, by default the
    dtype of the linear they replace (module docstring; held_tables); the targets sharing an encoder (same SAE,
    same device) share its tables, in the first one's.
    runtime "auto": the crossover is `crossover_tokens` when given (reproducible runs, tests), else
    measured now by calibrate_auto (each target's `calibration` holds its group's table)."""
    from actstore.models import get_module

    if crossover_tokens is not None:
        crossover_tokens = count(crossover_tokens, "lut crossover_tokens")
    if dtype is not None and dtype not in HELD_DTYPES:
        raise ConfigError(f"lut dtype {dtype!r}: expected None or one of {', '.join(map(repr, HELD_DTYPES))}")
    # Keyed by device too: targets of one SAE on two GPUs (a model split across devices) each need
    # the encoder on theirs, and a shared one would move to whichever target came last.
    encoders: dict[tuple[bytes, torch.device], LutEncoder] = {}
    installed = {}
    paths: dict[nn.Module, str] = {}  # get_module finds one module by two paths (with a base model's prefix)
    for module_path, entry in store.layers.items():
        linear, file = get_module(model, module_path, store.layers_source), store.dir / entry["file"]
        in_out = tuple(target_weight(linear, f"lut target {module_path!r}").shape)
        if linear in paths:
            raise ConfigError(f"lut targets {paths[linear]!r} and {module_path!r} are one module of the model")
        paths[linear] = module_path
        if in_out != (entry["input_dim"], entry["output_dim"]):
            raise FormatError(f"{file}: [{entry['input_dim']}, {entry['output_dim']}] does not "
                              f"fit {module_path} ({in_out[0]} -> {in_out[1]})")
        if linear.weight.is_meta:  # no values to check the tables against, nor to compute with
            raise ConfigError(f"lut target {module_path!r} holds no weights (meta device: a model_skeleton, or "
                              f"a layer accelerate offloads and loads per forward): install the LUT in a model "
                              f"whose targets are loaded on a device")
        stored = store.load(module_path)
        check_products(stored, linear, file, module_path)
        key = _sae_digest(stored), linear.weight.device
        held = encoders[key].products.dtype if key in encoders else (dtype or linear.weight.dtype)
        tables = held_tables(stored, held, file, module_path)
        if key not in encoders:
            encoders[key] = LutEncoder(tables, store.k_active, held).to(linear.weight.device)
        # On its encoder's device already (its tensors are made there): no .to, which would move the
        # encoder the group shares.
        lut = LutLinear(encoders[key], tables, linear, budget, runtime=runtime)
        lut.crossover_tokens = crossover_tokens
        installed[module_path] = lut
    calibrate_auto(installed)  # before the model changes: it may fail too (out of memory on a GPU)
    for module_path, lut in installed.items():
        parent, name = parent_module(model, module_path)
        setattr(parent, name, lut)
    return installed
