"""Review 62: safetensors headers and checkpoint loading, compared with what the safetensors library reads."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from actstore.checkpoint import INDEX, SINGLE, tensor_bytes
from actstore.errors import ConfigError

TOWER = "vision_tower.a.weight"
OTHER = "vision_tower.b.weight"
SHARD = "model-00001-of-00001.safetensors"


def write_checkpoint(folder: Path, header: dict, data: bytes) -> Path:
    """A sharded checkpoint in `folder`: its index, and one shard of exactly this header and data (whose
    header alone sizes the tower's job: no shard is opened by the library before the job runs)."""
    folder.mkdir()
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = folder / SHARD
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    (folder / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys([TOWER, OTHER], SHARD)}))
    return path


def entry(dtype: str, shape: list, offsets: list) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


# Each: a header the library refuses to load, the tensor (or field) the refusal names, the data's length.
REFUSED = {
    "overlapping": ({TOWER: entry("F32", [4], [0, 16]), OTHER: entry("F32", [4], [0, 16])}, OTHER, 16),
    "gap": ({TOWER: entry("F32", [2], [0, 8]), OTHER: entry("F32", [2], [12, 20])}, OTHER, 20),
    "trailing-data": ({TOWER: entry("F32", [2], [0, 8])}, "8 of its 16 bytes", 16),
    "shape-not-offsets": ({TOWER: entry("F32", [1000], [0, 8])}, TOWER, 8),
    "unknown-dtype": ({TOWER: entry("F12", [2], [0, 8])}, TOWER, 8),
    "no-dtype": ({TOWER: {"shape": [2], "data_offsets": [0, 8]}}, TOWER, 8),
    "negative-dim": ({TOWER: entry("F32", [-2, -1], [0, 8])}, TOWER, 8),
    "float-dim": ({TOWER: entry("F32", [2.0], [0, 8])}, TOWER, 8),
    "overflowing-shape": ({TOWER: entry("F32", [2**40, 2**40, 0], [0, 0])}, TOWER, 0),
    "half-a-byte": ({TOWER: entry("F4", [3], [0, 2])}, TOWER, 2),
    "metadata-not-text": ({"__metadata__": {"k": 1}, TOWER: entry("F32", [2], [0, 8])}, "__metadata__", 8),
    "metadata-empty-list": ({"__metadata__": [], TOWER: entry("F32", [2], [0, 8])}, "__metadata__", 8),
    "entry-not-object": ({TOWER: [0, 8]}, TOWER, 8),
    "dtype-a-list": ({TOWER: entry(["F32"], [2], [0, 8])}, TOWER, 8),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_a_header_the_library_refuses_does_not_size_the_tower_job(case, tmp_path):
    """tensor_bytes (the tower job's memory request) took any header whose data_offsets lay within the
    data: two tensors claiming the same bytes were counted twice (so N tensors sized N times the file),
    and a dtype, shape or metadata the library refuses sized a job whose load then failed on the
    cluster. Whatever the library refuses is a ConfigError naming the file and the tensor at the parse."""
    header, named, data_bytes = REFUSED[case]
    path = write_checkpoint(tmp_path / "model", header, b"\0" * data_bytes)
    with pytest.raises(Exception), safe_open(str(path), framework="pt") as handle:
        [handle.get_tensor(name) for name in handle.keys()]
    with pytest.raises(ConfigError, match=f"{SHARD} has no readable safetensors header .*{named}"):
        tensor_bytes(path.parent)


def test_every_dtype_and_shape_the_library_reads_is_sized_as_it_reads_it(tmp_path):
    """No header the library loads is refused: sub-byte, 8-bit float and complex dtypes, a scalar and an
    empty tensor, metadata, each sized as the bytes the library gives it."""
    tensors = {"vision_tower.f32": torch.ones(3, 2), "vision_tower.bf16": torch.ones(5, dtype=torch.bfloat16),
               "vision_tower.bool": torch.ones(7, dtype=torch.bool), "vision_tower.scalar": torch.tensor(2.0),
               "vision_tower.empty": torch.ones(0, 4), "vision_tower.c64": torch.ones(3, dtype=torch.complex64),
               "vision_tower.f8": torch.ones(9).to(torch.float8_e4m3fn)}
    folder = tmp_path / "model"
    folder.mkdir()
    save_file(tensors, folder / SINGLE, metadata={"format": "pt"})
    with safe_open(str(folder / SINGLE), framework="pt") as handle:
        expected = {name: handle.get_tensor(name).nbytes for name in handle.keys()}
    assert tensor_bytes(folder) == expected


def test_a_sub_byte_dtype_the_library_reads_is_sized(tmp_path):
    """F4 (two values a byte), which torch's save_file cannot write, read as the library reads it."""
    path = write_checkpoint(tmp_path / "model", {"__metadata__": None, TOWER: entry("F4", [4, 2], [0, 4])}, b"\0" * 4)
    with safe_open(str(path), framework="numpy") as handle:
        assert handle.get_slice(TOWER).get_shape() == [4, 2]
    assert tensor_bytes(path.parent) == {TOWER: 4}


def test_an_empty_tensor_of_huge_dims_the_library_reads_is_sized(tmp_path):
    """[2**61, 0] float32: 2**61 values before the 0 (no usize overflow), 2**66 bits had they been counted
    first: the library reads it as 0 bytes."""
    path = write_checkpoint(tmp_path / "model", {TOWER: entry("F32", [2**61, 0], [0, 0])}, b"")
    with safe_open(str(path), framework="numpy") as handle:
        assert handle.get_slice(TOWER).get_shape() == [2**61, 0]
    assert tensor_bytes(path.parent) == {TOWER: 0}


def saelens_folder(folder: Path, cfg: dict) -> Path:
    """A TopK SAELens SAE (d_in 4, d_sae 6, k 2) with this cfg.json over the layout's fields."""
    from actstore.config import SAELENS_CFG, SAELENS_WEIGHTS
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    save_file({"W_enc": torch.randn(4, 6, generator=generator), "b_enc": torch.randn(6, generator=generator),
               "W_dec": torch.randn(6, 4, generator=generator), "b_dec": torch.randn(4, generator=generator)},
              folder / SAELENS_WEIGHTS)
    (folder / SAELENS_CFG).write_text(json.dumps({"architecture": "topk", "d_in": 4, "d_sae": 6, "k": 2,
                                                  "metadata": {"sae_lens_version": "6.0.0"}, **cfg}))
    return folder


@pytest.mark.parametrize("field", ["apply_b_dec_to_input", "rescale_acts_by_decoder_norm"])
def test_a_saelens_switch_that_is_not_a_bool_is_named(field, tmp_path):
    """cfg.json's "false" (text) was read as bool("false"), true: b_dec subtracted, or decoder norms folded
    in, by an SAE whose cfg.json says otherwise, imported silently."""
    from actstore.errors import FormatError
    from actstore.sae import import_sae
    folder = saelens_folder(tmp_path / "sae", {field: "false"})
    with pytest.raises(FormatError, match=f"{folder}/cfg.json: {field} 'false' is a str, not true or false"):
        import_sae(folder, "saelens", k_active=2)


def test_saelens_switches_of_either_value_still_import(tmp_path):
    from actstore.sae import import_sae
    plain = import_sae(saelens_folder(tmp_path / "plain", {}), "saelens", k_active=2)
    off = import_sae(saelens_folder(tmp_path / "off", {"apply_b_dec_to_input": False}), "saelens", k_active=2)
    assert torch.equal(plain.decoder_weight, off.decoder_weight)
    assert not torch.equal(plain.encoder_bias, off.encoder_bias)


def test_a_k_active_of_thousands_of_digits_is_named(tmp_path):
    """load_sae's int() of a header k_active past Python's 4300-digit limit was a bare ValueError,
    naming neither the file nor the field."""
    from actstore.errors import FormatError
    from actstore.sae.checkpoint import load_sae
    from actstore.safetensors_io import save_safetensors
    state = {"encoder_weight": torch.ones(6, 4), "encoder_bias": torch.ones(6), "decoder_weight": torch.ones(6, 4),
             "decoder_bias": torch.ones(4)}
    path = tmp_path / "sae.safetensors"
    save_safetensors(state, path, {"k_active": "1" * 5000})
    with pytest.raises(FormatError, match=f"{path}: header k_active '1111.* is not a whole number in 1..num_basis"):
        load_sae(path)


def test_a_missing_index_config_json_names_is_a_config_error(tmp_path):
    """config.json's transformers_weights naming a shard index that is not there was a bare
    FileNotFoundError out of the parse's job sizing, not the ConfigError naming the folder."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"transformers_weights": "sub/model.safetensors.index.json"}))
    with pytest.raises(ConfigError, match=f"model.path {folder}: sub/model.safetensors.index.json names no weight_map"):
        tensor_bytes(folder)


def test_a_saev_sae_with_no_inputs_is_named(tmp_path):
    """W_enc [0, 6] in saev's own file was a ZeroDivisionError out of its header's exp_factor check,
    naming nothing (import_sae without a hook width: the API's call)."""
    from actstore.errors import FormatError
    from actstore.sae import import_sae
    path = tmp_path / "sae.pt"
    header = {"schema": 5, "cfg": {"activation": {"cls": "TopK", "params": {"top_k": 2}}}}
    with open(path, "wb") as fh:
        fh.write(json.dumps(header).encode() + b"\n")
        torch.save({"W_enc": torch.ones(0, 6), "b_enc": torch.ones(6), "W_dec": torch.ones(6, 0),
                    "b_dec": torch.ones(0)}, fh)
    with pytest.raises(FormatError, match=rf"{path}: W_enc has shape \[0, 6\], a dimension of 0"):
        import_sae(path, "saev", k_active=2)


def test_an_actstore_sae_with_no_inputs_is_named(tmp_path):
    """load_sae took encoder_weight [6, 0]: an SAE of a hook of width 0, written out as LUT tables."""
    from actstore.errors import FormatError
    from actstore.sae.checkpoint import load_sae
    from actstore.safetensors_io import save_safetensors
    path = tmp_path / "sae.safetensors"
    save_safetensors({"encoder_weight": torch.ones(6, 0), "encoder_bias": torch.ones(6),
                      "decoder_weight": torch.ones(6, 0), "decoder_bias": torch.ones(0)}, path, {"k_active": "2"})
    with pytest.raises(FormatError, match=rf"{path}: encoder_weight has shape \[6, 0\], a dimension of 0"):
        load_sae(path)


@pytest.mark.parametrize("weight_map", [[[TOWER, SHARD]], ["ab"]], ids=["pairs", "two-letter-names"])
def test_a_weight_map_that_is_not_an_object_is_named(weight_map, tmp_path):
    """dict() made a mapping of a list of pairs (or of two-letter strings: "ab" mapped a to b), an index
    transformers refuses (its weight_map.values()), so the tower's job was sized and ran to fail there."""
    path = write_checkpoint(tmp_path / "model", {TOWER: entry("F32", [2], [0, 8])}, b"\0" * 8)
    (path.parent / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigError, match=f"model.path {path.parent}: {INDEX} weight_map is a list, not an object"):
        tensor_bytes(path.parent)
