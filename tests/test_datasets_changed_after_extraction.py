"""Review 65: data changed under a finished extraction whose hash names the data by its path alone
(dataset.identity path, or unset on a config written as the demo's) is refused at parse time
(datasets.check_extraction_data_unchanged), from the extraction's own dataset_scan.json; a copy of
the extraction, or of the data with its times, is the same data and passes."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import tiny
from actstore.datasets import check_extraction_data_unchanged, scan_dataset, write_scan
from actstore.errors import ConfigError


def section(data: Path, **keys) -> dict:
    """The dataset section validate_config makes of one written as the demo's (path and name only)."""
    return {"path": str(data), "name": "mytexts", "split": "train", "limit": None, **keys}


def finished_extraction(extract_dir: Path, dataset: dict) -> Path:
    """An extraction directory as a finished run leaves it: its scan of the data, and its extract.json."""
    extract_dir.mkdir(parents=True)
    write_scan(scan_dataset(dataset["path"], dataset["limit"], dataset["split"]), extract_dir / "dataset_scan.json")
    (extract_dir / "extract.json").write_text("{}")
    return extract_dir


@pytest.fixture
def texts(tmp_path) -> Path:
    return tiny.write_jsonl(tmp_path / "texts.jsonl", 12)


def append_rows(data: Path, n: int) -> None:
    rows = data.read_text().splitlines(keepends=True)
    data.write_text("".join(rows + rows[:n]))


def test_rows_appended_to_a_path_hashed_jsonl_are_refused_naming_the_file(tmp_path, texts):
    extract_dir = finished_extraction(tmp_path / "extract" / "abc", section(texts))
    before = texts.stat().st_size
    append_rows(texts, 3)
    with pytest.raises(ConfigError) as error:
        check_extraction_data_unchanged(section(texts), extract_dir)
    message = str(error.value)
    assert message.startswith(f"{texts}: changed since the dataset was scanned (size {before} -> "
                              f"{texts.stat().st_size} bytes)")
    assert "dataset.identity: stat" in message and f"move {extract_dir} away" in message


def test_explicit_identity_path_is_checked_too(tmp_path, texts):
    dataset = section(texts, identity="path")
    extract_dir = finished_extraction(tmp_path / "extract" / "abc", dataset)
    append_rows(texts, 1)
    with pytest.raises(ConfigError, match=r"its hash names the data by its path alone \(dataset\.identity: path\)"):
        check_extraction_data_unchanged(dataset, extract_dir)


def test_a_touched_file_is_refused_and_its_recorded_mtime_given_back_passes(tmp_path, texts):
    """The scan holds no digest of the bytes: an mtime moved at the same size may be an edit in place."""
    extract_dir = finished_extraction(tmp_path / "extract" / "abc", section(texts))
    scanned = texts.stat().st_mtime_ns
    os.utime(texts, ns=(scanned + 5 * 10**9, scanned + 5 * 10**9))
    with pytest.raises(ConfigError, match=r"its modification time moved, its size \(\d+ bytes\) did not") as error:
        check_extraction_data_unchanged(section(texts), extract_dir)
    touch = str(error.value).split("`")[1]  # the command the message gives
    subprocess.run(touch, shell=True, check=True)
    assert texts.stat().st_mtime_ns == scanned
    check_extraction_data_unchanged(section(texts), extract_dir)


def test_a_copied_dump_to_with_the_data_in_place_passes(tmp_path, texts):
    extract_dir = finished_extraction(tmp_path / "results" / "extract" / "abc", section(texts))
    subprocess.run(["cp", "-a", str(tmp_path / "results"), str(tmp_path / "copy")], check=True)
    check_extraction_data_unchanged(section(texts), extract_dir)
    check_extraction_data_unchanged(section(texts), tmp_path / "copy" / "extract" / "abc")


def test_data_copied_with_its_times_to_the_same_relative_path_passes(tmp_path, texts, monkeypatch):
    """Another checkout holding the same file (copied with its times) at the same relative path."""
    checkout = tmp_path / "checkout"
    (checkout / "data").mkdir(parents=True)
    shutil.copy2(texts, checkout / "data" / "texts.jsonl")
    monkeypatch.chdir(checkout)
    extract_dir = finished_extraction(tmp_path / "shared" / "extract" / "abc", section(Path("data/texts.jsonl")))
    other = tmp_path / "other"
    shutil.copytree(checkout, other)  # copy2: the times too
    monkeypatch.chdir(other)
    check_extraction_data_unchanged(section(Path("data/texts.jsonl")), extract_dir)
    tiny.write_jsonl(other / "data" / "texts.jsonl", 15)  # that checkout's own data
    with pytest.raises(ConfigError, match=r"^data/texts\.jsonl: changed since the dataset was scanned \(size "):
        check_extraction_data_unchanged(section(Path("data/texts.jsonl")), extract_dir)


@pytest.mark.parametrize("identity", ["stat", "content"])
def test_a_hash_of_the_data_itself_is_not_checked(tmp_path, texts, identity):
    """Under stat other data hashes apart; a file touched under content is the same data (no false alarm)."""
    dataset = section(texts, identity=identity)
    extract_dir = finished_extraction(tmp_path / "extract" / "abc", dataset)
    scanned = texts.stat().st_mtime_ns
    os.utime(texts, ns=(scanned + 10**9, scanned + 10**9))
    check_extraction_data_unchanged(dataset, extract_dir)


def test_an_unfinished_extraction_is_left_to_its_part_jobs(tmp_path, texts):
    extract_dir = finished_extraction(tmp_path / "extract" / "abc", section(texts))
    (extract_dir / "extract.json").unlink()
    append_rows(texts, 3)
    check_extraction_data_unchanged(section(texts), extract_dir)  # rule extract_part's job refuses it


def test_an_image_added_to_a_path_hashed_image_folder_is_refused_with_the_counts(tmp_path, image_folder):
    photos = tmp_path / "photos"
    shutil.copytree(image_folder, photos)
    extract_dir = finished_extraction(tmp_path / "extract" / "abc", section(photos))
    check_extraction_data_unchanged(section(photos), extract_dir)
    shutil.copy2(photos / "animal" / "img_00.png", photos / "animal" / "img_99.png")
    with pytest.raises(ConfigError, match=rf"^{photos}: its files changed since the dataset was scanned "
                                          rf"\(9 files, 8 when scanned\); the finished extraction"):
        check_extraction_data_unchanged(section(photos), extract_dir)
    (photos / "animal" / "img_99.png").unlink()
    check_extraction_data_unchanged(section(photos), extract_dir)
    (photos / "object" / "img_00.png").rename(photos / "object" / "img_zz.png")
    with pytest.raises(ConfigError, match=r"its files changed since the dataset was scanned \(other file names\)"):
        check_extraction_data_unchanged(section(photos), extract_dir)
