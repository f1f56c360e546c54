"""Review 59: one cache of a value built from files (integrity.LastBuilt) behind saev's and pickle's
read_vector, rebuilt when a file is rewritten or replaced; one scan for inf and NaN in LUT tables, of
their raw bits, behind both verify and LutStore.load."""
from __future__ import annotations

import os
import shutil

import pytest
import safetensors.torch
import torch

from actstore.errors import FormatError
from actstore.formats import lut as lut_format
from actstore.formats import pickle as ps
from actstore.formats import saev
from actstore.formats.lut import check as lut_check
from actstore.formats.pickle.read import shard_path
from actstore.integrity import LastBuilt
from test_pickle_reader_shard_ids_dtypes import machines  # noqa: F401 (a fixture)
from test_saev import text_store
from test_lut_verify_nonfinite_tables import _lut_with


def test_last_built_is_kept_while_its_files_are_unchanged_and_rebuilt_after(tmp_path):
    """Kept while the files are as they were; rebuilt when one is rewritten in place (same size, a new
    mtime), replaced by a rename (same size and mtime, another inode), or `extra` differs."""
    file, other = tmp_path / "a", tmp_path / "b"
    file.write_bytes(b"one")
    other.write_bytes(b"x")
    cache, builds = LastBuilt(), []

    def get(extra=None) -> bytes:
        return cache.get([file, other], lambda: builds.append(file.read_bytes()) or builds[-1], extra)

    assert get() == get() == b"one" and len(builds) == 1
    stamp = file.stat().st_mtime_ns
    file.write_bytes(b"two")
    os.utime(file, ns=(stamp + 1, stamp + 1))
    assert get() == get() == b"two" and len(builds) == 2
    replacement = tmp_path / "new"
    replacement.write_bytes(b"six")
    os.utime(replacement, ns=(stamp + 1, stamp + 1))  # only the inode tells it from the file it replaces
    replacement.rename(file)
    assert get() == b"six" and len(builds) == 3
    assert get(extra="sha256:other") == b"six" and len(builds) == 4
    other.unlink()  # absent: a key of its own, the build names why
    assert get(extra="sha256:other") == b"six" and len(builds) == 5


def test_saev_read_vector_sees_windows_npy_replaced_since(tmp_path):
    """The store read_vector keeps open is opened again when a file opening it reads is replaced (here
    windows.npy, renamed over with the same size and mtime): sample 2's vector, then none."""
    store_dir = text_store(tmp_path / "a", [[0, 0, 4], [1, 0, 4], [2, 0, 4]])
    assert saev.read_vector(store_dir, 2, 0, 1).tolist() == [201, 201]
    windows = store_dir / "windows.npy"
    other = text_store(tmp_path / "b", [[0, 0, 4], [1, 0, 4], [3, 0, 4]]) / "windows.npy"
    assert other.stat().st_size == windows.stat().st_size
    stamp = windows.stat().st_mtime_ns
    os.utime(other, ns=(stamp, stamp))
    shutil.copy2(other, tmp_path / "replacement")
    (tmp_path / "replacement").rename(windows)
    assert saev.read_vector(store_dir, 2, 0, 1) is None
    assert saev.read_vector(store_dir, 3, 0, 1).tolist() == [201, 201]


def test_pickle_read_vector_sees_a_shard_rewritten_since(machines, tmp_path):  # noqa: F811
    """The shard read_vector keeps loaded is loaded again (its checksum checked) when its file changed
    with its metadata entry unchanged: one byte flipped in place, the same size and mtime, is refused,
    never answered from the shard as it was."""
    store = tmp_path / "store"
    shutil.copytree(machines[1] / "machine-0000", store)
    info = ps.load_metadata(store)["shards"][0]
    lo, layer = info["sample_id_range"][0], info["layers"][0]
    assert ps.read_vector(store, lo, layer, 0) is not None
    shard = shard_path(store, info)
    stamp = shard.stat().st_mtime_ns
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    replacement = tmp_path / "replacement"
    replacement.write_bytes(bytes(data))
    os.utime(replacement, ns=(stamp, stamp))
    replacement.rename(shard)
    with pytest.raises(FormatError, match=r"shard_0001\.pkl(\.gz)?: checksum "):
        ps.read_vector(store, lo, layer, 0)


def test_lut_load_refuses_inf_or_nan_by_the_scan_verify_runs_before_the_table_loads(tmp_path, monkeypatch):
    """LutStore.load checked values with torch once the whole table was loaded (a second check beside
    verify's): it now runs verify's scan of the raw bits, a few values at a time, before loading. A NaN
    in a later piece of the scan is named as verify names it, and the table is never loaded."""
    monkeypatch.setattr(lut_check, "SCAN_VALUES", 7)
    lut, file = _lut_with(tmp_path, torch.bfloat16, "precomputed_products", float("nan"), 7 * 5 + 2)
    named = f"{file}: key 'precomputed_products' holds 1 inf or NaN values"
    assert lut_format.verify(lut) == [named]

    def loaded(*_):
        raise AssertionError("the table was loaded before its values were checked")

    monkeypatch.setattr(safetensors.torch, "load_file", loaded)
    with pytest.raises(FormatError) as refused:
        lut_format.open_lut(lut).load("layers.0.q")
    assert str(refused.value) == named
