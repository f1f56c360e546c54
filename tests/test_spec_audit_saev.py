"""Review 66: the saev store checked against /work/shared/specs/saev-protocol.md (protocol 2.1) and against
saev's own readers (OSU-NLP-Group/saev at 3d73f1f, its newest snapshot: IndexedDataset, ordered and
shuffled DataLoaders, Metadata.load, ShardInfo.load). Those readers read every vector of our upstream
stores bitwise equal (a [2, 0] layer order, a short last shard, labels.bin); the four faults it pinned (as
xfail(strict) tests, since fixed) are tested here. They need no saev checkout: each pins the bytes or
fields that saev's code would trip on, quoted in its docstring."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import ConfigError, FormatError
from actstore.formats import saev
from actstore.formats.extract.read import open_extraction
from actstore.formats.saev.layout import store_name
from actstore.model_config import read_model_config

from test_saev_dropped_tokens_protocol import upstream_store


def test_a_store_of_layers_in_config_order_follows_the_spec_offsets(extracted, tmp_path):
    """Spec §4.2: layer_idx = layers.index(layer), offset = (ex_in_shard*L*T + layer_idx*T + token) * D * 4.
    saev.layers [2, 0] is kept in that order (not sorted), and a 3-example budget leaves a short last
    shard: every vector read by hand at the spec's offset is the extraction's own block output."""
    config, extract_dir = extracted("dinov2")
    extraction = open_extraction(extract_dir)
    tokens = int(np.diff(extraction.parts[0].offsets)[0])
    section = {**config["saev"], "layers": [2, 0], "patches_per_shard": 3 * 2 * tokens}
    store = saev.write_store(extraction, section, tmp_path, model_config=read_model_config(config["model"]["path"]),
                             progress=False)
    md = json.loads((store / "metadata.json").read_text())
    shards = json.loads((store / "shards.json").read_text())
    n_layers, d_model, per_shard = len(md["layers"]), md["d_model"], 3
    assert md["layers"] == [2, 0] and md["patches_per_ex"] + md["cls_token"] == tokens
    assert [s["n_examples"] for s in shards] == [3, 3, 2] and md["n_examples"] == extraction.n_samples == 8
    for example in range(md["n_examples"]):
        shard_idx, ex_in_shard = divmod(example, per_shard)
        raw = (store / f"acts{shard_idx:06d}.bin").read_bytes()
        for layer in (0, 2):
            layer_idx = md["layers"].index(layer)
            for token in range(tokens):
                offset = ((ex_in_shard * n_layers * tokens) + layer_idx * tokens + token) * d_model * 4
                vector = np.frombuffer(raw, "<f4", d_model, offset)
                want = np.asarray(extraction.activations(f"layer_{layer}", example), np.float32)[token]
                np.testing.assert_array_equal(vector, want)


def test_extractions_that_differ_get_stores_of_different_hash(extracted, tmp_path):
    """Spec intro/§1: 'Referenced by a content-hash, so identical configs collide, divergent ones never do'.
    write_store's default extract_hash=None left `data` naming nothing of the extraction's bytes: a
    float16-storage and a float32-storage extraction of one model and dataset got one HASH, the second
    write replacing the first store, verify clean. `data` now holds the extraction's digest."""
    stores = []
    for extract in ({}, {"storage_dtype": "float16"}):
        config, extract_dir = extracted("bert", extract=extract)
        stores.append(saev.write_store(open_extraction(extract_dir), config["saev"], tmp_path, model_config=None,
                                       progress=False))
    assert stores[0].name != stores[1].name, f"both extractions wrote {stores[0]}"
    assert [saev.verify(store) for store in stores] == [[], []]


def rewrite_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value, indent=2))


def test_verify_names_a_key_saev_metadata_refuses_in_an_upstream_store(tmp_path):
    """Flavor upstream promises what saev reads; saev's Metadata.load builds Metadata(**dct) and raises
    TypeError on any key outside its 13 fields. upstream_hash hashes those 13 alone, so an extra key left
    the directory name right and verify reported nothing."""
    store = upstream_store(tmp_path / "saev", registers=0)
    rewrite_json(store / "metadata.json", lambda md: md.update(note="added"))
    problems = saev.verify(store)
    assert any(str(store / "metadata.json") in p and "note" in p for p in problems), problems


def test_verify_names_a_shard_entry_key_saev_refuses_in_an_upstream_store(tmp_path):
    """Spec §2.2: each shard object has the fields name and n_examples; saev's ShardInfo.load builds
    Shard(**entry) and raises TypeError on any other key. An upstream store (never written with checksums
    in shards.json) whose entry gained one verified clean."""
    store = upstream_store(tmp_path / "saev", registers=0)
    rewrite_json(store / "shards.json", lambda shards: shards[0].update(sha256="0" * 64))
    problems = saev.verify(store)
    assert any(str(store / "shards.json") in p and "sha256" in p for p in problems), problems


def test_a_raw_plan_with_a_relative_dataset_path_is_refused_naming_the_field(tmp_path):
    """Spec §2.1: dataset is the 'absolute path to original dataset root' (runs symlink back to the images
    through it). write_raw_store took any string, writing a relative path into metadata.json and its hash."""
    md = {"family": "dinov2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": 3, "cls_token": True,
          "d_model": 2, "n_examples": 2, "patches_per_shard": 8, "dtype": "float32",
          "data": saev.encode_data({"source": "test"}), "dataset": "photos", "protocol": saev.PROTOCOL}

    def fill(start: int, out: np.ndarray) -> None:
        out[:] = start
    with pytest.raises((FormatError, ConfigError), match="'dataset' = 'photos'"):
        saev.write_raw_store(saev.Plan(md, None, {}), fill, tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []  # refused before any shard was written


def test_a_store_saev_wrote_with_a_relative_dataset_path_still_opens_and_verifies(tmp_path):
    """The writer alone refuses a relative `dataset`: saev's own writer may record one, and its stores
    (named by their metadata, relative path and all) must still open and verify."""
    store = upstream_store(tmp_path / "saev", registers=0)
    rewrite_json(store / "metadata.json", lambda md: md.update(dataset="photos"))
    renamed = tmp_path / "saev" / store_name(json.loads((store / "metadata.json").read_text()))
    store.rename(renamed)
    assert saev.verify(renamed) == []
    assert saev.open_store(renamed).metadata["dataset"] == "photos"
