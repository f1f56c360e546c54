"""Per-stage hashes: every stage writes under {dump_to}/{stage}/{hash}/.

hash = sha256 of the canonical JSON of exactly the resolved config sections the stage reads plus
its upstream stages' hashes, so identical configs reuse outputs and divergent ones never collide.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from actstore.config import enabled_stages
from actstore.formats import FORMAT_STAGES
from actstore.integrity import STAGE_CONFIG_FILE
from actstore.io_utils import canonical_json, write_json_atomic

STAGES = ("extract", *FORMAT_STAGES, "sae", "lut", "validate")
# Config sections each stage reads: its own, and for extraction also the model and dataset.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    stage: ("model", "dataset", "extract") if stage == "extract" else (stage,) for stage in STAGES}
# Keys that change how a stage runs, never what it writes (tested byte for byte): not hashed.
EXECUTION_KEYS: dict[str, tuple[str, ...]] = {"extract": ("num_workers", "buffers", "writer_threads")}


def upstream_stages(config: dict[str, Any], stage: str) -> list[str]:
    """Stages whose outputs `stage` reads (only enabled ones for the validation stage)."""
    if stage == "extract":
        return []
    if stage in FORMAT_STAGES or stage == "sae":
        return ["extract"]
    if stage == "lut":
        return ["extract", "sae"]
    if stage == "validate":
        return [s for s in enabled_stages(config) if s != "validate"]
    raise KeyError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")


def stage_payload(config: dict[str, Any], stage: str) -> dict[str, Any]:
    """The exact resolved config a stage depends on, with its upstream hashes."""
    return {
        "stage": stage,
        "config": {section: hashed_section(config, section) for section in STAGE_SECTIONS[stage]},
        "upstream": {up: stage_hash(config, up) for up in upstream_stages(config, stage)},
    }


def hashed_section(config: dict[str, Any], section: str) -> Any:
    """A config section as hashed: execution-only keys dropped; extract.storage_dtype resolved, and
    dropped when float32 (all earlier releases stored), so extractions made before it keep their hash."""
    values = config[section]
    if not isinstance(values, dict):
        return values
    values = {k: v for k, v in values.items() if k not in EXECUTION_KEYS.get(section, ())}
    if section == "extract" and "storage_dtype" in values:
        dtype = values.pop("storage_dtype")
        dtype = config["model"]["torch_dtype"] if dtype == "auto" else dtype
        if dtype != "float32":
            values["storage_dtype"] = dtype
    return values


def stage_hash(config: dict[str, Any], stage: str) -> str:
    """Full sha256 hex of the stage's canonical payload."""
    return hashlib.sha256(canonical_json(stage_payload(config, stage)).encode()).hexdigest()


def stage_dir(config: dict[str, Any], stage: str) -> Path:
    """{dump_to}/{stage}/{hash}/ for a resolved config."""
    return Path(config["dump_to"]) / stage / stage_hash(config, stage)


def write_stage_config(config: dict[str, Any], stage: str, out_dir: str | Path | None = None) -> Path:
    """Record the resolved config a stage directory was made from (atomic, idempotent)."""
    target = Path(out_dir) if out_dir is not None else stage_dir(config, stage)
    path = target / STAGE_CONFIG_FILE
    write_json_atomic(path, {**stage_payload(config, stage), "hash": stage_hash(config, stage)})
    return path
