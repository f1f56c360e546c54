"""saev review 57: a text store copied without its windows.npy, plans whose shard arithmetic divides by zero."""
from __future__ import annotations

import pytest

from actstore.errors import ConfigError, FormatError
from actstore.formats import saev
from actstore.formats.saev.loader import ShuffledActivations

from test_saev import text_store

WINDOWS = [[0, 0, 4], [0, 4, 2], [2, 0, 3]]  # sample 0: 6 tokens in two windows, sample 1: none, sample 2: 3


def test_a_text_store_whose_recorded_windows_npy_is_missing_is_refused_not_read_as_images(tmp_path):
    """A text store copied without windows.npy (only its *.bin and *.json, to node-local disk): read as
    an image store's, read_vector gave sample 1 (which has no token) example 1's vector, sample 0's
    token 4, and the loader yielded the 3 zero-padding vectors as data, both without an error (only
    verify named it). Where actstore.json records windows.npy, both refuse it naming the file."""
    store_dir = text_store(tmp_path, WINDOWS)
    assert saev.read_vector(store_dir, 1, 0, 0) is None
    assert sum(len(b["act"]) for b in ShuffledActivations(store_dir, batch_size=4)) == 4 + 2 + 3
    (store_dir / "windows.npy").unlink()
    named = rf"{store_dir / 'windows.npy'}: missing, but {store_dir / saev.SIDECAR} records it"
    with pytest.raises(FormatError, match=named):
        saev.read_vector(store_dir, 1, 0, 0)
    with pytest.raises(FormatError, match=named):
        list(ShuffledActivations(store_dir, batch_size=4))
    assert saev.verify(store_dir) == [f"{store_dir / 'windows.npy'}: missing (listed in {saev.SIDECAR})"]


def raw_metadata(root, **fields) -> dict:
    """A one-layer ViT-shaped store's metadata (CLS + 4 patches, d_model 4, 5 examples), `fields` changed."""
    return {"family": "dinov2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": 4, "cls_token": True,
            "d_model": 4, "n_examples": 5, "patches_per_shard": 10, "dtype": "float32",
            "data": saev.encode_data({"source": "test"}), "dataset": str(root), "protocol": saev.PROTOCOL, **fields}


@pytest.mark.parametrize("fields, named", [
    ({"patches_per_shard": 3}, r"saev.patches_per_shard=3 is smaller than one example \(5 tokens x 1 layers\)"),
    ({"d_model": 0}, r"d_model 0, n_examples 5: an example needs a layer, a token and a dimension"),
    ({"layers": []}, r"layers \[\], 5 tokens"),
    ({"patches_per_ex": 0, "cls_token": False}, r"0 tokens \(patches_per_ex \+ cls_token\)"),
    ({"n_examples": -5}, r"n_examples -5: .* n_examples must be >= 0"),
])
def test_a_raw_plan_whose_shards_hold_no_example_is_named_before_writing(tmp_path, fields, named):
    """write_raw_store takes any plan: patches_per_shard below one example (a token budget taken for an
    example count), a d_model, a layer list or a token count of 0 raised ZeroDivisionError naming
    nothing; n_examples -5 wrote a shard of one example for a store no reader opens. Each is a
    ConfigError naming the fields, before any file is written."""
    plan = saev.Plan(raw_metadata(tmp_path, **fields), None, {})
    with pytest.raises(ConfigError, match=named):
        saev.write_raw_store(plan, lambda start, out: out.fill(1), tmp_path / "saev", progress=False)
    assert not (tmp_path / "saev" / plan.store_name).exists()
    good = saev.write_raw_store(saev.Plan(raw_metadata(tmp_path), None, {}), lambda start, out: out.fill(start),
                                tmp_path / "saev", progress=False)
    assert saev.verify(good) == [] and saev.open_store(good).example(4)[0, 0].tolist() == [4] * 4
