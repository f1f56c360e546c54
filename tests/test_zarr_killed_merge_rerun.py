"""Zarr logger review: a merge finisher killed at any moment of its moves is finished by its rerun; a
shard's damaged start or files.json sizes are named by the merge and the manifest job."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.formats.zarr.layout import FILES_JSON
from actstore.jobs import job_items

EPOCH = "1700000000"  # SOURCE_DATE_EPOCH: the merged store's "created", the same in every run


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    """Three shards (T_chunk 4, 2 layers) of a small synthetic extraction: ~45 samples each."""
    root = tmp_path_factory.mktemp("review55")
    extract = synthetic_extraction(root / "extract", 200_000, 3, 16, [1, 2], tokens=(3, 20))
    paths = [root / zs.shard_name(k) for k in range(3)]
    for part, path in zip(open_extraction(extract).parts, paths):
        zs.write_shard(part.dir, path, t_chunk=4, progress=False)
    return paths


def linked(shards: list[Path], root: Path) -> list[Path]:
    """The workflow's two zarr_merge_chunks jobs by hand."""
    dirs = [root / "scatter" / f"merge-{j}" for j in range(2)]
    for j, d in enumerate(dirs):
        zs.link_chunks([shards[p] for p in job_items(3, 2, j)], d, 2, j, progress=False)
    return dirs


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# The finisher in a fresh interpreter, SIGKILLed at the `kill_at`-th rename of a sample directory
# (counting the renames back after a failure too); `fail` makes files.json's writing fail first.
KILLED_FINISH = """
import json, os, signal, sys
import actstore.formats.zarr.merge as merge
shards, dirs, out, kill_at, fail = json.loads(sys.argv[1])
renames, rename = [], os.rename
def killing_rename(src, dst):
    if "/arrays/activations/" in str(src):
        renames.append(src)
        if len(renames) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    rename(src, dst)
def failing(*_):
    raise OSError("files.json failed")
merge.os.rename = killing_rename
if fail:
    merge._write_merged_files_json = failing
merge.finish_merge(shards, dirs, out, progress=False)
"""


@pytest.mark.parametrize("kill_at, fail", [(2, False), (50, False), (133, False), (140, True)],
                         ids=["second-move", "mid-moves", "last-move", "moving-back"])
def test_a_finish_merge_killed_in_its_moves_is_finished_by_its_rerun(shards, tmp_path, monkeypatch, kill_at, fail):
    """A kill (a job's time or memory limit) during the moves, or while they are renamed back after
    a failure, left the moved sample directories in the finisher's temp of the merged store, and
    every rerun refused the chunk dirs (those samples missing) until the link jobs were rerun."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    zs.merge_stores(shards, tmp_path / "ref" / zs.MERGED, progress=False)
    dirs = linked(shards, tmp_path)
    out = tmp_path / "run" / zs.MERGED
    args = json.dumps([[str(s) for s in shards], [str(d) for d in dirs], str(out), kill_at, fail])
    killed = subprocess.run([sys.executable, "-c", KILLED_FINISH, args], capture_output=True, text=True, timeout=120,
                    env={**os.environ, "SOURCE_DATE_EPOCH": EPOCH})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{zs.MERGED}.")]  # its temp, moves in it
    zs.finish_merge(shards, dirs, out, progress=False)
    assert tree(out) == tree(tmp_path / "ref" / zs.MERGED)
    assert zs.verify(out) == [] and [p.name for p in out.parent.iterdir()] == [zs.MERGED]


def test_a_sample_directory_in_a_killed_finishers_temp_goes_back_only_as_the_shards_files(shards, tmp_path):
    """One holding a file that is not the link job's (a new file of the chunk's size) is left to the
    sweep: taken back, it would be merged under the record of the shard's bytes, no byte of it hashed."""
    dirs = linked(shards, tmp_path)
    moved = dirs[0] / zs.ACTS / "3"
    stale = tmp_path / "run" / f".{zs.MERGED}.abcd1234.tmp" / zs.ACTS
    stale.mkdir(parents=True)
    os.rename(moved, stale / "3")  # as a killed finisher left it
    chunk = stale / "3" / "0" / "0" / "0"
    size = chunk.stat().st_size
    chunk.unlink()
    chunk.write_bytes(bytes(size))  # then replaced by a new file of its size
    with pytest.raises(FormatError, match=f"merge-0/{zs.ACTS}/3/0/0/0: missing"):
        zs.finish_merge(shards, dirs, tmp_path / "run" / zs.MERGED, progress=False)
    assert not moved.exists()


def with_attrs(store: Path, out: Path, edit) -> Path:
    """A copy of `store` whose .zattrs, and its entry in .zmetadata, are edited alike (a store damaged,
    or written by another tool, consistently)."""
    out = Path(shutil.copytree(store, out))
    attrs = json.loads((out / ".zattrs").read_text())
    edit(attrs)
    (out / ".zattrs").write_text(json.dumps(attrs))
    consolidated = json.loads((out / ".zmetadata").read_text())
    consolidated["metadata"][".zattrs"] = attrs
    (out / ".zmetadata").write_text(json.dumps(consolidated))
    return out


@pytest.mark.parametrize("edit", [lambda a: a.pop("global_index_start"),
                                  lambda a: a.update(global_index_start=float(a["global_index_start"])),
                                  lambda a: a.update(global_index_start=str(a["global_index_start"]))],
                         ids=["missing", "float", "string"])
def test_a_shards_start_that_is_no_whole_number_is_named_before_the_merge_links_a_chunk(shards, tmp_path, edit):
    """A float start linked every chunk as arrays/activations/45.0/..., in silence; a missing one raised
    a bare KeyError, a string a TypeError."""
    shard = with_attrs(shards[1], tmp_path / shards[1].name, edit)
    with pytest.raises(FormatError, match=re.escape(f"{shard}/.zattrs: ") + ".*global_index_start"):
        zs.link_chunks([shard], tmp_path / "merge-1", 2, 1, progress=False)
    assert not (tmp_path / "merge-1").exists()


@pytest.mark.parametrize("damage, named", [
    ("attrs", r"/\.zattrs: \{'num_samples': \d+, 'global_index_start': None\}, expected whole numbers"),
    ("bytes", r"/meta/files\.json: files\['text/prompts\.jsonl'\] must be an object with a whole number of bytes"),
], ids=["attrs", "bytes"])
def test_the_manifest_job_names_a_shard_field_damaged_since_its_job(shards, tmp_path, damage, named):
    """store_entry takes each shard's counts and files.json sizes: a missing start raised a bare KeyError,
    a size given as a string a TypeError, neither naming the shard."""
    store = Path(shutil.copytree(shards[0], tmp_path / shards[0].name))
    if damage == "attrs":
        attrs = json.loads((store / ".zattrs").read_text())
        del attrs["global_index_start"]
        (store / ".zattrs").write_text(json.dumps(attrs))
    else:
        files = json.loads((store / FILES_JSON).read_text())
        files["files"]["text/prompts.jsonl"]["bytes"] = "12"
        (store / FILES_JSON).write_text(json.dumps(files))
    with pytest.raises(FormatError, match=named):
        zs.write_manifest(tmp_path, [store])
    assert not (tmp_path / zs.MANIFEST).exists()
