"""The lut stage: LUTs precomputed from a trained SAE and the model's target linears (nn.Linear, or
transformers' Conv1D as GPT-2 holds its projections; the format is
actstore.formats.lut, the runtime that uses them actstore.lut_runtime), then evaluated end to end
with the runtime installed in the model."""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from actstore.errors import ConfigError, FormatError
from actstore.formats.extract import Extraction, PartFile, PartsCheck, open_extraction
from actstore.formats.lut import LutStore, open_lut, precompute, write_lut
from actstore.integrity import read_json
from actstore.lut_runtime import LutEncoder, LutLinear, calibrate_auto, install_luts, parent_module, target_weight
from actstore.io_utils import sha256_file, write_json_atomic
from actstore.model_config import config_int, trusted
from actstore.resources import LUT_EVAL_LOGITS

log = logging.getLogger(__name__)
REPORT_FILE = "report.json"
# creation_info's record of the SAE file the tables were built from: its path alone does not tell a
# rerun of the sae stage (GPU training is not bit-reproducible) from the SAE that was there.
SAE_SHA256 = "sae_sha256"


def model_config_summary(config_json: dict[str, Any]) -> dict[str, Any]:
    """metadata.json model_config: the spec's four fields (of the tower extraction runs, model_config.tower_config)."""
    summary = {"model_type": config_json.get("model_type"),
               "num_layers": config_int(config_json, "num_hidden_layers"),
               "num_attention_heads": config_int(config_json, "num_attention_heads"),
               "hidden_size": config_int(config_json, "hidden_size")}
    return {k: v for k, v in summary.items() if v is not None}


def target_linears(model: nn.Module, targets: list[str], d_in: int) -> dict[str, nn.Module]:
    """lut.targets resolved on `model` (a model skeleton works: the sae job checks them before it
    trains), keyed by each one's dotted path in `model` (module_full_path), the LUT's layer key and file
    name: the spec's runtime finds it with get_submodule, which a causal LM's base-model spelling
    (`layers.1.self_attn.q_proj`) does not; ConfigError naming a target that is missing, not an nn.Linear
    nor a transformers Conv1D (target_weight), or of another input width."""
    from actstore.models import module_full_path

    if not targets:
        raise ConfigError("lut.targets is empty: list the nn.Linear (or Conv1D) module paths that read "
                          "sae.hook's tensor")
    linears: dict[str, nn.Module] = {}
    paths: dict[nn.Module, str] = {}  # lut.targets may name one module by two paths (with a base model's prefix)
    for module_path in targets:
        full_path = module_full_path(model, module_path, "lut.targets")
        linear = model.get_submodule(full_path)
        w_target = target_weight(linear, f"lut.targets: {module_path!r}")
        if linear in paths:  # its two tables would be written, then refused by install_luts after training
            raise ConfigError(f"lut.targets: {paths[linear]!r} and {module_path!r} are one module of the model")
        paths[linear] = module_path
        if w_target.shape[0] != d_in:
            raise ConfigError(f"lut.targets: {module_path!r} takes {w_target.shape[0]} inputs, the SAE {d_in}")
        linears[full_path] = linear
    return linears


def check_targets_before_training(config: dict[str, Any], extract_dir: str | Path) -> None:
    """The lut stage's targets checked on the model skeleton against sae.hook's width, and its held-out
    samples' existence, so a bad target or a one-sample extraction fails before the SAE trains rather than after."""
    from actstore.model_config import resolve_model_path
    from actstore.models import model_skeleton
    from actstore.config import resolve_hook
    from actstore.sae import tensors

    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    if extraction.n_samples < 2:  # the lut stage evaluates on the SAE's held-out samples; one sample holds none out
        raise ConfigError(f"{extract_dir}: the extraction holds {extraction.n_samples} sample, and the lut stage "
                          "evaluates its tables on samples the SAE did not train on: extract at least 2")
    d_in = tensors(extraction, resolve_hook(config))[0].shape[1]
    target_linears(model_skeleton(resolve_model_path(config["model"]["path"]), config["model"].get("tower"),
                                  trusted(config["model"])), config["lut"]["targets"], d_in)


def check_targets_read_hook(config: dict[str, Any], extract_dir: str | Path, loaded: Any, hook: str) -> None:
    """ConfigError naming a lut.targets entry whose input is not the SAE's hook tensor, from one forward
    of sample 0: the widths alone let through a linear of another layer, whose tables would encode
    inputs the SAE never saw (and relative_errors, run on the hook's tensors, would look fine)."""
    from actstore.extract.capture import capture

    targets = config["lut"]["targets"]
    inputs = batch_inputs(config, open_extraction(extract_dir, config["extract"]["parts"]), loaded, [0])
    specs = list(dict.fromkeys([hook, *(f"{target}:input" for target in targets)]))  # once: the hook may be one
    with torch.inference_mode(), capture(loaded, [], specs) as captured:
        loaded.model(**inputs)
    for target in targets:
        seen = captured.get(f"{target}:input")
        if seen is None or not torch.equal(seen, captured[hook]):
            raise ConfigError(f"lut.targets: {target!r} does not take the SAE's hook tensor {hook!r} as its input "
                              f"({'not called' if seen is None else 'another tensor'} on sample 0): its tables "
                              f"would encode inputs the SAE was not trained on; list the linears that read {hook!r}")


def build_tables(config: dict[str, Any], model: nn.Module, sae_state: dict[str, torch.Tensor]
                 ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(module path, its tables) for each target, precomputed from the live model's weights when asked
    for and never held here: write_lut writes and drops each before the next is made, so the stage holds
    one target's tables (GBs at 65k latents), not every target's. The targets are resolved up front."""
    linears = target_linears(model, config["lut"]["targets"], sae_state["encoder_weight"].shape[1])
    return ((module_path, precompute(sae_state, target_weight(linear, module_path).float().cpu(),
                                     None if linear.bias is None else linear.bias.detach().float().cpu(),
                                     config["lut"]["dtype"], module_path))
            for module_path, linear in linears.items())


def build_lut(config: dict[str, Any], extract_dir: str | Path, sae_dir: str | Path, out_dir: str | Path,
              progress: bool = True) -> dict[str, Any]:
    """The lut stage: write <out_dir>/lut/ per spec, then evaluate it and write <out_dir>/report.json."""
    from actstore.model_config import resolve_model_path
    from actstore.models import load_model, pick_device
    from actstore.sae import REPORT_FILE as SAE_REPORT, SAE_FILE, load_sae

    device = str(pick_device(config["lut"]["device"], "lut.device"))
    if config["extract"]["image_pipeline"] == "gpu" and not device.startswith("cuda"):
        raise ConfigError(f"lut.device {device}: the extraction decoded its images on the GPU "
                          "(extract.image_pipeline gpu), and the lut stage's held-out images are decoded so too: "
                          "run it on a GPU (lut.device auto or cuda)")
    sae_file = Path(sae_dir) / SAE_FILE
    # Hashed before it is read: a file replaced in between then fails validate, rather than passing.
    sae_sha256 = sha256_file(sae_file)
    sae, sae_meta = load_sae(sae_file)
    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    hook = sae_report(Path(sae_dir) / SAE_REPORT)["hook"]
    # Before the model loads: an extraction that holds out no token is named before any heavy work.
    rows, samples = heldout_split(config, extraction, Path(sae_dir) / SAE_REPORT)
    # Every part file the job reads, checked whole beside the reads and the model's load, before the
    # tables are renamed into place (the end-to-end evaluation reads token ids of files checked here).
    with PartsCheck(lut_reads(config, extraction, hook, rows, samples)):
        heldout = hook_rows(extraction, hook, rows), samples
        loaded = load_model(resolve_model_path(config["model"]["path"]), "float32", device,
                            config["model"].get("tower"), trusted(config["model"]),
                            fix_mistral_regex=config["model"].get("fix_mistral_regex"))
        if config["extract"]["image_pipeline"] == "gpu":  # named before the tables are built
            from actstore.extract.device_images import check_device_pipeline

            check_device_pipeline(loaded.preprocessor, loaded.device)
        check_targets_read_hook(config, extract_dir, loaded, hook)
    lut_root = write_lut(out_dir, build_tables(config, loaded.model, sae.state()), sae.k_active,
                         model_config_summary(loaded.config), {
        "source_model": sae_meta.get("model"), "sae_model": str(sae_file), SAE_SHA256: sae_sha256,
        "hook": sae_meta.get("hook"), "format_writer": "actstore"})
    del sae  # its float32 weights are in the tables now: not held through the evaluation (lut_mem_mb)
    report = evaluate_lut(config, extract_dir, heldout, lut_root, loaded, progress)
    write_json_atomic(Path(out_dir) / REPORT_FILE, report)
    return report


# ---------------------------------------------------------------- evaluation

def relative_errors(store: LutStore, model: nn.Module, x: torch.Tensor, budgets: list[int]) -> dict[str, Any]:
    """Per target and budget: ||LUT(x) - xW|| / ||xW|| over all held-out tokens (Frobenius) and the
    mean of the per-token ratio. Both sides exclude the linear's bias (the spec's output ≈ x @ W).
    Always the lookup (whatever lut.runtime says): this is the accuracy of the tables. A token whose
    x @ W is 0 has no ratio: it is left out of the mean and counted (zero_output_tokens, only when
    there are some; a floor of 1e-12 made the mean ~1e9 for one such token); a ratio with no token to
    average over, or a zero ||xW||, is null. One target's tables are held at a time (target_errors)."""
    return {module_path: target_errors(store, model, module_path, x, budgets) for module_path in store.layers}


def target_errors(store: LutStore, model: nn.Module, module_path: str, x: torch.Tensor,
                  budgets: list[int]) -> dict[str, Any]:
    """relative_errors of one target, its tables loaded here and let go on return (a loop's variables
    held the last target's float32 copies while the next loaded)."""
    from actstore.models import get_module

    linear = get_module(model, module_path, store.layers_source)
    tables = store.load(module_path)
    lut = LutLinear(LutEncoder(tables, store.k_active, torch.float32), tables, linear, with_bias=False)
    exact = x @ lut.w_target
    norms = exact.norm(dim=-1)
    nonzero = norms > 0
    zero_tokens = int((~nonzero).sum())
    if zero_tokens:
        log.warning("lut %s: %d held-out token(s) with a zero target output x @ W, left out of its "
                    "mean_token_relative_error (their ratio is undefined)", module_path, zero_tokens)
    per_budget = {}
    for budget in budgets:
        lut.set_budget(budget)
        with torch.inference_mode():
            diff = lut(x) - exact
        ratios = diff.norm(dim=-1)[nonzero] / norms[nonzero]
        errors = {"relative_error": float(diff.norm() / exact.norm()) if exact.norm() > 0 else None,
                  "mean_token_relative_error": float(ratios.mean()) if len(ratios) else None}
        per_budget[str(budget)] = {**errors, "zero_output_tokens": zero_tokens} if zero_tokens else errors
    return per_budget


def heldout_inputs(config: dict[str, Any], extract_dir: str | Path, sae_dir: str | Path,
                   ) -> tuple[torch.Tensor, list[int]]:
    """The SAE's held-out tokens of its hook tensor (heldout_split's rows, read) and held-out samples."""
    from actstore.sae import REPORT_FILE as SAE_REPORT

    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    rows, samples = heldout_split(config, extraction, Path(sae_dir) / SAE_REPORT)
    return hook_rows(extraction, sae_report(Path(sae_dir) / SAE_REPORT)["hook"], rows), samples


def heldout_split(config: dict[str, Any], extraction: Extraction, report_path: Path
                  ) -> tuple[list[np.ndarray], list[int]]:
    """The token rows (per part) the tables are evaluated on: the SAE's held-out tokens, a seeded uniform
    sample of lut.eval_tokens of them when there are more (the first in storage order were one class's in a
    dataset sorted by label); and the held-out samples. ConfigError when the split holds out no token (one
    sample: the SAE trained on all)."""
    from actstore.sae import split_tokens
    from actstore.sae.data import sampled_rows

    split = split_tokens(extraction, config["sae"]["heldout_fraction"], config["sae"]["seed"])
    if not split.n_heldout:
        raise ConfigError(f"{extraction.dir}: sae.heldout_fraction {config['sae']['heldout_fraction']} of its "
                          f"{extraction.n_samples} sample(s) holds out no token, and the lut stage evaluates its "
                          "tables on tokens the SAE did not train on: extract at least 2 samples")
    check_recorded_split(report_path, sae_report(report_path).get("heldout_samples"), split.heldout_samples)
    return sampled_rows(split.heldout, config["lut"]["eval_tokens"], config["sae"]["seed"]), split.heldout_samples


def hook_rows(extraction: Extraction, hook: str, rows: list[np.ndarray]) -> torch.Tensor:
    """`rows` (per part) of `hook`, float32, in order."""
    from actstore.sae import iter_rows, tensors

    return torch.from_numpy(np.concatenate(list(iter_rows(tensors(extraction, hook), rows))))


def lut_reads(config: dict[str, Any], extraction: Extraction, hook: str, rows: list[np.ndarray],
              samples: list[int]) -> list[PartFile]:
    """The part files the lut job reads, to be checked whole (PartsCheck): the hook's files holding `rows`
    (sae.data.hook_reads: a file is hashed whole however few rows are read of it) and token_ids.npy of each
    part holding sample 0 (check_targets_read_hook) or one of the end-to-end samples (end_to_end's, of the
    held-out `samples`): a text model's inputs. An image model's are read from the dataset."""
    from actstore.sae.data import hook_reads

    read = [0, *sampled_samples(samples, config["lut"]["eval_samples"], config["sae"]["seed"])]
    holding = {part.dir: part for part, _ in map(extraction.locate, read)}
    return hook_reads(extraction, hook, rows) + [(part, "token_ids.npy") for part in holding.values()
                                                 if "token_ids.npy" in part.meta["files"]]


def check_recorded_split(path: Path, recorded: Any, heldout_samples: list[int]) -> None:
    """ConfigError naming the SAE report `path` unless the held-out samples it records (`recorded`) are
    `heldout_samples` (the split recomputed from this config): a config whose sae.seed or heldout_fraction
    differ from the SAE stage's (build_lut given another run's SAE) would evaluate the tables on training
    tokens. A report without the record (hand-made) is not checked: the SAE stage always writes it."""
    if recorded is not None and recorded != heldout_samples:
        raise ConfigError(f"{path}: heldout_samples {recorded!r:.80} are not the held-out samples of this config's "
                          f"sae.heldout_fraction and sae.seed ({heldout_samples!r:.80}): the SAE was trained with "
                          f"another split, so its held-out tokens would be ones it trained on; run the lut stage "
                          f"with the SAE stage's config")


def sae_report(path: Path) -> dict[str, Any]:
    """The SAE stage's report, read strictly (a key given twice was the last, a missing or damaged
    report a Python traceback), its "hook" the tensor it trained on; FormatError naming it otherwise."""
    report = read_json(path)
    hook = report.get("hook") if isinstance(report, dict) else None
    if not isinstance(hook, str):
        raise FormatError(f"{path}: hook {hook!r:.80} is not a tensor name")
    return report


def end_to_end(config: dict[str, Any], extract_dir: str | Path, lut_root: Path, loaded: Any,
               samples: list[int], budgets: list[int]) -> dict[str, Any]:
    """Swap the targets into the real model with lut.runtime: cosine of final hidden states (encoders,
    vision) or KL(original || LUT) and perplexity change (causal LMs), on a seeded sample of
    lut.eval_samples held-out samples (sampled_samples), batched as extraction batched them; per budget
    which path (lookup or dense) the targets' calls took, each target's crossover and (runtime auto,
    not pinned by lut.crossover_tokens) the measured times it came from. Each batch runs the original
    model once (its linears put back: its outputs do not depend on the budget) and then the LUT one at
    each budget, each budget's statistics counted (Comparison) before the next: one batch's reference
    and one LUT output are held, never the whole evaluation's (64 samples x 1,024 tokens of a
    128K-vocabulary model's logits are 34 GB)."""
    from actstore.models import get_module

    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    samples = sampled_samples(samples, config["lut"]["eval_samples"], config["sae"]["seed"])
    inputs = [batch_inputs(config, extraction, loaded, batch)
              for batch in eval_batches(extraction, loaded, samples, eval_batch_rows(config, loaded))]
    store = open_lut(lut_root)
    originals = {path: get_module(loaded.model, path, store.layers_source) for path in store.layers}
    runtime = config["lut"].get("runtime", "lookup")
    installed = install_luts(loaded.model, store, budgets[0], runtime=runtime,
                             crossover_tokens=config["lut"].get("crossover_tokens"))
    # Every budget calibrated before the batches, which then switch between them (a budget listed twice
    # runs once: its crossovers and path counts are one record).
    runs = {budget: BudgetRun.calibrated(installed, budget) for budget in budgets}
    comparisons = {budget: Comparison(loaded.kind) for budget in runs}
    with torch.inference_mode():
        for inp in inputs:
            with swapped_in(loaded.model, originals):
                reference = run_model(loaded, inp)
            for budget, run in runs.items():
                run.set_on(installed)
                comparisons[budget].add(reference, run_model(loaded, inp), inp)
    return {"n_samples": len(samples), "model_kind": loaded.kind, "runtime": runtime,
            "budgets": {str(budget): {**comparisons[budget].result(), **run.report()} for budget, run in runs.items()}}


@dataclass
class BudgetRun:
    """One budget's state of the installed targets, set on them (set_on) whenever a batch runs at it:
    each target's crossover and calibration table (a crossover holds for the budget it was measured at)
    and its path counts, which count only this budget's calls."""
    budget: int
    crossovers: dict[str, tuple[int | None, dict[str, Any] | None]]
    calibration: list[dict[str, Any]]
    paths: dict[str, dict[str, int]]

    @classmethod
    def calibrated(cls, installed: dict[str, LutLinear], budget: int) -> BudgetRun:
        """The targets set to `budget` and their crossovers measured at it (calibrate_auto: those of
        runtime auto not pinned by lut.crossover_tokens), no call counted yet."""
        for lut in installed.values():
            lut.set_budget(budget)
        calibration = calibrate_auto(installed)
        return cls(budget, {name: (lut.crossover_tokens, lut.calibration) for name, lut in installed.items()},
                   calibration, {name: {"lookup": 0, "dense": 0} for name in installed})

    def set_on(self, installed: dict[str, LutLinear]) -> None:
        """The targets at this budget, with its crossovers and its record counting their calls."""
        for name, lut in installed.items():
            lut.set_budget(self.budget)  # drops another budget's measured crossover: this one's put back
            lut.crossover_tokens, lut.calibration = self.crossovers[name]
            lut.paths = self.paths[name]  # the target's calls counted in this budget's record

    def report(self) -> dict[str, Any]:
        return {
            # Which path each target's forward calls took (runtime auto switches by token count).
            "paths": {path: sum(paths[path] for paths in self.paths.values()) for path in ("lookup", "dense")},
            "paths_by_target": {name: dict(paths) for name, paths in self.paths.items()},
            "crossover_tokens": {name: crossover for name, (crossover, _) in self.crossovers.items()},
            "calibration": self.calibration}


def sampled_samples(samples: list[int], limit: int, seed: int) -> list[int]:
    """`samples` when they are at most `limit`, else a seeded uniform sample of `limit` of them, in
    index order: the first `limit` were one class's in a dataset sorted by label (an image folder)."""
    from actstore.sae.data import uniform_picks

    if len(samples) <= limit:
        return samples
    return [samples[i] for i in uniform_picks(len(samples), limit, np.random.default_rng(seed))]


def eval_batches(extraction: Any, loaded: Any, samples: list[int], rows: int) -> list[list[int]]:
    """`samples` in batches of at most `rows`, grouped by token length as extraction groups them
    (length_batches): a PADDING_SENSITIVE_TYPES model's padding changes its real tokens' outputs, so
    texts of mixed lengths in one batch fed the targets inputs the SAE never saw, and the reference
    outputs were not the model's own."""
    from actstore.extract import length_batches

    if loaded.kind == "vision":  # every image has the same token count
        lengths = [1] * len(samples)
    else:
        lengths = [int(part.offsets[local + 1] - part.offsets[local])
                   for part, local in map(extraction.locate, samples)]
    batches = length_batches(lengths, rows, loaded.config.get("model_type"))
    return [[samples[i] for i in batch] for batch in batches]


def eval_batch_rows(config: dict[str, Any], loaded: Any) -> int:
    """extract.batch_size samples a batch, fewer for a causal LM whose logits would pass
    LUT_EVAL_LOGITS (512 MiB of float32 a run)."""
    rows = config["extract"]["batch_size"]
    if loaded.kind != "causal":
        return rows
    vocab = loaded.model.get_output_embeddings().out_features
    return max(1, min(rows, LUT_EVAL_LOGITS // (config["extract"]["max_seq_length"] * vocab)))


@contextmanager
def swapped_in(model: nn.Module, modules: dict[str, nn.Module]) -> Iterator[None]:
    """`modules` at their paths for the duration; what was there put back after."""
    def put(path: str, module: nn.Module) -> nn.Module:
        parent, name = parent_module(model, path)
        there = getattr(parent, name)
        setattr(parent, name, module)
        return there
    replaced = {path: put(path, module) for path, module in modules.items()}
    try:
        yield
    finally:
        for path, module in replaced.items():
            put(path, module)


def batch_inputs(config: dict[str, Any], extraction: Any, loaded: Any, batch: list[int]) -> dict[str, torch.Tensor]:
    from actstore.datasets import configured_dataset
    from actstore.extract import image_batch, text_batch

    if loaded.kind == "vision":
        dataset = configured_dataset(config, loaded.path)
        return image_batch(loaded, dataset, [dataset.samples[i] for i in batch], config["extract"]["image_pipeline"])
    ids = []
    for sample_idx in batch:
        part, local = extraction.locate(sample_idx)
        ids.append([int(t) for t in part.token_ids(local)])
    return text_batch(loaded, ids)


def run_model(loaded: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    out = loaded.model(**inputs)
    return (out.logits if loaded.kind == "causal" else out.last_hidden_state).float().cpu()


class Comparison:
    """Token-level cosine (mean, min) or KL and perplexity over real (non-pad) tokens of one budget's
    LUT outputs against the reference, counted batch by batch (add) so that no batch's outputs are
    held past it: the cosine keeps each batch's per-token values (one float a token), KL and NLL are
    running sums."""

    def __init__(self, kind: str):
        self.kind = kind
        self.cosines: list[torch.Tensor] = []
        self.kl, self.nll_ref, self.nll_lut, self.n, self.n_real = 0.0, 0.0, 0.0, 0, 0

    def add(self, r: torch.Tensor, o: torch.Tensor, inp: dict[str, torch.Tensor]) -> None:
        """One batch: the reference's outputs `r`, the LUT model's `o` and their inputs `inp`."""
        mask = mask_of(inp, r)
        if self.kind != "causal":
            self.cosines.append(torch.nn.functional.cosine_similarity(r, o, dim=-1)[mask])
            return
        logp_r, logp_o = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
        # A token's KL is >= 0; float32 rounding puts one of two near-equal distributions a few 1e-8 either
        # side, and a mean of -1.3e-8 was reported at a budget that recovers the model.
        self.kl += float(((logp_r.exp() * (logp_r - logp_o)).sum(-1)).clamp_min(0)[mask].sum())
        self.n_real += int(mask.sum())
        # Next-token NLL: position t predicts token t+1 (both real tokens).
        nxt = mask[:, 1:] & mask[:, :-1]
        ids = inp["input_ids"][:, 1:].cpu()
        self.nll_ref -= float(logp_r[:, :-1].gather(-1, ids[..., None])[..., 0][nxt].sum())
        self.nll_lut -= float(logp_o[:, :-1].gather(-1, ids[..., None])[..., 0][nxt].sum())
        self.n += int(nxt.sum())

    def result(self) -> dict[str, float]:
        if self.kind != "causal":
            cos = torch.cat(self.cosines)
            return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}
        ppl_ref, ppl_lut = perplexity(self.nll_ref, self.n), perplexity(self.nll_lut, self.n)
        return {"kl_mean": self.kl / max(1, self.n_real), "perplexity_original": ppl_ref, "perplexity_lut": ppl_lut,
                "perplexity_change": None if None in (ppl_ref, ppl_lut) else ppl_lut - ppl_ref}


def perplexity(nll: float, n: int) -> float | None:
    """exp of the mean next-token NLL; None (JSON null: JSON has no infinity) past what a float holds, a
    mean NLL over 709 nats that a LUT breaking the model's logits gives: math.exp raised OverflowError,
    ending the stage with no report."""
    try:
        return math.exp(nll / max(n, 1))
    except OverflowError:
        log.warning("lut: a mean next-token NLL of %.4g nats: its perplexity is past a float, recorded as null",
                    nll / max(n, 1))
        return None


def mask_of(inputs: dict[str, torch.Tensor], ref: torch.Tensor) -> torch.Tensor:
    if "attention_mask" in inputs:
        return inputs["attention_mask"].cpu().bool()
    return torch.ones(ref.shape[:2], dtype=torch.bool)


def evaluate_lut(config: dict[str, Any], extract_dir: str | Path, heldout: tuple[torch.Tensor, list[int]],
                 lut_root: Path, loaded: Any, progress: bool = True) -> dict[str, Any]:
    """report.json: per-target relative errors for each budget on the held-out tokens, and the end-to-end
    effect on the held-out samples (heldout: heldout_inputs)."""
    budgets = list(config["lut"]["budgets"])
    x, samples = heldout
    store = open_lut(lut_root)
    report = {"lut_dir": str(lut_root), "targets": sorted(store.layers), "k_active": store.k_active,
              "num_basis": store.num_basis, "dtype": config["lut"]["dtype"], "n_heldout_tokens": len(x),
              "budgets": budgets, "relative_error": relative_errors(store, loaded.model, x, budgets)}
    report["end_to_end"] = end_to_end(config, extract_dir, lut_root, loaded, samples, budgets)
    log.info("lut relative errors: %s", report["relative_error"])
    return report
