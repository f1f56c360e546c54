"""Format detection, integrity checks and cross-format agreement (the validate stage)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from actstore.casts import bfloat16_bits_to_float32, to_bfloat16_bits
from actstore.config import enabled_stages
from actstore.errors import FormatError
from actstore.formats import FORMAT_STAGES, format_module
from actstore.formats.extract import layer_tensor, open_extraction
from actstore.hashing import stage_dirs
from actstore.integrity import link_out, read_json, stage_config_problems
from actstore.io_utils import sha256_file, write_json_atomic

log = logging.getLogger(__name__)

DTYPE_CASTS = {"float32": np.float32, "float16": np.float16}


def find_store(directory: Path, name: str) -> Path:
    """The directory holding format `name`, as its reader and verify take it: the stage dir itself
    or one level below it. A saev stage dir points at the store beside it (named by its metadata
    hash): verify given the stage dir checks the store's metadata against the pointer's seal too.
    A link to a directory is never taken for the store: one leading to a good copy elsewhere was
    checked in its place (and read outside the stage) while the stage's own store went unchecked."""
    module = format_module(name)
    for candidate in [directory, *sorted(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink())]:
        if module.detect(candidate):
            return candidate
    raise FormatError(f"{directory}: no {name} store found")


def reference_dtype(dtype: str) -> type:
    if dtype == "bfloat16":
        return lambda x: bfloat16_bits_to_float32(to_bfloat16_bits(x))
    cast = DTYPE_CASTS.get(dtype, np.float32)
    return lambda x: np.asarray(x).astype(cast).astype(np.float32)


def sample_coordinates(extraction, n_coords: int, seed: int) -> list[tuple[int, int, int]]:
    """Seeded (sample_idx, layer, token) triples; each sampled row also gets its last token. The rows
    take the layers in turn (in a seeded order), so every layer is checked once there are as many
    rows as layers: drawn at random, 48 rows missed some of 24 layers at most seeds."""
    rng = np.random.default_rng(seed)
    coords = []
    rows = sorted(rng.choice(extraction.n_samples, size=min(n_coords, extraction.n_samples), replace=False))
    layers = rng.permutation(extraction.info.layers)
    for i, sample_idx in enumerate(rows):
        # The token count the activations hold (offsets.npy, checked as the part opens), not the
        # samples.jsonl row's copy: a wrong copy made the "last token" another, or a token past the end.
        part, local = extraction.locate(int(sample_idx))
        tokens = part.sample_slice(local)
        n_tokens = tokens.stop - tokens.start
        layer = int(layers[i % len(layers)])
        for token in {int(rng.integers(n_tokens)), n_tokens - 1}:
            coords.append((int(sample_idx), layer, token))
    return coords


def check_format(name: str, store: Path, extraction, coords) -> dict[str, Any]:
    """verify() + inspect() + every coordinate read through the format's reader vs the extraction."""
    module = format_module(name)
    problems = module.verify(store)
    info = module.inspect(store)
    to_stored = reference_dtype(info.get("dtype", "float32"))
    checked, not_stored, latencies_us = 0, 0, []
    for sample_idx, layer, token in coords:
        started = time.perf_counter()
        got = module.read_vector(store, sample_idx, layer, token)
        latencies_us.append((time.perf_counter() - started) * 1e6)
        if got is None:
            not_stored += 1
            continue
        want = to_stored(extraction.activations(layer_tensor(layer), sample_idx)[token])
        if difference := _difference(np.asarray(got, np.float32), want):
            problems.append(f"{store}: (sample {sample_idx}, layer {layer}, token {token}) differs from "
                            f"the extraction ({difference})")
        checked += 1
    return {"store": str(store), "problems": problems, "inspect": info, "checked": checked,
            "not_stored": not_stored, "read_latency_us": latencies_us}


def _difference(got: np.ndarray, want: np.ndarray) -> str | None:
    """How a store's vector differs from the extraction's, None when it holds the same values. NaN
    equals NaN: a model that overflowed stores NaN, and every faithful copy holds it too."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, the extraction's {list(want.shape)}"
    if np.array_equal(got, want, equal_nan=True):
        return None
    return f"max abs diff {np.max(np.abs(got - want)):.3g}"


def validate_all(config: dict[str, Any], report_path: str | Path) -> dict[str, Any]:
    """Check every format the config produces; write report.json, raise FormatError on any problem."""
    dirs = stage_dirs(config)
    extract_dir = dirs["extract"]
    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    coords = sample_coordinates(extraction, config["validate"]["n_coords"], config["validate"]["seed"])
    stages = enabled_stages(config)
    report: dict[str, Any] = {"coordinates": len(coords), "formats": {}}
    report["formats"]["extract"] = check_format("extract", extract_dir, extraction, coords)
    for name in [s for s in FORMAT_STAGES if s in stages]:
        store = find_store(dirs[name], name)
        report["formats"][name] = check_format(name, store, extraction, coords)
        log.info("%s: %d checked, %d not stored, %d problems", name, report["formats"][name]["checked"],
                 report["formats"][name]["not_stored"], len(report["formats"][name]["problems"]))
    for name in ("sae", "lut"):
        if name in stages:
            report[name] = stage_report(dirs[name])
    if "lut" in stages:  # the sae stage is enabled wherever the lut stage is (enabled_stages)
        report["formats"]["lut"] = check_lut(find_store(dirs["lut"], "lut"), dirs["sae"])
    for entry in report["formats"].values():
        # Paths relative to dump_to, so the report does not depend on where the run lived.
        entry["store"] = os.path.relpath(entry["store"], config["dump_to"])
        entry["inspect"] = {key: _relative(value, config["dump_to"]) for key, value in entry["inspect"].items()}
    problems = [p for entry in report["formats"].values() for p in entry["problems"]]
    problems += [p for stage in stages if stage != "validate"
                 for p in stage_config_problems(dirs[stage], required=True)]
    if problems:
        raise FormatError("validation failed:\n" + "\n".join(problems))
    write_json_atomic(report_path, report)
    return report


def check_lut(store: Path, sae_dir: Path) -> dict[str, Any]:
    """verify() + inspect() of the LUT, and the SAE it was built from against the sae stage's
    (lut_sae_problems); `notes`: what could not be checked, which is no failure."""
    module = format_module("lut")
    problems = module.verify(store)
    sae_problems, notes = lut_sae_problems(store, sae_dir)
    for note in notes:
        log.warning("lut: %s", note)
    return {"store": str(store), "problems": problems + sae_problems, "inspect": module.inspect(store),
            "notes": notes}


def lut_sae_problems(store: Path, sae_dir: Path) -> tuple[list[str], list[str]]:
    """(problems, notes): the sha256 the LUT's creation_info records of the SAE it was built from must
    be that of the sae stage's sae.safetensors. The stage directories are named by config hashes, not
    by output bytes, so a rerun sae stage (GPU training is not bit-reproducible) leaves another SAE
    beside a LUT that verifies. A LUT written before the sha256 was recorded is noted, not failed, as
    verify passes a table whose sha256 another writer did not record."""
    from actstore.formats.lut import META_FILE, lut_dir, read_metadata
    from actstore.lut import SAE_SHA256
    from actstore.sae import SAE_FILE

    meta_path, sae_file = lut_dir(store) / META_FILE, sae_dir / SAE_FILE
    try:
        info = read_metadata(store).get("creation_info", {})
    except FormatError:  # verify names what is wrong with it
        return [], []
    if SAE_SHA256 not in info:
        return [], [f"creation_info.{SAE_SHA256} absent (a LUT written before actstore recorded it): "
                    f"not checked against the sae stage's {SAE_FILE}"]
    if not sae_file.is_file():
        return [f"{sae_file}: missing, so the SAE of the LUT of {meta_path} is not checked"], []
    actual = sha256_file(sae_file)
    if info[SAE_SHA256] != actual:
        return [f"{meta_path}: creation_info.{SAE_SHA256} {info[SAE_SHA256]!r:.70} is not the sha256 of "
                f"{sae_file} ({actual}): the LUT was built from another SAE"], []
    return [], []


def _relative(value: Any, root: str) -> Any:
    """A path string under `root` made relative to it; anything else unchanged."""
    absolute_root = os.path.abspath(root)
    if isinstance(value, str) and os.path.isabs(value) and value.startswith(absolute_root + os.sep):
        return os.path.relpath(value, absolute_root)
    return value


def stage_report(directory: Path) -> dict[str, Any] | None:
    """A stage's own report.json (SAE training curve, LUT errors), if it wrote one; read strictly
    (read_json), and a link out of the stage directory is named, never read (validate copies the
    report into its own, and the stage's seal is checked only after)."""
    path = directory / "report.json"
    if problem := link_out(directory, path):
        raise FormatError(f"{problem}: not read")
    return read_json(path) if path.is_file() else None


def sae_summary(directory: Path) -> dict[str, Any]:
    """`actstore inspect` of an sae stage directory, which holds no format's store: the SAE its
    checkpoint's header and report.json describe (read without torch), and its SAELens copy."""
    from safetensors import safe_open

    checkpoint = directory / "sae.safetensors"
    if not checkpoint.is_file():
        raise FormatError(f"{directory}: no sae.safetensors; not an sae stage directory")
    with safe_open(str(checkpoint), framework="numpy") as fh:
        header = fh.metadata() or {}
    report = stage_report(directory) or {}
    held = report.get("heldout") or {}
    saelens = directory / "saelens"
    return {"format": "sae", "model": header.get("model"), "hook": header.get("hook"),
            "d_in": _whole(header.get("d_in")), "num_basis": _whole(header.get("num_basis")),
            "k_active": _whole(header.get("k_active")), "source": header.get("source"),
            "heldout_fvu": held.get("fvu"), "heldout_dead_fraction": held.get("dead_fraction"),
            "saelens": str(saelens) if saelens.is_dir() else None, "bytes": checkpoint.stat().st_size}


def _whole(text: str | None) -> int | str | None:
    """A safetensors header value (always a string) as the count it holds."""
    return int(text) if isinstance(text, str) and text.isdigit() else text
