"""saev review 63: a raw plan's labels.bin that no reader takes, refused only after every shard was
written, an empty last shard that memmap() could not map, and metadata.json holding a field under both
of its flavors' names."""
from __future__ import annotations

import json

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import saev

from test_saev import synthetic_store


def raw_metadata(n: int) -> dict:
    return {"family": "dinov2", "ckpt": "x", "layers": [0], "patches_per_ex": 4, "cls_token": True, "d_model": 2,
            "n_examples": n, "patches_per_shard": 8, "dtype": "float32", "data": saev.encode_data({"source": "test"}),
            "dataset": "/x", "protocol": saev.PROTOCOL}


@pytest.mark.parametrize("labels, got", [(np.zeros((3, 3), np.uint8), r"uint8 \(3, 3\)"),
                                         (np.zeros((3, 4), np.int64), r"int64 \(3, 4\)")])
def test_raw_plan_labels_of_another_shape_are_refused_before_any_shard(tmp_path, labels, got):
    """labels.bin of another shape or dtype was refused by finish_store, after every shard was filled and
    written, naming labels.bin in the store's temp dir (gone by the time the message is read)."""
    md = {**raw_metadata(3)}
    filled = []
    with pytest.raises(FormatError, match=rf"^saev\.Plan\.labels: need uint8 \(3, 4\), got {got}"):
        saev.write_raw_store(saev.Plan(md, None, {}, labels=labels), lambda start, out: filled.append(start),
                             tmp_path, progress=False)
    assert filled == []


def test_an_empty_last_shard_of_no_bytes_maps_as_no_examples(tmp_path):
    """A last shard of n_examples 0 may be 0 bytes (SaevStore.allowed_bytes), but memmap() of it raised
    numpy's "cannot mmap an empty file", naming no file; it is the shard's (0, L, T, D) examples."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    shards = json.loads((store_dir / "shards.json").read_text())
    (store_dir / "shards.json").write_text(json.dumps([*shards, {"name": "acts000002.bin", "n_examples": 0}]))
    (store_dir / "acts000002.bin").write_bytes(b"")
    store = saev.open_store(store_dir)
    assert store.memmap(2).shape == (0, 1, 5, 4)
    assert store.memmap(1).shape == (3, 1, 5, 4)


@pytest.mark.parametrize("extra", [{"patches_per_ex": 3}, {"max_tokens_per_shard": 10}])
def test_metadata_with_a_field_under_both_flavors_names_is_refused(tmp_path, extra):
    """An upstream metadata.json also holding a spec name (or a spec one an upstream name) was read with
    whichever came last in the file: the store's hash (its name) covers only its flavor's fields, so
    verify passed the directory while every reader used the other value. saev's own Metadata refuses any
    key it does not know."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    md = json.loads((store_dir / "metadata.json").read_text())
    if "patches_per_ex" in extra:
        md = saev.layout.to_upstream(md, "majority")
    (store_dir / "metadata.json").write_text(json.dumps({**md, **extra}))
    name = next(iter(extra))
    with pytest.raises(FormatError, match=rf"{store_dir / 'metadata.json'}: field {name!r} "):
        saev.open_store(store_dir)
    assert any(f"field {name!r}" in problem for problem in saev.verify(store_dir))


def test_a_shard_job_refuses_bad_raw_plan_labels_before_writing(tmp_path):
    """write_shards (a workflow shard job) checks the plan's labels as write_raw_store does."""
    md = {**raw_metadata(3)}
    plan = saev.Plan(md, None, {}, labels=np.zeros((2, 4), np.uint8))
    with pytest.raises(FormatError, match=r"saev\.Plan\.labels: need uint8 \(3, 4\), got uint8 \(2, 4\)"):
        saev.write_shards(plan, lambda start, out: None, tmp_path / "job", 1, 0)
    assert not (tmp_path / "job").exists()
