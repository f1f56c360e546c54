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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HEADER_ALIGN = 8  # safetensors pads its JSON header with spaces to this alignment


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
