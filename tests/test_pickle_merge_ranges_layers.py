"""Review 56 of the pickle writer and readers: a merge that held every sample id of the store at once,
read machine metadata it never checked and wrote shard paths outside the store it merged; readers
that served a layer the store lacks as no samples, and a dataset left broken by a shard it could not
load."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from actstore.errors import FormatError
from actstore.formats import pickle as ps
from actstore.formats.pickle.layout import METADATA
from test_pickle import write_machines
from tiny import traced_peak


@pytest.fixture(scope="module")
def machines(extracted, tmp_path_factory):
    """A real extraction (tiny bert, two parts) written as two machine stores, not merged."""
    config, extract_dir = extracted("bert")
    return write_machines(config, extract_dir, tmp_path_factory.mktemp("write_review56"))


def _copy(out: Path, dst: Path) -> list[Path]:
    """A copy of the machine stores a test may edit; their directories in machine order."""
    shutil.copytree(out, dst)
    return sorted(dst.glob("machine-*"))


def _edit(mdir: Path, edit) -> None:
    meta = json.loads((mdir / METADATA).read_text())
    edit(meta)
    (mdir / METADATA).write_text(json.dumps(meta))


def test_the_merge_holds_no_set_of_every_sample_id(machines, tmp_path):
    """The merge built a set of every sample id (560 MB for 10M samples, in a 1000 MB job); ranges
    are compared instead. Here the last shard lists a million samples, as a large store's would."""
    dirs = _copy(machines, tmp_path / "store")

    def widen(meta):
        last = meta["shards"][-1]
        last["sample_id_range"][1] = last["sample_id_range"][0] + 999_999
        last["num_samples"] = 1_000_000
    _edit(dirs[-1], widen)
    merged, peak = traced_peak(lambda: ps.merge_machines(dirs, tmp_path / "store"))
    assert merged["statistics"]["total_samples"] > 1_000_000
    assert peak < 20_000_000, peak  # the set of a million ids held 99 MB


@pytest.mark.parametrize("first, last", [(0, 10**15), (0, 0)])
def test_a_range_that_disagrees_with_num_samples_is_refused_before_it_is_counted(machines, tmp_path, first, last):
    """A sample_id_range of 10**15 ids was made into a set before it was compared with num_samples."""
    dirs = _copy(machines, tmp_path / "store")
    _edit(dirs[0], lambda meta: meta["shards"][0].update(sample_id_range=[first, last]))
    with pytest.raises(FormatError, match=r"machine-0000/shard_0001\.pkl\.gz.*num_samples"):
        ps.merge_machines(dirs, tmp_path / "store")


def test_ranges_that_overlap_across_machines_are_refused(machines, tmp_path):
    dirs = _copy(machines, tmp_path / "store")
    first = ps.load_metadata(dirs[0])["shards"][0]["sample_id_range"]
    _edit(dirs[1], lambda meta: meta["shards"][0].update(sample_id_range=first))
    with pytest.raises(FormatError, match=r"machine-0001/shard_0001\.pkl\.gz.*overlap"):
        ps.merge_machines(dirs, tmp_path / "store")


@pytest.mark.parametrize("edit, named", [
    (lambda meta: meta["shards"][0].update(sample_id_range=None), r"shards\[0\]\.sample_id_range"),
    (lambda meta: meta["shards"][0].update(filename=None), r"shards\[0\]\.filename"),
    (lambda meta: meta["distributed_config"].pop("machine_id"), r"distributed_config\.machine_id"),
    (lambda meta: meta.pop("statistics"), r"missing required field 'statistics'"),
    (lambda meta: meta["shards"][0].update(filename="../machine-0001/shard_0001.pkl.gz"),
     r"'\.\./machine-0001/shard_0001\.pkl\.gz' is not a relative path inside"),
])
def test_a_machine_metadata_field_of_the_wrong_type_is_named(machines, tmp_path, edit, named):
    """The merge read machine metadata unchecked: a TypeError or KeyError that named no file, a shard
    path out of the machine's directory followed."""
    dirs = _copy(machines, tmp_path / "store")
    _edit(dirs[0], edit)
    with pytest.raises(FormatError, match=r"machine-0000/metadata\.json: " + named):
        ps.merge_machines(dirs, tmp_path / "store")


def test_a_machine_outside_the_merged_store_is_refused(machines, tmp_path):
    """A machine directory outside the merge's directory gave `../` shard paths, which every reader of
    the merged store then refused: the merge refuses it, naming it, and writes nothing."""
    dirs = _copy(machines, tmp_path / "store")
    (tmp_path / "merged").mkdir()
    with pytest.raises(FormatError, match=r"machine-0000.*not.*inside"):
        ps.merge_machines(dirs, tmp_path / "merged")
    assert not (tmp_path / "merged" / METADATA).exists()


@pytest.mark.parametrize("layer", [1, "0"])
def test_a_layer_the_store_does_not_hold_is_named_not_served_as_no_samples(machines, layer):
    """iter_activations and ActivationDataset of a layer not extracted (or "0" for 0) gave no items
    and no error: an SAE trained on nothing. saev and zarr readers name the layer; so does this."""
    store = machines / "machine-0000"
    with pytest.raises(FormatError, match=rf"{store}: layer {layer!r} not stored; layers are \[0, 2\]"):
        next(ps.iter_activations(store, layer))
    with pytest.raises(FormatError, match=rf"{store}: layer {layer!r} not stored; layers are \[0, 2\]"):
        ps.ActivationDataset(store, layer)


def test_the_dataset_after_a_shard_it_could_not_load_reloads_the_shard_it_dropped(machines, tmp_path):
    """A shard that failed to load left the dataset holding no shard under the old shard's id: the next
    item of that old shard was `None[...]`, a TypeError naming nothing."""
    store = _copy(machines, tmp_path / "store")[0]
    dataset = ps.ActivationDataset(store, 0)
    first = dataset[0]
    second_shard = ps.load_metadata(store)["shards"][1]
    damaged = store / second_shard["filename"]
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    with pytest.raises(FormatError, match=rf"{damaged}: checksum"):
        dataset[dataset.index.index((second_shard["shard_id"], 0))]
    assert dataset[0]["sample_idx"] == first["sample_idx"]
