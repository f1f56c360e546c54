"""The sae stage: an SAE trained (or imported) on the configured hook, written with its report."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from actstore.config import import_files, resolve_hook
from actstore.formats.extract import Extraction, PartsCheck, open_extraction
from actstore.io_utils import sha256_file, write_json_atomic
from actstore.sae.checkpoint import REPORT_FILE, SAE_FILE, SAELENS_DIR, import_sae, save_sae, save_saelens
from actstore.sae.data import hook_reads, sampled_rows, split_tokens, tensors
from actstore.sae.model import TopKSAE
from actstore.sae.train import evaluate, heldout_summary, train_sae

log = logging.getLogger(__name__)


def imported_sae(extraction: Extraction, hook: str, sae_cfg: dict[str, Any]) -> tuple[TopKSAE, dict[str, Any]]:
    """sae.import's checkpoint, checked against the hook's width and evaluated on the same held-out
    split a trained SAE would get; return it and the report dict."""
    imported = sae_cfg["import"]
    arrays = tensors(extraction, hook)
    sae = import_sae(imported["path"], imported["style"], sae_cfg["k_active"], hook_width=arrays[0].shape[1],
                     hook=hook)
    split = split_tokens(extraction, sae_cfg["heldout_fraction"], sae_cfg["seed"])
    held_rows = sampled_rows(split.heldout, sae_cfg["eval_tokens"], sae_cfg["seed"])
    # Only the evaluated rows are read: the files holding one are checked whole, beside the reads (evaluate
    # samples them as here, so its seeded sample is these rows).
    with PartsCheck(hook_reads(extraction, hook, held_rows)):
        held = evaluate(sae, arrays, held_rows)
    if imported["style"] == "saev" and held["tokens_under_k"]:
        log.warning("sae.import %s: %d of %d held-out tokens have fewer than %d positive pre-activations; saev's "
                    "TopK keeps the negative ones there, Step A (TopK of ReLU) zeroes them", imported["path"],
                    held["tokens_under_k"], held["n_tokens"], sae.k_active)
    # The stage's hash names the import's path only: its sha256 tells which bytes this SAE came from.
    files = {str(path): sha256_file(path) for path in import_files(imported["path"], imported["style"])}
    report = {"source": f"import:{imported['style']}", "import_path": str(imported["path"]),
              "import_sha256": files, "hook": hook,
              "d_in": sae.d_in, "num_basis": sae.num_basis, "k_active": sae.k_active,
              "n_heldout_tokens": split.n_heldout, "heldout_samples": split.heldout_samples,
              "heldout": heldout_summary(held), "loss_curve": []}
    return sae, report


def build_sae(config: dict[str, Any], extract_dir: str | Path, out_dir: str | Path,
              progress: bool = True) -> dict[str, Any]:
    """The sae stage: train (or import) an SAE on the configured hook; write sae.safetensors, the same
    SAE in SAELens' layout (saelens/) and report.json."""
    sae_cfg = config["sae"]
    hook = resolve_hook(config)
    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    out_dir = Path(out_dir)
    if sae_cfg.get("import"):
        sae, report = imported_sae(extraction, hook, sae_cfg)
    else:
        sae, report = train_sae(extraction, hook, sae_cfg, progress)
    save_sae(sae, out_dir / SAE_FILE, {"hook": hook, "source": report["source"],
                                       "model": extraction.info.model.name})
    # hook_name is the module path and side the extraction captured (SAELens names TransformerLens hooks).
    save_saelens(sae, out_dir / SAELENS_DIR, {"model_name": extraction.info.model.name, "hook_name": hook,
                                              "context_size": extraction.info.max_seq_length,
                                              "trained_by": f"actstore ({report['source']})"})
    write_json_atomic(out_dir / REPORT_FILE, report)
    return report
