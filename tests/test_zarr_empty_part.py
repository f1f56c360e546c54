"""An extraction part of no sample (ceil(N/P) rows a part leaves the last parts empty: 9 rows in 4 parts
are 3, 3, 3, 0) through the Zarr stage: its shard, the manifest, the merge, the readers and verify.
The extraction writes such a part without data files (no batch declared one), so no width."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tiny
from test_workflow import snakemake, write
from actstore.formats import zarr as zs
from actstore.formats.extract import PartWriter, layer_tensor, open_extraction, open_part, write_index, write_part
from actstore.formats.extract.layout import INDEX, part_dirname
from actstore.formats.extract.write import _synthetic_meta, _synthetic_part
from actstore.hashing import stage_dir

LAYERS, DIM = [0, 2], 8


def rows_of(n: int, parts: int, part: int) -> range:
    """The extraction's split (datasets.part_range): ceil(N/P) rows a part, the last ones short or empty."""
    per_part = -(-n // parts)
    return range(min(n, part * per_part), min(n, (part + 1) * per_part))


def empty_tail_extraction(root: Path, n: int = 9, parts: int = 4) -> Path:
    """A text extraction of `n` samples in `parts` parts, the last empty as extract_part writes it:
    offsets, samples.jsonl and part.json alone, sample_range [0, 0]."""
    rng = np.random.default_rng(0)
    lengths = [3 + i % 5 for i in range(n)]
    pool = rng.standard_normal(1 << 12, dtype=np.float32)
    for part in range(parts):
        rows = rows_of(n, parts, part)
        meta = _synthetic_meta(root, part, parts, rows, n, LAYERS, max(lengths))
        with write_part(root / part_dirname(part)) as tmp:
            if rows:
                writer = _synthetic_part(tmp, rows, lengths, LAYERS, DIM, pool, rng, "float32")
            else:
                writer, meta["sample_range"] = PartWriter(tmp, [], np.zeros(1, np.int64)), [0, 0]
            writer.finish(meta)
    write_index(root, root / INDEX)
    return root


@pytest.fixture(scope="module")
def extract_dir(tmp_path_factory) -> Path:
    root = empty_tail_extraction(tmp_path_factory.mktemp("empty-tail") / "extract")
    assert not list((root / "part-0003").glob("layer_*.npy"))  # what the bug report's part holds
    return root


def build(extract_dir: Path, run_dir: Path, merged: bool) -> list[Path]:
    shards = [run_dir / "shards" / zs.shard_name(k) for k in range(4)]
    for k, shard in enumerate(shards):
        zs.write_shard(extract_dir / part_dirname(k), shard, progress=False)
    if merged:
        zs.merge_stores(shards, run_dir / zs.MERGED, progress=False)
    zs.write_manifest(run_dir, shards, run_dir / zs.MERGED if merged else None)
    return shards


def test_the_shard_of_an_empty_part_is_a_store_of_no_sample_that_verifies(extract_dir, tmp_path):
    import zarr

    store = tmp_path / zs.shard_name(3)
    entry = zs.write_shard(extract_dir / "part-0003", store, progress=False)
    assert entry["num_samples"] == 0 and entry["global_index_start"] == 9  # after every sample, as ZarrRun finds it
    assert zs.verify(store) == []
    reader = zs.ZarrStore(store)
    assert reader.n_samples == 0 and reader.layers == LAYERS and len(reader.seq_len) == 0
    with pytest.raises(IndexError):
        reader.read(0, 0)
    acts = zarr.open_consolidated(str(store), mode="r")["arrays/activations"]
    assert acts.shape[0] == 0 and acts[:].size == 0 and min(acts.chunks) >= 1  # the spec: no chunk edge of 0


@pytest.mark.parametrize("merged", [False, True])
def test_a_run_with_an_empty_part_reads_verifies_and_merges(extract_dir, tmp_path, merged):
    run_dir = tmp_path / "run"
    shards = build(extract_dir, run_dir, merged)
    extraction = open_extraction(extract_dir)
    manifest = json.loads((run_dir / zs.MANIFEST).read_text())
    assert [s["global_index_start"] for s in manifest["shards"]] == [0, 3, 6, 9]
    assert manifest["num_samples"] == 9 and manifest["hidden_size"] == DIM
    assert zs.verify(run_dir) == []
    for reader in [zs.ZarrRun(run_dir)] + ([zs.ZarrRun(run_dir, merged=True)] if merged else []):
        assert reader.n_samples == 9 and reader.hidden == DIM
        for part, local, row in extraction.iter_samples():
            for layer in LAYERS:
                want = part.activations(layer_tensor(layer), local).astype(np.float16)
                assert np.array_equal(reader.read(row["sample_idx"], layer), want)
    info = zs.inspect(run_dir)
    assert info["n_examples"] == 9 and info["d_model"] == DIM and info["n_shards"] == 4
    if merged:
        assert zs.ZarrStore(run_dir / zs.MERGED).attrs["hidden_size"] == DIM
        assert zs.verify(run_dir / zs.MERGED) == []
    assert open_part(extract_dir / "part-0003").info.n_samples == 0 and len(shards) == 4


@pytest.mark.slow
def test_the_workflow_validates_a_zarr_run_whose_last_part_is_empty(model_dir, text_jsonl, tmp_path):
    """4 rows in 3 parts (2, 2, 0) through `snakemake validate`: the zarr_shards job of the empty part died on
    the layer file it lacks (the other formats off: this is the zarr stage's test). One run, merged: its
    shard jobs, manifest and validate (which reads the shards) are an unmerged run's, and the merge
    jobs take the empty shard too (a second run, unmerged, held nothing more)."""
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, dataset={"limit": 4},
                              extract={"parts": 3}, zarr={"merged": True}, saev={"enabled": False},
                              pickle={"enabled": False}, lmprobe={"enabled": False})
    snakemake(tmp_path, write(config, tmp_path / "config.yaml"), "validate", timeout=300)
    run_dir = stage_dir(config, "zarr")
    assert zs.verify(run_dir) == []  # the shards, then the merged store
    manifest = json.loads((run_dir / zs.MANIFEST).read_text())
    assert [s["num_samples"] for s in manifest["shards"]] == [2, 2, 0] and manifest["merged"]["num_samples"] == 4
    report = json.loads(next((Path(config["dump_to"]) / "validate").glob("*/report.json")).read_text())
    assert report["formats"]["zarr"]["problems"] == [] and report["formats"]["zarr"]["checked"] > 0
