"""Per-stage hashes: every stage writes under {dump_to}/{stage}/{hash}/.

hash = sha256 of the canonical JSON of exactly the resolved config sections the stage reads plus
its upstream stages' hashes, so identical configs reuse outputs and divergent ones never collide.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from actstore.config import FORMAT_STAGES, enabled_stages
from actstore.io_utils import canonical_json, write_json_atomic

STAGES = ("extract", "saev", "pickle", "lmprobe", "zarr", "sae", "lut", "validate")
# Config sections each stage reads.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "extract": ("model", "dataset", "extract"),
    "saev": ("saev",),
    "pickle": ("pickle",),
    "lmprobe": ("lmprobe",),
    "zarr": ("zarr",),
    "sae": ("sae",),
    "lut": ("lut",),
    "validate": ("validate",),
}
STAGE_CONFIG_FILE = "actstore_config.json"


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
        "config": {section: config[section] for section in STAGE_SECTIONS[stage]},
        "upstream": {up: stage_hash(config, up) for up in upstream_stages(config, stage)},
    }


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
