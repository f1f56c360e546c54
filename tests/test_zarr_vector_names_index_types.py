"""Zarr logger review 59: a 1-D array name from .zmetadata that leaves arrays/ ("..", ".", "") is
refused by reads and named by verify, as is a 1-D array's .zarray the reader refuses; a bool or float
sample index or layer is refused, never read as another sample or block."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.formats.zarr.check import verify
from actstore.formats.zarr.layout import FILES_JSON
from test_zarr_merged_sample_count import edited


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> list[Path]:
    """Two parts (2 layers, hidden 16, 3-20 tokens) of a small synthetic extraction."""
    extract = synthetic_extraction(tmp_path_factory.mktemp("review59") / "extract", 100_000, 2, 16, [1, 2],
                                   tokens=(3, 20))
    return [part.dir for part in open_extraction(extract).parts]


@pytest.fixture(scope="module")
def run(parts, tmp_path_factory) -> Path:
    """A run of two shards, no merged store."""
    run_dir = tmp_path_factory.mktemp("review59") / "run"
    shards = [run_dir / "shards" / zs.shard_name(k) for k in range(len(parts))]
    for part, shard in zip(parts, shards):
        zs.write_shard(part, shard, t_chunk=4, progress=False)
    zs.write_manifest(run_dir, shards, None)
    return run_dir


def _recorded(store: Path, names: list[str]) -> None:
    """`names` (files of `store`) recorded anew in its files.json, in name order as the writer keeps it."""
    files = json.loads((store / FILES_JSON).read_text())
    for name in names:
        data = (store / name).read_bytes()
        files["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    files["files"] = dict(sorted(files["files"].items()))
    (store / FILES_JSON).write_text(json.dumps(files, sort_keys=True, separators=(",", ":")) + "\n")


@pytest.mark.parametrize("name", [".", ""])
def test_a_vector_named_outside_arrays_fails_verify_and_reads(parts, tmp_path, name):
    """A .zmetadata key arrays/./.zarray (or arrays//.zarray) named a 1-D array whose chunks are
    arrays/0, ...: with those files present and recorded, verify passed and vector() read them."""
    store = tmp_path / "store.zarr"
    zs.write_shard(parts[0], store, t_chunk=4, progress=False)
    key = f"arrays/{name}/.zarray"
    consolidated = json.loads((store / ".zmetadata").read_text())
    consolidated["metadata"][key] = consolidated["metadata"]["arrays/seq_len/.zarray"]
    (store / ".zmetadata").write_text(json.dumps(consolidated))
    (store / "arrays/.zarray").write_bytes((store / "arrays/seq_len/.zarray").read_bytes())
    (store / "arrays/0").write_bytes((store / "arrays/seq_len/0").read_bytes())
    _recorded(store, [".zmetadata", "arrays/.zarray", "arrays/0"])
    named = f"{store}/.zmetadata: {key!r} is no array directly under arrays/"
    assert any(problem.startswith(named) for problem in verify(store))
    reader = zs.ZarrStore(store)
    for read in (lambda: reader.vector_names, lambda: reader.vector(name)):
        with pytest.raises(FormatError, match="is no array directly under arrays/"):
            read()


def _listing(run: Path, tmp_path: Path, key: str) -> Path:
    """A copy of the run's first shard whose .zmetadata also lists `key`, as arrays/seq_len/.zarray."""
    store = shutil.copytree(run / "shards" / zs.shard_name(0), tmp_path / "store.zarr")
    consolidated = json.loads((store / ".zmetadata").read_text())
    consolidated["metadata"][key] = consolidated["metadata"]["arrays/seq_len/.zarray"]
    (store / ".zmetadata").write_text(json.dumps(consolidated))
    return store


@pytest.mark.parametrize("key", ["arrays/../.zarray", "arrays/seq_len/x/.zarray", "arrays/a\0b/.zarray"])
def test_a_vector_key_that_is_no_plain_name_is_named(run, tmp_path, key):
    """arrays/../.zarray listed a vector "..", read from the store's own files (arrays/../0); a nested
    key listed "seq_len" twice; a NUL made the open a bare ValueError."""
    reader = zs.ZarrStore(_listing(run, tmp_path, key))
    with pytest.raises(FormatError, match=r"\.zmetadata: .* is no array directly under arrays/"):
        reader.vector_names


@pytest.mark.parametrize("name", ["..", "a\0b"])
def test_reading_a_vector_that_is_no_plain_name_is_refused(run, tmp_path, name):
    """vector("..") read the store's own files arrays/../0 as an array; a NUL was a bare ValueError."""
    store = _listing(run, tmp_path, f"arrays/{name}/.zarray")
    with pytest.raises(FormatError, match="is no array directly under arrays/"):
        zs.ZarrStore(store).vector(name)


def test_a_vector_zarray_the_reader_refuses_fails_verify(parts, tmp_path):
    """A 1-D array's .zarray with a compressor (its raw chunks no zarr client reads) was alike in
    .zmetadata and on disk: verify passed, then vector() and the merge refused the store."""
    store = tmp_path / "store.zarr"
    zs.write_shard(parts[0], store, t_chunk=4, progress=False)
    assert verify(store) == []
    edited(store, "arrays/prompt_len/.zarray", lambda z: z.update(compressor={"id": "zlib", "level": 1}))
    with pytest.raises(FormatError, match="compressor"):
        zs.ZarrStore(store).vector("prompt_len")
    assert [p for p in verify(store) if "arrays/prompt_len/.zarray: compressor=" in p]


@pytest.mark.parametrize("index", [True, 1.0, np.float64(1.0)], ids=["bool", "float", "numpy-float"])
def test_a_sample_index_that_is_no_integer_is_refused(run, index):
    """ZarrRun.read(True, layer) read sample 1 (True - 0); a float was a TypeError naming no store."""
    reader = zs.ZarrRun(run)
    for read in (lambda: reader.read(index, 1), lambda: reader.seq_len(index),
                 lambda: reader.stores[0].read(index, 1)):
        with pytest.raises(TypeError, match=rf"^{reader.path}.*: sample(_idx)? {re.escape(repr(index))} is not an integer"):
            read()


@pytest.mark.parametrize("layer", [True, 1.0], ids=["bool", "float"])
def test_a_layer_that_is_no_integer_is_refused(run, layer):
    """A bool or float layer equals block 1 as a dict key: read(0, True) returned block 1's activations."""
    store = zs.ZarrRun(run).stores[0]
    assert 1 in store.layers
    with pytest.raises(TypeError, match=f"layer {layer!r} is not an integer"):
        store.read(0, layer)


def test_numpy_integers_read_as_ints(run):
    """A numpy integer (what a sampler or np.arange gives) is a sample index and a layer."""
    reader = zs.ZarrRun(run)
    last = reader.n_samples - 1
    np.testing.assert_array_equal(reader.read(np.int64(last), np.int32(2)), reader.read(last, 2))
    assert reader.seq_len(np.uint16(last)) == reader.seq_len(last)
