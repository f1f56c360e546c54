"""The pickle-shard checker (formats/pickle/check.py) on real stores: a damaged shard named as itself
by verify and read_vector, never a bare Python error blamed on metadata.json, and a repeated shard_id
named with both its files."""
from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from actstore.errors import FormatError
from actstore.formats import pickle as ps
from actstore.formats.pickle.layout import METADATA
from test_pickle_reader_shard_ids_dtypes import machines, naive_merge, replant  # noqa: F401 (machines: a fixture)


def damaged_machine(out: Path, tmp_path: Path, damage) -> tuple[Path, Path, dict]:
    """A copy of machine-0000 whose first shard's loaded dict `damage` edited (size and checksum fixed,
    as a writer's bug or a hostile store leaves them): (store, shard path, shard entry)."""
    store = tmp_path / "store"
    shutil.copytree(out / "machine-0000", store)
    info = ps.load_metadata(store)["shards"][0]
    shard = ps.load_shard(store, info)
    damage(shard)
    return store, replant(store, pickle.dumps(shard, protocol=5)), info


def first_layer(shard: dict) -> list[dict]:
    return shard[min(shard)]


DAMAGES = {
    "activation not an array": lambda s: first_layer(s)[0].update(activation=[1.0]),
    "shape not a list": lambda s: first_layer(s)[0].update(shape=3),
    "sample_idx a string": lambda s: [items[0].update(sample_idx=str(items[0]["sample_idx"])) for items in s.values()],
    "layer key not a string": lambda s: s.update({0: s.pop(min(s))}),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_item_field_of_the_wrong_type_is_named_in_its_shard(machines, tmp_path, damage):  # noqa: F811
    """verify compared an activation's dtype, its item's shape and the sample ids without checking
    their types: a list in an activation's place, an int shape, a string sample_idx beside ints or an
    int layer key was an AttributeError or TypeError that verify reported as
    "metadata.json: TypeError: ...", sending the user to the wrong file."""
    _, out = machines
    store, path, _ = damaged_machine(out, tmp_path, DAMAGES[damage])
    problems = ps.verify(store)
    assert problems and all(p.startswith(f"{path}: ") for p in problems), problems


@pytest.mark.parametrize("damage", ["layer missing", "1-D activation"])
def test_read_vector_refuses_a_shard_whose_content_verify_refuses(machines, tmp_path, damage):  # noqa: F811
    """read_vector (what `actstore validate` reads every coordinate through, after verify) trusted the
    shard's content: a layer its entry lists but it lacks was a bare KeyError that crashed validate,
    and a 1-D activation gave a 0-d scalar as the token's vector."""
    layers, out = machines

    def edit(shard):
        key = f"layer_{layers[0]}"
        if damage == "layer missing":
            del shard[key]
        else:
            for item in shard[key]:
                item.update(activation=item["activation"][0].copy())
    store, path, info = damaged_machine(out, tmp_path, edit)
    with pytest.raises(FormatError, match=f"{path}: "):
        ps.read_vector(store, info["sample_id_range"][0], layers[0], 0)


def test_a_repeated_shard_id_is_named_with_both_files(machines, tmp_path):  # noqa: F811
    """verify said only "shard_id values are not unique": which id, and which of hundreds of shards,
    was left to the user. It names both, as ActivationDataset does on opening."""
    _, out = machines
    store = naive_merge(out, tmp_path / "store")
    expected = (f"{store / METADATA}: shard_id 1 is listed twice (machine-0000/shard_0001.pkl.gz and "
                "machine-0001/shard_0001.pkl.gz)")
    assert expected in ps.verify(store)
