"""The bytes of a saev protocol 2.1 store: file names, metadata fields, dtype, shard arithmetic.

Every other room asks this one where a byte goes; nothing here reads or writes a file.
"""
from __future__ import annotations

import base64
import hashlib
import io
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
DTYPE = np.dtype("<f4")
METADATA_FIELDS = {
    "family": str, "ckpt": str, "layers": list, "patches_per_ex": int, "cls_token": bool,
    "d_model": int, "n_examples": int, "patches_per_shard": int, "data": str, "dataset": str,
    "dtype": str, "protocol": str,
}
# model_type -> spec family; text models keep their model_type (a documented extension).
FAMILIES = {"dinov2": "dinov2", "dinov2_with_registers": "dinov2", "clip": "clip",
            "clip_vision_model": "clip", "siglip": "siglip", "siglip_vision_model": "siglip"}
CLS_FAMILIES = ("dinov2", "clip")


def shard_name(idx: int) -> str:
    return f"acts{idx:06d}.bin"


def metadata_hash(metadata: dict[str, Any]) -> str:
    """The store's directory name: full sha256 hex of the canonical metadata JSON (spec §1)."""
    return hashlib.sha256(canonical_json(metadata).encode("utf-8")).hexdigest()


def examples_per_shard(patches_per_shard: int, tokens_per_ex: int, n_layers: int) -> int:
    """Spec §3: floor(patches_per_shard / (tokens_per_ex * len(layers)))."""
    return patches_per_shard // (tokens_per_ex * n_layers)


def shard_sizes(n_examples: int, per_shard: int) -> list[int]:
    """Examples in each shard: per_shard each, the last one smaller."""
    full, rest = divmod(n_examples, per_shard)
    return [per_shard] * full + ([rest] if rest else [])


def text_windows(num_tokens: np.ndarray, window: int) -> np.ndarray:
    """windows.npy rows (n_windows, 3) sample_idx, token_start, n_valid: windows never cross samples,
    the last one of a sample is short."""
    n_win = -(-num_tokens // window)
    sample = np.repeat(np.arange(len(num_tokens), dtype=np.int64), n_win)
    first = np.repeat(np.cumsum(n_win) - n_win, n_win)
    start = (np.arange(len(sample), dtype=np.int64) - first) * window
    valid = np.minimum(window, num_tokens[sample] - start)
    return np.stack([sample, start, valid], axis=1).astype(np.int64)


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
    """Every spec field present with its type; raise FormatError naming the field."""
    if not isinstance(md, dict):
        raise FormatError(f"{where}: top level must be an object")
    for name, kind in METADATA_FIELDS.items():
        if name not in md:
            raise FormatError(f"{where}: field {name!r} missing")
        value = md[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise FormatError(f"{where}: field {name!r} = {value!r} is not {kind.__name__}")
    if md["dtype"] != "float32":
        raise FormatError(f"{where}: dtype {md['dtype']!r}; protocol {PROTOCOL} fixes 'float32'")
    if not md["layers"] or not all(isinstance(x, int) for x in md["layers"]):
        raise FormatError(f"{where}: layers {md['layers']!r} must be a non-empty int list")
    for name in ("patches_per_ex", "d_model", "patches_per_shard"):
        if md[name] < 1:
            raise FormatError(f"{where}: {name} = {md[name]} must be >= 1")
