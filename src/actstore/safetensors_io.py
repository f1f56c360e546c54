"""safetensors files whose bytes depend only on their tensors and metadata.

safetensors (0.8.0 measured) serialises the `__metadata__` dict from a Rust HashMap, whose iteration
order is seeded anew for every map, so writing the same tensors and metadata twice, even in one
process, gives headers with the keys in different orders (and so different sha256s). The tensor data
layout is deterministic (the library sorts by dtype alignment, then name): its bytes are kept as the
library writes them and only the header is serialised again, canonically.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from actstore.integrity import STRICT_JSON

if TYPE_CHECKING:
    import torch

HEADER_ALIGN = 8  # safetensors pads its JSON header with spaces to this alignment
MAX_HEADER = 100_000_000  # the safetensors library's limit on a header's JSON (not 100 MiB)


def read_header_json(fh: BinaryIO, size: int) -> tuple[Any, int]:
    """(the header's JSON value, its length) of the safetensors file of `size` bytes open as `fh` at its
    start, parsed as strictly as the safetensors library reads it: a length within the file and
    MAX_HEADER, UTF-8 (json.loads would take UTF-16 or a BOM), no key twice, no NaN or Infinity, and
    -0 no count. ValueError saying which; what the value holds is the caller's to check."""
    raw = fh.read(8)
    if len(raw) < 8:
        raise ValueError(f"{size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > min(MAX_HEADER, size - 8):
        raise ValueError(f"safetensors header length {n} exceeds the file ({size} bytes) "
                         f"or the safetensors limit of {MAX_HEADER}")
    try:
        return json.loads(fh.read(n).decode("utf-8"), **STRICT_JSON, parse_int=_int_or_negative_zero), n
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a key given twice, NaN, Infinity
        raise ValueError(f"safetensors header is not JSON ({exc})") from None
    except RecursionError:
        raise ValueError("safetensors header is not JSON (nested too deeply to parse)") from None


def _int_or_negative_zero(literal: str) -> int | float:
    """A JSON integer as json.loads reads it, except -0 as the float -0.0: Python's int has no -0, so
    it would pass as a count, where the library refuses it (its counts are unsigned)."""
    return -0.0 if literal == "-0" else int(literal)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """safetensors.torch.save_file with a canonical header (sorted metadata keys, tensors in data
    order). Holds the file's bytes in memory once more than save_file (which already copies every
    tensor to bytes before writing)."""
    from safetensors.torch import save

    raw = memoryview(save(tensors, metadata=metadata))
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(bytes(raw[8:8 + length]))
    with open(path, "wb") as fh:
        fh.write(canonical_header(header))
        fh.write(raw[8 + length:])


def canonical_header(header: dict) -> bytes:
    """The safetensors header prefix: 8-byte little-endian length, then compact JSON with
    `__metadata__` first (keys sorted) and the tensors by data offset, padded with spaces."""
    metadata = header.pop("__metadata__", None)
    ordered = {} if metadata is None else {"__metadata__": dict(sorted(metadata.items()))}
    ordered.update(sorted(header.items(), key=lambda item: (item[1]["data_offsets"], item[0])))
    return header_bytes(ordered)


def header_bytes(header: dict[str, Any]) -> bytes:
    """A safetensors header as its keys are ordered: 8-byte little-endian length, then compact UTF-8
    JSON (as the library writes it) padded with spaces to HEADER_ALIGN."""
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text
