"""sae.safetensors and *.lut.safetensors are byte-reproducible and read back by safetensors itself."""
from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from actstore.safetensors_io import save_safetensors

TENSORS = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.float16),
           "i": torch.arange(3), "bf": torch.full((2, 2), 0.5, dtype=torch.bfloat16), "empty": torch.zeros(0)}
METADATA = {key: f"value {i} é" for i, key in enumerate("hgfedcba")}


def test_library_header_order_is_random_ours_is_not(tmp_path):
    # Why this module exists: the library's own bytes differ between two writes of the same input.
    assert len({save(TENSORS, metadata=METADATA) for _ in range(10)}) > 1
    digests = set()
    for i in range(10):
        # Insertion order of both dicts varied too: it must not matter.
        order = list(reversed(METADATA.items())) if i % 2 else list(METADATA.items())
        tensors = dict(reversed(TENSORS.items())) if i % 3 else TENSORS
        save_safetensors(tensors, tmp_path / f"{i}.safetensors", dict(order))
        digests.add(hashlib.sha256((tmp_path / f"{i}.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1


def test_safetensors_reads_our_file_as_its_own(tmp_path):
    path = tmp_path / "t.safetensors"
    save_safetensors(TENSORS, path, METADATA)
    loaded = load_file(str(path))
    assert loaded.keys() == TENSORS.keys()
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in TENSORS.items())
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == METADATA
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    # Same layout as the library's: space padding to 8 bytes, same tensor bytes after the header.
    assert length % 8 == 0 and raw[8:8 + length].rstrip(b" ").endswith(b"}")
    assert list(header["__metadata__"]) == sorted(METADATA)
    theirs = save(TENSORS, metadata=METADATA)
    (their_length,) = struct.unpack("<Q", theirs[:8])
    assert raw[8 + length:] == theirs[8 + their_length:]


def test_sae_and_lut_files_are_byte_reproducible(tmp_path):
    from actstore.formats.lut import precompute, write_lut
    from actstore.sae.checkpoint import save_sae
    from actstore.sae.model import TopKSAE, init_sae

    sae = TopKSAE(8, 16, 2)
    init_sae(sae, torch.zeros(8), seed=0)  # seeded weights (a bare TopKSAE holds torch.empty's garbage)
    meta = {"hook": "layer.0:input", "model": "m", "seed": 0}
    save_sae(sae, tmp_path / "a.safetensors", meta)
    save_sae(sae, tmp_path / "b.safetensors", dict(reversed(meta.items())))
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    tables = {"t": precompute(sae.state(), torch.randn(8, 4), torch.randn(4))}
    first, second = write_lut(tmp_path / "1", tables, 2), write_lut(tmp_path / "2", tables, 2)
    assert (first / "t.lut.safetensors").read_bytes() == (second / "t.lut.safetensors").read_bytes()
