"""saev follow-ups: dropped_tokens a writer never records, iter_ordered's default chunk bounded by
bytes, a recorded labels.bin gone missing, a protocol of another major version under verify."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import saev
from actstore.formats.saev import read as saev_read
from actstore.formats.saev.loader import ShuffledActivations

from test_saev import synthetic_store


def edit_sidecar(store_dir: Path, **fields) -> None:
    sidecar = json.loads((store_dir / saev.SIDECAR).read_text())
    (store_dir / saev.SIDECAR).write_text(json.dumps({**sidecar, **fields}))


def upstream_store(root: Path, registers: int) -> Path:
    """A raw upstream dinov2 store (CLS + 3 patches) whose sidecar records what write.plan_store does
    for a model with `registers` registers; vector [example, 0, token] is example * 10 + token."""
    md = {"family": "dinov2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": 3, "cls_token": True,
          "d_model": 2, "n_examples": 3, "patches_per_shard": 2 * 4, "dtype": "float32",
          "data": saev.encode_data({"source": "test"}), "dataset": str(root), "protocol": saev.PROTOCOL}
    sidecar = {"registers": registers, "dropped_tokens": list(range(1, 1 + registers))}

    def fill(start: int, out: np.ndarray) -> None:
        out[:] = (np.arange(start, start + len(out))[:, None, None] * 10 + np.arange(4))[..., None]
    return saev.write_raw_store(saev.Plan(md, None, sidecar, flavor="upstream"), fill, root, progress=False)


@pytest.mark.parametrize("dropped", [[0], [1], [1, 2]])
def test_dropped_tokens_no_writer_records_on_a_spec_store_are_refused(tmp_path, dropped):
    """A spec-flavor store keeps every extracted token, and its writer records no dropped_tokens: an
    edited [0] made find(1, 1) return example 1's CLS vector for token 1, verify passing."""
    store_dir = synthetic_store(tmp_path, n=4, tokens=3, d=2, per_shard=2)
    edit_sidecar(store_dir, dropped_tokens=dropped)
    named = (f"{store_dir / saev.SIDECAR}: dropped_tokens must be increasing token indices, got {dropped}; "
             "its writer records none: a spec-flavor store keeps every extracted token")
    with pytest.raises(FormatError, match=re.escape(named)):
        saev.open_store(store_dir)
    assert saev.verify(store_dir) == [named]


@pytest.mark.parametrize("edit", [{"dropped_tokens": [1]}, {"dropped_tokens": [2, 3]}, {"registers": 1},
                                  {"dropped_tokens": [1.0, 2.0]}])
def test_dropped_tokens_other_than_the_registers_after_cls_are_refused(tmp_path, edit):
    """An upstream store leaves out exactly its `registers` tokens right after CLS; any other list
    shifts the extraction's tokens onto other stored vectors. The written one reads right."""
    good = upstream_store(tmp_path / "good", registers=2)
    assert saev.verify(good) == []
    assert saev.read_vector(good, 1, 0, 2) is None and saev.read_vector(good, 1, 0, 3).tolist() == [11, 11]
    bad = upstream_store(tmp_path / "bad", registers=2)
    edit_sidecar(bad, **edit)
    with pytest.raises(FormatError, match=r"dropped_tokens must be increasing token indices, got .*; its writer "
                                          r"records the registers=[12] tokens after CLS"):
        saev.open_store(bad)
    assert len(saev.verify(bad)) == 1


def test_iter_ordered_default_chunk_is_bounded_by_bytes(tmp_path, monkeypatch):
    """The default of 1024 examples a chunk read a whole shard at once (about 10 GiB for a multi-layer
    ViT store at the spec's patches_per_shard); it now holds READ_CHUNK_BYTES, at least one example,
    and yields the same examples in the same order."""
    store = saev.open_store(synthetic_store(tmp_path, n=11, tokens=3, d=2, per_shard=5))
    one_by_one = [(first, chunk) for first, chunk in store.iter_ordered(chunk_examples=1)]
    for budget, most in [(2 * store.example_bytes + 1, 2), (store.example_bytes - 1, 1)]:
        monkeypatch.setattr(saev_read, "READ_CHUNK_BYTES", budget)
        chunks = list(store.iter_ordered())
        assert max(len(chunk) for _, chunk in chunks) == most
        np.testing.assert_array_equal(np.concatenate([c for _, c in chunks]),
                                      np.concatenate([c for _, c in one_by_one]))
        assert [first for first, chunk in chunks for first in range(first, first + len(chunk))] == list(range(11))


def test_a_recorded_labels_bin_gone_missing_is_named_not_absent(tmp_path):
    """labels.bin recorded in actstore.json and deleted: labels() returned None and the loader said
    the store had no labels.bin. Both name it missing though recorded."""
    store_dir = synthetic_store(tmp_path, n=4, tokens=3, d=2, per_shard=2)
    saev.write_labels(store_dir, np.zeros((4, 2), np.uint8))
    (store_dir / "labels.bin").unlink()
    named = re.escape(f"{store_dir / 'labels.bin'}: missing, but {store_dir / saev.SIDECAR} records it")
    with pytest.raises(FormatError, match=named):
        saev.open_store(store_dir).labels()
    with pytest.raises(FormatError, match=named):
        ShuffledActivations(store_dir, keep_labels=[0])


def test_a_protocol_of_another_major_version_is_a_verify_problem(tmp_path):
    """metadata.json protocol "3.0" (its store named by that metadata's hash): opening warned, as spec
    §5 asks, but verify reported the store clean though every vector is found by 2.x arithmetic."""
    md = {"family": "gpt2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": 2, "cls_token": False,
          "d_model": 2, "n_examples": 3, "patches_per_shard": 4, "dtype": "float32",
          "data": saev.encode_data({"source": "test"}), "dataset": str(tmp_path)}

    def store(protocol: str) -> Path:
        plan = saev.Plan({**md, "protocol": protocol}, np.array([[0, 0, 2], [1, 0, 2], [2, 0, 2]]), {})
        return saev.write_raw_store(plan, lambda start, out: out.fill(0), tmp_path, progress=False)
    newer_minor, newer_major = store("2.9"), store("3.0")
    assert saev.verify(newer_minor) == []
    with pytest.warns(UserWarning, match="different major"):
        saev.open_store(newer_major)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert saev.verify(newer_major) == [f"{newer_major / 'metadata.json'}: protocol 3.0 has a different major "
                                            "version than this reader's 2.1; the layout may have changed"]
