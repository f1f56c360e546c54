"""Review 65: dataset_scan.json carries a seal over its content, so an edited scan (a row count cut, a mark
moved) is refused by the part's job that reads it, naming the file, instead of cutting rows silently."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tiny
from actstore.datasets import configured_scan, read_scan, scan_dataset, write_scan
from actstore.errors import FormatError
from actstore.extract import run_part
from actstore.formats import extract as ex
from actstore.integrity import SEAL_KEY
from actstore.io_utils import canonical_sha256


def written(scan, path: Path) -> dict:
    write_scan(scan, path)
    return json.loads(path.read_text())


def edited_refused(path: Path, record: dict) -> None:
    """`record` written over `path` is refused by read_scan as edited, naming the file and the rescan."""
    path.write_text(json.dumps(record))
    with pytest.raises(FormatError, match=re.escape(f"{path}: edited since it was written") + ".*extract_scan"):
        read_scan(path)


def test_the_seal_is_the_sha256_of_the_scans_content_and_reads_back(text_jsonl, tmp_path):
    scan = scan_dataset(text_jsonl)
    record = written(scan, tmp_path / "dataset_scan.json")
    content = {key: value for key, value in record.items() if key != SEAL_KEY}
    assert record[SEAL_KEY] == canonical_sha256(content)
    assert content["n_samples"] == scan.n_samples == 30 and len(scan.marks) >= 1 and scan.stamps
    assert read_scan(tmp_path / "dataset_scan.json") == scan


# Each edit, but for the seal, leaves a scan read_scan's field checks would take.
JSONL_EDITS = {
    "n_samples": lambda r: r["n_samples"] - 4,
    "labels": lambda r: [*r["labels"], "a label no row holds"],
    "marks": lambda r: [],
    "stamps": lambda r: [[size, mtime + 1] for size, mtime in r["stamps"]],
    "listing": lambda r: "0" * 64,
}


@pytest.mark.parametrize("field", sorted(JSONL_EDITS))
def test_an_edited_field_of_a_jsonl_scan_is_refused_naming_the_file(field, text_jsonl, tmp_path):
    path = tmp_path / "dataset_scan.json"
    record = written(scan_dataset(text_jsonl), path)
    assert record[field] != JSONL_EDITS[field](record)
    edited_refused(path, {**record, field: JSONL_EDITS[field](record)})


FOLDER_EDITS = {  # an image folder's scan: the fields a JSONL scan leaves empty
    "runs": {"runs": lambda r: [[folder, files, "0" * 64] for folder, files, _ in r["runs"]]},
    "folder_format": {"folder_format": lambda r: "text_folder"},
    "metadata": {"metadata": lambda r: "metadata.csv", "stamps": lambda r: [[10, 20]]},
}


@pytest.mark.parametrize("field", sorted(FOLDER_EDITS))
def test_an_edited_field_of_an_image_folder_scan_is_refused_naming_the_file(field, image_folder, tmp_path):
    path = tmp_path / "dataset_scan.json"
    record = written(scan_dataset(image_folder, format="image_folder"), path)
    edit = {key: change(record) for key, change in FOLDER_EDITS[field].items()}
    assert record["runs"] and record["folder_format"] == "image_folder" and record[field] != edit[field]
    edited_refused(path, {**record, **edit})


def test_a_removed_field_or_another_seal_is_refused(text_jsonl, tmp_path):
    path = tmp_path / "dataset_scan.json"
    record = written(scan_dataset(text_jsonl), path)
    edited_refused(path, {key: value for key, value in record.items() if key != "features"})
    edited_refused(path, {**record, SEAL_KEY: canonical_sha256("another scan")})
    path.write_text(json.dumps({**record, SEAL_KEY: 5}))
    with pytest.raises(FormatError, match=re.escape(f"{path}: {SEAL_KEY} must be a sha256")):
        read_scan(path)


def test_a_scan_written_before_the_seal_is_still_read(text_jsonl, tmp_path):
    """Runs finished before scans were sealed keep their scan: a lost part is still redone from it."""
    scan = scan_dataset(text_jsonl)
    path = tmp_path / "dataset_scan.json"
    record = written(scan, path)
    path.write_text(json.dumps({key: value for key, value in record.items() if key != SEAL_KEY}))
    assert read_scan(path) == scan


def test_a_scan_written_again_over_an_edited_one_gives_the_parts_every_row(model_dir, text_jsonl, tmp_path):
    """The advice the refusal gives: the data scanned again (rule extract_scan: configured_scan, write_scan)
    over the edited file, the last part's job reads it and extracts up to the dataset's last row."""
    config = tiny.make_config(tmp_path, model_dir("gpt2"), text_jsonl)
    path = tmp_path / "dataset_scan.json"
    record = written(configured_scan(config), path)
    edited_refused(path, {**record, "n_samples": record["n_samples"] - 4})
    path.unlink()
    write_scan(configured_scan(config), path)
    last = config["extract"]["parts"] - 1
    run_part(config, last, tmp_path / "part", progress=False, scan=path)
    info = ex.open_part(tmp_path / "part").info
    assert info.n_dataset_samples == 30 and info.sample_range[1] == 30
