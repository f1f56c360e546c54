"""Review 62 of the LUT format: stores its writer published that its own verify refuses, and a table
of another writer whose extra keys the reader loaded (and failed on, naming no file)."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from actstore.errors import FormatError
from actstore.formats.lut import REQUIRED_KEYS, open_lut, verify, write_lut
from test_lut_install_hostile_inputs import BASIS, Tiny, tables_for


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_write_refuses_a_table_holding_nan_or_inf(tmp_path, value):
    """precompute refused an overflow of float16's range only: a NaN or inf (a model weight holding
    one, a float32 product past its range, tables given to write_lut directly) was written and
    published, and the store's own verify (and every load) refused it after."""
    tables = tables_for(Tiny())
    tables["layers.0.q"]["precomputed_products"][3, 1] = value
    with pytest.raises(FormatError, match=r"layers\.0\.q\.lut\.safetensors: not written, key "
                                          r"'precomputed_products' holds 1 inf or NaN values"):
        write_lut(tmp_path, tables, 4)
    assert not (tmp_path / "lut").exists()
    assert not list(tmp_path.iterdir())  # nor a temporary left behind


def test_write_names_an_empty_set_of_tables(tmp_path):
    """No tables was refused as 'tables disagree on num_basis []': nothing disagreed."""
    with pytest.raises(FormatError, match="no tables to write"):
        write_lut(tmp_path / "out", {}, 4)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("k_active", [2.5, True, "3"])
def test_write_refuses_a_k_active_that_is_no_whole_number(tmp_path, k_active):
    """int() made 2.5 a k_active of 2 and True one of 1, written without a word."""
    with pytest.raises(FormatError, match=f"k_active {k_active!r} is not a whole number"):
        write_lut(tmp_path / "out", tables_for(Tiny()), k_active)
    assert not (tmp_path / "out").exists()


def _add_key(path, name, dtype, shape, nbytes):
    """`path`'s safetensors file with one more tensor, as another writer might add one."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data + b"\0" * nbytes)


def test_a_tables_extra_key_is_never_loaded(tmp_path):
    """Extra keys are allowed and never interpreted, but load read every key: one of a dtype torch
    has no type for (F6_E2M3) failed with safetensors' bare 'Dtype not understood', naming no file,
    and a large one cost its bytes in memory for nothing."""
    lut = write_lut(tmp_path, tables_for(Tiny()), 4)
    meta = json.loads((lut / "metadata.json").read_text())
    for entry in meta["layers"].values():  # another writer's store: the spec records no size or sha256
        del entry["sha256"], entry["bytes"]
    (lut / "metadata.json").write_text(json.dumps(meta))
    _add_key(lut / "layers.0.q.lut.safetensors", "other_writers_codes", "F6_E2M3", [8], 6)
    assert verify(lut) == []
    tables = open_lut(lut).load("layers.0.q")
    assert sorted(tables) == sorted([*REQUIRED_KEYS, "target_bias"])
    assert tables["precomputed_products"].shape == (BASIS, tables["bias_product"].shape[0])
    assert tables["precomputed_products"].dtype == torch.float16


@pytest.mark.parametrize("given, named", [
    ({"creation_info": {"source_model": None}}, "'creation_info.source_model' must be a string, got None"),
    ({"model_config": {"hidden_size": 0}}, "'model_config.hidden_size' must be a positive whole number, got 0"),
    ({"creation_info": {"created_at": "yesterday"}}, "'creation_info.created_at' must be an ISO 8601 time")])
def test_write_refuses_metadata_its_own_verify_would_refuse(tmp_path, given, named):
    """model_config and creation_info were written as the caller gave them: a store was published whose
    metadata.json its own verify (and every open) refused."""
    with pytest.raises(FormatError, match=f"metadata.json: field {named}"):
        write_lut(tmp_path, tables_for(Tiny()), 4, **given)
    assert not list(tmp_path.iterdir())
