"""SAE training (Gao et al. 2024, "Scaling and evaluating sparse autoencoders") and held-out evaluation.

Decoder rows are kept unit-norm (the gradient parallel to each row is removed before the step), dead
latents get the AuxK loss, and the report's held-out split is of whole samples (never tokens of a
sample seen in training).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from actstore.errors import ConfigError
from actstore.formats.extract import Extraction, PartsCheck
from actstore.models import pick_device
from actstore.sae.data import (Moments, Prefetcher, TokenSplit, data_moments, hook_reads, iter_rows, sampled_rows,
                               split_tokens, stream_batches, tensors)
from actstore.sae.model import ZERO_VARIANCE, TopKSAE, auxk_loss, init_sae, normalised

log = logging.getLogger(__name__)

EVAL_CODE_ELEMENTS = 1 << 24  # a held-out chunk's (rows, num_basis) activations: 64 MB in float32


@torch.no_grad()
def evaluate(sae: TopKSAE, arrays: list[np.ndarray], rows: list[np.ndarray], limit: int | None = None,
             device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Held-out FVU (sum ||x - x_hat||^2 / sum ||x - mean||^2), MSE, per-latent firing counts and the
    tokens with fewer than k_active latents firing (where a TopK without ReLU, saev's, keeps negative
    pre-activations that Step A zeroes), on `rows`, or a seeded uniform sample of `limit` of them: the
    first `limit` in storage order were the first classes' tokens in a dataset sorted by label, and the
    latents of the others were reported dead."""
    sq_err, sq, s, n, under_k = 0.0, 0.0, None, 0, 0
    fires = torch.zeros(sae.num_basis, dtype=torch.long)
    blocks = iter_rows(arrays, sampled_rows(rows, limit, seed))
    for x in (chunk.to(device) for block in blocks for chunk in torch.from_numpy(block).split(eval_rows(sae))):
        values, indices = sae.encode(x)
        x_hat = sae.decode_dense(values, indices)
        sq_err += float((x - x_hat).double().pow(2).sum())
        sq += float(x.double().pow(2).sum())
        s = x.double().sum(0) if s is None else s + x.double().sum(0)
        n += len(x)
        fires += torch.bincount(indices[values > 0].cpu(), minlength=sae.num_basis)
        under_k += int((values <= 0).any(dim=1).sum())
    if n == 0:
        return {"n_tokens": 0, "fvu": None, "mse": None, "dead_fraction": None, "tokens_under_k": 0}
    total_var = sq - float((s * s).sum()) / n
    # Tokens without variance (one token: a tiny held-out split, or eval_tokens 1; or all equal) have an
    # undefined FVU, not their float32 rounding error over 1e-30 (6e26). "Without": below float64's rounding
    # of the sums it is computed from (equal tokens of a value float64 cannot hold leave ~1e-17 of sq).
    fvu = sq_err / total_var if n > 1 and total_var > sq * ZERO_VARIANCE else None
    return {"n_tokens": n, "fvu": fvu, "mse": sq_err / (n * sae.d_in),
            "dead_fraction": float((fires == 0).float().mean()), "tokens_under_k": under_k, "fires": fires}


def eval_rows(sae: TopKSAE) -> int:
    """Held-out rows encoded at once: their (rows, num_basis) pre-activations and dense code are made
    at once; iter_rows' 8,192 rows of a 65,536-latent SAE took 4 GB, after the whole training run."""
    return max(1, EVAL_CODE_ELEMENTS // sae.num_basis)


def heldout_summary(held: dict[str, Any]) -> dict[str, Any]:
    """evaluate's result for report.json: without the per-latent firing counts (a tensor)."""
    return {key: value for key, value in held.items() if key != "fires"}


class HostCopy:
    """Device tensors copied to the host without waiting for the device: on CUDA into pinned memory,
    non-blocking, with an event recorded after the copy; elsewhere an ordinary copy. `read` waits for
    that event, which at the next curve point has long completed: the check costs no sync a step."""

    def __init__(self, *values: torch.Tensor):
        device = values[0].device
        cuda = device.type == "cuda"
        self.host = [torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda).copy_(v, non_blocking=cuda)
                     for v in values]
        self.copied = torch.cuda.Event() if cuda else None
        if self.copied is not None:  # on the copies' stream: not the current device's for an SAE on cuda:1
            self.copied.record(torch.cuda.current_stream(device))

    def read(self) -> list[torch.Tensor]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host


def check_finite(first_bad: HostCopy, step: int, sae_cfg: dict[str, Any]) -> None:
    """ConfigError naming the first step whose loss was not finite, and that loss, if `first_bad` (the
    step, 0 for none, and its loss) holds one: the run is stopped at `step`, not trained to its end."""
    bad_step, bad_loss = (value.item() for value in first_bad.read())
    if bad_step:
        raise ConfigError(f"sae: the training loss was not finite from step {bad_step} of {sae_cfg['steps']} "
                          f"(loss {bad_loss}, sae.lr {sae_cfg['lr']}; stopped at step {step}): the run diverged, "
                          "or the activations' squares overflow float32")


def train_steps(sae: TopKSAE, opt: torch.optim.Optimizer, batches: Iterator[torch.Tensor], sae_cfg: dict[str, Any],
                progress: bool = True) -> tuple[int, list[dict[str, float]]]:
    """sae_cfg["steps"] optimiser steps on `batches` (already on the SAE's device); returns the tokens
    seen and the loss curve. Nothing in a step reads a device value back, so on a GPU the host runs
    ahead and queues work. The first step whose loss was not finite (that SAE has not learnt) is copied
    to the host at each curve point and read at the next one, a ConfigError: a diverged run stops
    within two curve intervals, not after all its steps. The curve's values are read at the end."""
    k, steps = sae.k_active, sae_cfg["steps"]
    aux_k = sae_cfg["aux_k"] or min(512, sae.num_basis // 2)
    # A latent is dead when it has not fired for dead_tokens training tokens (Gao et al.: 10M; scaled).
    last_fired = torch.zeros(sae.num_basis, dtype=torch.long, device=sae.decoder_weight.device)
    seen, curve, first_bad_on_host = 0, [], None
    first_non_finite = torch.zeros((), dtype=torch.long, device=last_fired.device)  # 0: none yet
    first_non_finite_loss = torch.zeros((), device=last_fired.device)
    for step in tqdm(range(1, steps + 1), desc="train sae", unit="step", disable=not progress):
        x = next(batches, None)
        if x is None:  # a finite source (the stage's is endless): its StopIteration named no step nor setting
            raise ConfigError(f"sae: the batches ended before step {step} of sae.steps {steps}")
        pre = sae.pre_acts(x)
        values, indices = torch.topk(pre, k, dim=-1)
        x_hat = sae.decode_dense(values, indices)
        mse = normalised((x_hat - x).pow(2).sum(-1).mean(), (x - x.mean(0)).pow(2).sum(-1).mean(), x)
        seen += len(x)
        last_fired.scatter_reduce_(0, indices.flatten(), torch.where(values > 0, seen, 0).flatten(), "amax")
        dead = (seen - last_fired) >= sae_cfg["dead_tokens"]
        aux = auxk_loss(sae, x, x_hat, pre, dead, aux_k)
        loss = mse + sae_cfg["aux_coef"] * aux
        is_first_bad = (first_non_finite == 0) & ~loss.isfinite()
        first_non_finite = torch.where(is_first_bad, step, first_non_finite)
        first_non_finite_loss = torch.where(is_first_bad, loss.detach(), first_non_finite_loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sae.remove_parallel_grad()
        opt.step()
        sae.normalize_decoder()
        if step == 1 or step % max(1, steps // 100) == 0 or step == steps:
            curve.append((step, seen, torch.stack([mse.detach(), aux.detach(), dead.float().mean()])))
            if first_bad_on_host is not None:
                check_finite(first_bad_on_host, step, sae_cfg)
            first_bad_on_host = HostCopy(first_non_finite, first_non_finite_loss)
    check_finite(first_bad_on_host, steps, sae_cfg)
    return seen, [{"step": step, "tokens": tokens, "fvu": fvu, "auxk": auxk, "dead_fraction_train": dead}
                  for (step, tokens, values) in curve for fvu, auxk, dead in [values.tolist()]]


def check_training_tokens(split: TokenSplit) -> None:
    """A batch is min(sae.batch_size, training tokens) rows (the schema asks 2 of batch_size); the loss
    is normalised by its variance and AuxK's by the residual's unbiased variance, both undefined for
    one row: such a run trained a NaN SAE with no error."""
    if split.n_train < 2:
        raise ConfigError(f"sae: {split.n_train} training token(s) (the other {split.n_heldout} held out by "
                          f"sae.heldout_fraction); training needs at least 2")


def check_variance(moments: Moments, hook: str) -> None:
    """ConfigError naming the hook when the training tokens read for b_dec's start are all equal (their
    variance at most ZERO_VARIANCE of their mean square: rounding): a constant tensor (token type
    embeddings) has nothing for an SAE to learn, and its loss, normalised by its variance, was rounding
    noise over a floor: a loss curve of FVUs in the millions, an SAE trained on that noise."""
    if moments.variance <= ZERO_VARIANCE * moments.mean_square:
        raise ConfigError(f"sae.hook {hook!r}: the {moments.count} training tokens sampled are all equal (no "
                          "variance): an SAE has nothing to learn of it; set sae.hook to another captured tensor")


def train_sae(extraction: Extraction, hook: str, sae_cfg: dict[str, Any],
              progress: bool = True) -> tuple[TopKSAE, dict[str, Any]]:
    """Train a TopK SAE on `hook`'s activations; return it and the report dict."""
    arrays = tensors(extraction, hook)
    d_in = arrays[0].shape[1]
    num_basis = sae_cfg["num_basis"] or 4 * d_in
    k = sae_cfg["k_active"]
    split = split_tokens(extraction, sae_cfg["heldout_fraction"], sae_cfg["seed"])
    check_training_tokens(split)
    moments = data_moments(arrays, split.train, seed=sae_cfg["seed"])
    check_variance(moments, hook)
    torch.manual_seed(sae_cfg["seed"])
    sae = TopKSAE(d_in, num_basis, k)
    init_sae(sae, moments.mean, sae_cfg["seed"])
    device = pick_device(sae_cfg["device"], "sae.device")
    sae.to(device)
    opt = torch.optim.Adam(sae.parameters(), lr=sae_cfg["lr"], betas=(0.9, 0.999), eps=6.25e-10)
    started = time.perf_counter()
    source = stream_batches(arrays, split.train, sae_cfg["batch_size"], np.random.default_rng(sae_cfg["seed"]))
    # Every part's hook file checked once, whole, beside the steps that read it again and again; a file
    # found to differ stops the steps then (guarded), and the check is waited for before the SAE is returned.
    with PartsCheck(hook_reads(extraction, hook)) as check:
        with Prefetcher(check.guarded(source), device) as batches:
            seen, curve = train_steps(sae, opt, batches, sae_cfg, progress)
        sae.cpu().eval()
        held = evaluate(sae, arrays, split.heldout, limit=sae_cfg["eval_tokens"], seed=sae_cfg["seed"])
    report = {"source": "trained", "hook": hook, "d_in": d_in, "num_basis": num_basis, "k_active": k,
              "steps": sae_cfg["steps"], "batch_size": sae_cfg["batch_size"], "train_tokens_seen": seen,
              "n_train_tokens": split.n_train, "n_heldout_tokens": split.n_heldout,
              "heldout_samples": split.heldout_samples, "training_seconds": time.perf_counter() - started,
              "device": device.type, "heldout": heldout_summary(held),
              "loss_curve": curve}
    log.info("sae %s: held-out FVU %.4f, dead %.3f", hook, held["fvu"] or float("nan"), held["dead_fraction"] or 0)
    return sae, report
