"""Zarr activation logger: shards, manifest, merge, fast raw reader vs plain zarr, corruption."""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from actstore import casts
from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import PartWriter, layer_tensor, open_extraction, open_part, tensor_file, write_part
from actstore.formats.zarr import merge as zarr_merge
from actstore.formats.zarr.layout import FILES_JSON, acts_chunk_key, files_json_text
from actstore.formats.zarr.read import list_store_files
from actstore.integrity import file_record
from actstore.jobs import job_items
from tiny import traced_peak


GIT_COMMIT = "0123456789abcdef0123456789abcdef01234567"  # what the zarr_shards script passes in


def build_run(extract_dir, run_dir, t_chunk=None, merged=True):
    """The workflow's zarr stage by hand: one shard per part, optional merge, manifest last."""
    extraction = open_extraction(extract_dir)
    shards = [zs.write_shard(p.dir, run_dir / "shards" / zs.shard_name(k), t_chunk, git_commit=GIT_COMMIT,
                             progress=False)
              for k, p in enumerate(extraction.parts)]
    paths = [run_dir / "shards" / s["path"] for s in shards]
    merged_path = run_dir / zs.MERGED if merged else None
    if merged:
        zs.merge_stores(paths, merged_path, progress=False)
    zs.write_manifest(run_dir, paths, merged_path)
    return extraction


@pytest.fixture(scope="module")
def bert_run(extracted, tmp_path_factory):
    config, extract_dir = extracted("bert")
    run_dir = tmp_path_factory.mktemp("zarr") / "run"
    return build_run(extract_dir, run_dir, t_chunk=8), run_dir


def test_every_sample_and_layer_equals_extraction(bert_run):
    extraction, run_dir = bert_run
    reader = zs.ZarrRun(run_dir)
    assert reader.n_samples == extraction.n_samples == 30
    assert reader.layers == [0, 2]
    assert len(reader.stores) == 2 and reader.stores[0].t_chunk == 8 and reader.stores[0].n_chunks == 3
    for part, local, row in extraction.iter_samples():
        for layer in (0, 2):
            x = reader.read(row["sample_idx"], layer)
            want = part.activations(layer_tensor(layer), local)
            assert x.dtype == np.float16 and x.shape == want.shape == (row["num_tokens"], want.shape[1])
            assert reader.seq_len(row["sample_idx"]) == row["num_tokens"]
            # float16 rounding of the float32 extraction, to the bit
            np.testing.assert_array_equal(x, want.astype(np.float16))


def test_plain_zarr_client_reads_same_values(bert_run):
    import zarr
    extraction, run_dir = bert_run
    manifest = json.loads((run_dir / zs.MANIFEST).read_text())
    assert [s["global_index_start"] for s in manifest["shards"]] == [p.sample_start for p in extraction.parts]
    for entry in manifest["shards"]:
        store_path = run_dir / entry["path"]
        group = zarr.open_consolidated(str(store_path), mode="r")
        fast = zs.ZarrStore(store_path)
        acts = group["arrays/activations"]
        assert acts.shape == (entry["num_samples"], 2, 24, fast.hidden) and acts.dtype == np.float16
        assert acts.chunks == (1, 1, 8, fast.hidden)
        np.testing.assert_array_equal(group["arrays/seq_len"][:], fast.seq_len)
        assert group.attrs["layers"] == [0, 2] and group.attrs["T_max"] == 24
        assert group.attrs["git_commit"] == GIT_COMMIT
        for i in range(entry["num_samples"]):
            n = int(group["arrays/seq_len"][i])
            for l, layer in enumerate(fast.layers):
                np.testing.assert_array_equal(acts[i, l, :n], fast.read(i, layer))
                assert not acts[i, l, n:].any()  # zero padding past seq_len
        keys = group["arrays/sample_key"][:]
        prompts = [json.loads(line) for line in (store_path / "text" / "prompts.jsonl").open()]
        assert [k.decode() for k in keys] == [p["sample_key"] for p in prompts]
        part = extraction.parts[manifest["shards"].index(entry)]
        assert [p["prompt"] for p in prompts] == [r["text"] for r in part.samples]
        np.testing.assert_array_equal(group["arrays/label"][:], [r["label_id"] for r in part.samples])


def test_merged_store_equals_shards(bert_run):
    import zarr
    extraction, run_dir = bert_run
    shards, merged = zs.ZarrRun(run_dir), zs.ZarrRun(run_dir, merged=True)
    assert len(merged.stores) == 1 and merged.n_samples == shards.n_samples
    for i in range(shards.n_samples):
        for layer in (0, 2):
            np.testing.assert_array_equal(merged.read(i, layer), shards.read(i, layer))
    group = zarr.open_consolidated(str(run_dir / zs.MERGED), mode="r")
    np.testing.assert_array_equal(group["arrays/sample_idx"][:], np.arange(30))
    np.testing.assert_array_equal(group["arrays/activations"][17, 1, :5], shards.read(17, 2)[:5])
    assert zs.verify(run_dir) == []
    assert zs.verify(run_dir / zs.MERGED) == []


def test_reader_touches_only_the_requested_chunks(bert_run, tmp_path):
    _, run_dir = bert_run
    store = tmp_path / "s.zarr"
    shutil.copytree(run_dir / "shards" / "shard-0000.zarr", store)
    full = zs.ZarrStore(store)
    i, layer = 3, 2
    expected = full.read(i, layer)
    n_chunks = -(-expected.shape[0] // full.t_chunk)
    acts = store / zs.ACTS
    for sample_dir in acts.iterdir():  # delete every chunk except the ones (i, layer) needs
        if sample_dir.is_dir() and sample_dir.name != str(i):
            shutil.rmtree(sample_dir)
    shutil.rmtree(acts / str(i) / "0")
    for c in range(n_chunks, full.n_chunks):
        (acts / str(i) / "1" / str(c) / "0").unlink()
    np.testing.assert_array_equal(zs.ZarrStore(store).read(i, layer), expected)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "extra"])
def test_corruption_is_detected(bert_run, tmp_path, damage):
    _, run_dir = bert_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    chunk = run / "shards" / "shard-0001.zarr" / zs.ACTS / "4" / "1" / "0" / "0"
    if damage == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:-2])
        with pytest.raises(FormatError, match="bytes, expected"):
            zs.ZarrRun(run).read(zs.ZarrRun(run).stores[1].attrs["global_index_start"] + 4, 2)
    elif damage == "flip":
        raw = bytearray(chunk.read_bytes())
        raw[100] ^= 0xFF
        chunk.write_bytes(bytes(raw))
    elif damage == "delete":
        chunk.unlink()
    else:
        (chunk.parent / "1").write_bytes(b"x")
    problems = zs.verify(run)
    assert problems and any("shard-0001.zarr/arrays/activations/4/1/0" in p for p in problems), problems


def test_zmetadata_names_are_read_only_inside_the_store_and_only_as_metadata(bert_run, tmp_path):
    """.zmetadata's keys are names read from metadata: one leading outside (climbing, absolute, or
    through a link), one that is not a zarr metadata document (/dev/zero would be read forever), or
    one naming a FIFO inside the store (reading it would block) is named by verify, never read; a
    .zmetadata whose metadata is not an object is refused by the reader, naming it."""
    import os

    _, run_dir = bert_run
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".zattrs").write_text("{}")
    os.mkfifo(outside / "fifo")
    cases = {"../../outside/.zattrs": "is not a relative path inside", str(outside / ".zattrs"): "is not a relative path",
             "linked/.zattrs": "a link to", "/dev/zero": "is not a relative path",
             "arrays/activations/0/0/0/0": "is not a zarr metadata name", "queue/.zattrs": "not a regular file"}
    for key, message in cases.items():
        store = tmp_path / "s.zarr"
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(run_dir / "shards" / "shard-0000.zarr", store)
        if key.startswith("linked"):  # a link out is named before anything is read (integrity.links_out)
            (store / "linked").symlink_to(outside, target_is_directory=True)
        (store / "queue").mkdir()
        os.mkfifo(store / "queue" / ".zattrs")
        meta = json.loads((store / ".zmetadata").read_text())
        meta["metadata"][key] = {}
        (store / ".zmetadata").write_text(json.dumps(meta))
        problems = zs.verify(store)
        named = "linked" if key.startswith("linked") else key
        assert any(message in p and named in p for p in problems), (key, problems)
    (store / ".zmetadata").write_text(json.dumps({"metadata": None}))
    with pytest.raises(FormatError, match=r"\.zmetadata: not consolidated metadata"):
        zs.ZarrStore(store)


@pytest.mark.parametrize("key, value", [("layers", [0, 10 ** 30]), ("hidden_size", -1), ("T_chunk", 7), ("T_max", 1),
                                        ("num_layers", 9), ("dtype", "float32"), ("schema_version", "0.0"),
                                        ("model_id", "another"),
                                        ("layers", [False, 2]), ("hidden_size", 32.0)])  # == the store's, not as JSON
def test_a_manifest_that_misstates_its_stores_is_named_and_refused(bert_run, key, value, tmp_path):
    """manifest.json's run-wide fields are what the run reader uses (a wrong layer list made it answer
    "not stored"): each is checked against every store's own, by verify and on opening."""
    _, run_dir = bert_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    manifest = json.loads((run / zs.MANIFEST).read_text())
    manifest[key] = value
    (run / zs.MANIFEST).write_text(json.dumps(manifest))
    message = rf"{zs.MANIFEST}: {key}={re.escape(f'{value!r:.60}')}, but .*(shard-0000\.zarr|merged) holds"
    assert any(re.search(message, p) for p in zs.verify(run)), zs.verify(run)
    with pytest.raises(FormatError, match=message):
        zs.open_zarr(run)


def copied_run(bert_run, tmp_path, edit):
    """A copy of bert_run's run (two shards of 15 samples, merged) with its manifest edited by `edit`."""
    _, run_dir = bert_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    manifest = json.loads((run / zs.MANIFEST).read_text())
    edit(manifest)
    (run / zs.MANIFEST).write_text(json.dumps(manifest))
    return run


@pytest.mark.parametrize("edit, named", [
    (lambda m: m.update(shards=float("nan")), r"not valid JSON \(NaN is not a JSON number\)"),
    (lambda m: m["shards"][0].update(bytes=[]), r"shards\[0\]: n_files and bytes must be whole numbers"),
    (lambda m: m["shards"][0].update(n_files=m["shards"][0]["n_files"] + 1), r"meta/files.json records \d+ files, "
                                                                             r"manifest.json says \d+"),
    (lambda m: m["shards"][0].update(bytes=m["shards"][0]["bytes"] - 1), r"meta/files.json records \d+ bytes"),
])
def test_a_manifest_entry_of_the_wrong_type_or_count_is_named(bert_run, tmp_path, edit, named):
    """The manifest's store entries: their counts are whole numbers and what the store's files.json
    records (verify); a manifest inspect cannot read is refused naming it, never a Python error."""
    run = copied_run(bert_run, tmp_path, edit)
    assert any(re.search(named, p) for p in zs.verify(run)), zs.verify(run)
    try:
        zs.inspect(run)
    except FormatError as exc:
        assert zs.MANIFEST in str(exc)


@pytest.mark.parametrize("field, value", [("dtype", "O"), ("dtype", "bogus"), ("dtype", None), ("chunks", [0]),
                                          ("chunks", "x")])
def test_a_per_sample_arrays_dtype_or_chunks_it_cannot_read_is_named(bert_run, tmp_path, field, value):
    """seq_len's .zarray decides how its chunks are read: an object or unknown dtype, or chunks that
    are not [samples per chunk], are refused naming the array (was a KeyError, or numpy's error)."""
    _, run_dir = bert_run
    store = tmp_path / "s.zarr"
    shutil.copytree(run_dir / "shards" / "shard-0000.zarr", store)
    meta = json.loads((store / ".zmetadata").read_text())
    zarray = meta["metadata"]["arrays/seq_len/.zarray"]
    zarray.pop(field) if value is None else zarray.update({field: value})
    (store / ".zmetadata").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=r"arrays/seq_len/\.zarray: dtype=.* chunks=.*expected a numeric"):
        zs.ZarrStore(store)


def test_tampered_metadata_is_refused(bert_run, tmp_path):
    _, run_dir = bert_run
    store = tmp_path / "s.zarr"
    shutil.copytree(run_dir / "shards" / "shard-0000.zarr", store)
    (store / ".snakemake_timestamp").touch()  # Snakemake's directory() marker is not part of the store
    assert zs.verify(store) == []
    meta = json.loads((store / ".zmetadata").read_text())
    meta["metadata"][f"{zs.ACTS}/.zarray"]["compressor"] = {"id": "zstd"}
    (store / ".zmetadata").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match="compressor"):
        zs.ZarrStore(store)
    assert any(".zmetadata" in p for p in zs.verify(store))
    manifest = json.loads((run_dir / zs.MANIFEST).read_text())
    manifest["shards"][0]["files_sha256"] = "0" * 64
    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    (bad / zs.MANIFEST).write_text(json.dumps(manifest))
    assert any("differs from manifest.json" in p for p in zs.verify(bad))
    assert zs.verify(tmp_path / "nothing") and not zs.detect(tmp_path / "nothing")


def test_files_json_is_checked_in_name_order_naming_what_is_wrong(bert_run, tmp_path):
    """verify walks files.json beside the store and the chunk keys, all in name order: an entry
    dropped, one leading outside, a listing out of order are each named."""
    _, run_dir = bert_run
    store = tmp_path / "s.zarr"
    shutil.copytree(run_dir / "shards" / "shard-0000.zarr", store)
    files = json.loads((store / FILES_JSON).read_text())["files"]
    dropped = f"{zs.ACTS}/10/1/0/0"
    (store / FILES_JSON).write_text(files_json_text({k: v for k, v in files.items() if k != dropped}))
    assert set(zs.verify(store)) == {f"{store}/{zs.ACTS}: 1 chunk files not recorded, e.g. {dropped}",
                                     f"{store / dropped}: not listed in {FILES_JSON}"}
    (store / FILES_JSON).write_text(files_json_text({**files, "../outside": files[dropped]}))
    assert [p for p in zs.verify(store) if "outside" in p] == \
        [f"{store / FILES_JSON}: '../outside' is not a relative path inside {store}"]
    doc = {"files": dict(reversed(files.items())), "format": "actstore-zarr-activation-logger", "schema_version": 1}
    (store / FILES_JSON).write_text(json.dumps(doc))
    assert any("out of name order" in p for p in zs.verify(store))


def test_cli_functions(bert_run):
    extraction, run_dir = bert_run
    assert zs.detect(run_dir) and zs.detect(run_dir / "shards" / "shard-0000.zarr")
    info = zs.inspect(run_dir)
    assert info["format"] == zs.FORMAT_NAME and info["layers"] == [0, 2] and info["n_examples"] == 30
    assert info["n_tokens"] == extraction.n_tokens and info["n_shards"] == 2 and info["dtype"] == "float16"
    assert info["merged"] and info["bytes"] > 30 * 2 * 24 * info["d_model"] * 2
    want = extraction.activations("layer_2", 21)[5]
    got = zs.read_vector(run_dir, 21, 2, 5)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2 ** -10, atol=1e-6)
    assert zs.read_vector(run_dir, 21, 1, 0) is None
    with pytest.raises(IndexError):
        zs.read_vector(run_dir, 21, 2, 1000)


def test_dataloader_workers_training_pattern(bert_run):
    extraction, run_dir = bert_run
    dataset = zs.ZarrActivationDataset(run_dir)
    assert len(dataset) == 60
    sampler = zs.TrainingPatternSampler(dataset.n_samples, dataset.layers, batch_samples=4, num_batches=3, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2,
                                         collate_fn=zs.collate_padded, multiprocessing_context="fork")
    keys = list(zs.TrainingPatternSampler(dataset.n_samples, dataset.layers, 4, num_batches=3, seed=1))
    batches = list(loader)
    assert len(batches) == 3
    for batch_keys, (padded, lengths) in zip(keys, batches):
        assert len(batch_keys) == 8 and len({i for i, _ in batch_keys}) == 4
        assert all(batch_keys[2 * j][1] != batch_keys[2 * j + 1][1] for j in range(4))  # 2 distinct layers
        for row, (i, layer) in enumerate(batch_keys):
            want = extraction.activations(layer_tensor(layer), i).astype(np.float16)
            assert lengths[row] == want.shape[0]
            np.testing.assert_array_equal(padded[row, : want.shape[0]].numpy(), want)
    x = dataset[7]  # int key = (7 // L, layers[7 % L])
    np.testing.assert_array_equal(x.numpy(), extraction.activations("layer_2", 3).astype(np.float16))


def test_chunk_choice_and_vision(extracted, tmp_path):
    assert zs.choose_t_chunk(2048, 4096) == 128  # 1 MiB chunks
    assert zs.choose_t_chunk(128, 384) == 128 and zs.choose_t_chunk(24, 384, 100) == 24
    config, extract_dir = extracted("dinov2")
    extraction = build_run(extract_dir, tmp_path / "run", merged=False)
    reader = zs.ZarrRun(tmp_path / "run")
    store = reader.stores[0]
    assert "prompt_len" not in store.vector_names and store.attrs["modality"] == "image"
    for part, local, row in extraction.iter_samples():
        np.testing.assert_array_equal(reader.read(row["sample_idx"], 2),
                                      part.activations("layer_2", local).astype(np.float16))
    assert zs.verify(tmp_path / "run") == []


@pytest.fixture(scope="module")
def three_shards(extracted, tmp_path_factory):
    """Shards of a 3-part extraction (the merge's unit of work)."""
    _, extract_dir = extracted("bert", extract={"parts": 3})
    shards = tmp_path_factory.mktemp("zarr3") / "shards"
    for k, part in enumerate(open_extraction(extract_dir).parts):
        zs.write_shard(part.dir, shards / zs.shard_name(k), 8, git_commit=GIT_COMMIT, progress=False)
    return [shards / zs.shard_name(k) for k in range(3)]


def scattered_chunks(shards, root, jobs):
    """The workflow's zarr_merge_chunks jobs by hand: job j links its contiguous shards."""
    dirs = [root / "scatter" / f"merge-{j}" for j in range(jobs)]
    for j, d in enumerate(dirs):
        zs.link_chunks([shards[p] for p in job_items(len(shards), jobs, j)], d, jobs, j, progress=False)
    return dirs


def tree_bytes(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("jobs", [2, 5])
def test_scattered_merge_equals_one_job_merge(three_shards, tmp_path, monkeypatch, jobs):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # the merged store's "created"
    zs.merge_stores(three_shards, tmp_path / "one" / zs.MERGED, progress=False)
    dirs = scattered_chunks(three_shards, tmp_path, jobs)
    zs.finish_merge(three_shards, dirs, tmp_path / "scattered" / zs.MERGED, progress=False)
    one, scattered = tree_bytes(tmp_path / "one" / zs.MERGED), tree_bytes(tmp_path / "scattered" / zs.MERGED)
    assert len(one) > 30 * 2 * 3 and scattered.keys() == one.keys()
    assert [rel for rel in one if scattered[rel] != one[rel]] == []
    assert zs.verify(tmp_path / "scattered" / zs.MERGED) == []
    # files.json, streamed in name order (sample 10 before 2), is the text of every other file's record
    store = tmp_path / "scattered" / zs.MERGED
    listed = {rel: file_record(store / rel) for rel in list_store_files(store) if rel != FILES_JSON}
    assert scattered[FILES_JSON].decode() == files_json_text(listed)
    assert [p.name for p in (tmp_path / "one").iterdir()] == [zs.MERGED]  # merge_stores' scratch is gone


def test_merged_chunks_are_the_shards_files_and_a_zarr_write_to_one_leaves_the_other(three_shards, tmp_path):
    """The merge links each chunk file (no byte copied, no disk space used twice); zarr writes a chunk
    by replacing its file, so writing through the merged store leaves the shard as it was."""
    import os

    import zarr
    shards = [shutil.copytree(s, tmp_path / "shards" / s.name) for s in three_shards]  # this test writes
    merged = tmp_path / zs.MERGED
    zs.merge_stores(shards, merged, progress=False)
    g = zs.ZarrStore(shards[1]).attrs["global_index_start"]  # shard 1's first sample, in the merged store
    shard_chunk, merged_chunk = shards[1] / acts_chunk_key(0, 1, 0), merged / acts_chunk_key(g, 1, 0)
    assert os.stat(shard_chunk).st_ino == os.stat(merged_chunk).st_ino and os.stat(shard_chunk).st_nlink == 2
    before = shard_chunk.read_bytes()
    zarr.open_group(str(merged), mode="r+")["arrays/activations"][g, 1, 0, :] = 7.0
    assert shard_chunk.read_bytes() == before and merged_chunk.read_bytes() != before
    assert zs.verify(shards[1]) == [] and any(acts_chunk_key(g, 1, 0) in p for p in zs.verify(merged))


@pytest.mark.parametrize("damage", ["chunk dir", "record", "job.json", "job order", "shards", "after the moves"])
def test_finish_merge_refuses_incomplete_chunks_and_leaves_them_whole(three_shards, tmp_path, monkeypatch, damage):
    dirs = scattered_chunks(three_shards, tmp_path, 2)
    record = dirs[1] / "job.json"
    last = json.loads(record.read_text())
    g = max(int(k.split("/")[2]) for k in last["files"])  # the last sample, in the second job
    if damage == "chunk dir":
        shutil.rmtree(dirs[1] / zs.ACTS / str(g))
        match = f"merge-1/{zs.ACTS}/{g}/0/0/0: missing \\(listed in .*merge-1/job.json\\)"
    elif damage == "record":
        del last["files"][f"{zs.ACTS}/{g}/1/2/0"]
        record.write_text(json.dumps(last))
        match = f"merge-1/job.json: no entry for {zs.ACTS}/{g}/1/2/0"
    elif damage == "job.json":
        record.unlink()
        match = "merge-1/job.json: missing"
    elif damage == "job order":
        dirs.reverse()
        match = "merge-1/job.json: the record of job 1 of 2, given as job 0 of 2"
    elif damage == "shards":
        record.write_text(json.dumps({**last, "shards": [zs.shard_name(0)]}))
        match = "merge-1/job.json: linked shards .*, job 1 of 2 takes"
    else:  # every check passed and every sample directory moved: they are moved back
        def fail(*_):
            raise FormatError("files.json failed")
        monkeypatch.setattr(zarr_merge, "_write_merged_files_json", fail)
        match = "files.json failed"
    before = tree_bytes(dirs[0])
    out = tmp_path / zs.MERGED
    with pytest.raises(FormatError, match=match):
        zs.finish_merge(three_shards, dirs, out, progress=False)
    assert not out.exists() and list(tmp_path.glob(f".{zs.MERGED}*")) == []
    assert tree_bytes(dirs[0]) == before  # the sample directories already moved were moved back


@pytest.mark.parametrize("c_casts", [True, False])
def test_float16_overflow_counted_and_stored_as_inf(tmp_path, monkeypatch, c_casts):
    """Values past float16's range (65504; 65520 and up round to inf) are +-inf and counted; float32
    infinities are stored as they are and not counted; everything else, NaNs too, as numpy casts it;
    with the C casts and without."""
    if not c_casts:
        monkeypatch.setattr(casts, "_casts", None)
    x = np.random.default_rng(0).standard_normal((2 * 5, 16)).astype(np.float32)
    x[1, :4] = [65504, 65519, 65520, -1e6]  # two overflow
    x[7, 0], x[7, 1], x[8, 5], x[9, 9] = np.inf, -np.inf, 3e38, np.nan  # one more overflow
    x.view(np.uint32)[9, 10] = 0x7F8CFC76  # a signalling NaN: numpy keeps its payload (0x7C67)
    part = synthetic_part(tmp_path / "part-0000", x, [5, 5])
    zs.write_shard(part, tmp_path / "shard.zarr", t_chunk=2, git_commit=GIT_COMMIT, progress=False)
    store = zs.ZarrStore(tmp_path / "shard.zarr")
    assert store.attrs["float16_overflow_count"] == 3
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = np.concatenate([store.read(i, 0) for i in range(2)])
    assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()  # to the bit, NaN included
    np.testing.assert_array_equal(np.isinf(got[1, :4]), [False, False, True, True])


def synthetic_part(out, x, lengths, dtype="float32"):
    """An extraction part of one layer holding the rows `x` stored in `dtype` (float32, float16, or
    bfloat16 as its bits), samples of `lengths` tokens."""
    x = casts.to_bfloat16_bits(x) if dtype == "bfloat16" else x.astype(dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = [{"sample_idx": i, "text": f"t{i}", "label": None, "label_id": -1, "num_tokens": n, "metadata": {}}
            for i, n in enumerate(lengths)]
    with write_part(out) as tmp:
        writer = PartWriter(tmp, rows, offsets)
        writer.add_tokens(tensor_file(layer_tensor(0)), x.shape[1], dtype)
        for i in range(len(lengths)):
            writer.write(tensor_file(layer_tensor(0)), i, x[offsets[i]:offsets[i + 1]])
        writer.finish({"part": 0, "parts": 1, "sample_range": [0, len(lengths)], "n_dataset_samples": len(lengths),
                       "tensors": [layer_tensor(0)], "layers": [0], "hooks": [], "modality": "text",
                       "model_kind": "encoder", "max_seq_length": max(lengths), "batch_size": 1, "logits_topk": None,
                       "model": {"name": "synthetic", "path": "-", "architecture": "-", "n_blocks": 1},
                       "dataset": {"name": "synthetic", "path": "-", "split": "train", "labels": []}})
    return out


def test_a_chunk_that_cannot_be_written_names_its_file_and_leaves_no_shard(tmp_path):
    """Disk full, simulated with RLIMIT_FSIZE below one chunk (512 KiB) but above the metadata: the
    error comes from a thread writing the chunks behind the casts, names the chunk file, and the
    shard store is not left behind, whole or half."""
    import subprocess
    import sys
    x = np.random.default_rng(0).standard_normal((2 * 64, 4096)).astype(np.float32)
    part = synthetic_part(tmp_path / "part-0000", x, [64, 64])
    out = tmp_path / "shard.zarr"
    code = ("import resource; from actstore.formats import zarr\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
            f"zarr.write_shard({str(part)!r}, {str(out)!r}, t_chunk=64, git_commit='0' * 40, progress=False)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert re.search(r"OSError: \[Errno 27\] \S+/arrays/activations/[01]/0/0/0: File too large", proc.stderr), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-0000"]


def test_a_shard_is_the_same_bytes_whatever_its_writing_threads(tmp_path, monkeypatch, caplog):
    """Chunk files finish in any order across threads: the store's bytes (meta/files.json included)
    are the same for 1 and 3 threads, and without the C casts, and every chunk holds its sample's
    float16 rows. The job's log
    counts the chunk files and says where their threads' seconds went."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    lengths = [5, 1, 7, 3, 8, 2]
    x = np.random.default_rng(1).standard_normal((sum(lengths), 16)).astype(np.float32)
    part = synthetic_part(tmp_path / "part-0000", x, lengths)
    stores = {t: tmp_path / f"shard-{t}.zarr" for t in (1, 3)}
    for threads, store in stores.items():
        with caplog.at_level(logging.INFO, logger="actstore.formats.zarr.write"):
            zs.write_shard(part, store, t_chunk=2, git_commit=GIT_COMMIT, progress=False, threads=threads)
        chunks = sum(1 for f in (store / "arrays" / "activations").rglob("*") if f.is_file() and f.name == "0")
        assert chunks == sum(-(-n // 2) for n in lengths)
        assert re.search(rf"{chunks} chunk files of 64 bytes in \S+ s by {threads} threads; their seconds: "
                         r"file [\d.]+, hash [\d.]+$", caplog.messages[-1])
    assert tree_bytes(stores[1]) == tree_bytes(stores[3])
    monkeypatch.setattr(casts, "_casts", None)  # the chunk files as the writer makes them without its C casts
    zs.write_shard(part, tmp_path / "numpy.zarr", t_chunk=2, git_commit=GIT_COMMIT, progress=False, threads=3)
    assert tree_bytes(tmp_path / "numpy.zarr") == tree_bytes(stores[3])
    store, starts = zs.ZarrStore(stores[3]), np.cumsum([0] + lengths)
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(store.read(i, 0), x[starts[i]:starts[i] + n].astype(np.float16))
    assert zs.verify(stores[3]) == []


@pytest.mark.parametrize("narrow", ["float16", "bfloat16"])
def test_a_16bit_part_is_stored_as_its_bits(tmp_path, monkeypatch, narrow):
    """A part stored float16 (a float16 model's, extract.storage_dtype auto) is read into the chunks
    as stored, not through float32, and a bfloat16 one (a bf16 model's) widened exactly: its shard's
    bytes equal those of the same values stored float32 and cast by the writer, infinities and NaN
    included, with no overflow counted."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    lengths = [5, 1, 7, 3, 8, 2]
    x = np.random.default_rng(3).standard_normal((sum(lengths), 16)).astype(np.float32)
    x[2, :3] = [np.inf, -np.inf, np.nan]
    x = (x.astype(np.float16).astype(np.float32) if narrow == "float16"
         else casts.bfloat16_bits_to_float32(casts.to_bfloat16_bits(x)))  # values the narrow dtype holds
    stores = {}
    for dtype in ("float32", narrow):
        part = synthetic_part(tmp_path / dtype / "part-0000", x, lengths, dtype)
        assert open_part(part).tensor(layer_tensor(0)).stored_dtype == dtype
        stores[dtype] = tmp_path / f"shard-{dtype}.zarr"
        zs.write_shard(part, stores[dtype], t_chunk=2, git_commit=GIT_COMMIT, progress=False, threads=2)
    assert tree_bytes(stores[narrow]) == tree_bytes(stores["float32"])
    assert "float16_overflow_count" not in json.loads((stores[narrow] / ".zattrs").read_text())
    assert zs.verify(stores[narrow]) == []


def test_only_the_chunks_holding_tokens_are_files_and_zarr_reads_zeros_past_them(tmp_path, monkeypatch):
    """A sample's chunks past its tokens hold only the fill value: they have no file (zarr leaves an
    empty chunk out), zarr-python reads them as zeros, and verify expects exactly the others. A shard
    written before (every chunk a file, the padding recorded in files.json) still verifies, and its
    merged store leaves the padding out."""
    import zarr
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    lengths = [5, 1, 7, 3, 8, 2]
    x = np.random.default_rng(2).standard_normal((sum(lengths), 16)).astype(np.float32)
    part = synthetic_part(tmp_path / "part-0000", x, lengths)
    store = tmp_path / "shards" / zs.shard_name(0)
    zs.write_shard(part, store, t_chunk=2, git_commit=GIT_COMMIT, progress=False)
    chunks = sorted(rel for rel in list_store_files(store) if rel.count("/") == 5)  # arrays/activations/i/l/c/0
    assert chunks == sorted(acts_chunk_key(i, 0, c) for i, n in enumerate(lengths) for c in range(-(-n // 2)))
    acts, starts = zarr.open_consolidated(str(store), mode="r")["arrays/activations"], np.cumsum([0] + lengths)
    padded = np.zeros((len(lengths), 1, 8, 16), np.float16)
    for i, n in enumerate(lengths):
        padded[i, 0, :n] = x[starts[i]:starts[i] + n]
    np.testing.assert_array_equal(acts[:], padded)
    assert zs.verify(store) == []
    (store / chunks[0]).unlink()
    assert zs.verify(store) == [f"{store / chunks[0]}: missing (listed in {FILES_JSON})"]
    zs.write_shard(part, store, t_chunk=2, git_commit=GIT_COMMIT, progress=False)
    # as shards were written before: every chunk a file, each padding chunk zeros and recorded
    files = json.loads((store / FILES_JSON).read_text())["files"]
    for i, n in enumerate(lengths):
        for c in range(-(-n // 2), 4):
            (store / acts_chunk_key(i, 0, c)).parent.mkdir(parents=True)
            (store / acts_chunk_key(i, 0, c)).write_bytes(bytes(2 * 16 * 2))
            files[acts_chunk_key(i, 0, c)] = file_record(store / acts_chunk_key(i, 0, c))
    (store / FILES_JSON).write_text(files_json_text(files))
    assert zs.verify(store) == []
    merged = tmp_path / zs.MERGED
    zs.merge_stores([store], merged, progress=False)
    assert sorted(rel for rel in list_store_files(merged) if rel.count("/") == 5) == chunks
    np.testing.assert_array_equal(zarr.open_consolidated(str(merged), mode="r")["arrays/activations"][:], padded)
    assert zs.verify(merged) == []


def test_a_chunks_padding_is_a_hole_that_reads_as_zeros(tmp_path):
    """The zeros past a sample's last token in its last chunk are not written: the chunk file is
    its full size, reads back as the row then zeros (raw, through zarr-python and by verify), and
    on a file system that makes holes its padding takes no disk blocks."""
    import zarr
    x = np.random.default_rng(4).standard_normal((1 + 64, 4096)).astype(np.float32)
    part = synthetic_part(tmp_path / "part-0000", x, [1, 64])
    store = tmp_path / "shard.zarr"
    zs.write_shard(part, store, t_chunk=64, git_commit=GIT_COMMIT, progress=False)
    short, full = store / acts_chunk_key(0, 0, 0), store / acts_chunk_key(1, 0, 0)
    chunk_bytes = 64 * 4096 * 2
    assert short.stat().st_size == full.stat().st_size == chunk_bytes
    raw = np.fromfile(short, np.float16).reshape(64, 4096)
    np.testing.assert_array_equal(raw[0], x[0].astype(np.float16))
    assert not raw[1:].any()
    acts = zarr.open_consolidated(str(store), mode="r")["arrays/activations"]
    np.testing.assert_array_equal(acts[0, 0], raw)
    assert zs.verify(store) == []
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        f.truncate(chunk_bytes)
    if probe.stat().st_blocks == 0:  # this file system makes holes (ext4, xfs, tmpfs, GPFS, Lustre do)
        assert short.stat().st_blocks * 512 <= 64 * 1024 < full.stat().st_blocks * 512


def test_a_sample_longer_than_the_parts_max_seq_length_is_refused_by_name(tmp_path):
    x = np.random.default_rng(0).standard_normal((2 * 5, 16)).astype(np.float32)
    part = synthetic_part(tmp_path / "part-0000", x, [5, 5])
    meta = json.loads((part / "part.json").read_text())
    (part / "part.json").write_text(json.dumps({**meta, "max_seq_length": 3}))
    with pytest.raises(FormatError, match=r"part-0000: sample 0 has 5 tokens, more than the part's max_seq_length 3"):
        zs.write_shard(part, tmp_path / "shard.zarr", t_chunk=2, git_commit=GIT_COMMIT, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-0000"]


@pytest.mark.parametrize("edit", ["shards swapped", "merged start"])
def test_a_manifest_entry_that_places_a_store_at_another_start_is_named_and_refused(bert_run, tmp_path, edit):
    """Reads find a sample's store by the manifest entries' global_index_start: an entry naming
    another store of as many samples (its path and records swapped), or a merged store said to start
    past 0, sent reads to the wrong samples and verified clean. Each start is the store's own."""
    _, run_dir = bert_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    manifest = json.loads((run / zs.MANIFEST).read_text())
    if edit == "shards swapped":
        a, b = manifest["shards"]
        assert a["num_samples"] == b["num_samples"]
        for key in ("path", "files_sha256", "n_files", "bytes"):
            a[key], b[key] = b[key], a[key]
        named = rf"{zs.MANIFEST}: shards\[0\]: global_index_start=0, but \S*shard-0001\.zarr/\.zattrs says 15"
    else:
        manifest["merged"]["global_index_start"] = 2
        named = rf"{zs.MANIFEST}: merged: global_index_start=2, expected 0"
    (run / zs.MANIFEST).write_text(json.dumps(manifest))
    assert any(re.search(named, p) for p in zs.verify(run)), zs.verify(run)
    with pytest.raises(FormatError, match=named):
        zs.ZarrRun(run, merged=edit == "merged start")


def test_a_stores_sample_idx_is_its_start_plus_the_local_index(bert_run, tmp_path):
    """arrays/sample_idx is the dataset row of each local sample: global_index_start + i. One that
    says otherwise (its files.json record made to match) is named by verify."""
    _, run_dir = bert_run
    store = tmp_path / "s.zarr"
    shutil.copytree(run_dir / "shards" / "shard-0001.zarr", store)
    assert zs.verify(store) == []
    chunk = store / "arrays/sample_idx/0"
    chunk.write_bytes(np.arange(15, dtype="<i8").tobytes())  # local indices, not the dataset's
    files = json.loads((store / FILES_JSON).read_text())["files"]
    (store / FILES_JSON).write_text(files_json_text({**files, "arrays/sample_idx/0": file_record(chunk)}))
    assert zs.verify(store) == [f"{store}/arrays/sample_idx: [0] = 0, expected global_index_start 15 + 0 (.zattrs)"]


def synthetic_shard(tmp_path, store, lengths=(5, 3)):
    """A one-layer shard (H 16, T_chunk 4) at `store` of a synthetic part written under tmp_path."""
    x = np.random.default_rng(5).standard_normal((sum(lengths), 16)).astype(np.float32)
    part = synthetic_part(tmp_path / "part-0000", x, list(lengths))
    zs.write_shard(part, store, t_chunk=4, git_commit=GIT_COMMIT, progress=False)
    return store


@pytest.mark.parametrize("link", ["directory out", "directory in", "chunk file"])
def test_the_merge_refuses_a_shard_whose_chunks_it_would_reach_through_a_link(tmp_path, link):
    """A hard link is made to what a path resolves to: a shard's sample directory linked to a copy
    outside the run made the merged store hard-link those outside files (verified clean, and written
    through). Links out of a shard are refused naming them, before anything is linked; a link inside
    it (a directory's or a chunk file's) too, naming the link."""
    import os

    store = synthetic_shard(tmp_path, tmp_path / "shards" / zs.shard_name(0))
    sample, chunk = store / zs.ACTS / "0", store / acts_chunk_key(0, 0, 0)
    if link == "directory out":
        shutil.move(sample, tmp_path / "outside")
        os.symlink(tmp_path / "outside", sample)
        named = f"{sample}: a link to {tmp_path / 'outside'}, outside {store}"
    elif link == "directory in":
        shutil.move(sample, store / "elsewhere")
        os.symlink(store / "elsewhere", sample)
        named = f"{sample}: a link; the merge hard-links only a shard's own chunk files"
    else:
        shutil.copy(chunk, store / "copy")
        chunk.unlink()
        os.symlink(store / "copy", chunk)
        named = f"{chunk}: a link; the merge hard-links only a shard's own chunk files"
    with pytest.raises(FormatError, match=re.escape(named)):
        zs.merge_stores([store], tmp_path / zs.MERGED, progress=False)
    assert not (tmp_path / zs.MERGED).exists()


@pytest.mark.parametrize("damage", ["seq_len", "prompts", "attrs"])
def test_the_merge_refuses_a_shard_file_it_copies_that_differs_from_its_files_json(tmp_path, damage):
    """The merged store takes a shard's per-sample arrays, prompts and attrs (from .zmetadata) as they
    are and records them anew: a damaged one (a seq_len one more, a changed prompt, another model)
    made a merged store that verified clean. Each is checked against the shard's files.json first."""
    store = synthetic_shard(tmp_path, tmp_path / "shards" / zs.shard_name(0))
    if damage == "seq_len":
        name = "arrays/seq_len/0"
        (store / name).write_bytes(np.array([5, 4], "<i4").tobytes())  # 3 tokens read as 4: still one chunk
    elif damage == "prompts":
        name = "text/prompts.jsonl"
        (store / name).write_text((store / name).read_text().replace('"t1"', '"evil"'))
    else:
        name = ".zmetadata"
        (store / name).write_text((store / name).read_text().replace('"synthetic"', '"another"'))
    with pytest.raises(FormatError, match=re.escape(str(store / name)) + r": (sha256 differs from |\d+ bytes, )" +
                       re.escape(FILES_JSON)):
        zs.merge_stores([store], tmp_path / zs.MERGED, progress=False)
    assert not (tmp_path / zs.MERGED).exists()


def test_a_per_sample_arrays_chunk_is_refused_by_its_size_before_it_is_read(tmp_path):
    """A 1-D array's chunk of the wrong size is named from its size alone: a 64 MiB sparse seq_len
    chunk was read whole first (a 512 MiB one cost verify and inspect 512 MiB of memory)."""
    store = synthetic_shard(tmp_path, tmp_path / "s.zarr")
    with open(store / "arrays/seq_len/0", "r+b") as fh:
        fh.truncate(64 << 20)
    def refused() -> None:
        with pytest.raises(FormatError, match=rf"arrays/seq_len/0: {64 << 20} bytes, expected 8"):
            zs.ZarrStore(store)

    assert traced_peak(refused)[1] < 1 << 20


def test_a_fifo_in_an_activation_chunks_place_is_refused_never_waited_on(tmp_path):
    """ZarrStore.read opened each chunk with a blocking open: a FIFO named like a chunk blocked it
    forever. It is a FormatError naming the chunk."""
    import os

    from test_integrity import read_in_thread

    store = synthetic_shard(tmp_path, tmp_path / "s.zarr")
    reader, chunk = zs.ZarrStore(store), store / acts_chunk_key(0, 0, 0)
    chunk.unlink()
    os.mkfifo(chunk)
    errors = read_in_thread(lambda: reader.read(0, reader.layers[0]), chunk)
    assert errors == [f"{chunk}: not a regular file (a FIFO, device or directory is never read)"]


def test_a_metadata_file_zmetadata_lists_is_compared_only_when_it_is_metadata_sized(tmp_path):
    """verify compares each file .zmetadata names with its entry: a 2 GiB (sparse) one was read whole
    (then decoded: 4 GiB), a MemoryError on a small machine that lost every other problem. It is named
    from its size, unread, and the rest of the report stays."""
    import os

    store = synthetic_shard(tmp_path, tmp_path / "s.zarr")
    (store / "extra").mkdir()
    (store / "extra" / ".zattrs").touch()
    os.truncate(store / "extra" / ".zattrs", 2 << 30)
    meta = json.loads((store / ".zmetadata").read_text())
    meta["metadata"]["extra/.zattrs"] = {}
    (store / ".zmetadata").write_text(json.dumps(meta))
    problems, peak = traced_peak(lambda: zs.verify(store))
    assert f"{store}/extra/.zattrs: {2 << 30} bytes, over the {1 << 30} of any metadata file (listed in .zmetadata)" \
        in problems, problems
    assert f"{store}/extra/.zattrs: not listed in {FILES_JSON}" in problems
    assert peak < 64 << 20


def test_the_manifest_job_names_a_shard_attrs_file_damaged_since_its_job(tmp_path):
    """write_manifest reads each shard's .zattrs, written by another job: one no longer JSON raised a
    bare JSONDecodeError naming no file."""
    store = synthetic_shard(tmp_path, tmp_path / "shards" / zs.shard_name(0))
    (store / ".zattrs").write_text('{"num_samples": 2,')
    with pytest.raises(FormatError, match=re.escape(f"{store}/.zattrs: not valid JSON")):
        zs.write_manifest(tmp_path, [store])


def test_a_merge_across_file_systems_says_the_merged_store_must_be_on_the_shards(tmp_path):
    """The merged store is the shards' chunk files, hard-linked: across file systems (shards on tmpfs,
    the store on the test's disk) there is no link and no copy is made; the error names both places
    and says where the store must be (was a bare EXDEV OSError)."""
    import errno
    import os
    import tempfile

    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's tmp_path")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        store = synthetic_shard(tmp_path, Path(shm) / zs.shard_name(0))
        with pytest.raises(OSError, match=rf"{re.escape(str(store))} and {re.escape(str(tmp_path))}/\S+ are on "
                                          "different file systems: the merged store must be on the shards' file "
                                          "system") as raised:
            zs.merge_stores([store], tmp_path / zs.MERGED, progress=False)
    assert raised.value.errno == errno.EXDEV
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-0000"]
