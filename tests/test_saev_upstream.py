"""saev interop: the upstream flavor saev's own code reads, and stores saev itself wrote.

The expected structures come from the field lists of saev's code at commit 3d73f1f as issue 15 lists
them (never from actstore's constants or saev's code).
"""
from __future__ import annotations

import base64
import hashlib
import json
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from actstore.errors import ConfigError, FormatError
from actstore.formats import saev
from actstore.formats.extract import open_extraction
from actstore.formats.saev.loader import ShuffledActivations
from actstore.hashing import stage_hash
from actstore.io_utils import sha256_tree_file

import tiny
from test_saev import GEOMETRY, expected_patch_labels, segmentation, write  # noqa: F401 (fixture)

SAEV_METADATA = ["family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model", "n_examples",
                 "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol"]
SAEV_FAMILIES = {"bird-mae", "clip", "dinov2", "dinov3", "fake-clip", "pe-core", "pe-spatial", "siglip"}
PER_SHARD = 5  # dinov2 tiny: 8 images -> shards of 5 and 3, the last padded by 2 examples
TOKENS, LAYERS = 17, 2


def saev_hash(md: dict) -> str:
    """saev's Metadata.hash: 8 hex of the sha256 of its compact JSON in field order."""
    ordered = {name: md[name] for name in SAEV_METADATA}
    return hashlib.sha256(json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()[:8]


def build(extracted, flavor):
    config, extract_dir = extracted("dinov2")
    section = {**config["saev"], "patches_per_shard": PER_SHARD * TOKENS * LAYERS, "flavor": flavor}
    extraction = open_extraction(extract_dir)
    return extraction, write(extraction, section, extract_dir.parent.parent / "saev", stage_hash(config, "extract"))


def every_pair(store_dir: Path, **kwargs) -> list[tuple[int, int]]:
    return [(e, t) for b in ShuffledActivations(store_dir, batch_size=7, **kwargs)
            for e, t in zip(b["example_idx"].tolist(), b["token_idx"].tolist())]


def test_upstream_store_is_what_saev_reads(extracted):
    extraction, store_dir = build(extracted, "upstream")
    md = json.loads((store_dir / "metadata.json").read_text())
    assert list(md) == SAEV_METADATA
    assert md["family"] in SAEV_FAMILIES and md["pixel_agg"] == "majority" and md["protocol"] == "2.1"
    assert md["content_tokens_per_example"] == TOKENS - 1 and md["max_tokens_per_shard"] == PER_SHARD * TOKENS * LAYERS
    assert store_dir.parts[-3:-1] == ("saev", "shards") and re.fullmatch(r"[0-9a-f]{8}", store_dir.name)
    assert store_dir.name == saev_hash(md)
    shards = json.loads((store_dir / "shards.json").read_text())
    assert shards == [{"name": "acts000000.bin", "n_examples": 5}, {"name": "acts000001.bin", "n_examples": 3}]
    full = PER_SHARD * LAYERS * TOKENS * 32 * 4
    last = (store_dir / "acts000001.bin").stat()
    assert last.st_size == full and last.st_blocks * 512 < full  # apparent size full, padding is a hole
    assert saev.verify(store_dir) == [] and saev.inspect(store_dir)["flavor"] == "upstream"
    pairs = every_pair(store_dir)
    assert sorted(pairs) == [(e, t) for e in range(8) for t in range(TOKENS)]  # each once, no padding row
    batch = next(iter(ShuffledActivations(store_dir, layers=[2], batch_size=8)))
    for act, e, t in zip(batch["act"].numpy(), batch["example_idx"].tolist(), batch["token_idx"].tolist()):
        np.testing.assert_array_equal(act, extraction.activations("layer_2", e)[t])
        np.testing.assert_array_equal(saev.read_vector(store_dir, e, 2, t), act)
    assert sum(len(block) for _, block in saev.open_store(store_dir).iter_ordered()) == 8


def test_stage_pointer_finds_the_upstream_store(extracted, tmp_path):
    _, store_dir = build(extracted, "upstream")
    stage = store_dir.parent.parent / ("0" * 64)
    saev.write_pointer(stage / "saev.json", store_dir)
    assert json.loads((stage / "saev.json").read_text())["store"] == f"../shards/{store_dir.name}"
    assert saev.resolve(stage) == store_dir and saev.detect(stage)
    pointer = json.loads((stage / "saev.json").read_text())
    (stage / "saev.json").write_text(json.dumps(pointer | {"hash": "0" * 8}))  # the stage recorded another store
    with pytest.raises(FormatError, match=r"saev\.json: hash '00000000' is not the store's name"):
        saev.resolve(stage)


@pytest.mark.parametrize("flavor", ["spec", "upstream"])
def test_shards_json_holds_only_the_spec_fields(extracted, flavor):
    _, store_dir = build(extracted, flavor)
    shards = json.loads((store_dir / "shards.json").read_text())
    assert all(set(entry) == {"name", "n_examples"} for entry in shards)
    files = json.loads((store_dir / "actstore.json").read_text())["files"]
    assert all(set(files[entry["name"]]) == {"bytes", "sha256_tree"} for entry in shards)  # checksums moved here
    # the tree hash of the whole file: the upstream flavor's last shard ends in a hole, hashed as zeros
    assert all(files[entry["name"]]["sha256_tree"] == sha256_tree_file(store_dir / entry["name"]) for entry in shards)


def test_spec_flavor_is_unchanged_but_for_the_checksums(extracted):
    _, store_dir = build(extracted, "spec")
    md = json.loads((store_dir / "metadata.json").read_text())
    assert set(md) == set(saev.METADATA_FIELDS) and store_dir.name == saev.metadata_hash(md)
    sizes = [(store_dir / f"acts{i:06d}.bin").stat().st_size for i in range(2)]
    assert sizes == [5 * LAYERS * TOKENS * 32 * 4, 3 * LAYERS * TOKENS * 32 * 4]  # exact-size last shard


def test_flavor_refused_where_saev_cannot_read_it(extracted):
    config, extract_dir = extracted("gpt2")
    extraction = open_extraction(extract_dir)
    with pytest.raises(ConfigError, match="saev.flavor: upstream needs an image model"):
        write(extraction, {**config["saev"], "flavor": "upstream"}, extract_dir.parent.parent / "saev")
    with pytest.raises(ConfigError, match="saev.flavor = 'saev'"):
        write(extraction, {**config["saev"], "flavor": "saev"}, extract_dir.parent.parent / "saev")


def saev_written(root: Path, n: int, per_shard: int, trailing_empty: bool = False) -> tuple[Path, np.ndarray]:
    """A store laid out the way saev's ShardWriter writes one: .../saev/shards/<8 hex>, metadata in its
    field names, every shard (the last included) memory-mapped at full size, no actstore.json; when n
    fills its shards exactly, saev also leaves an empty full-size shard with n_examples 0."""
    d, layers = 8, [3, 7]
    md = {"family": "dinov3", "ckpt": "facebook/dinov3-vits16-pretrain-lvd1689m", "layers": layers,
          "content_tokens_per_example": 4, "cls_token": True, "d_model": d, "n_examples": n,
          "max_tokens_per_shard": per_shard * 5 * len(layers), "dataset": "/data/images",
          "data": base64.b64encode(pickle.dumps(SimpleNamespace(root="/data/images"))).decode(),  # a class, as saev's
          "pixel_agg": "majority", "dtype": "float32", "protocol": "2.1"}
    store = root / "saev" / "shards" / saev_hash(md)
    store.mkdir(parents=True)
    (store / "metadata.json").write_text(json.dumps(md, indent=2))
    values = np.random.default_rng(1).standard_normal((n, len(layers), 5, d), dtype=np.float32)
    counts = [min(per_shard, n - lo) for lo in range(0, n, per_shard)] + ([0] if trailing_empty else [])
    for i, count in enumerate(counts):
        shard = np.zeros((per_shard, len(layers), 5, d), dtype=np.float32)
        shard[:count] = values[i * per_shard:i * per_shard + count]
        shard.tofile(store / f"acts{i:06d}.bin")
    (store / "shards.json").write_text(json.dumps([{"name": f"acts{i:06d}.bin", "n_examples": c}
                                                   for i, c in enumerate(counts)], indent=2))
    return store, values


@pytest.mark.parametrize("n, trailing_empty", [(7, False), (6, True)])
def test_store_written_by_saev_opens(tmp_path, n, trailing_empty):
    store_dir, values = saev_written(tmp_path, n, per_shard=3, trailing_empty=trailing_empty)
    store = saev.open_store(store_dir)
    assert store.flavor == "upstream" and store.patches_per_ex == 4 and store.n_examples == n
    assert saev.verify(store_dir) == []
    assert saev.inspect(store_dir)["family"] == "dinov3"
    np.testing.assert_array_equal(saev.read_vector(store_dir, n - 1, 7, 4), values[n - 1, 1, 4])
    seen = {}
    for batch in ShuffledActivations(store_dir, batch_size=4, layers=[3, 7]):
        for act, e, t in zip(batch["act"].numpy(), batch["example_idx"].tolist(), batch["token_idx"].tolist()):
            assert (e, t) not in seen
            seen[e, t] = act
    assert sorted(seen) == [(e, t) for e in range(n) for t in range(5)]  # no padding row, each once
    for (e, t), act in seen.items():
        np.testing.assert_array_equal(act, values[e, :, t])


def test_saev_written_store_drift_and_short_shard_named(tmp_path):
    store_dir, _ = saev_written(tmp_path, 7, per_shard=3)
    md = json.loads((store_dir / "metadata.json").read_text())
    (store_dir / "metadata.json").write_text(json.dumps({**md, "ckpt": "other"}))
    assert any("does not match the directory name" in p for p in saev.verify(store_dir))
    (store_dir / "metadata.json").write_text(json.dumps(md))
    with open(store_dir / "acts000002.bin", "r+b") as fh:
        fh.truncate(100)
    assert any("acts000002.bin: 100 bytes" in p for p in saev.verify(store_dir))


def test_labels_bin_of_a_store_saev_wrote_is_the_specs_checked_by_size(tmp_path):
    """labels.bin is a spec file (§1) saev writes with no record: verify named it as not listed; now
    it passes at n_examples x patches_per_ex bytes and is named at any other size."""
    store_dir, _ = saev_written(tmp_path, 7, per_shard=3)
    (store_dir / "labels.bin").write_bytes(bytes(7 * 4))
    assert saev.verify(store_dir) == []
    (store_dir / "labels.bin").write_bytes(bytes(7 * 4 + 3))
    assert saev.verify(store_dir) == [f"{store_dir / 'labels.bin'}: 31 bytes, expected 28 (uint8 n_examples 7 x "
                                      f"patches_per_ex 4 of {store_dir / 'metadata.json'})"]


def test_stores_with_checksums_in_shards_json_still_verify(extracted, tmp_path):
    """Stores written before the checksums moved keep them in shards.json; verify still reads them."""
    import shutil

    _, src = build(extracted, "spec")
    store_dir = tmp_path / src.name
    shutil.copytree(src, store_dir)
    sidecar = json.loads((store_dir / "actstore.json").read_text())
    shards = json.loads((store_dir / "shards.json").read_text())
    for entry in shards:  # as those writers recorded them: bytes and plain sha256
        sidecar["files"].pop(entry["name"])
        entry.update(plain_record(store_dir / entry["name"]))
    (store_dir / "shards.json").write_text(json.dumps(shards))
    (store_dir / "actstore.json").write_text(json.dumps(sidecar))
    assert saev.verify(store_dir) == []
    with open(store_dir / "acts000000.bin", "r+b") as fh:
        fh.write(b"\x01")
    assert saev.verify(store_dir) == [f"{store_dir / 'acts000000.bin'}: sha256 differs from shards.json"]


def plain_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


@pytest.mark.parametrize("flavor", ["spec", "upstream"])
def test_stores_with_plain_sha256_in_actstore_json_still_verify(extracted, tmp_path, flavor):
    """Stores written before the shards' tree hashes record a plain sha256 in actstore.json; verify
    still checks it, and names a changed byte."""
    import shutil

    _, src = build(extracted, flavor)
    store_dir = tmp_path / src.parent.name / src.name  # upstream's name is shards/<8 hex>
    shutil.copytree(src, store_dir)
    sidecar = json.loads((store_dir / "actstore.json").read_text())
    shards = json.loads((store_dir / "shards.json").read_text())
    for entry in shards:
        sidecar["files"][entry["name"]] = plain_record(store_dir / entry["name"])
    (store_dir / "actstore.json").write_text(json.dumps(sidecar))
    assert saev.verify(store_dir) == []
    with open(store_dir / "acts000001.bin", "r+b") as fh:
        fh.write(b"\x01")
    assert saev.verify(store_dir) == [f"{store_dir / 'acts000001.bin'}: sha256 differs from actstore.json"]


def test_flavor_has_no_default_so_saev_hashes_stay():
    from actstore.config import validate_config

    base = {"dump_to": "/d", "model": {"path": "/m"}, "dataset": {"path": "/x"}}
    plain = validate_config(json.loads(json.dumps(base)))
    assert "flavor" not in plain["saev"]
    upstream = validate_config({**json.loads(json.dumps(base)), "saev": {"flavor": "upstream"}})
    assert stage_hash(upstream, "saev") != stage_hash(plain, "saev")


@pytest.mark.slow
def test_snakemake_saev_upstream_store_behind_the_stage_pointer(model_dir, image_folder, tmp_path):
    import tiny

    config = {"dump_to": str(tmp_path / "dump"), "model": {"path": str(model_dir("dinov2"))},
              "dataset": {"path": str(image_folder)}, "extract": {"layers": [1], "parts": 1, "batch_size": 4},
              "saev": {"flavor": "upstream"},
              **{s: {"enabled": False} for s in ("pickle", "lmprobe", "zarr", "sae", "validate")}}
    store = tiny.run_saev_stage(tmp_path, config, "upstream")
    assert store.parent == tmp_path / "dump" / "saev" / "shards" and saev.verify(store) == []
    assert list(json.loads((store / "metadata.json").read_text())) == SAEV_METADATA


@pytest.mark.parametrize("kind, family", [("dinov2_registers", "dinov2"), ("dinov3", "dinov3")])
def test_upstream_store_leaves_out_the_register_tokens_as_saev_does(extracted, segmentation, kind, family):
    """saev's own dinov2 and dinov3 writers store CLS, then the patches: content token i is patch i and
    labels.bin has one column a patch. The registers stay in the extraction; the store's readers say
    they are not stored, and validation checks every other token against the extraction."""
    from actstore.verify import check_format

    images, masks, coarse = segmentation("dinov2_registers")  # the same Bit processor geometry
    _, _, crop, registers = GEOMETRY["dinov2_registers"]
    config, extract_dir = extracted(kind, images)
    extraction = open_extraction(extract_dir)
    labels_cfg = {"masks": str(masks), "mask_suffix": ".png", "pixel_agg": "majority", "bg_label": 0}
    section = {**config["saev"], "patches_per_shard": 3 * TOKENS * LAYERS, "flavor": "upstream",
               "patch_labels": labels_cfg}
    store_dir = write(extraction, section, extract_dir.parent.parent / "saev", stage_hash(config, "extract"))
    md = json.loads((store_dir / "metadata.json").read_text())
    n, tokens = extraction.n_samples, 1 + registers + 16
    assert md["family"] == family and md["cls_token"] is True and md["content_tokens_per_example"] == 16
    sidecar = json.loads((store_dir / saev.SIDECAR).read_text())
    assert sidecar["registers"] == registers and sidecar["dropped_tokens"] == list(range(1, 1 + registers))
    store = saev.open_store(store_dir)
    for ex in range(n):
        for li, layer in enumerate(md["layers"]):
            acts = extraction.activations(f"layer_{layer}", ex)
            assert acts.shape[0] == tokens
            np.testing.assert_array_equal(store.example(ex)[li], np.concatenate([acts[:1], acts[1 + registers:]]))
    labels = np.fromfile(store_dir / "labels.bin", dtype=np.uint8).reshape(n, 16)
    for ex in range(n):
        rel = extraction.sample(ex)["text"]
        assert labels[ex].tolist() == expected_patch_labels(coarse[int(rel.split("_")[-1][:2])][crop], tiny.PATCH,
                                                             "majority")
    assert saev.verify(store_dir) == []
    assert sorted(every_pair(store_dir)) == [(e, t) for e in range(n) for t in range(17)]
    report = check_format("saev", store_dir, extraction, [(e, 0, t) for e in range(n) for t in range(tokens)])
    assert report["problems"] == [] and report["not_stored"] == n * registers and report["checked"] == n * 17


def test_a_damaged_dropped_tokens_record_is_named(extracted, segmentation, tmp_path):
    images, _, _ = segmentation("dinov2_registers")
    config, extract_dir = extracted("dinov2_registers", images)
    section = {**config["saev"], "patches_per_shard": 3 * TOKENS * LAYERS, "flavor": "upstream"}
    store_dir = write(open_extraction(extract_dir), section, tmp_path / "saev")
    sidecar = json.loads((store_dir / saev.SIDECAR).read_text())
    (store_dir / saev.SIDECAR).write_text(json.dumps({**sidecar, "dropped_tokens": [3, 1]}))
    assert any("dropped_tokens must be increasing token indices, got [3, 1]" in p for p in saev.verify(store_dir))
