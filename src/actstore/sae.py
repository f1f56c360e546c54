"""TopK sparse autoencoders for the LUT stage: train on a captured hook tensor, or import one.

The encoder is exactly the LUT spec's Step A — ReLU(x @ encoder_weight.T + encoder_bias), then TopK —
so the LUT built from this SAE reproduces the trained encoder. Imported SAELens/saev checkpoints
(which subtract b_dec before encoding) are folded into that form: encoder_bias = b_enc - b_dec @ W_enc.

Training follows Gao et al. 2024 ("Scaling and evaluating sparse autoencoders"): decoder rows kept
unit-norm (gradient parallel to each row removed before the step), b_dec initialised to the data
mean, encoder initialised to the decoder's transpose, AuxK loss on dead latents, and a held-out split
of whole samples (never tokens of a sample seen in training) for the report.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from actstore.errors import ConfigError, FormatError
from actstore.formats.extract import Extraction, open_extraction
from actstore.io_utils import atomic_path, write_json_atomic
from actstore.lut_runtime import weighted_rows
from actstore.models import pick_device

log = logging.getLogger(__name__)
SAE_FILE = "sae.safetensors"
REPORT_FILE = "report.json"
# The LUT spec's key names; an actstore SAE checkpoint stores these four in float32.
SAE_KEYS = ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias")
IMPORT_STYLES = ("saelens", "saev")


class TopKSAE(nn.Module):
    """x -> TopK(ReLU(x W_enc^T + b_enc)) -> z W_dec + b_dec, weights in the LUT spec's layout."""

    def __init__(self, d_in: int, num_basis: int, k_active: int):
        super().__init__()
        if not 0 < k_active <= num_basis:
            raise ConfigError(f"sae.k_active {k_active} must be in 1..num_basis ({num_basis})")
        self.k_active = k_active
        self.encoder_weight = nn.Parameter(torch.empty(num_basis, d_in))
        self.encoder_bias = nn.Parameter(torch.zeros(num_basis))
        self.decoder_weight = nn.Parameter(torch.empty(num_basis, d_in))
        self.decoder_bias = nn.Parameter(torch.zeros(d_in))

    @property
    def num_basis(self) -> int:
        return self.encoder_weight.shape[0]

    @property
    def d_in(self) -> int:
        return self.encoder_weight.shape[1]

    def pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        """ReLU(x @ encoder_weight.T + encoder_bias): the spec's sparse_act before TopK."""
        return torch.relu(x @ self.encoder_weight.T + self.encoder_bias)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices) of the k_active largest post-ReLU activations (spec Step A)."""
        return torch.topk(self.pre_acts(x), self.k_active, dim=-1)

    def decode(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """sum_j values_j * decoder_weight[indices_j] + decoder_bias (the LUT runtime's fused row sum)."""
        return weighted_rows(values, indices, self.decoder_weight) + self.decoder_bias

    def decode_dense(self, values: torch.Tensor, indices: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """Same as decode via a scattered dense code: faster on CPU for training and its backward."""
        code = torch.zeros(values.shape[0], self.num_basis, dtype=values.dtype, device=values.device)
        out = code.scatter(1, indices, values) @ self.decoder_weight
        return out + self.decoder_bias if bias else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(*self.encode(x))

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.decoder_weight /= self.decoder_weight.norm(dim=1, keepdim=True).clamp_min(1e-8)

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """Keep decoder rows on the unit sphere: drop each row gradient's radial component."""
        w, g = self.decoder_weight, self.decoder_weight.grad
        if g is not None:
            g -= (g * w).sum(dim=1, keepdim=True) * w

    def state(self) -> dict[str, torch.Tensor]:
        return {key: getattr(self, key).detach().float().cpu().contiguous() for key in SAE_KEYS}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], k_active: int) -> "TopKSAE":
        sae = cls(state["encoder_weight"].shape[1], state["encoder_weight"].shape[0], k_active)
        with torch.no_grad():
            for key in SAE_KEYS:
                getattr(sae, key).copy_(state[key].float())
        return sae


# ---------------------------------------------------------------- data: held-out split + streaming

@dataclass
class TokenSplit:
    """Token rows of each part for training and for held-out evaluation (whole samples)."""

    train: list[np.ndarray]
    heldout: list[np.ndarray]
    heldout_samples: list[int]

    @property
    def n_train(self) -> int:
        return sum(len(rows) for rows in self.train)

    @property
    def n_heldout(self) -> int:
        return sum(len(rows) for rows in self.heldout)


def split_tokens(extraction: Extraction, heldout_fraction: float, seed: int) -> TokenSplit:
    """Hold out a seeded random fraction of samples; every token of a sample goes to one side."""
    n = extraction.n_samples
    rng = np.random.default_rng(seed)
    n_held = min(n - 1, max(1, int(round(n * heldout_fraction)))) if n > 1 else 0
    held = np.zeros(n, dtype=bool)
    held[rng.permutation(n)[:n_held]] = True
    train, heldout = [], []
    for part in extraction.parts:
        start = part.sample_start
        counts = np.diff(part.offsets)
        is_held = np.repeat(held[start:start + len(counts)], counts)
        rows = np.arange(int(part.offsets[-1]), dtype=np.int64)
        train.append(rows[~is_held])
        heldout.append(rows[is_held])
    return TokenSplit(train, heldout, [int(i) for i in np.flatnonzero(held)])


def tensors(extraction: Extraction, hook: str) -> list[np.ndarray]:
    """The hook's (n_tokens, d) float32 memmap of each part (nothing is loaded here)."""
    if hook not in extraction.tensor_names:
        raise ConfigError(f"sae.hook {hook!r} was not captured by the extraction at {extraction.dir}; "
                          f"captured: {extraction.tensor_names} (add it to extract.hooks)")
    return [part.tensor(hook) for part in extraction.parts]


def gather(arrays: list[np.ndarray], rows: list[np.ndarray], picks: np.ndarray) -> np.ndarray:
    """Rows `picks` (indices into the concatenation of `rows`) read from the memmaps, sorted per part
    so each read walks the file forward."""
    sizes = np.cumsum([0] + [len(r) for r in rows])
    out = []
    for p, (array, part_rows) in enumerate(zip(arrays, rows)):
        local = picks[(picks >= sizes[p]) & (picks < sizes[p + 1])] - sizes[p]
        if len(local):
            out.append(np.asarray(array[np.sort(part_rows[local])], dtype=np.float32))
    return np.concatenate(out) if out else np.empty((0, arrays[0].shape[1]), np.float32)


def stream_batches(arrays: list[np.ndarray], rows: list[np.ndarray], batch_size: int,
                   rng: np.random.Generator) -> Iterator[torch.Tensor]:
    """Endless shuffled batches: each epoch is a fresh permutation of the training rows."""
    total = sum(len(r) for r in rows)
    if total == 0:
        raise ConfigError("sae: no training tokens (dataset too small for sae.heldout_fraction)")
    while True:
        order = rng.permutation(total)
        for start in range(0, total - batch_size + 1 if total >= batch_size else 1, batch_size):
            yield torch.from_numpy(gather(arrays, rows, order[start:start + batch_size]))


class Prefetcher:
    """Batches of `source` made on a background thread, `depth` ahead of the training step.

    On CUDA each batch is copied into one of a ring of pinned host buffers and sent to the device on a
    side stream; the step's stream waits on that copy's event, the host never does (no per-step
    synchronisation). Elsewhere the thread only overlaps the memmap gathers with the step (no pinning:
    pinned memory only speeds up copies to a GPU). The batches and their order are those of `source`.
    """

    def __init__(self, source: Iterator[torch.Tensor], device: torch.device, depth: int = 2):
        self.device, self.cuda = device, device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # A pinned slot is rewritten only after its copy finished: depth queued + 1 in use + 1 being filled.
        self._slots = depth + 2
        self._thread = threading.Thread(target=self._produce, args=(source,), daemon=True, name="sae-prefetch")
        self._thread.start()

    def _produce(self, source: Iterator[torch.Tensor]) -> None:
        try:
            stream = torch.cuda.Stream(self.device) if self.cuda else None
            pinned: list[torch.Tensor | None] = [None] * self._slots
            copied: list[torch.cuda.Event | None] = [None] * self._slots
            for i, batch in enumerate(source):
                item = (batch, None)
                if self.cuda:
                    slot = i % self._slots
                    if copied[slot] is not None:
                        copied[slot].synchronize()  # this (background) thread waits, not the step
                    if pinned[slot] is None or pinned[slot].shape != batch.shape:
                        pinned[slot] = torch.empty(batch.shape, dtype=batch.dtype, pin_memory=True)
                    pinned[slot].copy_(batch)
                    with torch.cuda.stream(stream):
                        on_device = pinned[slot].to(self.device, non_blocking=True)
                        copied[slot] = torch.cuda.Event()
                        copied[slot].record(stream)
                    item = (on_device, copied[slot])
                if not self._put(item):
                    return
        except BaseException as exc:  # re-raised in the training thread by __next__
            self._put((exc, None))

    def _put(self, item: tuple[Any, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> torch.Tensor:
        batch, copied = self._queue.get()
        if isinstance(batch, BaseException):
            raise batch
        if copied is not None:
            step_stream = torch.cuda.current_stream(self.device)
            step_stream.wait_event(copied)
            batch.record_stream(step_stream)  # allocated on the side stream, used on this one
        return batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def iter_rows(arrays: list[np.ndarray], rows: list[np.ndarray], chunk: int = 8192,
              limit: int | None = None) -> Iterator[np.ndarray]:
    """The given rows in order, `chunk` at a time, stopping after `limit` rows."""
    seen = 0
    for array, part_rows in zip(arrays, rows):
        for start in range(0, len(part_rows), chunk):
            take = part_rows[start:start + chunk]
            if limit is not None:
                take = take[:max(0, limit - seen)]
            if len(take) == 0:
                return
            seen += len(take)
            yield np.asarray(array[take], dtype=np.float32)


def data_mean(arrays: list[np.ndarray], rows: list[np.ndarray], limit: int = 65536) -> torch.Tensor:
    total, count = None, 0
    for block in iter_rows(arrays, rows, limit=limit):
        s = block.astype(np.float64).sum(0)
        total = s if total is None else total + s
        count += len(block)
    return torch.from_numpy(total / max(count, 1)).float()


# ---------------------------------------------------------------- training

def init_sae(sae: TopKSAE, mean: torch.Tensor, seed: int) -> None:
    """Unit-norm random decoder rows, encoder = decoder (tied init), b_dec = data mean and
    encoder_bias = -encoder_weight @ mean so the first encodings see centred data."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        sae.decoder_weight.copy_(torch.randn(sae.num_basis, sae.d_in, generator=gen))
        sae.normalize_decoder()
        sae.encoder_weight.copy_(sae.decoder_weight)
        sae.decoder_bias.copy_(mean)
        sae.encoder_bias.copy_(-(sae.encoder_weight @ mean))


def auxk_loss(sae: TopKSAE, x: torch.Tensor, x_hat: torch.Tensor, pre: torch.Tensor,
              dead: torch.Tensor, aux_k: int) -> torch.Tensor:
    """Gao et al.'s AuxK: the top-aux_k dead latents reconstruct the residual, scaled by its variance.
    Never reads a value back to the host: live latents are masked to 0, so with fewer than aux_k dead
    latents the extra picks add 0, and with none the loss is multiplied by 0."""
    masked = pre.masked_fill(~dead, 0.0)
    values, indices = torch.topk(masked, min(aux_k, sae.num_basis), dim=-1)
    residual = (x - x_hat).detach()
    recon = sae.decode_dense(values, indices, bias=False)
    loss = (recon - residual).pow(2).sum(-1).mean() / residual.var(0).sum().clamp_min(1e-8)
    return loss * dead.any()


@torch.no_grad()
def evaluate(sae: TopKSAE, arrays: list[np.ndarray], rows: list[np.ndarray], limit: int | None = None,
             device: str = "cpu") -> dict[str, Any]:
    """Held-out FVU (sum ||x - x_hat||^2 / sum ||x - mean||^2), MSE and per-latent firing counts."""
    sq_err, sq, s, n = 0.0, 0.0, None, 0
    fires = torch.zeros(sae.num_basis, dtype=torch.long)
    for block in iter_rows(arrays, rows, limit=limit):
        x = torch.from_numpy(block).to(device)
        values, indices = sae.encode(x)
        x_hat = sae.decode_dense(values, indices)
        sq_err += float((x - x_hat).double().pow(2).sum())
        sq += float(x.double().pow(2).sum())
        s = x.double().sum(0) if s is None else s + x.double().sum(0)
        n += len(x)
        fires += torch.bincount(indices[values > 0].cpu(), minlength=sae.num_basis)
    if n == 0:
        return {"n_tokens": 0, "fvu": None, "mse": None, "dead_fraction": None}
    total_var = sq - float((s * s).sum()) / n
    return {"n_tokens": n, "fvu": sq_err / max(total_var, 1e-30), "mse": sq_err / (n * sae.d_in),
            "dead_fraction": float((fires == 0).float().mean()), "fires": fires}


def resolve_hook(config: dict[str, Any]) -> str:
    """sae.hook, or the first ':input' entry of extract.hooks; must be captured by extract.hooks."""
    hook = config["sae"].get("hook")
    hooks = config["extract"]["hooks"]
    if hook is None:
        inputs = [h for h in hooks if h.endswith(":input")]
        if not inputs:
            raise ConfigError("sae.hook is null and extract.hooks has no '<module>:input' capture; "
                              "add the target modules' input to extract.hooks or set sae.enabled: false")
        return inputs[0]
    if hook not in hooks:
        raise ConfigError(f"sae.hook {hook!r} is not captured: extract.hooks = {hooks}; add it there")
    return hook


def train_steps(sae: TopKSAE, opt: torch.optim.Optimizer, batches: Iterator[torch.Tensor], sae_cfg: dict[str, Any],
                progress: bool = True) -> tuple[int, list[dict[str, float]]]:
    """sae_cfg["steps"] optimiser steps on `batches` (already on the SAE's device); returns the tokens
    seen and the loss curve. Nothing in a step reads a device value back, so on a GPU the host runs
    ahead and queues work; the curve's values are read once, at the end."""
    k, steps = sae.k_active, sae_cfg["steps"]
    aux_k = sae_cfg["aux_k"] or min(512, sae.num_basis // 2)
    # A latent is dead when it has not fired for dead_tokens training tokens (Gao et al.: 10M; scaled).
    last_fired = torch.zeros(sae.num_basis, dtype=torch.long, device=sae.decoder_weight.device)
    seen, curve = 0, []
    for step in tqdm(range(1, steps + 1), desc="train sae", unit="step", disable=not progress):
        x = next(batches)
        pre = sae.pre_acts(x)
        values, indices = torch.topk(pre, k, dim=-1)
        x_hat = sae.decode_dense(values, indices)
        mse = (x_hat - x).pow(2).sum(-1).mean() / (x - x.mean(0)).pow(2).sum(-1).mean().clamp_min(1e-8)
        seen += len(x)
        last_fired.scatter_reduce_(0, indices.flatten(), torch.where(values > 0, seen, 0).flatten(), "amax")
        dead = (seen - last_fired) >= sae_cfg["dead_tokens"]
        aux = auxk_loss(sae, x, x_hat, pre, dead, aux_k)
        loss = mse + sae_cfg["aux_coef"] * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sae.remove_parallel_grad()
        opt.step()
        sae.normalize_decoder()
        if step == 1 or step % max(1, steps // 100) == 0 or step == steps:
            curve.append((step, seen, torch.stack([mse.detach(), aux.detach(), dead.float().mean()])))
    return seen, [{"step": step, "tokens": tokens, "fvu": fvu, "auxk": auxk, "dead_fraction_train": dead}
                  for (step, tokens, values) in curve for fvu, auxk, dead in [values.tolist()]]


def train_sae(extraction: Extraction, hook: str, sae_cfg: dict[str, Any],
              progress: bool = True) -> tuple[TopKSAE, dict[str, Any]]:
    """Train a TopK SAE on `hook`'s activations; return it and the report dict."""
    arrays = tensors(extraction, hook)
    d_in = arrays[0].shape[1]
    num_basis = sae_cfg["num_basis"] or 4 * d_in
    k = sae_cfg["k_active"]
    split = split_tokens(extraction, sae_cfg["heldout_fraction"], sae_cfg["seed"])
    torch.manual_seed(sae_cfg["seed"])
    sae = TopKSAE(d_in, num_basis, k)
    init_sae(sae, data_mean(arrays, split.train), sae_cfg["seed"])
    device = pick_device(sae_cfg["device"])
    sae.to(device)
    opt = torch.optim.Adam(sae.parameters(), lr=sae_cfg["lr"], betas=(0.9, 0.999), eps=6.25e-10)
    started = time.perf_counter()
    source = stream_batches(arrays, split.train, sae_cfg["batch_size"], np.random.default_rng(sae_cfg["seed"]))
    with Prefetcher(source, device) as batches:
        seen, curve = train_steps(sae, opt, batches, sae_cfg, progress)
    sae.cpu().eval()
    held = evaluate(sae, arrays, split.heldout, limit=sae_cfg["eval_tokens"])
    report = {"source": "trained", "hook": hook, "d_in": d_in, "num_basis": num_basis, "k_active": k,
              "steps": sae_cfg["steps"], "batch_size": sae_cfg["batch_size"], "train_tokens_seen": seen,
              "n_train_tokens": split.n_train, "n_heldout_tokens": split.n_heldout,
              "heldout_samples": split.heldout_samples, "training_seconds": time.perf_counter() - started,
              "device": device.type, "heldout": {k_: v for k_, v in held.items() if k_ != "fires"},
              "loss_curve": curve}
    log.info("sae %s: held-out FVU %.4f, dead %.3f", hook, held["fvu"] or float("nan"), held["dead_fraction"] or 0)
    return sae, report


# ---------------------------------------------------------------- import and save/load

def import_sae(path: str | Path, style: str, k_active: int) -> TopKSAE:
    """Load a SAELens- or saev-style safetensors checkpoint (W_enc [d_in, d_sae], W_dec [d_sae, d_in],
    b_enc [d_sae], b_dec [d_in]) and fold `x - b_dec` into the encoder bias.

    SAELens: b_dec is subtracted before encoding unless cfg.json beside the file says
    apply_b_dec_to_input: false. saev: always subtracted.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if style not in IMPORT_STYLES:
        raise ConfigError(f"sae.import.style {style!r}: expected one of {IMPORT_STYLES}")
    if not path.is_file():
        raise ConfigError(f"sae.import.path {path}: no such file")
    raw = load_file(str(path))
    missing = [key for key in ("W_enc", "b_enc", "W_dec", "b_dec") if key not in raw]
    if missing:
        raise FormatError(f"{path}: {style} checkpoint lacks {missing}; has {sorted(raw)}")
    w_enc, b_enc, w_dec, b_dec = (raw[key].float() for key in ("W_enc", "b_enc", "W_dec", "b_dec"))
    d_in, d_sae = w_enc.shape
    expect = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    for key, shape in expect.items():
        if tuple(raw[key].shape) != shape:
            raise FormatError(f"{path}: {key} has shape {list(raw[key].shape)}, expected {list(shape)}")
    subtract = True
    cfg_path = path.with_name("cfg.json")
    if style == "saelens" and cfg_path.is_file():
        subtract = bool(json.loads(cfg_path.read_text()).get("apply_b_dec_to_input", True))
    bias = b_enc - b_dec @ w_enc if subtract else b_enc
    return TopKSAE.from_state({"encoder_weight": w_enc.T, "encoder_bias": bias,
                               "decoder_weight": w_dec, "decoder_bias": b_dec}, k_active)


def save_sae(sae: TopKSAE, path: str | Path, meta: dict[str, Any]) -> None:
    """float32 safetensors with the LUT key names; meta (hook, k_active, ...) in the header."""
    from safetensors.torch import save_file

    header = {key: str(value) for key, value in {**meta, "k_active": sae.k_active,
                                                 "num_basis": sae.num_basis, "d_in": sae.d_in}.items()}
    with atomic_path(path) as tmp:
        save_file(sae.state(), str(tmp), metadata=header)


def load_sae(path: str | Path) -> tuple[TopKSAE, dict[str, str]]:
    """Read an actstore SAE checkpoint written by save_sae."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: SAE checkpoint missing")
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
        missing = [key for key in SAE_KEYS if key not in fh.keys()]
        if missing or "k_active" not in meta:
            raise FormatError(f"{path}: not an actstore SAE checkpoint (missing {missing or ['k_active']})")
        state = {key: fh.get_tensor(key) for key in SAE_KEYS}
    return TopKSAE.from_state(state, int(meta["k_active"])), meta


def build_sae(config: dict[str, Any], extract_dir: str | Path, out_dir: str | Path,
              progress: bool = True) -> dict[str, Any]:
    """The sae stage: train (or import) an SAE on the configured hook; write sae.safetensors + report.json."""
    sae_cfg = config["sae"]
    hook = resolve_hook(config)
    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    out_dir = Path(out_dir)
    imported = sae_cfg.get("import")
    if imported:
        sae = import_sae(imported["path"], imported["style"], sae_cfg["k_active"])
        arrays = tensors(extraction, hook)
        if arrays[0].shape[1] != sae.d_in:
            raise ConfigError(f"sae.import.path {imported['path']}: d_in {sae.d_in} != {hook} width {arrays[0].shape[1]}")
        split = split_tokens(extraction, sae_cfg["heldout_fraction"], sae_cfg["seed"])
        held = evaluate(sae, arrays, split.heldout, limit=sae_cfg["eval_tokens"])
        report = {"source": f"import:{imported['style']}", "import_path": str(imported["path"]), "hook": hook,
                  "d_in": sae.d_in, "num_basis": sae.num_basis, "k_active": sae.k_active,
                  "n_heldout_tokens": split.n_heldout, "heldout_samples": split.heldout_samples,
                  "heldout": {k: v for k, v in held.items() if k != "fires"}, "loss_curve": []}
    else:
        sae, report = train_sae(extraction, hook, sae_cfg, progress)
    save_sae(sae, out_dir / SAE_FILE, {"hook": hook, "source": report["source"],
                                       "model": extraction.meta["model"]["name"]})
    write_json_atomic(out_dir / REPORT_FILE, report)
    return report
