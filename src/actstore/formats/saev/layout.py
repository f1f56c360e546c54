"""The bytes of a saev protocol 2.1 store: file names, metadata fields, dtype, shard arithmetic.

Two flavors share the shard bytes and differ in metadata.json and the directory name: `spec` (the
protocol document) and `upstream` (what saev's code reads, checked at commit 3d73f1f). Readers take
either and see the spec's field names (to_spec).
Every other room asks this one where a byte goes; nothing here reads or writes a file.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import FormatError
from actstore.io_utils import canonical_json

PROTOCOL = "2.1"
METADATA = "metadata.json"
SHARDS = "shards.json"
LABELS = "labels.bin"
WINDOWS = "windows.npy"
SIDECAR = "actstore.json"
POINTER = "saev.json"
# The store's metadata files its workflow pointer seals (write_pointer): the store sits outside the
# stage directory whose stage config seals the pointer.
SEALED = (METADATA, SHARDS, SIDECAR)
DTYPE = np.dtype("<f4")
METADATA_FIELDS = {
    "family": str, "ckpt": str, "layers": list, "patches_per_ex": int, "cls_token": bool,
    "d_model": int, "n_examples": int, "patches_per_shard": int, "data": str, "dataset": str,
    "dtype": str, "protocol": str,
}
# saev's Metadata (3d73f1f), in its field order: the order its 8-hex hash is taken in.
UPSTREAM_FIELDS = {
    "family": str, "ckpt": str, "layers": list, "content_tokens_per_example": int, "cls_token": bool,
    "d_model": int, "n_examples": int, "max_tokens_per_shard": int, "data": str, "dataset": str,
    "pixel_agg": str, "dtype": str, "protocol": str,
}
# saev's Shard (3d73f1f): ShardInfo.load builds Shard(**entry) from each shards.json entry, as Metadata.load
# builds Metadata(**dct) from metadata.json: a key outside these fields (or UPSTREAM_FIELDS) is a TypeError.
UPSTREAM_SHARD_FIELDS = ("name", "n_examples")
UPSTREAM_RENAMED = {"patches_per_ex": "content_tokens_per_example", "patches_per_shard": "max_tokens_per_shard"}
UPSTREAM_FAMILIES = ("bird-mae", "clip", "dinov2", "dinov3", "fake-clip", "pe-core", "pe-spatial", "siglip")
PIXEL_AGGS = ("majority", "prefer-fg")
UPSTREAM_ROOT = "shards"  # saev requires .../saev/shards/<hash>
FLAVORS = ("spec", "upstream")
POSITIVE = ("patches_per_ex", "d_model", "patches_per_shard", *UPSTREAM_RENAMED.values())
# model_type -> spec family; text models keep their model_type (a documented extension).
FAMILIES = {"dinov2": "dinov2", "dinov2_with_registers": "dinov2", "dinov3_vit": "dinov3", "clip": "clip",
            "clip_vision_model": "clip", "metaclip_2": "clip",
            "siglip": "siglip", "siglip_vision_model": "siglip", "aimv2": "aimv2", "aimv2_vision_model": "aimv2",
            "vit": "vit", "deit": "deit", "beit": "beit", "data2vec-vision": "data2vec-vision", "ijepa": "ijepa",
            "vit_msn": "vit-msn"}
# A CLS token first (then any registers, or DeiT's distillation token), then the patches.
CLS_FAMILIES = ("dinov2", "dinov3", "clip", "vit", "deit", "beit", "data2vec-vision", "vit-msn")


def protocol_problem(protocol: str) -> str | None:
    """Why a store of `protocol` cannot be read by this protocol's arithmetic, or None. Spec §5 bumps
    the major version for a shape reorder, a dtype switch or a new required key; a minor one only adds."""
    if protocol.split(".")[0] == PROTOCOL.split(".")[0]:
        return None
    return (f"protocol {protocol} has a different major version than this reader's {PROTOCOL}; "
            "the layout may have changed")


def dropped_tokens(cls_token: bool, registers: int) -> list[int]:
    """The extracted token indices an upstream store leaves out: the registers right after CLS (saev's
    dinov2/dinov3 writers keep CLS and the patches)."""
    return list(range(int(cls_token), int(cls_token) + registers))


def shard_name(idx: int) -> str:
    return f"acts{idx:06d}.bin"


def metadata_hash(metadata: dict[str, Any]) -> str:
    """The store's directory name: full sha256 hex of the canonical metadata JSON (spec §1)."""
    return hashlib.sha256(canonical_json(metadata).encode("utf-8")).hexdigest()


def upstream_hash(metadata: dict[str, Any]) -> str:
    """saev's directory name: the first 8 hex of the sha256 of orjson's compact dump of its Metadata
    dataclass, which keeps field order (OPT_SORT_KEYS sorts dicts only) and writes UTF-8 unescaped."""
    ordered = {name: metadata[name] for name in UPSTREAM_FIELDS}
    return hashlib.sha256(json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()[:8]


def flavor_of(metadata: dict[str, Any]) -> str:
    return "upstream" if "content_tokens_per_example" in metadata else "spec"


def store_name(metadata: dict[str, Any]) -> str:
    """The store's path under {dump_to}/saev: <sha256> (spec) or shards/<8 hex> (upstream)."""
    if flavor_of(metadata) == "upstream":
        return f"{UPSTREAM_ROOT}/{upstream_hash(metadata)}"
    return metadata_hash(metadata)


def to_upstream(metadata: dict[str, Any], pixel_agg: str) -> dict[str, Any]:
    """saev's metadata.json from the spec's: two renamed fields and pixel_agg, in saev's field order."""
    renamed = {UPSTREAM_RENAMED.get(name, name): value for name, value in metadata.items()}
    renamed["pixel_agg"] = pixel_agg
    return {name: renamed[name] for name in UPSTREAM_FIELDS}


def to_spec(metadata: dict[str, Any]) -> dict[str, Any]:
    """The spec's 12 fields of either flavor (the names every reader uses)."""
    spec_name = {new: old for old, new in UPSTREAM_RENAMED.items()}
    return {spec_name.get(name, name): metadata[name] for name in metadata if name != "pixel_agg"}


def examples_per_shard(patches_per_shard: int, tokens_per_ex: int, n_layers: int) -> int:
    """Spec §3: floor(patches_per_shard / (tokens_per_ex * len(layers)))."""
    return patches_per_shard // (tokens_per_ex * n_layers)


def shard_sizes(n_examples: int, per_shard: int) -> list[int]:
    """Examples in each shard: per_shard each, the last one smaller."""
    full, rest = divmod(n_examples, per_shard)
    return [per_shard] * full + ([rest] if rest else [])


def groups_and_ranks(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of counts[i] items laid end to end: each item's group and its rank inside it."""
    group = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return group, np.arange(len(group), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def text_windows(num_tokens: np.ndarray, window: int) -> np.ndarray:
    """windows.npy rows (n_windows, 3) sample_idx, token_start, n_valid: windows never cross samples,
    the last one of a sample is short."""
    sample, nth = groups_and_ranks(-(-num_tokens // window))
    start = nth * window
    valid = np.minimum(window, num_tokens[sample] - start)
    return np.stack([sample, start, valid], axis=1).astype(np.int64)


def window_problem(windows: np.ndarray, n_examples: int, tokens_per_ex: int) -> str | None:
    """What keeps windows.npy (rows sample_idx, token_start, n_valid) from giving each token of a sample
    one place, or None. Readers find a sample's rows by binary search on sample_idx and take the first
    row holding the token, so rows out of sample order, or a sample's windows that overlap, leave a gap
    or start anywhere but its token 0, hand out other tokens' vectors without an error."""
    if windows.shape != (n_examples, 3):
        return f"shape {windows.shape}, expected ({n_examples}, 3): one row an example"
    sample, start, valid = (windows[:, i].astype(np.int64) for i in range(3))
    checks = [((valid < 1) | (valid > tokens_per_ex), f"n_valid out of [1, {tokens_per_ex}]"),
              (sample < 0, "sample_idx negative"),
              (np.r_[False, sample[1:] < sample[:-1]], "sample_idx smaller than the row before (rows out of order)")]
    for bad, what in checks:
        if bad.any():
            row = int(np.argmax(bad))
            return f"row {row} {windows[row].tolist()}: {what}"
    first = np.r_[True, sample[1:] != sample[:-1]]
    follows = np.where(first, 0, np.r_[0, start[:-1] + valid[:-1]])  # 0, or where the window before ended
    if (start != follows).any():
        row = int(np.argmax(start != follows))
        return (f"row {row} {windows[row].tolist()}: token_start {start[row]}, expected {follows[row]} "
                "(a sample's windows tile its tokens from 0, in order, without overlap or gap)")
    return None


def encode_data(description: dict[str, Any]) -> str:
    """Spec §2.1 `data`: base64 of a pickle. A dict of plain values, protocol 4, so it is
    deterministic and readable by decode_data without unpickling any class."""
    return base64.b64encode(pickle.dumps(description, protocol=4)).decode("utf8")


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every global: only dicts, lists, strings and numbers come back."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from metadata.json data")


def decode_data(data: str) -> Any:
    """Decode the `data` field safely (never executes code); raises FormatError if it needs classes."""
    try:
        return _PlainUnpickler(io.BytesIO(base64.b64decode(data))).load()
    except Exception as exc:
        raise FormatError(f"metadata.json data: not a plain pickled description ({exc})") from None


def check_metadata(md: Any, where: Path) -> None:
    """Every field of the store's flavor present with its type; raise FormatError naming the field."""
    if not isinstance(md, dict):
        raise FormatError(f"{where}: top level must be an object")
    upstream = flavor_of(md) == "upstream"
    # A field under both names was read (to_spec) as whichever came last, while the store's name hashes its
    # flavor's alone: verify passed the directory, every reader took the other value (saev refuses any key).
    for spec_name, upstream_name in UPSTREAM_RENAMED.items():
        other, own = (spec_name, upstream_name) if upstream else (upstream_name, spec_name)
        if other in md:
            raise FormatError(f"{where}: field {other!r} is the {'spec' if upstream else 'upstream'} flavor's name "
                              f"of {own!r}; a {'upstream' if upstream else 'spec'} metadata.json holds {own!r} alone")
    if upstream and md.get("pixel_agg") not in PIXEL_AGGS:
        raise FormatError(f"{where}: field 'pixel_agg' = {md.get('pixel_agg')!r} is not one of {PIXEL_AGGS}")
    fields = UPSTREAM_FIELDS if upstream else METADATA_FIELDS
    for name, kind in fields.items():
        if name not in md:
            raise FormatError(f"{where}: field {name!r} missing")
        value = md[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise FormatError(f"{where}: field {name!r} = {value!r} is not {kind.__name__}")
    if md["dtype"] != "float32":
        raise FormatError(f"{where}: dtype {md['dtype']!r}; protocol {PROTOCOL} fixes 'float32'")
    # A layer listed twice has two blocks in every example, and a reader finds only the first.
    if not md["layers"] or not all(type(x) is int for x in md["layers"]) or len(set(md["layers"])) < len(md["layers"]):
        raise FormatError(f"{where}: layers {md['layers']!r} must be a non-empty list of distinct ints")
    for name in (name for name in fields if name in POSITIVE):
        if md[name] < 1:
            raise FormatError(f"{where}: {name} = {md[name]} must be >= 1")
    if md["n_examples"] < 0:  # else shards.json was blamed: "must be a non-empty array"
        raise FormatError(f"{where}: n_examples = {md['n_examples']} must be >= 0")
