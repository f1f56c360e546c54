"""Zarr logger review: verify names a merged store that holds fewer samples than the shards it lists
beside, and a store whose chunk attrs disagree with its activations' .zarray (true taken for 1)."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable

import pytest

from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.formats.zarr.check import verify
from actstore.formats.zarr.layout import ACTS, FILES_JSON
from actstore.formats.zarr.write import store_entry


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> list[Path]:
    """Three parts (2 layers, hidden 16, 3-20 tokens) of a small synthetic extraction."""
    extract = synthetic_extraction(tmp_path_factory.mktemp("review56") / "extract", 100_000, 3, 16, [1, 2],
                                   tokens=(3, 20))
    return [part.dir for part in open_extraction(extract).parts]


def manifest_naming_merged(run: Path, shards: list[Path]) -> dict:
    """The run's manifest.json with its merged/ entry put in by hand: write_manifest refuses a merged
    store of fewer samples than the shards (review 63), which another tool, or an edit, can still write."""
    manifest = zs.write_manifest(run, shards)
    manifest["merged"] = store_entry(run / zs.MERGED, run)
    (run / zs.MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def test_write_manifest_refuses_a_merged_store_of_fewer_samples_than_the_shards(parts, tmp_path):
    shards = [tmp_path / "shards" / zs.shard_name(k) for k in range(3)]
    for part, shard in zip(parts, shards):
        zs.write_shard(part, shard, t_chunk=4, progress=False)
    zs.merge_stores(shards[:2], tmp_path / zs.MERGED, progress=False)
    with pytest.raises(FormatError, match="merged: num_samples="):
        zs.write_manifest(tmp_path, shards, tmp_path / zs.MERGED)
    assert not (tmp_path / zs.MANIFEST).exists()


def test_a_merged_store_of_fewer_samples_than_the_shards_fails_verify(parts, tmp_path):
    """A merged store built from two of the three shards verified clean beside them: Option B's
    reads (ZarrRun(merged=True)) then had none of the third shard's samples."""
    shards = [tmp_path / "shards" / zs.shard_name(k) for k in range(3)]
    for part, shard in zip(parts, shards):
        zs.write_shard(part, shard, t_chunk=4, progress=False)
    zs.merge_stores(shards[:2], tmp_path / zs.MERGED, progress=False)
    manifest = manifest_naming_merged(tmp_path, shards)
    held, total = manifest["merged"]["num_samples"], manifest["num_samples"]
    assert held < total
    assert verify(tmp_path) == [f"{tmp_path / zs.MANIFEST}: merged.num_samples={held}, the shards hold {total}"]


def edited(store: Path, name: str, edit: Callable[[dict], None]) -> None:
    """`store`'s JSON document `name` edited, alike in .zmetadata, both recorded anew in files.json (a
    store whose metadata was damaged before files.json was written, or written so by another tool)."""
    doc = json.loads((store / name).read_text())
    edit(doc)
    (store / name).write_text(json.dumps(doc))
    consolidated = json.loads((store / ".zmetadata").read_text())
    consolidated["metadata"][name] = doc
    (store / ".zmetadata").write_text(json.dumps(consolidated))
    files = json.loads((store / FILES_JSON).read_text())
    for changed in (name, ".zmetadata"):
        data = (store / changed).read_bytes()
        files["files"][changed] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (store / FILES_JSON).write_text(json.dumps(files, sort_keys=True, separators=(",", ":")) + "\n")


@pytest.mark.parametrize("t_chunk, name, edit, named", [
    (4, ".zattrs", lambda attrs: attrs.update(T_chunk=8), "T_chunk=8, but {store}/{acts}/.zarray gives 4"),
    (1, ".zattrs", lambda attrs: attrs.update(T_chunk=True), "T_chunk=True, but {store}/{acts}/.zarray gives 1"),
], ids=["attrs-8", "attrs-true"])
def test_chunk_attrs_that_disagree_with_the_activations_zarray_fail_verify(parts, tmp_path, t_chunk, name, edit,
                                                                         named):
    """The merge builds the merged .zarray from the shards' .zattrs T_chunk and links their chunk files
    into it: a shard whose T_chunk disagreed with its .zarray verified clean, then merged into a store
    whose every chunk has the wrong size. A JSON true (Python's 1) passed in either document."""
    store = tmp_path / "store.zarr"
    zs.write_shard(parts[0], store, t_chunk=t_chunk, progress=False)
    edited(store, name, edit)
    assert f"{store}/.zattrs: " + named.format(store=store, acts=ACTS) in verify(store)


def test_a_store_as_written_has_no_chunk_attr_problem(parts, tmp_path):
    """chunk_shape and chunk_bytes as the writer gives them agree with the .zarray, as JSON."""
    store = tmp_path / "store.zarr"
    zs.write_shard(parts[0], store, t_chunk=4, progress=False)
    assert verify(store) == []


@pytest.mark.parametrize("edit, named", [
    (lambda zarray: zarray["chunks"].__setitem__(2, True), "chunks=[1, 1, True, 16], expected [1, 1, T_chunk, 16]"),
    (lambda zarray: zarray.update(zarr_format=2.0), "zarr_format=2.0, expected 2"),
], ids=["t-chunk-true", "format-float"])
def test_an_activations_zarray_taking_true_for_1_is_refused_on_opening(parts, tmp_path, edit, named):
    """The reader compared its .zarray's fields with Python's ==: chunks [1, 1, true, H] (true == 1) and
    zarr_format 2.0 opened, and verified clean where .zattrs agreed."""
    store = tmp_path / "store.zarr"
    zs.write_shard(parts[0], store, t_chunk=1, progress=False)
    edited(store, f"{ACTS}/.zarray", edit)
    with pytest.raises(FormatError, match=re.escape(f"{store}/{ACTS}/.zarray: {named}")):
        zs.ZarrStore(store)


def test_a_merged_store_of_fewer_samples_than_the_run_is_refused_on_opening(parts, tmp_path):
    """ZarrRun(merged=True), Option B's reads, opened a merged store of two of three shards' samples."""
    shards = [tmp_path / "shards" / zs.shard_name(k) for k in range(3)]
    for part, shard in zip(parts, shards):
        zs.write_shard(part, shard, t_chunk=4, progress=False)
    zs.merge_stores(shards[:2], tmp_path / zs.MERGED, progress=False)
    manifest = manifest_naming_merged(tmp_path, shards)
    with pytest.raises(FormatError, match=re.escape(f"{tmp_path / zs.MANIFEST}: merged: num_samples="
                                                    f"{manifest['merged']['num_samples']}, but the run's num_samples "
                                                    f"is {manifest['num_samples']}")):
        zs.ZarrRun(tmp_path, merged=True)
    assert zs.ZarrRun(tmp_path).n_samples == manifest["num_samples"]
