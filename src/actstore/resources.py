"""Slurm resource estimates (runtime in minutes, mem_mb) that scale with the data, computed from the
config at parse time without loading a model: rules call these in their `resources:` so a 64-part
run on a 7B model asks for more than the demo does. Deliberately generous (a killed job costs more
than an idle reservation) and multiplied by Snakemake's `attempt`, so `--retries 1` doubles them."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actstore.datasets.source import resolve_source
from actstore.datasets.tables import count_rows
from actstore.models import model_kind, read_model_config, resolve_model_path

GPU_FLOPS = 5e12          # sustained fp32 forward throughput assumed for one GPU (V100-class, pessimistic)
IO_BYTES_PER_S = 100e6    # write/read rate assumed on /fs/scratch for one job (shared Lustre, pessimistic)
STARTUP_MIN = 10          # imports, model load, dataset read
MAX_RUNTIME_MIN = 48 * 60
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class Workload:
    rows: int            # dataset rows used (after dataset.limit)
    tokens: int          # upper bound on stored tokens (rows * max_seq_length for text)
    d: int               # widest captured vector
    n_tensors: int       # layers + hooks
    weight_bytes: int    # bytes of weight files on disk
    data_bytes: int      # dataset size on disk
    itemsize: int        # bytes per stored value (extract.storage_dtype)

    @property
    def activation_bytes(self) -> int:
        return self.tokens * self.d * self.itemsize * self.n_tensors


def _count_rows(section: dict[str, Any]) -> tuple[int, int]:
    """(rows, bytes) of the dataset: table rows from the files' own metadata, JSONL newlines, or
    the images of a folder; nothing is parsed."""
    source = resolve_source(section["path"], section.get("format") or "auto", section.get("split") or "train")
    size = sum(p.stat().st_size for p in source.files)
    if source.table:
        return max(sum(count_rows(source.format, p) for p in source.files), 1), size
    if source.format == "jsonl":
        return max(sum(_newlines(p) for p in source.files), 1), size
    return max(len(source.files), 1), size


def _newlines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 24), b""))


@functools.lru_cache(maxsize=16)
def _workload(key: str) -> Workload:
    config = json.loads(key)
    model_path = resolve_model_path(config["model"]["path"])
    model = read_model_config(model_path)
    vision = model_kind(model) == "vision"
    model = model.get("text_config", model) if "hidden_size" not in model else model
    hidden = int(model.get("hidden_size") or model.get("n_embd") or model.get("d_model") or 1024)
    inner = int(model.get("intermediate_size") or model.get("n_inner") or 4 * hidden)
    ext = config["extract"]
    rows, data_bytes = _count_rows(config["dataset"])
    if config["dataset"].get("limit"):
        rows = min(rows, config["dataset"]["limit"])
    # Images: a ViT emits at most a few hundred tokens; text: truncated at max_seq_length.
    per_row = 1025 if vision else ext["max_seq_length"]
    weights = sum(p.stat().st_size for p in model_path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    storage = ext.get("storage_dtype", "float32")
    storage = config["model"].get("torch_dtype", "float32") if storage == "auto" else storage
    return Workload(rows=rows, tokens=rows * per_row, d=inner if ext.get("hooks") else hidden,
                    n_tensors=len(ext["layers"]) + len(ext.get("hooks", [])),
                    weight_bytes=weights, data_bytes=data_bytes, itemsize=4 if storage == "float32" else 2)


def workload(config: dict[str, Any]) -> Workload:
    """Size of the extraction this config describes (cached per model/dataset/extract sections)."""
    key = {k: config[k] for k in ("model", "dataset", "extract")}
    return _workload(json.dumps(key, sort_keys=True, default=str))


def _round_mb(mb: float) -> int:
    return int(math.ceil(mb / 1000.0) * 1000)


def _minutes(seconds: float, attempt: int) -> int:
    return int(min(MAX_RUNTIME_MIN, math.ceil((STARTUP_MIN + 2 * seconds / 60) * attempt)))


def extract_part_mem_mb(config: dict[str, Any], attempt: int = 1) -> int:
    """Host memory of one extraction job: weights loaded on the host first, the dataset's text,
    the staging ring (extract.buffers batches of captures) plus one batch being packed, and 3 GB
    for torch/CUDA."""
    w = workload(config)
    ext = config["extract"]
    batch = ext["batch_size"] * (w.tokens // max(w.rows, 1)) * w.d * w.itemsize * w.n_tensors
    batch *= ext.get("buffers", 3) + 1
    return _round_mb((1.5 * w.weight_bytes + 2 * w.data_bytes + batch) / 1e6 + 3000) * attempt


def extract_part_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for one part: forward FLOPs (2 per weight per token) on one GPU plus writing its share."""
    w = workload(config)
    parts = config["extract"]["parts"]
    params = w.weight_bytes / 4  # float32 checkpoints; half-precision ones make this an overestimate
    seconds = (2 * params * w.tokens / GPU_FLOPS + w.activation_bytes / IO_BYTES_PER_S) / parts
    return _minutes(seconds, attempt)


def io_mem_mb(config: dict[str, Any], attempt: int = 1, per_part: bool = False, buffered_mb: int = 0) -> int:
    """Memory of a format writer that streams the activations: `buffered_mb` it keeps (a shard,
    a chunk), 2 GB for the interpreter and libraries."""
    return _round_mb(2000 + buffered_mb) * attempt


def io_runtime(config: dict[str, Any], attempt: int = 1, per_part: bool = False, passes: float = 2.0) -> int:
    """Minutes for a job that reads and writes the activations `passes` times in total
    (all of them, or one part's share when per_part)."""
    w = workload(config)
    share = w.activation_bytes / (config["extract"]["parts"] if per_part else 1)
    return _minutes(passes * share / IO_BYTES_PER_S, attempt)


def sae_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for train_sae on one GPU: about 12 x d x num_basis FLOPs per training token (encoder and
    dense decoder, forward and backward) plus reading the hook's activations a few times."""
    w, sae = workload(config), config["sae"]
    flops = 12 * w.d * (sae["num_basis"] or 4 * w.d) * sae["steps"] * sae["batch_size"]
    reads = 4 * w.tokens * w.d * w.itemsize
    return _minutes(flops / GPU_FLOPS + reads / IO_BYTES_PER_S, attempt)


def sae_mem_mb(config: dict[str, Any], attempt: int = 1) -> int:
    """Host memory of train_sae: the prefetch ring of float32 batches (pinned on a GPU), the held-out
    evaluation's chunks, 3 GB for torch/CUDA."""
    w = workload(config)
    batches = 8 * config["sae"]["batch_size"] * w.d * 4
    return _round_mb((batches + 8192 * w.d * 16) / 1e6 + 3000) * attempt


def lut_mem_mb(config: dict[str, Any], attempt: int = 1) -> int:
    """Host memory of build_lut: the model loaded in float32 on the host first (twice its weight files
    for a 16-bit checkpoint), the tables of every target, 3 GB for torch/CUDA."""
    w = workload(config)
    return _round_mb(2 * w.weight_bytes / 1e6 * 1.5 + 3000) * attempt
