"""Follow-ups to the 57th review of the pickle and extraction formats: pickle verify's duplicate
check held every sample id of the store, collate_padded of no samples, the extraction's read_vector
on one part, read_rows from a negative row, samples.jsonl's label_id, and non-integer sample indices."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tiny
from actstore.formats import pickle as ps
from actstore.formats.extract import open_extraction, open_part, read_vector, verify
from actstore.formats.pickle.write import dump_shard
from test_extract_text_path_part_records import rewritten_samples
from tiny import traced_peak


def _tiny_shards(root: Path, ranges: list[tuple[int, int]]) -> Path:
    """A pickle store (the writer's dump_shard) of one layer, one shard a (first, n) sample-id range,
    each sample one token of width 1: shards whose ids cost more than their arrays."""
    root.mkdir()
    shards = []
    for k, (first, n) in enumerate(ranges):
        items = [{"sample_idx": first + i, "shape": (1, 1), "text_preview": "", "metadata": {"token_count": 1},
                  "activation": np.zeros((1, 1), np.float32)} for i in range(n)]
        path = root / f"shard_{k:04d}.pkl"
        digest = dump_shard({"layer_0": items}, path, False, 1, "isal")
        shards.append({"shard_id": k, "filename": path.name, "size_bytes": path.stat().st_size, "layers": [0],
                       "checksum": f"sha256:{digest}", "compressed": False, "num_samples": n, "num_tokens": n,
                       "machine_id": 0, "sample_id_range": [first, first + n - 1]})
    config = {"model_name": "m", "model_architecture": "bert", "model_params": {"hidden_size": 1},
              "dataset_name": "d", "dataset_config": None, "dataset_split": "train", "layers_extracted": [0],
              "max_seq_length": 8, "batch_size": 1}
    stats = {"total_shards": len(shards), "total_samples": sum(s["num_samples"] for s in shards),
             "total_size_bytes": sum(s["size_bytes"] for s in shards), "total_tokens": sum(n for _, n in ranges),
             "layers_extracted": [0], "extraction_duration_seconds": 0.0}
    meta = {"version": "1.0", "created_at": "1970-01-01T00:00:00+00:00", "extraction_config": config,
            "distributed_config": {"total_machines": 1}, "shards": shards, "statistics": stats,
            "actstore": {"d_model": 1, "dtype": "float32"}}
    (root / "metadata.json").write_text(json.dumps(meta))
    return root


def test_pickle_verify_holds_no_sample_id_set_of_the_whole_store(tmp_path):
    """verify kept every shard's sample ids and a set of all of them to find one stored twice (~1 GB
    of Python ints at 10M samples). Compared as the shards' checked sample_id_ranges, 40 shards verify
    in about the memory of 2."""
    from actstore import integrity

    few = _tiny_shards(tmp_path / "few", [(k * 500, 500) for k in range(2)])
    many = _tiny_shards(tmp_path / "many", [(k * 500, 500) for k in range(40)])
    with integrity.check_threads(1):
        problems_few, peak_few = traced_peak(lambda: ps.verify(few))
        problems_many, peak_many = traced_peak(lambda: ps.verify(many))
    assert problems_few == problems_many == []
    assert peak_many < 1.5 * peak_few, (peak_few, peak_many)


@pytest.mark.parametrize("ranges, named", [
    ([(0, 50), (49, 50)], [1]),             # shard 1's first id is shard 0's last
    ([(0, 100), (10, 5), (50, 5)], [1, 2]),  # two shards inside the first: both named
    ([(60, 10), (0, 61)], [0]),             # out of order in metadata.json: named by the later range
])
def test_a_sample_id_in_two_shards_is_named(tmp_path, ranges, named):
    """A sample id that two shards hold is named in the shard whose range starts later."""
    from actstore import integrity

    store = _tiny_shards(tmp_path / "store", ranges)
    problems = ps.verify(store)
    assert problems == [f"{store / f'shard_{k:04d}.pkl'}: duplicate sample_idx within the store" for k in named]
    with integrity.check_threads(1):
        assert ps.verify(store) == problems


def test_a_sample_id_twice_in_one_shard_is_named(tmp_path):
    store = _tiny_shards(tmp_path / "store", [(0, 4), (4, 4)])
    info = json.loads((store / "metadata.json").read_text())["shards"][1]
    shard = ps.load_shard(store, info)
    shard["layer_0"][1]["sample_idx"] = 6  # ids 4, 6, 6, 7: still the range [4, 7]
    path = store / info["filename"]
    digest = dump_shard(shard, path, False, 1, "isal")
    meta = json.loads((store / "metadata.json").read_text())
    meta["shards"][1].update(checksum=f"sha256:{digest}", size_bytes=path.stat().st_size)
    meta["statistics"]["total_size_bytes"] = sum(s["size_bytes"] for s in meta["shards"])
    (store / "metadata.json").write_text(json.dumps(meta))
    assert ps.verify(store) == [f"{path}: duplicate sample_idx within the store"]


def test_collate_padded_of_no_samples_says_so():
    """torch's default_collate([]) fails too (an empty batch has no shape); ours named nothing."""
    with pytest.raises(ValueError, match="empty batch"):
        ps.collate_padded([])


@pytest.fixture(scope="module")
def extraction(extracted, tmp_path_factory) -> Path:
    """A real two-part extraction of 12 texts under two labels."""
    data = tmp_path_factory.mktemp("labelled") / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": row["text"][:200], "label": "ab"[i % 2]}) + "\n"
                            for i, row in enumerate(tiny.corpus_rows(12))))
    return extracted("bert", data)[1]


def test_read_vector_reads_a_single_part(extraction):
    """detect, verify and inspect take one part directory; read_vector said "no extraction parts"."""
    part_dir = extraction / "part-0001"
    part, whole = open_part(part_dir), open_extraction(extraction)
    first, layer = part.sample_start, part.info.layers[0]
    got = read_vector(part_dir, first + 1, layer, 2)
    np.testing.assert_array_equal(got, whole.activations(f"layer_{layer}", first + 1)[2])
    assert read_vector(part_dir, first + 1, layer + 100, 0) is None
    with pytest.raises(IndexError, match="part-0001"):
        read_vector(part_dir, first - 1, layer, 0)  # in part 0, not this one


def test_read_rows_from_a_negative_row_is_refused(extraction):
    """Rows [-1, 1) into a buffer of 2 rows read the .npy header's bytes as a token's values."""
    part = open_part(extraction / "part-0000")
    tensor = part.tensor(part.info.tensors[0])
    with pytest.raises(IndexError, match=r"layer_\d+\.npy"):
        tensor.read_rows(-1, 1, np.empty((2, tensor.shape[1]), np.float32))
    out = np.empty((2, tensor.shape[1]), np.float32)
    tensor.read_rows(0, 2, out)
    np.testing.assert_array_equal(out, tensor[0:2])


def test_a_label_id_that_is_not_its_labels_position_is_named(extraction, tmp_path):
    """Zarr, pickle and lmprobe copy each line's label_id: one that is not its label's position in
    part.json's dataset.labels (its sha256 re-recorded) passed verify."""
    labels = open_part(extraction / "part-0001").info.dataset.labels
    assert len(labels) > 1 and verify(extraction) == []

    def relabel(rows):
        rows[1]["label_id"] = (rows[1]["label_id"] + 1) % len(labels)
    _, part_dir = rewritten_samples(extraction, tmp_path, relabel)
    for path in (part_dir.parent, part_dir):
        problems = verify(path)
        assert len(problems) == 1 and f"{part_dir / 'samples.jsonl'}: line 2 says label_id" in problems[0], problems


@pytest.mark.parametrize("indices", [[1.5], [0, 2.0], [True]])
def test_samples_of_a_non_integer_index_are_refused(extraction, indices):
    """np.asarray(..., dtype=int64) cut 1.5 to 1: the row of another sample came back."""
    whole = open_extraction(extraction)
    with pytest.raises(TypeError, match="sample_idx"):
        whole.samples(indices)
    assert [row["sample_idx"] for row in whole.samples(np.array([3, 0]))] == [3, 0]
    assert whole.samples([]) == []
