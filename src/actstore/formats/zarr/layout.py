"""The bytes of the Zarr activation logger: names, constants, array encoding and the JSON documents.

Writer, reader and verifier all take the layout from here, so they cannot drift apart.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Iterable, Iterator

import numpy as np

from actstore.formats.extract import PartInfo
from actstore.integrity import whole_number

FORMAT_NAME = "actstore-zarr-activation-logger"
SCHEMA_VERSION = 1

# Run directory and store file names.
MANIFEST = "manifest.json"
MERGED = "merged"
FILES_JSON = "meta/files.json"
PROMPTS_JSONL = "text/prompts.jsonl"
ACTS = "arrays/activations"
ZARR_METADATA_NAMES = (".zarray", ".zattrs", ".zgroup")  # what .zmetadata may name: zarr v2 metadata documents
# The groups of the hierarchy, which .zmetadata must hold: zarr.open_consolidated opens no group it lacks.
GROUP_KEYS = (".zgroup", "arrays/.zgroup")

# Encoding of every array (the reader's fast path depends on exactly this).
ZARR_FORMAT = 2
ACTS_DTYPE = "<f2"
ORDER = "C"
SEPARATOR = "/"
ACTS_ZARRAY = {"zarr_format": ZARR_FORMAT, "dtype": ACTS_DTYPE, "order": ORDER, "compressor": None,
               "filters": None, "dimension_separator": SEPARATOR}
VECTOR_ZARRAY = {"zarr_format": ZARR_FORMAT, "compressor": None, "filters": None}

TARGET_CHUNK_BYTES = 1 << 20  # middle of the spec's 0.5-2 MB window
VECTOR_CHUNK = 1 << 16  # samples per chunk of the 1-D per-sample arrays
SPLIT_CODES = {"train": 0, "val": 1, "validation": 1, "test": 2}
SPLIT_VALUES = sorted(set(SPLIT_CODES.values()))  # the spec's only codes of arrays/split
NO_LABEL = -1  # arrays/label of a sample without a label; any other is a position in label_names
REQUIRED_ATTRS = ("schema_version", "model_id", "num_layers", "layers", "hidden_size", "T_max",
                  "dtype", "T_chunk", "num_samples", "global_index_start")
# Attrs every shard of one run must share (checked before merging): the merged store takes the first
# shard's, so they must be true of every sample (its label ids index label_names). Not the model and
# dataset records: they hold the extraction's path, which a moved run's shards rewritten since differ in.
COMPATIBLE_ATTRS = ("layers", "hidden_size", "T_max", "T_chunk", "dtype", "model_id", "schema_version",
                    "model_num_blocks", "modality", "model_kind", "label_names", "split_codes")
# Attrs a store of no sample cannot know: an empty extraction part (ceil(N/P) rows a part leaves the
# last ones empty) has no tensor file to take a width from (the extraction declares them from its
# first batch), nor an image's tokens. Its store holds none of their values, so none is checked
# against it: a run (its manifest, its merged store) takes them from its first store of samples.
WIDTH_ATTRS = ("hidden_size", "T_max", "T_chunk")
MANIFEST_ENTRY_KEYS = ("path", "num_samples", "global_index_start", "files_sha256")


def shard_name(part: int) -> str:
    return f"shard-{part:04d}.zarr"


def acts_chunk_key(i: int, l: int, c: int) -> str:
    """Key of the activations chunk of sample i, layer position l, token chunk c."""
    return f"{ACTS}/{i}/{l}/{c}/0"


def chunk_counts(seq_len: np.ndarray, t_chunk: int) -> np.ndarray:
    """Activation chunk files of each sample and layer: those holding its seq_len tokens. The chunks
    past them hold only the fill value (0) and are not written, as zarr leaves an empty chunk out."""
    return -(-np.asarray(seq_len, dtype=np.int64) // t_chunk)


def chunk_keys_in_name_order(counts: np.ndarray, n_layers: int) -> Iterator[tuple[str, int]]:
    """(key, index) of every activations chunk file, in the order of sorted keys ("/" sorts before
    every digit: samples 0, 1, 10, 100, ..., 2), one at a time; `counts` = chunk_counts of the samples,
    index = the chunk's place in (sample, layer, chunk) order."""
    firsts = n_layers * (np.cumsum(counts) - counts)
    for i in in_name_order(len(counts)):
        count, first = int(counts[i]), int(firsts[i])
        for l in in_name_order(n_layers):
            for c in in_name_order(count):
                yield acts_chunk_key(i, l, c), first + l * count + c


def in_name_order(n: int) -> Iterator[int]:
    """0 .. n-1 in the order of their decimal names (0, 1, 10, 100, 101, ..., 11, ...), one at a time."""
    if n:
        yield 0
    i = 1
    for _ in range(n - 1):
        yield i
        if i * 10 < n:
            i *= 10
            continue
        if i + 1 >= n:
            i //= 10
        i += 1
        while i % 10 == 0:
            i //= 10


def chunk_width(hidden: int) -> int:
    """The activations chunks' last edge: hidden_size, or 1 in a store of no width (an empty part's,
    hidden_size 0): a zarr chunk edge is at least 1, where an array's length may be 0."""
    return max(hidden, 1)


def chunk_shape(t_chunk: int, hidden: int) -> list[int]:
    """The activations' chunks (1, 1, T_chunk, H): a chunk never spans samples or layers."""
    return [1, 1, t_chunk, chunk_width(hidden)]


def chunk_bytes(t_chunk: int, hidden: int) -> int:
    return t_chunk * chunk_width(hidden) * 2


def choose_t_chunk(t_max: int, hidden: int, t_chunk: int | None = None) -> int:
    """Tokens per chunk: the configured value, else the power of two nearest a 1 MiB chunk; <= T_max.
    ValueError for a configured value that is no integer of at least 1 (0 and -4 became 1, 2.5 2)."""
    if t_chunk is None:
        t_chunk = 2 ** max(0, round(math.log2(TARGET_CHUNK_BYTES / chunk_bytes(1, hidden))))
    elif not whole_number(t_chunk, 1):
        raise ValueError(f"t_chunk={t_chunk!r:.40} must be an integer of at least 1 (tokens per chunk)")
    return max(1, min(int(t_chunk), t_max))


def vector_chunks(n: int) -> tuple[int]:
    return (max(1, min(n, VECTOR_CHUNK)),)


def vector_fill(name: str) -> Any:
    return b"" if name == "sample_key" else 0


def sample_key(text: str) -> bytes:
    """The |S64 per-sample key: sha256 hex of the sample's text (its image path for images)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest().encode("ascii")


def store_t_max(info: PartInfo, longest: int) -> int:
    """T_max of a part's store, given its longest sample's tokens: extract.max_seq_length, which cuts
    texts. An image's tokens are never cut (a ViT-B/16's 197 pass the default 128, a DINOv2's 257): an
    image part's T_max holds them."""
    t_max = int(info.max_seq_length)
    return max(t_max, longest) if info.modality == "image" else t_max


def store_attrs(info: PartInfo, n: int, t_max: int, t_chunk: int, hidden: int, created: str,
                git_commit: str | None) -> dict[str, Any]:
    """Global metadata kept in the group attrs (never per-sample data: the spec's attrs guardrail).
    An empty part's sample_range is [0, 0]; the extraction's split (datasets.part_range) leaves only
    the last parts empty, so its store starts after every sample, where a run's reads count it."""
    layers = list(info.layers)
    return {
        "format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "model_id": info.model.name,
        "num_layers": len(layers), "layers": layers, "model_num_blocks": info.model.n_blocks,
        "hidden_size": hidden, "T_max": t_max, "dtype": "float16",
        "T_chunk": t_chunk, "chunk_shape": chunk_shape(t_chunk, hidden), "chunk_bytes": chunk_bytes(t_chunk, hidden),
        "num_samples": n, "global_index_start": int(info.sample_range[0]) if n else info.n_dataset_samples,
        "created": created, "git_commit": git_commit,
        "dataset": info.dataset.record, "model": info.model.record, "modality": info.modality,
        "model_kind": info.model_kind, "label_names": info.dataset.labels,
        "split_codes": SPLIT_CODES, "extraction_created_at": info.created_at,
    }


def prompt_line(i: int, row: dict[str, Any]) -> str:
    """One line of text/prompts.jsonl for local sample i."""
    return json.dumps({"i": i, "sample_idx": row["sample_idx"], "sample_key": sample_key(row["text"]).decode(),
                       "prompt": row["text"], "label": row.get("label"), "metadata": row.get("metadata")},
                      ensure_ascii=False) + "\n"


def files_json_text(files: dict[str, dict]) -> str:
    """meta/files.json: bytes + sha256 of every other file of the store."""
    return "".join(files_json_pieces(sorted(files.items())))


def files_json_pieces(entries: Iterable[tuple[str, dict]]) -> Iterator[str]:
    """meta/files.json's text in pieces, from its (name, entry) pairs in name order: the JSON of
    {"files", "format", "schema_version"} with sorted keys, compact, streamed (a merged store lists
    millions of files)."""
    yield '{"files":{'
    for i, (name, entry) in enumerate(entries):
        yield ("," if i else "") + json.dumps(name) + ":" + json.dumps(entry, sort_keys=True, separators=(",", ":"))
    rest = {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION}  # keys sorting after "files"
    yield "}," + json.dumps(rest, sort_keys=True, separators=(",", ":"))[1:] + "\n"


def run_attrs(attrs: list[dict[str, Any]]) -> dict[str, Any]:
    """The attrs a run's manifest and merged store take: its first store's that holds a sample (an
    empty part's store knows no WIDTH_ATTRS), the first store's where none does; {} of no store."""
    return next((a for a in attrs if a["num_samples"]), attrs[0] if attrs else {})


def known_attrs(attrs: dict[str, Any], keys: Iterable[str]) -> list[str]:
    """Those of `keys` a store's attrs hold for the run: all but WIDTH_ATTRS in a store of no sample."""
    return [key for key in keys if attrs["num_samples"] or key not in WIDTH_ATTRS]


def manifest_doc(first_attrs: dict[str, Any], entries: list[dict], merged: dict | None, created: str) -> dict:
    """manifest.json of a run: every shard's entry (global_index_start = sample_idx), merged when built."""
    a = first_attrs
    return {
        "format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "model_id": a["model_id"],
        "num_samples": sum(e["num_samples"] for e in entries), "layers": a["layers"],
        "num_layers": a["num_layers"], "hidden_size": a["hidden_size"], "T_max": a["T_max"],
        "T_chunk": a["T_chunk"], "dtype": "float16", "shards": entries, "merged": merged,
        "created": created,
    }
