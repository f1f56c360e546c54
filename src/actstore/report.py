"""Plots for `snakemake --report`: what a user would rather see than read."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from actstore.formats.extract import Extraction, layer_tensor

MAX_TOKENS_PER_LAYER = 20000


def _pyplot():
    """matplotlib's pyplot, imported when a plot is drawn: every Snakemake job parses the Snakefile,
    which takes PLOTS from here (imported at the top: 0.3 s and 34 MB a parse)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure():
    return _pyplot().subplots(figsize=(6, 3.5))


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def activation_norms(extraction: Extraction, path: Path) -> None:
    """Box plot of per-token L2 norms for every stored layer (a seeded token subsample); a layer's label
    counts the sampled tokens the model computed as NaN or inf, which have no norm to draw."""
    rng = np.random.default_rng(0)
    norms, labels = [], []
    per_part = max(1, MAX_TOKENS_PER_LAYER // len(extraction.parts))  # 0 past 20,000 parts: every box empty
    for layer in extraction.info.layers:
        values = []
        for part in extraction.parts:
            if part.info.n_tokens == 0:
                continue
            tensor = part.tensor(layer_tensor(layer))
            take = np.sort(rng.choice(len(tensor), size=min(len(tensor), per_part), replace=False))
            values.append(np.linalg.norm(tensor[take], axis=1))
        layer_norms = np.concatenate(values)
        # A box of NaN statistics is not drawn: a layer with one NaN token would vanish without a word.
        finite = np.isfinite(layer_norms)
        norms.append(layer_norms[finite])
        labels.append(f"{layer}\n({(~finite).sum()} non-finite)" if not finite.all() else str(layer))
    fig, ax = _figure()
    ax.boxplot(norms, showfliers=False)
    ax.set_xticks(range(1, len(norms) + 1), labels)
    ax.set(xlabel="layer (block output)", ylabel="token L2 norm", title="Activation norm per layer")
    _save(fig, path)


def tokens_per_sample(extraction: Extraction, path: Path) -> None:
    """40 bins over every sample's token count, from the parts' offsets (which verify holds to be the
    truth), a part at a time: a Python list of every row's parsed count took ~36 bytes a sample (3.6 GB
    at 10^8 samples) and a JSON parse of each row's text."""
    def counts() -> Iterator[np.ndarray]:  # each part's, made when asked for: never a list of every part's
        return (np.diff(part.offsets) for part in extraction.parts if part.info.n_samples)

    lo, hi = min((int(c.min()) for c in counts()), default=0), max((int(c.max()) for c in counts()), default=0)
    edges = np.histogram_bin_edges([lo, hi], bins=40)
    samples = sum((np.histogram(c, bins=edges)[0] for c in counts()), np.zeros(40, np.int64))
    fig, ax = _figure()
    ax.stairs(samples, edges, fill=True)
    ax.set(xlabel="tokens per sample", ylabel="samples", title=f"Tokens per sample (n={extraction.n_samples})")
    _save(fig, path)


def bytes_per_format(report: dict[str, Any], path: Path) -> None:
    names = [n for n, e in report["formats"].items() if "inspect" in e]
    sizes = [report["formats"][n]["inspect"].get("bytes", 0) / 2**20 for n in names]
    fig, ax = _figure()
    ax.barh(names, sizes)
    ax.set(xlabel="MiB on disk", title="Bytes per format")
    _save(fig, path)


def read_latency(report: dict[str, Any], path: Path) -> None:
    entries = {n: e["read_latency_us"] for n, e in report["formats"].items() if e.get("read_latency_us")}
    fig, ax = _figure()
    ax.boxplot(list(entries.values()), showfliers=True)
    ax.set_xticks(range(1, len(entries) + 1), list(entries))
    ax.set_yscale("log")
    ax.set(ylabel="µs per vector (open + read)", title="Random-vector read latency through each reader")
    _save(fig, path)


def lut_error(report: dict[str, Any], path: Path) -> None:
    """Relative error vs compensation budget per LUT target, from the LUT stage's report.json."""
    fig, ax = _figure()
    errors = (report.get("lut") or {}).get("relative_error") or {}
    for target, by_budget in sorted(errors.items()):
        budgets = sorted(by_budget, key=int)
        # A module path is text: matplotlib would parse one holding two '$' as mathtext (rendered as a
        # formula, or a ValueError at savefig), so its '$' are escaped.
        ax.plot([int(b) for b in budgets], [by_budget[b]["relative_error"] for b in budgets], marker="o",
                label=target.replace("$", r"\$"))
    ax.set(xlabel="compensation budget |S|", ylabel="‖LUT(x) − xW‖ / ‖xW‖", title="LUT error vs compensation")
    if errors:
        ax.legend(fontsize=7)
    _save(fig, path)


def sae_loss(report: dict[str, Any], path: Path) -> None:
    """Training FVU (and AuxK loss) per step, with the held-out FVU as a line."""
    sae = report.get("sae") or {}
    curve = sae.get("loss_curve") or []
    fig, ax = _figure()
    steps = [point["step"] for point in curve]
    for key in ("fvu", "auxk"):
        if any(point.get(key) for point in curve):
            ax.plot(steps, [point.get(key) for point in curve], label=f"train {key}")
    # An imported SAE has no training curve, but its held-out FVU was measured all the same.
    heldout = (sae.get("heldout") or {}).get("fvu")
    if heldout is not None:
        ax.axhline(heldout, color="k", linestyle="--", label=f"held-out FVU {heldout:.3f}")
    if ax.lines:
        ax.legend(fontsize=7)
    ax.set(xlabel="step", ylabel="fraction of variance unexplained", title="SAE training loss")
    _save(fig, path)


PLOTS = ("activation_norms", "tokens_per_sample", "bytes_per_format", "read_latency", "lut_error", "sae_loss")


def make_plots(extraction: Extraction, report: dict[str, Any], out: dict[str, str]) -> None:
    """Write every plot in PLOTS to out[name]."""
    activation_norms(extraction, Path(out["activation_norms"]))
    tokens_per_sample(extraction, Path(out["tokens_per_sample"]))
    bytes_per_format(report, Path(out["bytes_per_format"]))
    read_latency(report, Path(out["read_latency"]))
    lut_error(report, Path(out["lut_error"]))
    sae_loss(report, Path(out["sae_loss"]))
