"""LUT precomputation (the lut stage) and the LUT runtime: nn.Linear replaced by SAE encode + lookup.

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
import math
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from actstore.errors import ConfigError, FormatError
from actstore.formats.lut import LutStore, open_lut, precompute, write_lut
from actstore.io_utils import write_json_atomic

log = logging.getLogger(__name__)
REPORT_FILE = "report.json"
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


# ---------------------------------------------------------------- the lut stage

def model_config_summary(config_json: dict[str, Any]) -> dict[str, Any]:
    """metadata.json model_config: the spec's four fields (from the nested text/vision config if needed)."""
    cfg = {**(config_json.get("vision_config") or {}), **config_json}
    summary = {"model_type": config_json.get("model_type"),
               "num_layers": cfg.get("num_hidden_layers", cfg.get("n_layer")),
               "num_attention_heads": cfg.get("num_attention_heads", cfg.get("n_head")),
               "hidden_size": cfg.get("hidden_size", cfg.get("n_embd"))}
    return {k: v for k, v in summary.items() if v is not None}


def build_tables(config: dict[str, Any], model: nn.Module, sae_state: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Precompute each target's tables from the live model's weights."""
    from actstore.models import get_module

    targets = config["lut"]["targets"]
    if not targets:
        raise ConfigError("lut.targets is empty: list the nn.Linear module paths that read sae.hook's tensor")
    d_in = sae_state["encoder_weight"].shape[1]
    tables = {}
    for module_path in targets:
        try:
            linear = get_module(model, module_path)
        except ConfigError:
            raise ConfigError(f"lut.targets: module {module_path!r} does not exist in the model") from None
        if not isinstance(linear, nn.Linear):
            raise ConfigError(f"lut.targets: {module_path!r} is a {type(linear).__name__}, not nn.Linear")
        if linear.in_features != d_in:
            raise ConfigError(f"lut.targets: {module_path!r} takes {linear.in_features} inputs, the SAE {d_in}")
        w_target = linear.weight.detach().float().cpu().T
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        tables[module_path] = precompute(sae_state, w_target, bias, config["lut"]["dtype"])
    return tables


def build_lut(config: dict[str, Any], extract_dir: str | Path, sae_dir: str | Path, out_dir: str | Path,
              progress: bool = True) -> dict[str, Any]:
    """The lut stage: write <out_dir>/lut/ per spec, then evaluate it and write <out_dir>/report.json."""
    from actstore.models import load_model, resolve_model_path
    from actstore.sae import SAE_FILE, load_sae

    sae, sae_meta = load_sae(Path(sae_dir) / SAE_FILE)
    loaded = load_model(resolve_model_path(config["model"]["path"]), "float32", config["lut"]["device"])
    tables = build_tables(config, loaded.model, sae.state())
    lut_root = write_lut(out_dir, tables, sae.k_active, model_config_summary(loaded.config), {
        "source_model": sae_meta.get("model"), "sae_model": str(Path(sae_dir) / SAE_FILE),
        "hook": sae_meta.get("hook"), "format_writer": "actstore"})
    report = evaluate_lut(config, extract_dir, sae_dir, lut_root, loaded, progress)
    write_json_atomic(Path(out_dir) / REPORT_FILE, report)
    return report


# ---------------------------------------------------------------- evaluation

def relative_errors(store: LutStore, model: nn.Module, x: torch.Tensor, budgets: list[int]) -> dict[str, Any]:
    """Per target and budget: ||LUT(x) - xW|| / ||xW|| over all held-out tokens (Frobenius) and the
    mean of the per-token ratio. Both sides exclude the linear's bias (the spec's output ≈ x @ W).
    Always the lookup (whatever lut.runtime says): this is the accuracy of the tables."""
    from actstore.models import get_module

    results = {}
    for module_path in store.layers:
        linear = get_module(model, module_path)
        tables = store.load(module_path)
        lut = LutLinear(LutEncoder(tables, store.k_active, torch.float32), tables, linear, with_bias=False)
        exact = x @ lut.w_target
        norms = exact.norm(dim=-1).clamp_min(1e-12)
        per_budget = {}
        for budget in budgets:
            lut.set_budget(budget)
            with torch.inference_mode():
                diff = lut(x) - exact
            per_budget[str(budget)] = {"relative_error": float(diff.norm() / exact.norm().clamp_min(1e-12)),
                                       "mean_token_relative_error": float((diff.norm(dim=-1) / norms).mean())}
        results[module_path] = per_budget
    return results


def heldout_inputs(config: dict[str, Any], extract_dir: str | Path, sae_dir: str | Path) -> tuple[torch.Tensor, list[int]]:
    """The SAE's held-out tokens of its hook tensor (at most lut.eval_tokens) and held-out samples."""
    import json

    from actstore.formats.parts import open_extraction
    from actstore.sae import REPORT_FILE as SAE_REPORT, iter_rows, split_tokens, tensors

    sae_report = json.loads((Path(sae_dir) / SAE_REPORT).read_text())
    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    split = split_tokens(extraction, config["sae"]["heldout_fraction"], config["sae"]["seed"])
    arrays = tensors(extraction, sae_report["hook"])
    blocks = list(iter_rows(arrays, split.heldout, limit=config["lut"]["eval_tokens"]))
    return torch.from_numpy(np.concatenate(blocks)), split.heldout_samples


def end_to_end(config: dict[str, Any], extract_dir: str | Path, lut_root: Path, loaded: Any,
               samples: list[int], budgets: list[int]) -> dict[str, Any]:
    """Swap the targets into the real model with lut.runtime: cosine of final hidden states (encoders,
    vision) or KL(original || LUT) and perplexity change (causal LMs), on held-out samples; per budget
    which path (lookup or dense) the targets' calls took and each target's crossover."""
    from actstore.formats.parts import open_extraction

    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    samples = samples[:config["lut"]["eval_samples"]]
    batches = [samples[i:i + config["extract"]["batch_size"]] for i in range(0, len(samples), config["extract"]["batch_size"])]
    inputs = [batch_inputs(config, extraction, loaded, batch) for batch in batches]
    with torch.inference_mode():
        reference = [run_model(loaded, inp) for inp in inputs]
    runtime = config["lut"].get("runtime", "lookup")
    installed = install_luts(loaded.model, open_lut(lut_root), runtime=runtime)
    result = {"n_samples": len(samples), "model_kind": loaded.kind, "runtime": runtime, "budgets": {}}
    for budget in budgets:
        for lut in installed.values():
            lut.set_budget(budget)
            lut.paths = {"lookup": 0, "dense": 0}
        with torch.inference_mode():
            outs = [run_model(loaded, inp) for inp in inputs]
        result["budgets"][str(budget)] = {
            **compare(loaded.kind, reference, outs, inputs),
            # Which path each target's forward calls took (runtime auto switches by token count).
            "paths": {path: sum(lut.paths[path] for lut in installed.values()) for path in ("lookup", "dense")},
            "crossover_tokens": {name: lut.crossover_tokens() for name, lut in installed.items()}}
    return result


def batch_inputs(config: dict[str, Any], extraction: Any, loaded: Any, batch: list[int]) -> dict[str, torch.Tensor]:
    from actstore.datasets import load_dataset
    from actstore.extract import image_batch, text_batch

    if loaded.kind == "vision":
        dataset = load_dataset(config["dataset"]["path"], config["dataset"]["limit"])
        return image_batch(loaded, dataset, [dataset.samples[i] for i in batch])
    ids = []
    for sample_idx in batch:
        part, local = extraction.locate(sample_idx)
        ids.append([int(t) for t in part.token_ids(local)])
    return text_batch(loaded, ids)


def run_model(loaded: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    out = loaded.model(**inputs)
    return (out.logits if loaded.kind == "causal" else out.last_hidden_state).float().cpu()


def compare(kind: str, reference: list[torch.Tensor], outs: list[torch.Tensor],
            inputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Token-level cosine (mean, min) or KL and perplexity over real (non-pad) tokens."""
    if kind != "causal":
        cos = torch.cat([torch.nn.functional.cosine_similarity(r, o, dim=-1)[mask_of(inp, r)]
                         for r, o, inp in zip(reference, outs, inputs)])
        return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}
    kl, nll_ref, nll_lut, n = 0.0, 0.0, 0.0, 0
    for r, o, inp in zip(reference, outs, inputs):
        mask = mask_of(inp, r)
        logp_r, logp_o = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
        kl += float(((logp_r.exp() * (logp_r - logp_o)).sum(-1))[mask].sum())
        # Next-token NLL: position t predicts token t+1 (both real tokens).
        nxt = mask[:, 1:] & mask[:, :-1]
        ids = inp["input_ids"][:, 1:].cpu()
        nll_ref -= float(logp_r[:, :-1].gather(-1, ids[..., None])[..., 0][nxt].sum())
        nll_lut -= float(logp_o[:, :-1].gather(-1, ids[..., None])[..., 0][nxt].sum())
        n += int(nxt.sum())
    ppl_ref, ppl_lut = math.exp(nll_ref / max(n, 1)), math.exp(nll_lut / max(n, 1))
    return {"kl_mean": kl / max(1, sum(int(mask_of(i, r).sum()) for i, r in zip(inputs, reference))),
            "perplexity_original": ppl_ref, "perplexity_lut": ppl_lut, "perplexity_change": ppl_lut - ppl_ref}


def mask_of(inputs: dict[str, torch.Tensor], ref: torch.Tensor) -> torch.Tensor:
    if "attention_mask" in inputs:
        return inputs["attention_mask"].cpu().bool()
    return torch.ones(ref.shape[:2], dtype=torch.bool)


def evaluate_lut(config: dict[str, Any], extract_dir: str | Path, sae_dir: str | Path, lut_root: Path,
                 loaded: Any, progress: bool = True) -> dict[str, Any]:
    """report.json: per-target relative errors for each budget, and the end-to-end effect."""
    budgets = list(config["lut"]["budgets"])
    x, samples = heldout_inputs(config, extract_dir, sae_dir)
    store = open_lut(lut_root)
    report = {"lut_dir": str(lut_root), "targets": sorted(store.layers), "k_active": store.k_active,
              "num_basis": store.num_basis, "dtype": config["lut"]["dtype"], "n_heldout_tokens": len(x),
              "budgets": budgets, "relative_error": relative_errors(store, loaded.model, x, budgets)}
    report["end_to_end"] = end_to_end(config, extract_dir, lut_root, loaded, samples, budgets)
    log.info("lut relative errors: %s", report["relative_error"])
    return report
