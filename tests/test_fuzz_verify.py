"""A small seeded fuzz of verify and the readers over every activation format: random damages (a
flipped bit, a cut, appended bytes, a zeroed range, a metadata value of another type or an extreme,
a .npy header's shape) to copies of real stores. Each must end in problems from verify, or a
FormatError from the reader, or read exactly the undamaged vectors; a PASS of verify must read them.
inspect summarises the store or raises FormatError.
The faults it found have their own fixed-damage tests in test_integrity.py."""
from __future__ import annotations

import ast
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import format_module
from test_integrity import stores  # noqa: F401  (the module's fixture: one real store of each format)

FORMATS = ("extract", "saev", "pickle", "lmprobe", "zarr")
CASES = 40  # per format: ~0.05 s each
HOSTILE = [-1, 0, 2**63, 1.5, None, True, "", "../x", [], [[1]], {"a": {}}]
METADATA = (".json", ".jsonl", ".zarray", ".zattrs", ".zmetadata", ".npy")


def mutate_json(value: object, rng: random.Random) -> object:
    """`value` with one of its members (at any depth, itself included) replaced by a hostile value
    or dropped."""
    box = [value]
    holder, key = box, 0
    while isinstance(holder[key], (dict, list)) and holder[key] and rng.random() < 0.7:
        holder, key = holder[key], rng.choice(list(holder[key]) if isinstance(holder[key], dict)
                                              else range(len(holder[key])))
    if isinstance(holder, dict) and rng.random() < 0.2:
        del holder[key]
    else:
        holder[key] = rng.choice(HOSTILE)
    return box[0]


def damage_npy_shape(raw: bytes, rng: random.Random) -> bytes:
    """A .npy header whose first dimension is negative, one more, or huge (padded to its length)."""
    length = int.from_bytes(raw[8:10], "little")
    header = ast.literal_eval(raw[10:10 + length].decode("latin1"))
    shape = list(header["shape"]) or [1]
    shape[0] = rng.choice([-1, shape[0] + 1, 2**40])
    text = repr({**header, "shape": tuple(shape)})
    return raw[:10] + (text + " " * (length - 1 - len(text)) + "\n").encode("latin1") + raw[10 + length:]


def damage(path: Path, rng: random.Random) -> bytes:
    raw = path.read_bytes()
    if path.suffix == ".npy" and rng.random() < 0.5:
        return damage_npy_shape(raw, rng)
    if path.suffix in METADATA and path.suffix != ".npy" and rng.random() < 0.5:
        lines = raw.decode().splitlines() if path.suffix == ".jsonl" else [raw.decode()]
        row = rng.randrange(len(lines))
        lines[row] = json.dumps(mutate_json(json.loads(lines[row]), rng))
        return "\n".join(lines).encode() + b"\n"
    at = rng.randrange(max(len(raw), 1))
    kind = rng.choice(["flip", "cut", "extend", "zero"])
    if kind == "flip" and raw:
        return raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1:]
    if kind == "cut":
        return raw[:at]
    if kind == "zero":
        return raw[:at] + bytes(len(raw[at:at + 64])) + raw[at + 64:]
    return raw + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 32)))


def read_vectors(name: str, root: Path, coords: list[tuple[int, int, int]]) -> bytes:
    """Every coordinate's vector through the format's read_vector (which opens without verifying).
    IndexError: a token past what the store holds (zarr), which verify's reads count as missing."""
    module, out = format_module(name), []
    for coord in coords:
        try:
            vector = module.read_vector(root, *coord)
        except IndexError:
            vector = None
        out.append(b"-" if vector is None else np.asarray(vector, np.float32).tobytes())
    return b"".join(out)


@pytest.mark.parametrize("name", FORMATS)
def test_seeded_damage_is_named_or_harmless_never_a_crash(stores, name, tmp_path):  # noqa: F811
    store, module = stores[name], format_module(name)
    n_samples = format_module("extract").inspect(stores["extract"].root)["n_examples"]
    coords = [(sample, layer, 0) for sample in (0, n_samples // 2, n_samples - 1) for layer in (0, 2)]
    clean = read_vectors(name, store.root, coords)
    files = sorted(p.relative_to(store.root) for p in store.root.rglob("*") if p.is_file() and not p.is_symlink())
    for case in range(CASES):
        rng = random.Random(f"{name}-{case}")
        root = tmp_path / str(case) / store.root.name  # the same name: a saev store is named by its hash
        shutil.copytree(store.root, root, symlinks=True, copy_function=os.link)
        target = root / rng.choice(files)
        damaged = damage(target, rng)
        target.unlink()  # a hard link to the shared store: replaced, never written through
        target.write_bytes(damaged)
        what = f"case {case}: {target.relative_to(root)}"
        problems = module.verify(root)
        try:
            module.inspect(root)
        except FormatError:
            pass
        try:
            read = read_vectors(name, root, coords)
        except FormatError:
            read = None
        outcome = "refused" if read is None else "read other vectors"
        assert problems or read == clean, f"{what}: verify passed, and the reader {outcome}"
        shutil.rmtree(root.parent)
