"""Review 56 of dataset reading: a damaged or edited scan is named rather than read as other rows,
and JSON labels true and 1 are refused rather than made one class."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from actstore.datasets import load_dataset, read_scan, scan_dataset, write_scan
from actstore.datasets.core import one_kind
from actstore.errors import ConfigError, FormatError


def jsonl_files(folder: Path, labels_by_file: list[list]) -> Path:
    """A folder of JSONL files, one per list of labels, a row per label."""
    folder.mkdir()
    for f, labels in enumerate(labels_by_file):
        (folder / f"part{f}.jsonl").write_text(
            "".join(json.dumps({"text": f"row {f}.{i}", "label": label}) + "\n" for i, label in enumerate(labels)))
    return folder


def edited_scan(tmp_path: Path, data: Path, **fields) -> Path:
    """The scan of `data` as write_scan writes it, unsealed, with `fields` set to other values."""
    write_scan(scan_dataset(data), tmp_path / "scan.json")
    # Without its seal, as a scan written before scans were sealed: the checks after the seal are tested.
    scan = {k: v for k, v in json.loads((tmp_path / "scan.json").read_text()).items() if k != "sealed"} | fields
    (tmp_path / "edited.json").write_text(json.dumps(scan))
    return tmp_path / "edited.json"


def test_a_scan_whose_marks_name_a_file_past_its_stamps_is_named(tmp_path):
    """A mark in file 7 of a 2-file dataset read no file from there: the part past it got no rows, no error."""
    data = jsonl_files(tmp_path / "data", [[0, 1] * 25, [0, 1] * 25])
    path = edited_scan(tmp_path, data, marks=[[0, 0, 0, 0], [60, 7, 0, 0]])
    with pytest.raises(FormatError, match=r"edited\.json: marks name file 7 \(from 0\), but stamps hold 2 data files"):
        read_scan(path)


def test_a_scan_counting_more_rows_than_the_data_is_refused_not_read_short(tmp_path):
    """n_samples 150 for 100 rows: the last part read no rows and said nothing."""
    data = jsonl_files(tmp_path / "data", [[0, 1] * 25, [0, 1] * 25])
    scan = read_scan(edited_scan(tmp_path, data, n_samples=150))
    with pytest.raises(ConfigError, match=r"part1\.jsonl: the dataset ends before row 114, which its scan counts "
                                          r"\(150 rows\); scan it again"):
        load_dataset(data, parts=(4, 3), scan=scan)


def test_a_json_lines_scan_without_marks_is_named(tmp_path):
    """No marks: an IndexError (tuple index out of range) naming nothing."""
    data = jsonl_files(tmp_path / "data", [[0, 1]])
    scan = read_scan(edited_scan(tmp_path, data, marks=[]))
    with pytest.raises(ConfigError, match="scan holds no marks of where its rows start; scan it again"):
        load_dataset(data, scan=scan)


@pytest.mark.parametrize("labels", [[[1], 0], [0, 1, 0]])
def test_a_scan_whose_labels_nest_or_repeat_is_named(labels, tmp_path):
    """label_id = position in labels: a list there was a TypeError (unhashable) at extraction, a label
    twice gave its rows the last position."""
    data = jsonl_files(tmp_path / "data", [[0, 1]])
    with pytest.raises(FormatError, match="edited.json: labels must be a list of distinct strings, numbers or"):
        read_scan(edited_scan(tmp_path, data, labels=labels))


def test_labels_true_and_1_in_one_file_are_refused_naming_both_rows(tmp_path):
    """true == 1 in Python: labels true, 1, 0, false were two classes, [0, True], label 1's id that of True."""
    data = jsonl_files(tmp_path / "data", [[True, 1, 0, False]])
    with pytest.raises(ConfigError, match=r"part0\.jsonl:2: label 1, but .*part0\.jsonl:1: label true; a dataset's "
                                          r"labels are all booleans or none"):
        scan_dataset(data)


def test_labels_true_and_1_in_two_files_scanned_apart_are_refused(tmp_path):
    """Each file's scan (its own process) is of one kind; joined, their labels merged as one pass's did."""
    data = jsonl_files(tmp_path / "data", [[True, False], [None, 0, 1]])
    with pytest.raises(ConfigError, match=r"1\.jsonl: label 0, but \S*0\.jsonl: label false"):
        scan_dataset(data, workers=2)


def test_labels_of_one_kind_with_nulls_are_read():
    """Nulls have no kind; 1 and 1.0 (pandas' float column) stay one class, strings and numbers two."""
    first = None
    for where, label in enumerate([None, 1, 1.0, "1", None, 2]):
        first = one_kind(first, label, f"row {where}")
    assert first == (1, "row 1")
    assert one_kind(one_kind(None, False, "a"), True, "b") == (False, "a")


def test_a_webdataset_scan_counting_more_samples_than_its_shards_is_refused(tmp_path):
    """Tar shards read from a scan counting 24 samples for 16: the last part got no samples, no error."""
    from test_webdataset import write_shards

    write_shards(tmp_path / "shards")
    scan = read_scan(edited_scan(tmp_path, tmp_path / "shards", n_samples=24))
    with pytest.raises(ConfigError, match=r"shard-00002\.tar: the dataset ends before row 16, which its scan counts "
                                          r"\(24 rows\); scan it again"):
        load_dataset(tmp_path / "shards", parts=(3, 2), scan=scan)


def test_an_image_folder_of_split_folders_is_read_by_part_from_its_scan(tmp_path):
    """train/<label>/... beside validation/: the scan recorded the runs of train/, and every part job
    looked for <label>/ at the dataset's root ("cat: its files changed since the dataset was scanned")."""
    import numpy as np
    from PIL import Image

    root = tmp_path / "images"
    for split, shade in (("train", 0), ("validation", 100)):
        for label in ("cat", "dog"):
            (root / split / label).mkdir(parents=True)
            for i in range(3):
                Image.fromarray(np.full((8, 8, 3), shade + 10 * i, np.uint8)).save(root / split / label / f"{i}.png")
    whole = load_dataset(root)
    scan = scan_dataset(root)
    parts = [load_dataset(root, scan=scan, parts=(2, part)) for part in range(2)]
    read = [sample for part in parts for sample in part.samples]
    assert [(s.sample_idx, s.text, s.label) for s in read] == [(s.sample_idx, s.text, s.label) for s in whole.samples]
    assert [(s.text, s.label) for s in read] == [(f"{label}/{i}.png", label) for label in ("cat", "dog") for i in range(3)]
    assert np.asarray(parts[1].opener(parts[1].samples[-1]))[0, 0, 0] == 20  # train/dog/2.png, not validation's
