"""Review 66: the readers take the validate share jobs' pick of items themselves (share=(k, n): the
shards or chunks at places k, k + n, ... as integrity.in_share picks them), so the full pass
(actstore.fingerprints) reads a store through them instead of copies of their loops; and locate's
staleness check resolves the dataset once."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import actstore.datasets.source as source_module
from actstore import cli
from actstore.datasets import scan_dataset, write_scan
from actstore.errors import ConfigError, FormatError
from actstore.formats import pickle as ps
from actstore.formats.extract import synthetic_extraction
from actstore.formats.saev import open_store
from test_extract import write_real_store
import tiny


@pytest.fixture(scope="module")
def extraction_root(tmp_path_factory) -> Path:
    return synthetic_extraction(tmp_path_factory.mktemp("shares") / "x", 60_000, 3, 8, [1, 2], tokens=(4, 10))


@pytest.fixture(scope="module")
def pickle_store(extraction_root, tmp_path_factory) -> Path:
    """A merged store of one shard a machine: three shards."""
    return write_real_store("pickle", extraction_root, tmp_path_factory.mktemp("pickle") / "store", parts=(0, 1, 2))


def shard_samples(store: Path) -> list[list[int]]:
    """Each shard's sample_idx values, in metadata.json's order, read through the whole iteration."""
    items = iter(ps.iter_activations(store, 1))
    return [[next(items)["sample_idx"] for _ in range(info["num_samples"])]
            for info in json.loads((store / "metadata.json").read_text())["shards"]]


@pytest.mark.parametrize("share", [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4)])
def test_pickle_share_yields_the_items_of_its_shards_only(pickle_store, share):
    per_shard = shard_samples(pickle_store)
    assert len(per_shard) == 3 and all(per_shard)
    whole = {item["sample_idx"]: item["activation"] for item in ps.iter_activations(pickle_store, 2)}
    mine = list(ps.iter_activations(pickle_store, 2, share=share))
    assert [item["sample_idx"] for item in mine] == [s for shard in per_shard[share[0]::share[1]] for s in shard]
    for item in mine:
        assert np.array_equal(item["activation"], whole[item["sample_idx"]])


def test_pickle_share_never_loads_another_shares_shard(pickle_store, tmp_path):
    """Shard 0 damaged: share (1, 2) reads shards 1 and 3.. alone and passes; share (0, 2) names it."""
    store = Path(shutil.copytree(pickle_store, tmp_path / "store"))
    first = store / json.loads((store / "metadata.json").read_text())["shards"][0]["filename"]
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0xFF
    first.write_bytes(bytes(data))
    assert len(list(ps.iter_activations(store, 1, share=(1, 2)))) > 0
    with pytest.raises(FormatError, match=f"{first}: checksum"):
        list(ps.iter_activations(store, 1, share=(0, 2)))


@pytest.mark.parametrize("share", [(2, 2), (-1, 2), (0, 0), (True, 2)])
def test_a_share_outside_its_shares_is_refused_naming_it(pickle_store, extraction_root, tmp_path, share):
    """(2, 2) picked no shard and no chunk, with no error: an empty store to its reader."""
    with pytest.raises(ConfigError, match=r"share=.*must be \(k, n\)"):
        next(ps.iter_activations(pickle_store, 1, share=share))
    saev = open_store(write_real_store("saev", extraction_root, tmp_path / "saev"))
    with pytest.raises(ConfigError, match=r"share=.*must be \(k, n\)"):
        next(saev.iter_ordered(share=share))


@pytest.mark.parametrize("share", [(0, 1), (1, 2), (0, 3), (2, 3), (6, 7)])
def test_saev_share_yields_the_chunks_at_its_places_over_every_shard(extraction_root, tmp_path, share):
    """Chunks counted across shards (a shard of 7 examples, chunks of 3: the last chunk of each shard is
    short), as the full pass of a share job reads them."""
    saev = open_store(write_real_store("saev", extraction_root, tmp_path / "saev", patches_per_shard=7 * 4 * 2))
    assert len(saev.shards) > 3
    whole = list(saev.iter_ordered(3))
    mine = list(saev.iter_ordered(3, share=share))
    assert [first for first, _ in mine] == [first for first, _ in whole[share[0]::share[1]]]
    for (_, chunk), (_, same) in zip(mine, whole[share[0]::share[1]], strict=True):
        assert np.array_equal(chunk, same)


def test_locate_staleness_lists_the_data_once_and_still_names_a_change(tmp_path, monkeypatch):
    """_stale resolved the dataset to learn it was here, then the check resolved it again (an image
    folder of 1.28M files: listed twice). The second call counted: the first also fills the extract
    hash's own cached look at the data (hashing._auto_format, once a process)."""
    data = tiny.write_jsonl(tmp_path / "texts.jsonl", 12)
    dataset = {"path": str(data), "name": "mytexts", "split": "train", "limit": None}
    extract_dir = tmp_path / "extract" / "abc"
    extract_dir.mkdir(parents=True)
    write_scan(scan_dataset(str(data)), extract_dir / "dataset_scan.json")
    (extract_dir / "extract.json").write_text("{}")
    with open(data, "a") as out:
        out.write('{"text": "b"}\n')
    resolved = []
    resolve = source_module._resolve
    monkeypatch.setattr(source_module, "_resolve", lambda *key: resolved.append(key) or resolve(*key))
    config = {"model": {"path": str(tmp_path / "no model here")}, "dataset": dataset}
    cli._stale(config, extract_dir)
    resolved.clear()
    assert cli._stale(config, extract_dir).startswith(f"{data}: changed since the dataset was scanned")
    assert resolved == [(str(data), "auto", "train")]
