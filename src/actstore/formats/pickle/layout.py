"""The bytes of a pickle-shard store: file names, metadata keys, shard item fields, pickle protocol.

One store = `metadata.json` + `shard_NNNN.pkl.gz` (or `.pkl`). A shard is a pickled dict
`layer_{idx}` -> list of {sample_idx, activation float32 (tokens, d), shape, text_preview, metadata}.
"""
from __future__ import annotations

import re
from typing import Any

from actstore.io_utils import utc_now

FORMAT = "pickle"
VERSION = "1.0"
METADATA = "metadata.json"
PICKLE_PROTOCOL = 5  # in-band buffers: arrays unpickle without an extra copy
PREVIEW_CHARS = 200
REQUIRED = ("version", "created_at", "extraction_config", "shards", "statistics")
CONFIG_FIELDS = ("model_name", "model_architecture", "model_params", "dataset_name", "dataset_config",
                 "dataset_split", "layers_extracted", "max_seq_length", "batch_size")
SHARD_FIELDS = ("shard_id", "filename", "size_bytes", "num_samples", "layers", "sample_id_range",
                "compressed", "checksum")
STAT_FIELDS = ("total_shards", "total_samples", "total_size_bytes", "layers_extracted",
               "extraction_duration_seconds")
ITEM_FIELDS = ("sample_idx", "activation", "shape", "text_preview", "metadata")
NUMERIC_KINDS = "biufc"
SHARD_NAME = r"shard_\d{4,}\.pkl(\.gz)?"
CHECKSUM_PREFIX = "sha256:"


def machine_dirname(machine_id: int) -> str:
    return f"machine-{machine_id:04d}"


def shard_filename(shard_id: int, compressed: bool) -> str:
    return f"shard_{shard_id:04d}.pkl" + (".gz" if compressed else "")


def is_shard_name(name: str) -> bool:
    """A file name (not a path) of the spec's shard_NNNN.pkl[.gz] form."""
    return re.fullmatch(SHARD_NAME, name) is not None


def ends_in_shard_name(filename: str) -> bool:
    """A `filename` entry (possibly machine-NNNN/...) whose last part names a shard."""
    return re.search(SHARD_NAME + "$", filename) is not None


def layer_key(layer_idx: int) -> str:
    """The shard dict key of one layer's items."""
    return f"layer_{layer_idx}"


def iso_now() -> str:
    return utc_now().strftime("%Y-%m-%dT%H:%M:%SZ")


def statistics(shards: list[dict], layers: list[int], duration: float) -> dict[str, Any]:
    """The spec's statistics block (plus total_tokens), summed over the shard entries."""
    return {"total_shards": len(shards), "total_samples": sum(s["num_samples"] for s in shards),
            "total_size_bytes": sum(s["size_bytes"] for s in shards), "layers_extracted": layers,
            "extraction_duration_seconds": duration,
            "total_tokens": sum(s["num_tokens"] for s in shards)}


def distributed_config(machine_id: int | None, total_machines: int, samples_per_machine: int | None,
                       **extra: Any) -> dict[str, Any]:
    """The spec's distributed_config: one process per machine, no multi-host mesh."""
    return {"machine_id": machine_id, "total_machines": total_machines, "multihost": False, "num_hosts": 1,
            "mesh_type": "1d", "samples_per_machine": samples_per_machine, **extra}


def store_metadata(extraction_config: dict[str, Any], distributed: dict[str, Any], shards: list[dict],
                   stats: dict[str, Any], extension: dict[str, Any]) -> dict[str, Any]:
    """A whole metadata.json object; `actstore` is the optional extension key."""
    return {"version": VERSION, "created_at": iso_now(), "extraction_config": extraction_config,
            "distributed_config": distributed, "shards": shards, "statistics": stats, "actstore": extension}
