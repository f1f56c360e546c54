"""saev protocol 2.1: spec byte arithmetic vs the extraction, shards, HASH, integrity, loader."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from actstore.errors import ConfigError, FormatError
from actstore.formats import saev
from actstore.formats.extract import open_extraction
from actstore.io_utils import BEHIND
from actstore.formats.saev import loader as saev_loader
from actstore.formats.saev import write as saev_write
from actstore.formats.saev.loader import ShuffledActivations
from actstore.hashing import stage_hash
from actstore.model_config import read_model_config
from actstore.patch_labels import REGISTER_LABEL, image_patch_labels

import tiny

PPS = 100  # tiny patches_per_shard: several shards, a short last one


def build(extracted, kind, data=None, **section):
    config, extract_dir = extracted(kind, data)
    extraction = open_extraction(extract_dir)
    sec = {**config["saev"], "patches_per_shard": PPS, **section}
    root = extract_dir.parent.parent / "saev"
    return extraction, write(extraction, sec, root, stage_hash(config, "extract"))


def write(extraction, section, root, extract_hash=None):
    """write_store as workflow/scripts/saev.py calls it: the model's config.json and the labeler passed in."""
    image = extraction.meta["modality"] == "image"
    model_config = read_model_config(extraction.meta["model"]["path"]) if image else None
    return saev.write_store(extraction, section, root, extract_hash, model_config=model_config,
                            labeler=saev.PatchLabeler(image_patch_labels, REGISTER_LABEL), progress=False)


def spec_read(store_dir, example, layer, token):
    """Read a vector by the spec's §4 arithmetic alone, from metadata.json and shards.json."""
    md = json.loads((store_dir / "metadata.json").read_text())
    shards = json.loads((store_dir / "shards.json").read_text())
    L, T, D = len(md["layers"]), md["patches_per_ex"] + int(md["cls_token"]), md["d_model"]
    S = md["patches_per_shard"] // (T * L)
    assert shards[0]["n_examples"] == S
    shard_idx, ex_in_shard = divmod(example, S)
    offset = ((ex_in_shard * L * T) + md["layers"].index(layer) * T + token) * D * 4
    with open(store_dir / f"acts{shard_idx:06d}.bin", "rb") as fh:
        fh.seek(offset)
        return np.frombuffer(fh.read(D * 4), dtype="<f4")


def test_vision_store_matches_extraction(extracted):
    extraction, store_dir = build(extracted, "dinov2")
    md = json.loads((store_dir / "metadata.json").read_text())
    assert set(md) == set(saev.METADATA_FIELDS)
    assert md["family"] == "dinov2" and md["cls_token"] is True and md["protocol"] == "2.1"
    assert md["patches_per_ex"] == 16 and md["d_model"] == 32 and md["layers"] == [0, 2]
    assert md["n_examples"] == extraction.n_samples == 8 and md["dtype"] == "float32"
    assert os.path.isabs(md["dataset"])
    assert store_dir.name == saev.metadata_hash(md) and len(store_dir.name) == 64
    shards = json.loads((store_dir / "shards.json").read_text())
    per = PPS // (17 * 2)  # 2 examples per shard
    assert [s["n_examples"] for s in shards] == [per] * 4
    rng = np.random.default_rng(0)
    store = saev.open_store(store_dir)
    for _ in range(40):
        ex, layer, tok = int(rng.integers(8)), int(rng.choice([0, 2])), int(rng.integers(17))
        want = extraction.activations(f"layer_{layer}", ex)[tok]
        np.testing.assert_array_equal(spec_read(store_dir, ex, layer, tok), want)
        np.testing.assert_array_equal(saev.read_vector(store_dir, ex, layer, tok), want)
        np.testing.assert_array_equal(store.example(ex)[md["layers"].index(layer), tok], want)
    assert saev.read_vector(store_dir, 0, 1, 0) is None  # layer 1 not stored
    assert saev.verify(store_dir) == []
    assert saev.detect(store_dir) and not saev.detect(store_dir.parent)
    info = saev.inspect(store_dir)
    assert info["n_shards"] == 4 and info["n_examples"] == 8 and info["layers"] == [0, 2]
    assert info["bytes"] == sum(p.stat().st_size for p in store_dir.iterdir())
    assert saev.decode_data(md["data"])["modality"] == "image"


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_text_windows_match_extraction(extracted, kind):
    extraction, store_dir = build(extracted, kind, tokens_per_window=8)
    store = saev.open_store(store_dir)
    md = store.metadata
    assert md["family"] == extraction.meta["model"]["model_type"] and md["cls_token"] is False
    assert md["patches_per_ex"] == 8
    sizes = [s["n_examples"] for s in store.shards]
    assert len(sizes) > 2 and sizes[-1] < sizes[0] == PPS // (8 * 2)
    w = store.windows
    # Every extracted token is in exactly one window, in order; padding is zero.
    assert w[:, 2].sum() == extraction.n_tokens
    for _, _, row in extraction.iter_samples():
        mine = w[w[:, 0] == row["sample_idx"]]
        assert list(mine[:, 1]) == list(range(0, row["num_tokens"], 8))
    all_acts = np.concatenate([a for _, a in store.iter_ordered(chunk_examples=5)])
    assert all_acts.shape == (md["n_examples"], 2, 8, 32)
    pad = np.arange(8)[None, :] >= w[:, 2:3]
    assert pad.any() and not all_acts[:, :, :][np.broadcast_to(pad[:, None], all_acts.shape[:3])].any()
    rng = np.random.default_rng(1)
    for _ in range(40):
        sample = int(rng.integers(extraction.n_samples))
        n = extraction.sample(sample)["num_tokens"]
        tok, layer = int(rng.integers(n)), int(rng.choice([0, 2]))
        want = extraction.activations(f"layer_{layer}", sample)[tok]
        ex, t = store.find(sample, tok)
        np.testing.assert_array_equal(spec_read(store_dir, ex, layer, t), want)
        np.testing.assert_array_equal(saev.read_vector(store_dir, sample, layer, tok), want)
    assert saev.read_vector(store_dir, 0, 0, 10_000) is None
    assert saev.verify(store_dir) == []
    assert saev.inspect(store_dir)["n_tokens"] == extraction.n_tokens


def test_hash_changes_with_every_field_only(extracted):
    _, store_dir = build(extracted, "dinov2")
    md = json.loads((store_dir / "metadata.json").read_text())
    base = saev.metadata_hash(md)
    assert base == saev.metadata_hash(json.loads(json.dumps(md)))  # key order does not matter
    assert base == saev.metadata_hash(dict(reversed(list(md.items()))))
    for key, value in md.items():
        changed = {**md, key: (not value if isinstance(value, bool) else value + 1 if isinstance(value, int)
                               else value + [9] if isinstance(value, list) else value + "x")}
        assert saev.metadata_hash(changed) != base, key
    # The same config writes the same directory; a different patches_per_shard another one.
    _, again = build(extracted, "dinov2")
    _, other = build(extracted, "dinov2", patches_per_shard=PPS + 40)
    assert again == store_dir and other != store_dir
    assert saev.verify(other) == []


def test_missing_truncated_and_corrupt_shards_named(extracted, tmp_path):
    import shutil

    _, src = build(extracted, "dinov2")
    store_dir = tmp_path / src.name
    shutil.copytree(src, store_dir)
    saev.open_store(store_dir)
    (store_dir / "acts000002.bin").unlink()
    with pytest.raises(FormatError, match="acts000002.bin: missing"):
        saev.open_store(store_dir)
    shutil.copy(src / "acts000002.bin", store_dir)
    with open(store_dir / "acts000003.bin", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(FormatError, match="acts000003.bin: 100 bytes, expected"):
        saev.open_store(store_dir)
    assert any("acts000003.bin" in p for p in saev.verify(store_dir))
    shutil.copy(src / "acts000003.bin", store_dir)
    assert saev.verify(store_dir) == []
    with open(store_dir / "acts000001.bin", "r+b") as fh:  # one flipped byte, same size
        fh.seek(1234)
        byte = fh.read(1)
        fh.seek(1234)
        fh.write(bytes([byte[0] ^ 1]))
    assert saev.verify(store_dir) == [f"{store_dir / 'acts000001.bin'}: sha256_tree differs from actstore.json"]


def test_a_shard_cut_after_opening_is_named_by_every_pread_reader(extracted, tmp_path):
    """The store checks its shards' sizes when opened; a shard cut short afterwards (purged scratch)
    is named by the ordered and indexed readers, never read as what their buffers held."""
    _, src = build(extracted, "dinov2")
    store_dir = tmp_path / src.name
    shutil.copytree(src, store_dir)
    store = saev.open_store(store_dir)
    whole = np.concatenate([a for _, a in store.iter_ordered(chunk_examples=3)])
    victim = store_dir / store.shards[1]["name"]
    os.truncate(victim, store.example_bytes + 100)  # its first example whole, then 100 bytes
    with pytest.raises(FormatError, match=f"{victim.name}: ends at byte {store.example_bytes + 100}"):
        list(store.iter_ordered(chunk_examples=3))
    first = store.examples_per_shard  # shard 1's first example reads, its second is named
    np.testing.assert_array_equal(store.vector(first, store.layers[0], 0), whole[first, 0, 0])
    with pytest.raises(FormatError, match=f"{victim.name}: ends at byte"):
        store.vector(first + 1, store.layers[-1], store.T - 1)



@pytest.mark.parametrize("edit", [lambda side: side.update(files=-1), lambda side: side.update(files={"acts000000.bin": []}),
                                  lambda side: side["files"]["acts000001.bin"].update(bytes="x")])
def test_a_mistyped_sidecar_record_is_named_not_a_crash(extracted, tmp_path, edit):
    """actstore.json's file records are checked for shape when the store opens: verify reports the
    file, inspect and the reader refuse it (before, verify raised AttributeError or TypeError)."""
    import shutil

    _, src = build(extracted, "dinov2")
    store_dir = tmp_path / src.name
    shutil.copytree(src, store_dir)
    sidecar = json.loads((store_dir / saev.SIDECAR).read_text())
    edit(sidecar)
    (store_dir / saev.SIDECAR).write_text(json.dumps(sidecar))
    named = rf"{store_dir / saev.SIDECAR}: files"
    assert len(problems := saev.verify(store_dir)) == 1 and re.match(named, problems[0]), problems
    with pytest.raises(FormatError, match=named):
        saev.inspect(store_dir)
    with pytest.raises(FormatError, match=named):
        saev.open_store(store_dir)

def flip_byte(path: Path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 1]))


@pytest.mark.parametrize("sidecar", ["missing", "empty"])
def test_a_store_planned_from_an_extraction_without_its_sidecar_is_named(extracted, tmp_path, sidecar):
    """actstore.json holds every shard's sha256 of a store planned from an extraction (metadata.json's
    data says source "actstore"): deleted or emptied, and a shard byte then flipped, it is named by
    verify, not taken for a store saev wrote (which records none, so none is checked). A raw store of
    another source needs none."""
    _, src = build(extracted, "dinov2")
    store_dir = tmp_path / src.name
    shutil.copytree(src, store_dir)
    if sidecar == "missing":
        (store_dir / saev.SIDECAR).unlink()
    else:
        (store_dir / saev.SIDECAR).write_text("{}")
    flip_byte(store_dir / "acts000001.bin", 1000)
    problems = saev.verify(store_dir)
    named = f"{store_dir / saev.SIDECAR}: {sidecar}, but {store_dir / 'metadata.json'} data says"
    assert len(problems) == 1 and problems[0].startswith(named), problems
    with pytest.raises(FormatError, match=re.escape(named)):
        saev.open_store(store_dir, verify=True)
    raw = synthetic_store(tmp_path / "raw", n=5, tokens=4, d=8, per_shard=2)  # data: source "test"
    (raw / saev.SIDECAR).unlink()
    assert saev.verify(raw) == []


def test_a_duplicate_key_in_saev_metadata_is_named_not_read_past(extracted, tmp_path):
    """A key given twice in metadata.json: json.loads keeps the last value, so the store verified
    by its name's hash while the first value stood in the text; verify names the file and the key."""
    _, src = build(extracted, "dinov2")
    store_dir = tmp_path / src.name
    shutil.copytree(src, store_dir)
    text = (store_dir / "metadata.json").read_text()
    (store_dir / "metadata.json").write_text(text.replace("{", '{"n_examples": 1,', 1))
    named = f"{store_dir / 'metadata.json'}: not valid JSON (key 'n_examples' given twice)"
    assert saev.verify(store_dir) == [named]
    with pytest.raises(FormatError, match=re.escape(named)):
        saev.open_store(store_dir)


def scatter(extraction, section, root, jobs, extract_hash=None):
    """The workflow's shard jobs (plans without labels, as saev_shards.py makes them): their dirs."""
    image = extraction.meta["modality"] == "image"
    plan = saev.plan_store(extraction, section, extract_hash, labels=False,
                           model_config=read_model_config(extraction.meta["model"]["path"]) if image else None,
                           labeler=saev.PatchLabeler(image_patch_labels, REGISTER_LABEL))
    dirs = [root / "scatter" / f"job-{job:04d}" for job in range(jobs)]
    for job, job_dir in enumerate(dirs):
        saev.write_shards(plan, saev.extraction_fill(extraction, plan), job_dir, jobs, job)
    return dirs


def finish(extraction, section, root, dirs, extract_hash=None):
    """The workflow's finishing job: the full plan (labels computed) assembled from the jobs' dirs."""
    image = extraction.meta["modality"] == "image"
    plan = saev.plan_store(extraction, section, extract_hash,
                           model_config=read_model_config(extraction.meta["model"]["path"]) if image else None,
                           labeler=saev.PatchLabeler(image_patch_labels, REGISTER_LABEL))
    return saev.finish_store(plan, dirs, root)


def tree_bytes(store_dir):
    return {p.relative_to(store_dir): p.read_bytes() for p in sorted(store_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind, jobs, section", [
    ("gpt2", 3, {"tokens_per_window": 8}),  # many shards, a short last one
    ("dinov2", 7, {}),  # 4 shards: three jobs write none
    ("dinov2", 3, {"flavor": "upstream", "patches_per_shard": 5 * 17 * 2}),  # shards of 5 + 3 (padded: a hole)
])
def test_scattered_store_is_byte_identical_to_one_job(extracted, tmp_path, monkeypatch, kind, jobs, section):
    """Shard jobs + the finishing job write, file for file and byte for byte, what write_store writes in
    one go; slabs of one example (CHUNK_BYTES tiny) change nothing either."""
    config, extract_dir = extracted(kind)
    extraction = open_extraction(extract_dir)
    sec = {**config["saev"], "patches_per_shard": PPS, **section}
    one = write(extraction, sec, tmp_path / "one")
    n_shards = len(saev.open_store(one).shards)
    monkeypatch.setattr(saev_write, "CHUNK_BYTES", 1)
    dirs = scatter(extraction, sec, tmp_path / "many", jobs)
    records = [json.loads((d / "job.json").read_text()) for d in dirs]
    assert sum(len(r["files"]) for r in records) == n_shards >= 2
    assert [len(r["files"]) for r in records].count(0) == max(0, jobs - n_shards)
    many = finish(extraction, sec, tmp_path / "many", dirs)
    assert many.relative_to(tmp_path / "many") == one.relative_to(tmp_path / "one")
    assert tree_bytes(many) == tree_bytes(one)
    assert saev.verify(many) == []
    if section.get("flavor") == "upstream":  # the padding is a hole, as before
        last = many / saev.open_store(many).shards[-1]["name"]
        assert last.stat().st_blocks * 512 < last.stat().st_size


def test_finish_refuses_missing_or_short_shards_and_records(extracted, tmp_path):
    """A shard job's missing record, a missing or short shard, a record of another store, a shard listed
    by two jobs, a job's record twice: refused naming the file, no store under its final name; the job dirs are untouched, so the finish then succeeds."""
    config, extract_dir = extracted("dinov2")
    extraction = open_extraction(extract_dir)
    sec = {**config["saev"], "patches_per_shard": PPS}
    root = tmp_path / "saev"
    dirs = scatter(extraction, sec, root, 3)
    shard = dirs[1] / "acts000002.bin"  # 4 shards over 3 jobs: 0-1, 2, 3
    saved = {p: p.read_bytes() for p in (shard, dirs[0] / "job.json", dirs[2] / "job.json")}

    def refused(match):
        with pytest.raises(FormatError, match=match):
            finish(extraction, sec, root, dirs)
        assert [p.name for p in root.iterdir()] == ["scatter"]  # no store, no temp left beside it
        for path, data in saved.items():
            path.write_bytes(data)

    (dirs[2] / "job.json").unlink()
    refused(r"job-0002/job\.json: missing")
    shard.unlink()
    refused(r"job-0001/acts000002\.bin: missing \(listed in .*job-0001/job\.json\)")
    with open(shard, "r+b") as fh:
        fh.truncate(100)
    refused(r"job-0001/acts000002\.bin: 100 bytes, .*job-0001/job\.json says 8704")
    record = json.loads(saved[dirs[2] / "job.json"])
    (dirs[2] / "job.json").write_text(json.dumps({**record, "store": "0" * 64}))
    refused(r"job-0002/job\.json: shards of store '0{64}'")
    twice = {**record["files"], "acts000002.bin": record["files"]["acts000003.bin"]}
    (dirs[2] / "job.json").write_text(json.dumps({**record, "files": twice}))
    refused(r"job-0002/job\.json: acts000002\.bin also listed in .*job-0001/job\.json")
    (dirs[0] / "job.json").write_text((dirs[1] / "job.json").read_text())
    refused(r"job-0001/job\.json: the record of job 1 of 3, as is .*job-0000/job\.json")
    store = finish(extraction, sec, root, dirs)
    assert saev.verify(store) == [] and all((d / "job.json").is_file() for d in dirs)


def test_a_shard_job_rerun_never_writes_into_the_finished_store(extracted, tmp_path):
    """finish_store hard-links each job's shards into the store: a job rerun into its old directory
    writes new files there, so the finished store keeps its bytes whether the rerun dies partway (its
    shard was left cut to zeros) or completes with other data (its shard was rewritten in place)."""
    config, extract_dir = extracted("dinov2")
    extraction = open_extraction(extract_dir)
    sec = {**config["saev"], "patches_per_shard": PPS}
    root = tmp_path / "saev"
    dirs = scatter(extraction, sec, root, 2)
    store = finish(extraction, sec, root, dirs)
    before = tree_bytes(store)
    plan = saev.plan_store(extraction, sec, labels=False,
                           model_config=read_model_config(extraction.meta["model"]["path"]))

    def dies(start: int, out: np.ndarray) -> None:
        raise MemoryError("killed")  # as a job killed partway (out of memory, preempted)

    with pytest.raises(MemoryError):
        saev.write_shards(plan, dies, dirs[0], 2, 0)
    assert tree_bytes(store) == before
    saev.write_shards(plan, lambda start, out: out.fill(1.0), dirs[0], 2, 0)
    assert tree_bytes(store) == before and saev.verify(store) == []


def test_shards_written_from_a_ring_of_bounded_buffers(tmp_path, monkeypatch):
    """Every slab handed to fill is a view of one of BEHIND + 1 buffers of at most CHUNK_BYTES (or one
    example), used in turn (one is filled while the slabs before are written): no memory-mapped
    shard, nothing that grows with the data."""
    monkeypatch.setattr(saev_write, "CHUNK_BYTES", 3 * 16 * 8 * 4)  # 3 examples of 16 tokens x d 8
    md = {"family": "dinov2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": 15, "cls_token": True,
          "d_model": 8, "n_examples": 50, "patches_per_shard": 7 * 16, "dtype": "float32",
          "data": saev.encode_data({"source": "test"}), "dataset": str(tmp_path), "protocol": saev.PROTOCOL}
    seen = []

    def fill(start: int, out: np.ndarray) -> None:
        assert not isinstance(out, np.memmap) and not isinstance(out.base, np.memmap)
        seen.append((start, len(out), out.__array_interface__["data"][0], out.nbytes))
        out[:] = np.arange(start, start + len(out), dtype=np.float32)[:, None, None, None]
    store = saev.open_store(saev.write_raw_store(saev.Plan(md, None, {}), fill, tmp_path, progress=False))
    assert [(s, n) for s, n, _, _ in seen][:4] == [(0, 3), (3, 3), (6, 1), (7, 3)]  # shards of 7: 3 + 3 + 1
    assert len({address for _, _, address, _ in seen}) == BEHIND + 1 and max(b for *_, b in seen) == 3 * 16 * 8 * 4
    assert sum(n for _, n, _, _ in seen) == 50 and store.example(49)[0, 0, 0] == 49
    assert saev.verify(store.dir) == []


def test_bad_metadata_and_layer_errors(extracted, tmp_path):
    import shutil

    _, src = build(extracted, "dinov2")
    store = saev.open_store(src)
    with pytest.raises(FormatError, match=r"layer 1 not stored; stored layers are \[0, 2\]"):
        store.vector(0, 1, 0)
    store_dir = tmp_path / "s"
    shutil.copytree(src, store_dir)
    md = json.loads((store_dir / "metadata.json").read_text())
    (store_dir / "metadata.json").write_text(json.dumps({**md, "protocol": "3.0"}))
    with pytest.warns(UserWarning, match="different major"):
        saev.open_store(store_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert any("does not match the directory name" in p for p in saev.verify(store_dir))
    del md["d_model"]
    (store_dir / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(FormatError, match="'d_model' missing"):
        saev.open_store(store_dir)
    assert saev.verify(store_dir) and not saev.detect(tmp_path / "nothing")


def test_loader_epoch_exactly_once_seeded_and_workers(extracted):
    extraction, store_dir = build(extracted, "bert", tokens_per_window=8)
    for bad in ({"block_examples": 0}, {"block_examples": -1}, {"batch_size": 0}, {"fill_threads": 0}):
        with pytest.raises(ConfigError, match=f"{next(iter(bad))}={next(iter(bad.values()))}"):
            ShuffledActivations(store_dir, **bad)
    with pytest.raises(ConfigError, match=r"layers=\[\] asks for no layer"):
        ShuffledActivations(store_dir, layers=[])
    ds = ShuffledActivations(store_dir, layers=[2], batch_size=16, seed=3, block_examples=2, buffer_blocks=3)
    batches = list(ds)
    seen = [(int(e), int(t)) for b in batches for e, t in zip(b["example_idx"], b["token_idx"])]
    store = saev.open_store(store_dir)
    assert len(seen) == len(set(seen)) == extraction.n_tokens  # every real token once, no padding
    assert all(len(b["act"]) == 16 for b in batches[:-1]) and batches[0]["act"].shape == (16, 32)
    for b in batches[:3]:
        for act, e, t in zip(b["act"], b["example_idx"], b["token_idx"]):
            np.testing.assert_array_equal(act.numpy(), store.vector(int(e), 2, int(t)))
    again = list(ShuffledActivations(store_dir, layers=[2], batch_size=16, seed=3, block_examples=2, buffer_blocks=3))
    assert all(torch.equal(a["act"], b["act"]) for a, b in zip(batches, again))
    # Streaming (batches dropped as consumed, so buffers are recycled): same values, same order.
    for ref, b in zip(batches, ShuffledActivations(store_dir, layers=[2], batch_size=16, seed=3, block_examples=2,
                                                   buffer_blocks=3)):
        assert torch.equal(ref["act"], b["act"]) and torch.equal(ref["example_idx"], b["example_idx"])
    ds.set_epoch(1)
    assert not torch.equal(next(iter(ds))["example_idx"], batches[0]["example_idx"])
    # Two DataLoader workers: disjoint blocks, still every vector once.
    multi = ShuffledActivations(store_dir, batch_size=16, seed=3, block_examples=2, buffer_blocks=3)
    loader = torch.utils.data.DataLoader(multi, batch_size=None, num_workers=2)
    got = [(int(e), int(t)) for b in loader for e, t in zip(b["example_idx"], b["token_idx"])]
    assert sorted(got) == sorted(seen)
    first = next(iter(multi))
    assert first["act"].shape == (16, 2, 32)


def test_loader_threads_scatter_paths_and_purged_shards(extracted, monkeypatch):
    _, store_dir = build(extracted, "bert", tokens_per_window=8, patches_per_shard=3 * 8 * 12)
    store = saev.open_store(store_dir)
    assert len(store.shards) > 2

    # Whole-example blocks (3 per block) and sub-example blocks (3 tokens of one window, 9 blocks a buffer).
    for blocks in (dict(block_examples=3, buffer_blocks=2), dict(block_bytes=3 * 2 * 32 * 4, buffer_blocks=9)):
        def epoch(**kwargs) -> list[dict]:
            return list(ShuffledActivations(store_dir, batch_size=16, seed=5, **blocks, **kwargs))
        ref = epoch(fill_threads=1)
        for b in ref[:2]:  # both stored layers (0 and 2) of one token per row
            for act, e, t in zip(b["act"], b["example_idx"], b["token_idx"]):
                np.testing.assert_array_equal(act.numpy(), store.example(int(e))[:, int(t)])
        # The order blocks fill in across threads, and the fill used (C or numpy), change nothing;
        # nor does reading a subset of layers.
        runs = [(epoch(fill_threads=n), slice(None)) for n in (2, 4, 8)] + [(epoch(fill_threads=3, layers=[2]), 1)]
        with monkeypatch.context() as patch:
            patch.setattr(saev_loader, "_scatter", None)
            runs += [(epoch(fill_threads=2), slice(None)), (epoch(fill_threads=2, layers=[2]), 1)]
        for got, pick in runs:
            assert len(got) == len(ref)
            assert all(torch.equal(a["example_idx"], b["example_idx"]) for a, b in zip(ref, got))
            assert all(torch.equal(a["token_idx"], b["token_idx"]) for a, b in zip(ref, got))
            assert all(torch.equal(a["act"][:, pick], b["act"]) for a, b in zip(ref, got))
    # A shard purged after the dataset was made is named, at open and mid-read.
    ds = ShuffledActivations(store_dir, batch_size=16, block_examples=3)
    victim = store.dir / store.shards[1]["name"]
    with open(victim, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(FormatError, match=victim.name):
        list(ds)
    shards = saev_loader._ShardFiles(store)
    with pytest.raises(FormatError, match=f"{victim.name}: ends at byte 100"):
        shards.read(1, 0, np.empty((2, store.T, store.D), dtype=np.float32))
    shards.close()
    # A read that fails for another reason (here the shard became a folder) names the shard too.
    victim.unlink()
    victim.mkdir()
    shards = saev_loader._ShardFiles(store)
    with pytest.raises(IsADirectoryError, match=f"{victim.name}: Is a directory"):
        shards.read(1, 0, np.empty((2, store.T, store.D), dtype=np.float32))
    shards.close()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_fill_extension_built_and_checked(tmp_path):
    """Where a C compiler exists the install must have built the C fill; it reads blocks (merging
    reads that follow each other in the file), skips rows < 0 and names a truncated file's end."""
    assert saev_loader._scatter is not None
    T, D, L = 4, 8, 3  # a file of 2 examples x 3 layers x 4 tokens x 8 floats
    data = np.arange(2 * L * T * D, dtype=np.float32).reshape(2, L, T, D)
    path = tmp_path / "acts.bin"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        def fill(rows, n_ex, n_tok, offsets, layers, n_rows=12, file=fd):
            acts = np.zeros((n_rows, len(layers), D), dtype=np.float32)
            scratch = np.empty(64 * D, dtype=np.float32)
            arrays = [np.asarray(a, dtype=np.int64) for a in (rows, [file] * len(n_ex), offsets, n_ex, n_tok)]
            layer_off = np.array(layers, dtype=np.int64) * T * D * 4
            short = saev_loader._scatter.fill(
                acts.ctypes.data, n_rows, acts.strides[0], scratch.ctypes.data, scratch.nbytes, len(n_ex),
                arrays[1].ctypes.data, arrays[2].ctypes.data, arrays[3].ctypes.data, arrays[4].ctypes.data,
                L * T * D * 4, len(layers), layer_off.ctypes.data, D * 4, arrays[0].ctypes.data)
            return acts, short
        # Block 0: both examples, all tokens (one merged read); block 1: tokens 1..2 of example 1.
        rows = [0, 1, 2, 3, 4, 5, 6, -1, 8, 9]
        acts, short = fill(rows, [2, 1], [4, 2], [0, (L * T + 1) * D * 4], [0, 1, 2])
        assert short is None
        expect = np.zeros_like(acts)
        expect[:8] = data.transpose(0, 2, 1, 3).reshape(8, L, D)
        expect[7] = 0
        expect[[8, 9]] = data[1, :, 1:3].transpose(1, 0, 2)
        np.testing.assert_array_equal(acts, expect)
        acts, _ = fill([1, 0], [1], [2], [2 * D * 4], [2, 0])  # layers 2 and 0 of tokens 2, 3 of example 0
        np.testing.assert_array_equal(acts[[1, 0]], data[0][[2, 0]][:, 2:4].transpose(1, 0, 2))
        with pytest.raises(ValueError, match="row outside dst"):
            fill([0, 12], [1], [2], [0], [0])
        with pytest.raises(ValueError, match="larger than scratch"):
            fill(list(range(12)) * 6, [1] * 3, [24] * 3, [0] * 3, [0, 1, 2])
        # Reading past the end: the block and where the file ended come back.
        assert fill([0, 1, 2, 3], [1, 1], [2, 2], [0, data.nbytes - D * 4], [0])[1] == (1, data.nbytes, 0)
        empty = os.open(tmp_path / "empty.bin", os.O_RDONLY | os.O_CREAT)  # ends where the read starts, at 0
        try:
            assert fill([0, 1], [1], [2], [0], [0], file=empty)[1] == (0, 0, 0)
        finally:
            os.close(empty)
        folder = os.open(tmp_path, os.O_RDONLY)  # a read that fails (EISDIR): its errno comes back, with the block
        try:
            assert fill([0, 1], [1], [2], [64], [0], file=folder)[1] == (0, 64, errno.EISDIR)
        finally:
            os.close(folder)
        # Sizes whose products overflow are refused by the scratch check, not read past it; a block of no
        # tokens (or no examples) reads and fills nothing, however many examples it claims.
        with pytest.raises(ValueError, match="larger than scratch"):
            fill([0], [2**61], [1], [0], [0])
        with pytest.raises(ValueError, match="larger than scratch"):
            fill([0], [1], [2**61], [0], [0])
        acts, short = fill([], [2**61], [0], [0], [0, 1, 2])
        assert short is None and not acts.any()
    finally:
        os.close(fd)


def synthetic_store(root: Path, n: int, tokens: int, d: int, per_shard: int) -> Path:
    """A random ViT-shaped store (CLS + tokens-1 patches, one layer)."""
    md = {"family": "dinov2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": tokens - 1, "cls_token": True,
          "d_model": d, "n_examples": n, "patches_per_shard": per_shard * tokens, "dtype": "float32",
          "data": saev.encode_data({"source": "test"}), "dataset": str(root), "protocol": saev.PROTOCOL}
    rng = np.random.default_rng(0)

    def fill(start: int, out: np.ndarray) -> None:
        out[:] = rng.standard_normal(out.shape, dtype=np.float32)
    return saev.write_raw_store(saev.Plan(md, None, {}), fill, root, progress=False)


def text_store(root: Path, windows: list[list[int]], layers: tuple[int, ...] = (0,), tokens: int = 4) -> Path:
    """A raw text store of the given windows.npy rows (recorded in actstore.json by its writer), whose
    vector at [example, layer block b, token t] is example * 100 + b * 10 + t."""
    md = {"family": "gpt2", "ckpt": "synthetic", "layers": list(layers), "patches_per_ex": tokens, "cls_token": False,
          "d_model": 2, "n_examples": len(windows), "patches_per_shard": 3 * tokens * len(layers), "dtype": "float32",
          "data": saev.encode_data({"source": "test"}), "dataset": str(root), "protocol": saev.PROTOCOL}

    def fill(start: int, out: np.ndarray) -> None:
        value = (np.arange(start, start + len(out))[:, None, None] * 100 + np.arange(len(layers))[:, None] * 10
                 + np.arange(tokens))
        out[:] = value[..., None]
    return saev.write_raw_store(saev.Plan(md, np.array(windows, np.int64), {}), fill, root, progress=False)


def planted_windows(store_dir: Path, windows: list[list[int]]) -> Path:
    """The store's windows.npy replaced by these rows, its actstore.json record rewritten to match (a
    writer's bug, or a hostile store: the records cannot show it; the writer refuses such rows)."""
    from actstore.integrity import file_record

    np.save(store_dir / "windows.npy", np.array(windows, np.int64))
    sidecar = json.loads((store_dir / saev.SIDECAR).read_text())
    sidecar["files"]["windows.npy"] = file_record(store_dir / "windows.npy")
    (store_dir / saev.SIDECAR).write_text(json.dumps(sidecar))
    return store_dir


@pytest.mark.parametrize("windows, named", [
    ([[1, 0, 4], [0, 0, 4], [0, 4, 2]], r"row 1 \[0, 0, 4\]: sample_idx smaller than the row before"),
    ([[0, 0, 4], [0, 2, 4], [1, 0, 3]], r"row 1 \[0, 2, 4\]: token_start 2, expected 4"),  # overlap
    ([[0, 0, 4], [0, 6, 2], [1, 0, 3]], r"row 1 \[0, 6, 2\]: token_start 6, expected 4"),  # gap
    ([[0, -2, 4], [1, 0, 3]], r"row 0 \[0, -2, 4\]: token_start -2, expected 0"),
    ([[-1, 0, 4], [0, 0, 3]], r"row 0 \[-1, 0, 4\]: sample_idx negative"),
    ([[0, 0, 4], [1, 0, 0]], r"row 1 \[1, 0, 0\]: n_valid out of \[1, 4\]"),
])
def test_windows_that_hand_out_other_tokens_are_named(tmp_path, windows, named):
    """windows.npy rows out of sample order, or a sample's windows that overlap, leave a gap or start
    off its token 0: read_vector returned another sample's (or window's) vector and verify passed. verify
    names windows.npy and the row, read_vector refuses it; windows that tile each sample read right.
    The writer refuses such rows before it writes a shard (it wrote the store, which verify then named)."""
    with pytest.raises(FormatError, match=rf"saev\.Plan\.windows: {named}"):
        text_store(tmp_path / "refused", windows)
    assert not list((tmp_path / "refused").iterdir())
    store_dir = planted_windows(text_store(tmp_path / "bad", [[i, 0, 4] for i in range(len(windows))]), windows)
    problems = saev.verify(store_dir)
    assert len(problems) == 1 and re.match(rf"{re.escape(str(store_dir / 'windows.npy'))}: {named}", problems[0]), problems
    with pytest.raises(FormatError, match=named):
        saev.read_vector(store_dir, 0, 0, 1)
    good = text_store(tmp_path / "good", [[0, 0, 4], [0, 4, 2], [2, 0, 3]])
    assert saev.verify(good) == []
    assert saev.read_vector(good, 0, 0, 5).tolist() == [101, 101]  # example 1, token 1
    assert saev.read_vector(good, 2, 0, 2).tolist() == [202, 202] and saev.read_vector(good, 1, 0, 0) is None


def test_a_layer_listed_twice_or_a_bool_layer_is_refused(tmp_path):
    """metadata.json layers [0, 0]: every example holds two blocks and the reader found only the first
    for layer 0 (the second never read), verify passing; `true` passed as layer 1. Both are named."""
    for layers in ([0, 0], [True]):  # the writer refuses both (test_saev_raw_plan_metadata): a store edited after
        store_dir = text_store(tmp_path / str(layers), [[0, 0, 4]], layers=(0, 1)[:len(layers)])
        metadata = json.loads((store_dir / "metadata.json").read_text())
        (store_dir / "metadata.json").write_text(json.dumps({**metadata, "layers": layers}))
        named = rf"metadata.json: layers {re.escape(repr(layers))}"
        assert any(re.search(named + " must be a non-empty list of distinct ints", p) for p in saev.verify(store_dir))
        with pytest.raises(FormatError, match=named):
            saev.read_vector(store_dir, 0, 0, 0)


def test_labels_bin_of_another_size_than_its_metadata_is_named(tmp_path):
    """labels.bin one byte short of n_examples x patches_per_ex, its actstore.json record rewritten to
    match: verify passed it (only the loader refused it, at training time); it names the sizes."""
    from actstore.integrity import file_record

    store_dir = synthetic_store(tmp_path, n=5, tokens=4, d=8, per_shard=2)
    (store_dir / "labels.bin").write_bytes(bytes(5 * 3 - 1))
    sidecar = json.loads((store_dir / saev.SIDECAR).read_text())
    sidecar["files"]["labels.bin"] = file_record(store_dir / "labels.bin")
    (store_dir / saev.SIDECAR).write_text(json.dumps(sidecar))
    assert saev.verify(store_dir) == [f"{store_dir / 'labels.bin'}: 14 bytes, expected 15 (uint8 n_examples 5 x "
                                      f"patches_per_ex 3 of {store_dir / 'metadata.json'})"]


def uniform_distinct(n: int, tokens: int, batch: int) -> float:
    """Expected distinct examples among `batch` draws without replacement from n*tokens vectors."""
    return n * (1 - np.exp(np.sum(np.log1p(-tokens / (n * tokens - np.arange(batch))))))


def test_loader_mixing_near_uniform(tmp_path):
    """8-token blocks, a buffer holding a quarter of the store: batches hold within 15% as many distinct
    examples as a uniform shuffle's (0.89 measured; drawing blocks with replacement, the lower bound,
    gives 0.83), within 3% with the whole store in one buffer; whole-example blocks fall far short."""
    n, tokens, batch = 400, 65, 1024
    store_dir = synthetic_store(tmp_path / "store", n, tokens, 16, per_shard=64)

    def mixing(**kwargs) -> float:
        ds = ShuffledActivations(store_dir, batch_size=batch, seed=1, drop_last=True, **kwargs)
        distinct = [len(np.unique(b["example_idx"].numpy())) for b in ds]
        return float(np.mean(distinct)) / uniform_distinct(n, tokens, batch)
    quarter = n * tokens * 16 * 4 // 4
    assert mixing(block_bytes=8 * 16 * 4, buffer_bytes=quarter) >= 0.85
    assert mixing(block_bytes=8 * 16 * 4, buffer_blocks=n * 9) >= 0.97  # every block in one buffer
    assert mixing(block_examples=3, buffer_bytes=quarter) < 0.5


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 cores, on purpose
def test_loader_every_vector_once_threads_workers_labels(tmp_path):
    """Every kept vector exactly once per epoch, with CLS or without, with a label filter, whatever
    the fill threads and DataLoader workers; the batches identical across thread counts."""
    n, tokens = 60, 17
    store_dir = synthetic_store(tmp_path / "store", n, tokens, 8, per_shard=16)
    labels = np.random.default_rng(2).integers(0, 3, size=(n, tokens - 1)).astype(np.uint8)
    saev.write_labels(store_dir, labels)
    cases = {(True, None): [(e, t) for e in range(n) for t in range(tokens)],
             (False, None): [(e, t) for e in range(n) for t in range(1, tokens)],
             (True, (0, 2)): [(e, 0) for e in range(n)] + [(e, p + 1) for e, p in zip(*np.nonzero(labels != 1))],
             (False, (1,)): [(e, p + 1) for e, p in zip(*np.nonzero(labels == 1))]}
    for (cls, keep), expect in cases.items():
        def make(threads: int) -> ShuffledActivations:  # 5-token blocks, 20 a buffer: several buffers
            return ShuffledActivations(store_dir, batch_size=32, seed=4, include_cls=cls, keep_labels=keep,
                                       block_bytes=5 * 8 * 4, buffer_blocks=20, fill_threads=threads)
        ref = list(make(1))
        assert all(len(b["act"]) == 32 for b in ref[:-1])
        for threads in (2, 5):
            got = list(make(threads))
            assert all(torch.equal(a["act"], b["act"]) and torch.equal(a["example_idx"], b["example_idx"])
                       for a, b in zip(ref, got)) and len(got) == len(ref)
        for workers in (0, 2, 3):
            loader = torch.utils.data.DataLoader(make(2), batch_size=None, num_workers=workers)
            seen = [(int(e), int(t)) for b in loader for e, t in zip(b["example_idx"], b["token_idx"])]
            assert len(seen) == len(set(seen)) and sorted(seen) == sorted((int(e), int(t)) for e, t in expect)


def test_set_epoch_reaches_persistent_workers(tmp_path):
    """DataLoader(persistent_workers=True) keeps the workers' copies of the dataset across epochs:
    set_epoch reached only the main process's, and every epoch replayed epoch 0's order. Now each
    epoch's order is the one fresh workers give for it, and still holds every vector once."""
    store_dir = synthetic_store(tmp_path / "store", n=20, tokens=5, d=4, per_shard=8)

    def loader(ds: ShuffledActivations, persistent: bool) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)

    def order(loader: torch.utils.data.DataLoader) -> list[tuple[int, int]]:
        return [(int(e), int(t)) for b in loader for e, t in zip(b["example_idx"], b["token_idx"])]
    ds = ShuffledActivations(store_dir, batch_size=8, seed=1, block_bytes=8)
    persistent = loader(ds, persistent=True)
    orders = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        orders.append(order(persistent))
        fresh = ShuffledActivations(store_dir, batch_size=8, seed=1, block_bytes=8)
        fresh.set_epoch(epoch)
        assert orders[-1] == order(loader(fresh, persistent=False)) and fresh.epoch == epoch
    assert orders[0] != orders[1] != orders[2]
    assert all(sorted(o) == [(e, t) for e in range(20) for t in range(5)] for o in orders)


def test_a_buffer_asked_larger_than_the_store_is_sized_by_the_store(tmp_path):
    """buffer_blocks (or buffer_bytes) past the whole store, to shuffle it all in one buffer, allocated
    buffers of the size asked: MemoryError (petabytes, past any address space) on a 30-vector store.
    The buffers now hold the blocks the process reads; the batches are a buffer of every block's."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    exact = ShuffledActivations(store_dir, batch_size=4, seed=2, block_bytes=8)
    whole = list(ShuffledActivations(store_dir, batch_size=4, seed=2, block_bytes=8, buffer_blocks=exact.n_blocks))
    for asked in (dict(buffer_blocks=10**15), dict(buffer_bytes=1 << 50)):
        got = list(ShuffledActivations(store_dir, batch_size=4, seed=2, block_bytes=8, **asked))
        assert len(got) == len(whole) and all(torch.equal(a["act"], b["act"]) for a, b in zip(whole, got))
        loader = torch.utils.data.DataLoader(ShuffledActivations(store_dir, batch_size=4, block_bytes=8, **asked),
                                             batch_size=None, num_workers=2)
        seen = sorted((int(e), int(t)) for b in loader for e, t in zip(b["example_idx"], b["token_idx"]))
        assert seen == [(e, t) for e in range(6) for t in range(5)]


def test_keep_labels_and_seed_out_of_range_are_named(tmp_path):
    """keep_labels=[1.5] kept label 1's patches without a word; [300], a bare 1 and seed=-1 failed in
    numpy (OverflowError, TypeError, ValueError) naming no argument, layers=0 and a float batch_size
    in Python (TypeError). Each is a ConfigError naming it; labels given as a numpy array still filter,
    a numpy integer is a count."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    labels = np.arange(6 * 4).reshape(6, 4).astype(np.uint8) % 3
    saev.write_labels(store_dir, labels)
    for bad, named in (({"keep_labels": [1.5]}, r"keep_labels=\[1.5\]"), ({"keep_labels": [300]}, r"=\[300\]"),
                       ({"keep_labels": 1}, "keep_labels=1 "), ({"seed": -1}, "seed=-1"),
                       ({"layers": 0}, "layers=0 must be a list"), ({"batch_size": 2.0}, "batch_size=2.0"),
                       ({"fill_threads": True}, "fill_threads=True")):
        with pytest.raises(ConfigError, match=named):
            ShuffledActivations(store_dir, **bad)
    ds = ShuffledActivations(store_dir, include_cls=False, keep_labels=np.unique(labels)[1:], batch_size=np.int64(4))
    kept = [(int(e), int(t)) for b in ds for e, t in zip(b["example_idx"], b["token_idx"])]
    assert sorted(kept) == [(e, p + 1) for e, p in zip(*np.nonzero(labels != 0))]


def test_loader_cls_and_labels_filter(extracted, tmp_path):
    _, src = build(extracted, "dinov2")
    store = saev.open_store(src)
    n_all = len([1 for b in ShuffledActivations(src, batch_size=7, block_examples=1) for _ in b["token_idx"]])
    assert n_all == 8 * 17
    no_cls = [int(t) for b in ShuffledActivations(src, batch_size=7, include_cls=False) for t in b["token_idx"]]
    assert len(no_cls) == 8 * 16 and 0 not in no_cls
    labels = (np.arange(8 * 16).reshape(8, 16) % 3).astype(np.uint8)
    labels_store = tmp_path / src.name
    shutil.copytree(src, labels_store)
    saev.write_labels(labels_store, labels)
    assert saev.verify(labels_store) == []
    kept = [(int(e), int(t)) for b in ShuffledActivations(labels_store, batch_size=5, include_cls=False,
                                                          keep_labels=[1]) for e, t in zip(b["example_idx"], b["token_idx"])]
    assert sorted(kept) == sorted((e, p + 1) for e, p in zip(*np.nonzero(labels == 1)))
    (labels_store / "labels.bin").write_bytes(bytes(8 * 16))
    assert any("labels.bin" in p for p in saev.verify(labels_store))
    with pytest.raises(ConfigError, match="no labels.bin"):
        ShuffledActivations(src, keep_labels=[1])
    assert store.labels() is None


def test_patches_per_shard_too_small(extracted):
    with pytest.raises(ConfigError, match="patches_per_shard=10"):
        build(extracted, "dinov2", patches_per_shard=10)


@pytest.mark.parametrize("kind, family, cls_token, tokens", [
    ("clip", "clip", True, 17), ("metaclip_2", "clip", True, 17), ("siglip", "siglip", False, 16),
    ("aimv2", "aimv2", False, 16), ("vit", "vit", True, 17), ("beit", "beit", True, 17),
    ("data2vec_vision", "data2vec-vision", True, 17), ("ijepa", "ijepa", False, 16), ("vit_msn", "vit-msn", True, 17)])
def test_cls_token_by_family(extracted, kind, family, cls_token, tokens):
    """CLIP, MetaCLIP 2 (kept from its image-text checkpoint), ViT, BEiT, data2vec-vision and ViT-MSN
    put a CLS token first; SigLIP, AIMv2 and I-JEPA emit patches only."""
    extraction, store_dir = build(extracted, kind)
    md = json.loads((store_dir / "metadata.json").read_text())
    assert md["family"] == family and md["cls_token"] is cls_token and md["patches_per_ex"] == 16
    assert md["patches_per_ex"] + int(md["cls_token"]) == tokens == extraction.sample(0)["num_tokens"]
    rng = np.random.default_rng(1)
    for _ in range(20):
        ex, layer, tok = int(rng.integers(8)), int(rng.choice([0, 2])), int(rng.integers(tokens))
        np.testing.assert_array_equal(spec_read(store_dir, ex, layer, tok),
                                      extraction.activations(f"layer_{layer}", ex)[tok])
    assert saev.verify(store_dir) == []


@pytest.mark.parametrize("kind, family, registers", [("dinov2_registers", "dinov2", tiny.REGISTERS),
                                                       ("dinov3", "dinov3", tiny.REGISTERS), ("deit", "deit", 1)])
def test_register_tokens_follow_cls(extracted, image_folder, kind, family, registers):
    """dinov2_with_registers, DINOv3 and DeiT: CLS, then the registers (DeiT's distillation token, kept
    as one), then the patches, each equal to the model's own hidden states and found where the
    extraction has it; the register count is recorded in actstore.json."""
    from PIL import Image
    from actstore.models import load_model

    extraction, store_dir = build(extracted, kind)
    md = json.loads((store_dir / "metadata.json").read_text())
    assert md["family"] == family and md["cls_token"] is True
    assert md["patches_per_ex"] == registers + 16
    assert json.loads((store_dir / saev.SIDECAR).read_text())["registers"] == registers
    loaded = load_model(Path(extracted(kind)[0]["model"]["path"]))
    store = saev.open_store(store_dir)
    for ex in (0, 5):
        image = Image.open(image_folder / extraction.sample(ex)["text"]).convert("RGB")
        with torch.inference_mode():
            hidden = loaded.model(pixel_values=loaded.preprocessor(images=[image], return_tensors="pt")["pixel_values"],
                                  output_hidden_states=True).hidden_states
        for layer in (0, 2):  # "layer i" = output of block i = hidden_states[i + 1]
            np.testing.assert_allclose(store.example(ex)[md["layers"].index(layer)], hidden[layer + 1][0].numpy(),
                                       rtol=1e-5, atol=1e-5)
        for token in range(1 + registers):
            assert store.find(ex, token) == (ex, token)
            np.testing.assert_array_equal(saev.read_vector(store_dir, ex, 2, token),
                                          extraction.activations("layer_2", ex)[token])
    assert saev.verify(store_dir) == []
    no_cls = [int(t) for b in ShuffledActivations(store_dir, batch_size=32, include_cls=False) for t in b["token_idx"]]
    assert sorted(set(no_cls)) == list(range(1, 1 + registers + 16)) and len(no_cls) == 8 * (registers + 16)


@pytest.mark.parametrize("kind", ["deit", "beit", "data2vec_vision", "ijepa", "vit_msn"])
def test_upstream_flavor_is_refused_for_families_saev_does_not_know(extracted, kind):
    with pytest.raises(ConfigError, match="saev.flavor: upstream needs an image model of a family saev knows"):
        build(extracted, kind, flavor="upstream")


# ------------------------------------------------------------------------ labels.bin from masks

def expected_patch_labels(mask: np.ndarray, patch: int, pixel_agg: str, bg: int = 0) -> list[int]:
    """Row-major tiles of a processed mask, each labelled by counting its pixels one by one."""
    from collections import Counter

    out = []
    for gy in range(mask.shape[0] // patch):
        for gx in range(mask.shape[1] // patch):
            counts = Counter(mask[gy * patch:(gy + 1) * patch, gx * patch:(gx + 1) * patch].ravel().tolist())
            if pixel_agg == "prefer-fg" and set(counts) != {bg}:
                counts.pop(bg, None)
            top = max(counts.values())
            out.append(min(label for label, n in counts.items() if n == top))
    return out


# (kind, coarse mask h x w, blow-up factor, the processor's crop of the coarse map, registers)
GEOMETRY = {
    # BitImageProcessor: shortest edge 64 -> 32 (width 96 -> 48), then a centre crop 32x32: columns 8..40
    "dinov2": ((32, 48), (2, 2), np.s_[:, 8:40], 0),
    "dinov2_registers": ((32, 48), (2, 2), np.s_[:, 8:40], tiny.REGISTERS),
    # SiglipImageProcessor: a plain resize of 64x96 to 32x32, no crop
    "siglip": ((32, 32), (2, 3), np.s_[:, :], 0),
    # DeiTImageProcessor: a plain resize to 32x32, then a 32x32 crop that keeps it all; the distillation
    # token's column is a register's
    "deit": ((32, 32), (2, 3), np.s_[:, :], 1),
}


@pytest.fixture(scope="module")
def segmentation(tmp_path_factory):
    """segmentation(kind) -> (images dir, masks dir, coarse maps) sized for that kind's processor."""
    cache = {}

    def get(kind):
        hw, factor = GEOMETRY[kind][:2]
        if (hw, factor) not in cache:
            cache[hw, factor] = tiny.write_segmentation_folder(tmp_path_factory.mktemp("seg"), hw, factor)
        return cache[hw, factor]
    return get


@pytest.mark.parametrize("kind", list(GEOMETRY))
@pytest.mark.parametrize("pixel_agg", ["majority", "prefer-fg"])
def test_labels_bin_from_masks_follows_the_processor(extracted, segmentation, kind, pixel_agg):
    """labels.bin holds, per image, the label of every patch of the mask resized and cropped exactly as
    the pixels were; register columns hold 255; the settings change HASH; the loader filters on it."""
    images, masks, coarse = segmentation(kind)
    _, _, crop, registers = GEOMETRY[kind]
    labels_cfg = {"masks": str(masks), "mask_suffix": ".png", "pixel_agg": pixel_agg, "bg_label": 0}
    extraction, store_dir = build(extracted, kind, images, patch_labels=labels_cfg)
    md = json.loads((store_dir / "metadata.json").read_text())
    n, p = md["n_examples"], md["patches_per_ex"]
    assert n == len(coarse) == 6 and p == registers + 16
    labels = np.fromfile(store_dir / "labels.bin", dtype=np.uint8).reshape(n, p)
    for ex in range(n):
        rel = extraction.sample(ex)["text"]
        want = expected_patch_labels(coarse[int(rel.split("_")[-1][:2])][crop], tiny.PATCH, pixel_agg)
        assert labels[ex, registers:].tolist() == want, (kind, rel)
        assert (labels[ex, :registers] == REGISTER_LABEL).all()
    assert set(np.unique(labels[:, registers:])) <= {0, 1, 2, 3, 9} and 9 in labels
    assert saev.verify(store_dir) == []
    assert saev.decode_data(md["data"])["patch_labels"]["pixel_agg"] == pixel_agg
    _, plain = build(extracted, kind, images)
    assert plain.name != store_dir.name and not (plain / "labels.bin").exists()
    kept = sorted((int(e), int(t)) for b in ShuffledActivations(store_dir, batch_size=7, include_cls=False,
                                                                 keep_labels=[9])
                  for e, t in zip(b["example_idx"], b["token_idx"]))
    cls = int(md["cls_token"])
    assert kept == sorted((int(e), int(c) + cls) for e, c in zip(*np.nonzero(labels == 9)))


def test_bad_masks_are_named_and_nothing_is_written(extracted, segmentation, tmp_path):
    from PIL import Image

    images, masks, _ = segmentation("dinov2")
    config, extract_dir = extracted("dinov2", images)
    extraction = open_extraction(extract_dir)
    bad = tmp_path / "masks"
    shutil.copytree(masks, bad)
    cfg = {**config["saev"], "patches_per_shard": PPS,
           "patch_labels": {"masks": str(bad), "mask_suffix": ".png", "pixel_agg": "majority", "bg_label": 0}}
    root = tmp_path / "saev"
    victim = bad / "b" / "img_03.png"

    def fails(match):
        with pytest.raises((FormatError, ConfigError), match=match):
            write(extraction, cfg, root)
        assert not root.exists() or not any(root.iterdir())  # nothing half-written under the store name

    victim.unlink()
    fails(r"img_03\.png: mask missing")
    Image.new("L", (10, 10)).save(victim)
    fails(r"img_03\.png: mask is 10x10, its image is 96x64")
    Image.new("RGB", (96, 64)).save(victim)
    fails(r"img_03\.png: mask mode 'RGB'")
    Image.fromarray(np.full((64, 96), 300, dtype=np.uint16)).save(victim)
    fails(r"img_03\.png: class ids must be 0-255")
    with pytest.raises(ConfigError, match="image dataset"):
        build(extracted, "bert", patch_labels=cfg["patch_labels"])



def test_a_photo_stored_sideways_gets_its_upright_masks_labels(extracted, segmentation, tmp_path):
    """An image stored turned with an EXIF Orientation tag runs upright (as Hugging Face datasets shows
    it), and its mask, upright as datasets shows it too, labels its patches: the same activations and
    labels.bin as the upright photo; a mask in the stored pixels' orientation is refused by size."""
    from PIL import Image

    images, masks, _ = segmentation("dinov2")
    turned = tmp_path / "images"
    shutil.copytree(images, turned)
    victim = turned / "b" / "img_03.png"
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: stored turned anticlockwise
    Image.open(victim).transpose(Image.Transpose.ROTATE_90).save(victim, exif=exif)
    section = {"patch_labels": {"masks": str(masks), "mask_suffix": ".png", "pixel_agg": "majority", "bg_label": 0}}
    upright_extraction, upright_store = build(extracted, "dinov2", images, **section)
    extraction, store = build(extracted, "dinov2", turned, **section)
    index = [row["text"] for _, _, row in extraction.iter_samples()].index("b/img_03.png")
    assert np.array_equal(extraction.activations("layer_0", index), upright_extraction.activations("layer_0", index))
    assert (store / "labels.bin").read_bytes() == (upright_store / "labels.bin").read_bytes()
    sideways = tmp_path / "masks"
    shutil.copytree(masks, sideways)
    Image.open(sideways / "b" / "img_03.png").transpose(Image.Transpose.ROTATE_90).save(sideways / "b" / "img_03.png")
    config = {**extracted("dinov2", turned)[0]["saev"], "patches_per_shard": PPS,
              "patch_labels": {**section["patch_labels"], "masks": str(sideways)}}
    with pytest.raises(FormatError, match=r"img_03\.png: mask is 64x96, its image is 96x64"):
        write(extraction, config, tmp_path / "saev")

def test_a_mask_named_out_of_the_masks_folder_is_refused(tmp_path):
    """A sample text climbing out with `..` (or absolute), read from the extraction: the file outside
    the masks folder was read as the image's labels; refused naming it. A mask that is a link to a
    file still reads, as the image folder's own links do when it is extracted."""
    from PIL import Image
    from actstore.patch_labels import mask_path, read_mask

    outside = tmp_path / "outside.png"
    Image.fromarray(np.full((4, 4), 7, np.uint8)).save(outside)
    masks = tmp_path / "masks"
    (masks / "b").mkdir(parents=True)
    for rel in ("../outside.jpg", "b/../../outside.jpg", str(outside)):
        with pytest.raises(FormatError, match=rf"saev.patch_labels.masks: '{re.escape(rel)}' is not a relative path"):
            mask_path(masks, rel, ".png")
    (masks / "b" / "img_00.png").symlink_to(outside)
    assert read_mask(mask_path(masks, "b/img_00.jpg", ".png"), (4, 4)).tolist() == [[7] * 4] * 4


def test_labels_for_a_sample_that_is_no_image_file_are_refused(model_dir, tmp_path):
    """An image table's sample text names its shard and row ("<shard>.parquet#0"), no file under the
    dataset path: the image's size was read from that path, a bare FileNotFoundError; now a ConfigError
    naming it and what saev.patch_labels needs."""
    from PIL import Image

    masks, data = tmp_path / "masks", tmp_path / "data"
    masks.mkdir()
    data.mkdir()
    Image.fromarray(np.zeros((64, 96), np.uint8)).save(masks / "train-00000-of-00001.png")
    section = {"masks": str(masks), "mask_suffix": ".png", "pixel_agg": "majority", "bg_label": 0}
    with pytest.raises(ConfigError, match=r"parquet#0: no such image under .*data: saev.patch_labels names masks"):
        image_patch_labels(data, ["train-00000-of-00001.parquet#0"], model_dir("dinov2"), tiny.PATCH, section, 16, 0,
                           progress=False)


def test_mask_through_an_interpolating_processor_is_refused(tmp_path):
    """A processor that ignores resample=NEAREST would blend class ids: refused, naming the mask."""
    from transformers import SiglipImageProcessor
    from actstore.patch_labels import processed_mask

    class Bilinear(SiglipImageProcessor):
        def __call__(self, images, **kwargs):
            kwargs.pop("resample")
            return super().__call__(images, resample=2, **kwargs)  # PIL BILINEAR

    mask = np.kron(np.array([[0, 200], [50, 9]], dtype=np.uint8), np.ones((33, 47), np.uint8))
    with pytest.raises(ConfigError, match="m.png: .*nearest-neighbour"):
        processed_mask(Bilinear(size={"height": 32, "width": 32}), mask, tmp_path / "m.png")
    exact = processed_mask(SiglipImageProcessor(size={"height": 32, "width": 32}), mask, tmp_path / "m.png")
    assert exact.shape == (32, 32) and set(np.unique(exact)) == {0, 9, 50, 200}


@pytest.mark.slow
def test_snakemake_saev_target_writes_labels_bin(model_dir, segmentation, tmp_path):
    """The workflow path: `snakemake saev` with saev.patch_labels writes the same labels.bin as the library.
    One part (a job each of extract and saev_shards fewer): the labels of an extraction of two parts are
    the library tests' (test_labels_bin_from_masks_follows_the_processor); the saev job computes them whole."""
    images, masks, coarse = segmentation("dinov2")
    config = {"dump_to": str(tmp_path / "dump"), "model": {"path": str(model_dir("dinov2"))},
              "dataset": {"path": str(images)}, "extract": {"layers": [1], "parts": 1, "batch_size": 4},
              "saev": {"patch_labels": {"masks": str(masks), "pixel_agg": "prefer-fg"}},
              **{s: {"enabled": False} for s in ("pickle", "lmprobe", "zarr", "sae", "validate")}}
    store = tiny.run_saev_stage(tmp_path, config, "seg")
    assert saev.verify(store) == []
    labels = np.fromfile(store / "labels.bin", dtype=np.uint8).reshape(6, 16)
    extraction = open_extraction(next((tmp_path / "dump" / "extract").glob("*/extract.json")).parent)
    for _, _, row in extraction.iter_samples():
        want = expected_patch_labels(coarse[int(row["text"].split("_")[-1][:2])][:, 8:40], tiny.PATCH, "prefer-fg")
        assert labels[row["sample_idx"]].tolist() == want


def test_labels_bin_linked_from_outside_the_store_is_never_read(tmp_path):
    """verify named the link, but the loader's keep_labels filtered by the outside file's bytes."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(bytes(6 * 4))
    (store_dir / "labels.bin").symlink_to(outside)
    with pytest.raises(FormatError, match=r"'labels.bin' leads outside"):
        ShuffledActivations(store_dir, keep_labels=[0])
