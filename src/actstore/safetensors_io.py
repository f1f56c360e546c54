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

from actstore.integrity import STRICT_JSON, whole_numbers
from actstore.io_utils import errors_naming

if TYPE_CHECKING:
    import torch

HEADER_ALIGN = 8  # safetensors pads its JSON header with spaces to this alignment
MAX_HEADER = 100_000_000  # the safetensors library's limit on a header's JSON (not 100 MiB)


def read_header_json(fh: BinaryIO, size: int) -> tuple[Any, int]:
    """(the header's JSON value, its length) of the safetensors file of `size` bytes open as `fh` at its
    start, parsed as strictly as the safetensors library reads it: a length within the file and
    MAX_HEADER, UTF-8 (json.loads would take UTF-16 or a BOM), no NaN or Infinity, -0 no count, and
    no lone surrogate escape; and no key twice, which the library takes (0.8.0: the last wins), where
    which was meant is not known. ValueError saying which; what the value holds is the caller's to
    check (tensor_sizes)."""
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


# Bits of one value of each dtype the safetensors library reads (0.8.0's Dtype enum).
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
USIZE_LIMIT = 1 << 64  # the library counts in usize and refuses a shape whose bit count overflows it


def tensor_sizes(header: Any, data_bytes: int) -> dict[str, int]:
    """Bytes of each tensor of a safetensors header (read_header_json's value) whose file holds
    `data_bytes` of data after it, checked as the library checks it before it reads a tensor: text
    metadata; a known dtype, a shape of whole numbers whose bytes are its data_offsets'; the tensors'
    data laid end to end from 0 to `data_bytes`, no byte twice, none left over. ValueError naming the
    tensor: sized from offsets alone, two tensors claiming the same bytes were counted twice."""
    if not isinstance(header, dict):
        raise ValueError(f"safetensors header is a JSON {type(header).__name__}, not an object")
    metadata = header.get("__metadata__")  # null is none, as the library reads it
    texts = isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())
    if not (metadata is None or texts):
        raise ValueError(f"safetensors header __metadata__ {metadata!r:.100} is not a map of text to text")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    sizes = {name: _entry_bytes(name, entry) for name, entry in tensors.items()}
    end = 0
    for name in sorted(tensors, key=lambda name: tensors[name]["data_offsets"]):
        if tensors[name]["data_offsets"][0] != end:
            raise ValueError(f"tensor {name!r:.100} data_offsets {tensors[name]['data_offsets']} do not start where "
                             f"the tensor before it ends, at {end}: tensors overlap or leave a gap")
        end = tensors[name]["data_offsets"][1]
    if end != data_bytes:
        raise ValueError(f"the tensors' data ends at byte {end} of its {data_bytes} bytes of data")
    return sizes


def _entry_bytes(name: str, entry: Any) -> int:
    """Bytes of tensor `name`'s header entry, which its data_offsets must span; ValueError naming it."""
    dtype, offsets = (entry.get("dtype"), entry.get("data_offsets")) if isinstance(entry, dict) else (None, None)
    if not (isinstance(dtype, str) and dtype in DTYPE_BITS and whole_numbers(entry.get("shape"))
            and whole_numbers(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name!r:.100}: {entry!r:.200} is not a safetensors dtype, a shape of whole numbers "
                         "and two data_offsets in order")
    count = 1
    for dim in entry["shape"]:  # stops at an overflow, as the library: a long shape's product is no cost
        count *= dim
        if count >= USIZE_LIMIT:
            break
    bits = count * DTYPE_BITS[dtype]
    if bits >= USIZE_LIMIT:
        raise ValueError(f"tensor {name!r:.100}: shape {entry['shape']!r:.100} overflows the library's count")
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        raise ValueError(f"tensor {name!r:.100}: {dtype} {entry['shape']} is {bits / 8:g} bytes, its "
                         f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
    return bits // 8


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
