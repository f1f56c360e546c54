"""safetensors files whose bytes depend only on their tensors and metadata.

safetensors (0.8.0 measured) serialises the `__metadata__` dict from a Rust HashMap, whose iteration
order is seeded anew for every map, so writing the same tensors and metadata twice, even in one
process, gives headers with the keys in different orders (and so different sha256s). The tensor data
layout is deterministic (the library sorts by its dtype order, then name): it is laid out here as the
library lays it, the header serialised canonically, and each tensor's bytes written from its own
memory (the library's save holds the whole file twice more: 3x a 256 MiB SAE's bytes measured).
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from actstore.integrity import STRICT_JSON
from actstore.io_utils import errors_naming

if TYPE_CHECKING:
    import torch

HEADER_ALIGN = 8  # safetensors pads its JSON header with spaces to this alignment
MAX_HEADER = 100_000_000  # the safetensors library's limit on a header's JSON (not 100 MiB)


def read_header_json(fh: BinaryIO, size: int) -> tuple[Any, int]:
    """(the header's JSON value, its length) of the safetensors file of `size` bytes open as `fh` at its
    start, parsed as strictly as the safetensors library reads it: a length within the file and
    MAX_HEADER, UTF-8 (json.loads would take UTF-16 or a BOM), no key twice, no NaN or Infinity, -0
    no count, and no lone surrogate escape. ValueError saying which; what the value holds is the
    caller's to check."""
    raw = fh.read(8)
    if len(raw) < 8:
        raise ValueError(f"{size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > min(MAX_HEADER, size - 8):
        raise ValueError(f"safetensors header length {n} exceeds the file ({size} bytes) "
                         f"or the safetensors limit of {MAX_HEADER}")
    try:
        value = json.loads(fh.read(n).decode("utf-8"), **STRICT_JSON, parse_int=_int_or_negative_zero)
        _refuse_surrogates(value)
        return value, n
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a key given twice, NaN, Infinity
        raise ValueError(f"safetensors header is not JSON ({exc})") from None
    except RecursionError:
        raise ValueError("safetensors header is not JSON (nested too deeply to parse)") from None


# A code point of a UTF-16 surrogate: UTF-8 text cannot hold one, so in a parsed string it came from a
# \uD800-\uDFFF escape json.loads did not pair, which the library's parser (serde_json) refuses.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_surrogates(value: Any) -> None:
    """ValueError where a string of the parsed JSON `value` (a key too) holds a lone surrogate."""
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_surrogates(key)
            _refuse_surrogates(item)
    elif isinstance(value, list):
        for item in value:
            _refuse_surrogates(item)
    elif isinstance(value, str) and _SURROGATE.search(value):
        raise ValueError(f"lone surrogate escape in the string {value!r:.100}")


def _int_or_negative_zero(literal: str) -> int | float:
    """A JSON integer as json.loads reads it, except -0 as the float -0.0: Python's int has no -0, so
    it would pass as a count, where the library refuses it (its counts are unsigned)."""
    return -0.0 if literal == "-0" else int(literal)


# The library's data order: dtypes by its Dtype enum, last first (not by width alone: BF16 before F16,
# C64 after F32), then names. The names are its header's; only these dtypes are written here.
LIBRARY_DTYPES = {"torch.uint64": "U64", "torch.int64": "I64", "torch.float64": "F64", "torch.float32": "F32",
                  "torch.uint32": "U32", "torch.int32": "I32", "torch.bfloat16": "BF16", "torch.float16": "F16",
                  "torch.uint16": "U16", "torch.int16": "I16", "torch.int8": "I8", "torch.uint8": "U8",
                  "torch.bool": "BOOL"}
DATA_ORDER = {name: rank for rank, name in enumerate(LIBRARY_DTYPES.values())}


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """The bytes safetensors.torch.save_file writes, with a canonical header (sorted metadata keys,
    tensors in data order), each tensor written from its own memory: no copy of the file is held
    (a device tensor is copied to the host one at a time). ValueError naming the file for what the
    library's save refuses (metadata other than text, a tensor not contiguous) or a dtype outside
    LIBRARY_DTYPES; an OSError of the writes (a full disk, a quota) names it too."""
    for key, value in metadata.items():  # json.dumps would write any, the library reads only text
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"{path}: metadata {key!r}: {value!r} is not text")
    dtypes = {name: _library_dtype(tensor, path, name) for name, tensor in tensors.items()}
    ordered = sorted(tensors, key=lambda name: (DATA_ORDER[dtypes[name]], name))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in ordered:
        size = tensors[name].nelement() * tensors[name].element_size()
        header[name] = {"dtype": dtypes[name], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    with errors_naming(path), open(path, "wb") as fh:  # a full disk's error names no file
        fh.write(canonical_header(header))
        for name in ordered:
            fh.write(_host_bytes(tensors[name]))


def _library_dtype(tensor: torch.Tensor, path: str | Path, name: str) -> str:
    """The header's dtype of tensor `name`; ValueError where it cannot be written from its memory."""
    if str(tensor.dtype) not in LIBRARY_DTYPES:
        raise ValueError(f"{path}: tensor {name!r}: dtype {tensor.dtype} is not one safetensors_io writes "
                         f"({', '.join(LIBRARY_DTYPES)})")
    if not tensor.is_contiguous():  # its memory is not its row-major bytes: the library refuses it too
        raise ValueError(f"{path}: tensor {name!r} is not contiguous: call .contiguous() before saving it")
    return LIBRARY_DTYPES[str(tensor.dtype)]


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in host memory, a view where it is on the CPU (bfloat16 has no numpy dtype:
    read as bytes). Native byte order: the library's little-endian on the hosts actstore runs on
    (x86-64, ARM); on a big-endian one the library would swap them."""
    import torch

    return memoryview(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy())


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
