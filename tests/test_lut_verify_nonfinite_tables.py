"""Review of three leftovers: a LUT table holding inf or NaN under verify, read_vector on a padded pickle
store, checkpoint sizing of a model whose config.json names its weights file."""
from __future__ import annotations

import json
import re
import shutil
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from actstore.checkpoint import INDEX, SINGLE, check_checkpoint_files, tensor_bytes
from actstore.errors import ConfigError
from actstore.formats import lut as lut_format
from actstore.formats import pickle as ps
from actstore.formats.lut import check as lut_check
from actstore.formats.pickle.layout import METADATA
from actstore.models import load_model
from test_lut_install_hostile_inputs import K, Tiny, tables_for
from test_pickle_merge_ranges_layers import machines  # noqa: F401 (a fixture)
from test_tower_loading import assert_same_tensors, reference_tower, sharded_copy


def _lut_with(tmp_path, dtype: torch.dtype, key: str, value: float, index: int):
    """A LUT written by write_lut whose `layers.0.q` table holds `value` at flat `index` of `key`,
    rewritten by another writer that records no sha256 or size (the spec has neither)."""
    torch.manual_seed(0)
    tables = {path: {k: v.to(dtype) for k, v in t.items()} for path, t in tables_for(Tiny()).items()}
    lut = lut_format.write_lut(tmp_path, tables, K)
    file = lut / "layers.0.q.lut.safetensors"
    edited = load_file(str(file))
    edited[key].view(-1)[index] = value
    save_file(edited, str(file))
    meta = json.loads((lut / "metadata.json").read_text())
    for entry in meta["layers"].values():
        del entry["sha256"], entry["bytes"]
    (lut / "metadata.json").write_text(json.dumps(meta))
    return lut, file


@pytest.mark.parametrize("dtype, key, value", [(torch.float16, "precomputed_products", float("nan")),
                                               (torch.bfloat16, "encoder_weight", float("inf")),
                                               (torch.bfloat16, "target_bias", float("-inf"))])
def test_verify_names_a_lut_table_holding_inf_or_nan(tmp_path, dtype, key, value):
    """A table with no sha256 recorded holding one NaN or inf passed verify; only loading refused it.
    verify names the file and key, as loading does."""
    lut, file = _lut_with(tmp_path, dtype, key, value, 5)
    named = f"{file}: key {key!r} holds 1 inf or NaN values"
    assert lut_format.verify(lut) == [named]
    with pytest.raises(Exception, match=re.escape(named)):
        lut_format.open_lut(lut).load("layers.0.q")


def test_verify_scans_a_lut_table_in_pieces(tmp_path, monkeypatch):
    """The scan reads a few values at a time (a table can be GBs): a value in a later piece, past the
    first, is found; a finite store passes."""
    monkeypatch.setattr(lut_check, "SCAN_VALUES", 7)
    lut, file = _lut_with(tmp_path, torch.float16, "precomputed_products", float("nan"), 7 * 9 + 3)
    assert lut_format.verify(lut) == [f"{file}: key 'precomputed_products' holds 1 inf or NaN values"]
    finite, _ = _lut_with(tmp_path / "finite", torch.float16, "precomputed_products", 1.5, 0)
    assert lut_format.verify(finite) == []


def test_verify_names_a_lut_table_whose_header_gives_a_key_twice(tmp_path):
    """The safetensors library reads a header giving a key twice (one of the two wins): the scan for inf
    and NaN reads it as strictly as actstore's other headers and names the file, not a crash."""
    lut, file = _lut_with(tmp_path, torch.float16, "encoder_bias", 0.5, 0)
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length].decode()
    entry = re.search(r'"encoder_bias":\{[^}]*\}', header).group(0)
    twice = header.replace(entry, f"{entry},{entry}", 1).rstrip()
    twice += " " * (-len(twice) % 8)
    file.write_bytes(struct.pack("<Q", len(twice)) + twice.encode() + data[8 + length:])
    [problem] = lut_format.verify(lut)
    assert problem.startswith(f"{file}: unreadable safetensors") and "encoder_bias" in problem


def _padded_store(store) -> int:
    """`store` rewritten as the spec's example writes one (no `actstore` block nor our token counts;
    each activation padded with zero rows past its metadata.token_count); the padded length."""
    meta = ps.load_metadata(store)
    meta.pop("actstore")
    meta["statistics"].pop("total_tokens")
    padded = 1 + max(item["activation"].shape[0] for info in meta["shards"]
                     for items in ps.load_shard(store, info).values() for item in items)
    for info in meta["shards"]:
        shard = ps.load_shard(store, info)
        for items in shard.values():
            for item in items:
                act = item["activation"]
                item["activation"] = np.concatenate([act, np.zeros((padded - len(act), act.shape[1]), act.dtype)])
                item["shape"] = item["activation"].shape
        path = store / info["filename"]
        sha256 = ps.dump_shard(shard, path, compressed=True, compresslevel=1, compressor="isal")
        meta["statistics"]["total_size_bytes"] += path.stat().st_size - info["size_bytes"]
        info.update(size_bytes=path.stat().st_size, checksum="sha256:" + sha256)
        info.pop("num_tokens")
    (store / METADATA).write_text(json.dumps(meta))
    return padded


def test_read_vector_of_a_padded_pickle_store_stops_at_the_sample_token_count(machines, tmp_path):
    """The spec pads each activation to max_seq_length (token_count 487 of 512 rows): read_vector gave
    a padding row (zeros) as the activation of a token the sample does not have."""
    store = shutil.copytree(machines / "machine-0000", tmp_path / "store")
    info = ps.load_metadata(store)["shards"][0]
    layer, sample = info["layers"][0], info["sample_id_range"][0]
    item = next(i for i in ps.load_shard(store, info)[f"layer_{layer}"] if i["sample_idx"] == sample)
    count = item["metadata"]["token_count"]
    padded = _padded_store(store)
    assert ps.verify(store) == []
    np.testing.assert_array_equal(ps.read_vector(store, sample, layer, count - 1), item["activation"][count - 1])
    assert ps.read_vector(store, sample, layer, count) is None
    assert ps.read_vector(store, sample, layer, padded - 1) is None


def _retargeted_model(folder, out, sharded: bool):
    """A copy of the model folder whose config.json's transformers_weights names its real weights, moved
    to weights/tuned.safetensors (or saved in shards, their index moved to weights/), beside a stale
    model.safetensors holding the vision tower alone, zeroed (a base checkpoint left where a fine-tune
    was saved); the real weights."""
    if sharded:
        sharded_copy(folder, out)
        (out / "weights").mkdir()
        named = (out / INDEX).rename(out / "weights" / "tuned.safetensors.index.json").relative_to(out)
    else:
        shutil.copytree(folder, out)
        (out / "weights").mkdir()
        named = (out / SINGLE).rename(out / "weights" / "tuned.safetensors").relative_to(out)
    weights = load_file(str(folder / SINGLE))
    save_file({name: torch.zeros_like(t) for name, t in weights.items() if "vision_tower" in name}, str(out / SINGLE),
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "transformers_weights": named.as_posix()}))
    return weights


@pytest.mark.parametrize("sharded", [False, True])
def test_the_weights_config_json_names_are_the_ones_sized_and_read(model_dir, tmp_path, sharded):
    """from_pretrained loads the file (or shard index) config.json's transformers_weights names in place
    of model.safetensors: the vision tower was read from model.safetensors (zeros here) and the jobs
    sized by its tensors."""
    model = tmp_path / "model"
    weights = _retargeted_model(model_dir("llava"), model, sharded)
    assert tensor_bytes(model) == {name: t.nbytes for name, t in weights.items()}
    assert_same_tensors(load_model(model, "float32", "cpu", tower="vision").model, reference_tower(model))


def test_a_shard_the_named_index_lists_is_named_with_that_index(tmp_path):
    """A shard missing from the index config.json's transformers_weights names is blamed on that index,
    not on model.safetensors.index.json, which the folder does not hold."""
    (tmp_path / "weights").mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    (tmp_path / "weights" / "tuned.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "a.safetensors", "v": "gone.safetensors"}}))
    (tmp_path / "config.json").write_text(json.dumps({"transformers_weights": "weights/tuned.safetensors.index.json"}))
    with pytest.raises(ConfigError, match=r"gone\.safetensors, which weights/tuned\.safetensors\.index\.json names"):
        check_checkpoint_files(tmp_path)
