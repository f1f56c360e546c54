"""Zarr logger review 62: a .zmetadata that lacks a metadata document of the store (zarr.open_consolidated
then cannot open it, or sees other arrays) is named by verify; a float16_overflow_count that is no
whole number is named by verify and the merge, never summed; read_vector refuses a bool token; the
training sampler's batches of two seeds are not the same batches an epoch apart."""
from __future__ import annotations

import hashlib
import json
import shutil
import warnings
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
def shards(tmp_path_factory) -> list[Path]:
    """Two shards (2 layers, hidden 16, 3-20 tokens) of a small synthetic extraction."""
    base = tmp_path_factory.mktemp("review62")
    extract = synthetic_extraction(base / "extract", 100_000, 2, 16, [1, 2], tokens=(3, 20))
    stores = [base / "run" / "shards" / zs.shard_name(k) for k in range(2)]
    for part, store in zip(open_extraction(extract).parts, stores):
        zs.write_shard(part.dir, store, t_chunk=4, progress=False)
    return stores


def _without(store: Path, keys: list[str], delete: bool) -> None:
    """`keys` taken out of `store`'s .zmetadata (and, `delete`, their files too), files.json recorded anew."""
    consolidated = json.loads((store / ".zmetadata").read_text())
    for key in keys:
        del consolidated["metadata"][key]
        if delete:
            (store / key).unlink()
    (store / ".zmetadata").write_text(json.dumps(consolidated))
    files = json.loads((store / FILES_JSON).read_text())
    for key in keys if delete else []:
        del files["files"][key]
    data = (store / ".zmetadata").read_bytes()
    files["files"][".zmetadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (store / FILES_JSON).write_text(json.dumps(files, sort_keys=True, separators=(",", ":")) + "\n")


def _opens_consolidated(store: Path) -> list[str]:
    """The 1-D and activation arrays zarr.open_consolidated sees in `store`, [] when it cannot open it."""
    import zarr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return sorted(zarr.open_consolidated(str(store), mode="r")["arrays"].keys())
        except Exception:  # zarr's own errors (GroupNotFoundError, KeyError): the store does not open
            return []


@pytest.mark.parametrize("keys, delete, named", [
    (["arrays/.zgroup"], False, "arrays/.zgroup: a zarr metadata document"),
    (["arrays/split/.zarray", "arrays/split/.zattrs"], False, "arrays/split/.zarray: a zarr metadata document"),
    ([".zgroup"], True, ".zmetadata: no entry '.zgroup'"),
], ids=["group-listed-on-disk", "array-listed-on-disk", "root-group-gone"])
def test_a_zmetadata_short_of_the_stores_metadata_fails_verify(shards, tmp_path, keys, delete, named):
    """verify compared each .zmetadata entry with its file, never the other way: a .zmetadata short of a
    group (zarr.open_consolidated cannot open the store) or of an array (zarr sees one array fewer than
    a client reading the files) verified clean."""
    store = shutil.copytree(shards[0], tmp_path / "store.zarr")
    arrays = _opens_consolidated(store)
    _without(store, keys, delete)
    assert _opens_consolidated(store) != arrays  # the fault is real to zarr itself
    assert any(named in problem for problem in verify(store))


def _overflow_count(store: Path, count: object) -> None:
    edited(store, ".zattrs", lambda attrs: attrs.update(float16_overflow_count=count))


@pytest.mark.parametrize("count", ["3", 2.5, True])
def test_a_float16_overflow_count_that_is_no_whole_number_fails_verify_and_the_merge(shards, tmp_path, count):
    """The merge summed each shard's float16_overflow_count into the merged attrs: "3" raised a bare
    TypeError, 2.5 made a merged count of 2.5; verify passed the shard."""
    copies = [shutil.copytree(s, tmp_path / "shards" / s.name) for s in shards]
    _overflow_count(copies[1], count)
    assert any("float16_overflow_count=" in problem for problem in verify(copies[1]))
    with pytest.raises(FormatError, match=f"{copies[1]}/.zattrs: float16_overflow_count="):
        zs.merge_stores(copies, tmp_path / "merged", progress=False)
    assert not (tmp_path / "merged").exists()


def test_overflow_counts_of_the_shards_are_summed_into_the_merged_store(shards, tmp_path):
    copies = [shutil.copytree(s, tmp_path / "shards" / s.name) for s in shards]
    _overflow_count(copies[0], 2)
    _overflow_count(copies[1], 5)
    zs.merge_stores(copies, tmp_path / "merged", progress=False)
    assert zs.ZarrStore(tmp_path / "merged").attrs["float16_overflow_count"] == 7
    assert verify(tmp_path / "merged") == []


@pytest.mark.parametrize("token", [True, 1.0])
def test_read_vector_refuses_a_token_that_is_no_integer(shards, token):
    """read_vector(..., token_idx=True) returned a (1, H) array (numpy's boolean index), not token 1's (H,)."""
    with pytest.raises(TypeError, match="token"):
        zs.read_vector(shards[0], 0, 1, token)
    assert zs.read_vector(shards[0], 0, 1, np.int64(1)).shape == (16,)


def _batches(seed: int, epochs: int) -> list[list[tuple[int, int]]]:
    sampler = zs.TrainingPatternSampler(1000, [1, 2, 3, 4], batch_samples=8, num_batches=3, seed=seed)
    return [list(sampler) for _ in range(epochs)]


def test_two_seeds_draw_different_batches_in_every_epoch():
    """Reseeded with seed + epoch, seed 0's second epoch drew seed 1's first epoch's batches, batch for
    batch: runs of seeds 0, 1, 2, ... (replicates) trained on the same batches an epoch apart."""
    first, second = _batches(0, 2), _batches(1, 2)
    assert first[0] != first[1]
    assert all(a != b for a in first for b in second)
    assert _batches(0, 2) == first  # a seed still gives the same batches


@pytest.mark.parametrize("key, value", [("label_names", ["no", "yes"]), ("modality", "image"),
                                        ("model_kind", "decoder")])
def test_shards_of_other_labels_or_modality_are_not_merged(shards, tmp_path, key, value):
    """The merged store takes the first shard's attrs: a shard of other label names (its label ids
    then named by the first shard's), modality or model kind merged silently under them."""
    copies = [shutil.copytree(s, tmp_path / "shards" / s.name) for s in shards]
    edited(copies[1], ".zattrs", lambda attrs: attrs.update({key: value}))
    with pytest.raises(FormatError, match=f"{copies[1]}/.zattrs: {key}="):
        zs.merge_stores(copies, tmp_path / "merged", progress=False)
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("edit", [lambda doc: [], lambda doc: {**doc, "files": list(doc["files"])},
                                  lambda doc: {**doc, "files": {**doc["files"], "arrays/activations/0/0/0/0": 1}}],
                         ids=["list", "files-list", "record-1"])
def test_a_link_job_names_a_shard_files_json_that_is_no_files_object(shards, tmp_path, edit):
    """link_chunks took each chunk's record from the shard's files.json unchecked: a list raised a bare
    TypeError, a record that is no object went into the job record, to fail the finishing job."""
    store = shutil.copytree(shards[0], tmp_path / "shards" / shards[0].name)
    (store / FILES_JSON).write_text(json.dumps(edit(json.loads((store / FILES_JSON).read_text()))))
    with pytest.raises(FormatError, match=f"{store / FILES_JSON}: files"):
        zs.link_chunks([store], tmp_path / "merge-0", 1, 0, progress=False)
    assert not (tmp_path / "merge-0").exists()


def test_a_manifest_num_samples_that_is_no_whole_number_fails_verify(shards, tmp_path):
    """verify compared the manifest's num_samples with the shards' total by Python's ==: 67.0 (or true
    for one sample) passed, though ZarrRun(merged=True) refuses it as another count."""
    run = tmp_path / "run"
    copies = [shutil.copytree(s, run / "shards" / s.name) for s in shards]
    manifest = zs.write_manifest(run, copies)
    assert verify(run) == []
    (run / zs.MANIFEST).write_text(json.dumps({**manifest, "num_samples": float(manifest["num_samples"])}))
    assert any("num_samples=" in problem for problem in verify(run))
