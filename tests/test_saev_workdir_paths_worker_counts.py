"""saev review 62: a store given as `.` read as a directory without a name, ranks of different
DataLoader worker counts that read a vector twice or never, and a shard budget too small for one example
blamed on shards.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from actstore.errors import FormatError
from actstore.formats import saev
from actstore.formats.saev.layout import upstream_hash
from actstore.formats.saev.loader import ShuffledActivations

from test_saev import synthetic_store

EVERY_VECTOR = [(e, t) for e in range(6) for t in range(5)]  # synthetic_store(n=6, tokens=5)


def rows(batches) -> list[tuple[int, int]]:
    return [(int(e), int(t)) for b in batches for e, t in zip(b["example_idx"], b["token_idx"])]


def test_a_store_given_as_its_working_directory_verifies_by_its_name(tmp_path, monkeypatch):
    """`cd <store>; actstore verify .`: Path(".") has no name, so verify reported config drift against
    the directory name '' and inspect gave hash ''. The store's name is its absolute path's."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    monkeypatch.chdir(store_dir)
    assert saev.verify(".") == []
    assert saev.inspect(".")["hash"] == store_dir.name
    assert saev.open_store(".").dir == store_dir
    monkeypatch.chdir(store_dir.parent)
    assert saev.verify(f"{store_dir.name}/../{store_dir.name}") == []


def test_ranks_with_different_worker_counts_read_every_vector_once(tmp_path):
    """Rank r's worker w read block order[r * W + w :: world_size * W], W its own worker count: a rank
    with no DataLoader workers beside one with two (world_size 2) read positions 0 mod 2 and 2, 3 mod 4,
    so some vectors came twice an epoch and others never. Each rank's share no longer depends on how many
    workers read it."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    options = dict(batch_size=3, seed=4, block_bytes=8, buffer_blocks=2, world_size=2)
    alone = rows(ShuffledActivations(store_dir, rank=0, **options))
    workers = rows(torch.utils.data.DataLoader(ShuffledActivations(store_dir, rank=1, **options),
                                               batch_size=None, num_workers=2))
    assert sorted(alone + workers) == EVERY_VECTOR
    rank0_workers = rows(torch.utils.data.DataLoader(ShuffledActivations(store_dir, rank=0, **options),
                                                     batch_size=None, num_workers=2))
    assert sorted(rank0_workers) == sorted(alone)


def test_a_shard_budget_smaller_than_one_example_names_metadata(tmp_path):
    """patches_per_shard below one example (T x L tokens) gives 0 examples a shard: opening said
    "shards.json: acts000000.bin n_examples=3; expected 0 (only the last shard may be smaller)", blaming a
    right shards.json. It names metadata.json's field and what one example needs."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    md = json.loads((store_dir / "metadata.json").read_text())
    md["patches_per_shard"] = 4
    (store_dir / "metadata.json").write_text(json.dumps(md))
    with pytest.raises(FormatError, match=rf"{store_dir / 'metadata.json'}: patches_per_shard = 4 holds no example "
                                          r"\(5 tokens x 1 layers\)"):
        saev.open_store(store_dir)


@pytest.mark.parametrize("given", [".", "saev.json"])
def test_a_stage_dir_given_as_its_working_directory_finds_its_store(tmp_path, monkeypatch, given):
    """The pointer's store is "../<HASH>", looked up beside the stage dir: Path("saev.json").parent.parent
    is "." again, so from inside the stage dir the store was looked for inside it and was "missing"."""
    store_dir = synthetic_store(tmp_path / "saev", n=6, tokens=5, d=4, per_shard=3)
    stage = tmp_path / "saev" / "stage"
    stage.mkdir()
    saev.write_pointer(stage / "saev.json", store_dir)
    monkeypatch.chdir(stage)
    assert saev.open_store(given).dir == store_dir
    assert saev.verify(given) == []


@pytest.mark.parametrize("shard, error, named", [
    (-1, IndexError, "shard -1 out of range"),  # mapped the last shard
    (2, IndexError, r"shard 2 out of range \[0, 2\)"),  # "list index out of range"
    (True, TypeError, "shard True is not an integer"),  # mapped shard 1
])
def test_a_shard_index_out_of_range_is_named(tmp_path, shard, error, named):
    store = saev.open_store(synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3))
    with pytest.raises(error, match=rf"{store.dir}: {named}"):
        store.memmap(shard)
    assert store.memmap(1).shape == (3, 1, 5, 4)


def test_a_negative_example_count_names_metadata(tmp_path):
    """n_examples -1 beside an empty shards.json was refused as "shards.json: must be a non-empty array"."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    md = json.loads((store_dir / "metadata.json").read_text())
    md["n_examples"] = -1
    (store_dir / "metadata.json").write_text(json.dumps(md))
    (store_dir / "shards.json").write_text("[]")
    with pytest.raises(FormatError, match=rf"{store_dir / 'metadata.json'}: n_examples = -1 must be >= 0"):
        saev.open_store(store_dir)


def test_a_store_saev_wrote_of_a_family_we_do_not_map_verifies(tmp_path):
    """verify took every family outside its image lists for a text store and said a store saev wrote
    (no actstore.json, so nothing recorded) lacked a recorded windows.npy: saev's families grow with
    its releases. The check is for our text stores, whose writer always records windows.npy."""
    from test_saev_upstream import saev_written

    store_dir, values = saev_written(tmp_path, 7, per_shard=3)
    md = json.loads((store_dir / "metadata.json").read_text())
    md["family"] = "vjepa2"
    renamed = store_dir.parent / upstream_hash(md)
    store_dir.rename(renamed)
    (renamed / "metadata.json").write_text(json.dumps(md, indent=2))
    assert saev.verify(renamed) == []
    assert saev.read_vector(renamed, 6, 7, 4).tolist() == values[6, 1, 4].tolist()


def test_an_image_store_of_a_family_we_do_not_map_verifies_but_a_text_one_needs_windows(tmp_path):
    """An image store planned from a model_type FAMILIES does not map keeps the model_type as family:
    verify took it for a text store without windows.npy. What `data` says was extracted decides."""
    md = {"family": "swin", "ckpt": "synthetic", "layers": [0], "patches_per_ex": 4, "cls_token": False,
          "d_model": 2, "n_examples": 3, "patches_per_shard": 8, "dtype": "float32", "dataset": str(tmp_path),
          "protocol": saev.PROTOCOL}
    sidecar = {"source_extraction": "e" * 64, "model_type": "swin"}

    def store(modality: str) -> Path:
        data = saev.encode_data({"source": "actstore", "extract_hash": "e" * 64, "modality": modality})
        plan = saev.Plan({**md, "data": data}, None, sidecar)
        return saev.write_raw_store(plan, lambda start, out: out.fill(1), tmp_path / modality, progress=False)
    assert saev.verify(store("image")) == []
    text = store("text")
    assert saev.verify(text) == [f"{text / 'windows.npy'}: text store without a recorded windows.npy"]
