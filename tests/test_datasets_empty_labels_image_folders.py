"""Review 56 of the remaining dataset readers: tables, image folders and their metadata, sources."""
from __future__ import annotations

import csv

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from actstore.datasets import load_dataset, resolve_source, scan_dataset
from actstore.errors import ConfigError


def test_a_csv_rows_empty_label_is_no_label_not_a_class(tmp_path):
    """csv.writer writes a missing label (None) as the empty value, as pandas' to_csv writes NaN: the
    row has no label (before: a class "" of its own, in the labels and the row's label)."""
    path = tmp_path / "reviews.csv"
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows([["text", "label"], ["good", "pos"], ["unsure", None], ["bad", "neg"]])
    assert scan_dataset(path).labels == ["neg", "pos"]
    assert [(s.text, s.label) for s in load_dataset(path).samples] == [("good", "pos"), ("unsure", None),
                                                                       ("bad", "neg")]


def test_a_metadata_csv_empty_label_is_no_label_not_a_class(tmp_path):
    """An image folder's metadata.csv with an empty label value: that image has no label (before: a
    class ""); a kept field's empty value stays the empty text it is."""
    for i in range(3):
        Image.new("RGB", (4, 4)).save(tmp_path / f"{i}.png")
    with (tmp_path / "metadata.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows([["file_name", "kind", "caption"], ["0.png", "a", ""], ["1.png", None, "x"],
                                  ["2.png", "b", "y"]])
    assert scan_dataset(tmp_path, label_field="kind").labels == ["a", "b"]
    assert [(s.label, s.metadata) for s in load_dataset(tmp_path, label_field="kind").samples] == [
        ("a", {"caption": ""}), (None, {"caption": "x"}), ("b", {"caption": "y"})]


def test_a_folder_of_images_and_data_files_is_named_not_read_as_its_images(tmp_path):
    """A Hub snapshot (data/train-*.parquet) whose README shows a banner.png: format auto names both
    (before: an image folder of the banner alone, the table's rows left out); dataset.format picks
    one; an image folder's metadata file is no data file."""
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(50)], "label": [i % 2 for i in range(50)]}),
                   tmp_path / "data" / "train-00000-of-00001.parquet")
    Image.new("RGB", (40, 10)).save(tmp_path / "banner.png")
    with pytest.raises(ConfigError, match=r"holds images \(banner\.png, 1 in all\) and data files "
                                          r"\(data/train-00000-of-00001\.parquet\): set dataset\.format"):
        resolve_source(str(tmp_path))
    assert scan_dataset(tmp_path, format="parquet").n_samples == 50
    assert resolve_source(str(tmp_path), "image_folder").files == (tmp_path / "banner.png",)

    photos = tmp_path / "photos"
    (photos / "cat").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(photos / "cat" / "1.png")
    (photos / "metadata.csv").write_text("file_name,caption\ncat/1.png,a cat\n")
    assert resolve_source(str(photos)).format == "image_folder"


def test_a_csv_column_the_config_never_reads_does_not_fail_the_scan(tmp_path, monkeypatch):
    """A CSV whose `id` column holds numbers in its first block and text in a later one: the scan
    counts its rows and reads text and label (before: counting converted every column, and the
    scan failed on the id column, which nothing reads). Blocks of 1 KiB stand for 16 MiB ones."""
    from actstore.datasets import tables

    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", 1024)
    path = tmp_path / "reviews.csv"
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows([["id", "text", "label"]] + [[i if i < 190 else f"x{i}", f"review {i}", i % 2]
                                                              for i in range(200)])
    scan = scan_dataset(path)
    assert (scan.n_samples, scan.labels) == (200, [0, 1])
    assert [(s.text, s.label) for s in load_dataset(path, scan=scan, parts=(2, 1)).samples[-2:]] == [
        ("review 198", 0), ("review 199", 1)]


def test_a_metadata_file_above_split_folders_is_named_not_left_out(tmp_path):
    """metadata.jsonl at the root of train/ and test/ (file_name `train/0.png`, as Hugging Face's
    imagefolder reads it for every split) is named (before: the split's images were read without
    their fields, without a word); one in the split's folder is read."""
    import json

    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        for i in range(2):
            Image.new("RGB", (4, 4)).save(tmp_path / split / f"{i}.png")
    rows = [{"file_name": f"{split}/{i}.png", "caption": f"{split} {i}"}
            for split in ("train", "test") for i in range(2)]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ConfigError, match=r"metadata\.jsonl at the root of its split folders is not read \(the "
                                          r"split's images are read from train/\)"):
        load_dataset(tmp_path)
    (tmp_path / "metadata.jsonl").rename(tmp_path / "train" / "metadata.jsonl")
    (tmp_path / "train" / "metadata.jsonl").write_text("".join(
        json.dumps({**row, "file_name": row["file_name"].removeprefix("train/")}) + "\n" for row in rows[:2]))
    assert [(s.text, s.metadata) for s in load_dataset(tmp_path).samples] == [
        ("0.png", {"caption": "train 0"}), ("1.png", {"caption": "train 1"})]


def test_a_photo_whose_exif_holds_a_tag_of_another_type_runs_upright(tmp_path):
    """A JPEG turned by its EXIF Orientation (6) whose other tag's value is not of its type (a
    description under YPosition, a rational): ImageOps.exif_transpose wrote the EXIF again and raised
    a TypeError naming no file; the image decodes upright, as the tag turns it."""
    import io

    import numpy as np

    exif = Image.Exif()
    exif[0x0112], exif[0x010E] = 6, "a camera's description"  # Orientation, ImageDescription (ASCII)
    buffer = io.BytesIO()
    Image.fromarray((np.arange(20 * 30 * 3) % 251).astype(np.uint8).reshape(20, 30, 3)).save(buffer, "JPEG", exif=exif)
    described = b"\x01\x0e\x00\x02"  # the big-endian IFD entry: tag 270, type ASCII
    assert buffer.getvalue().count(described) == 1
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "photo.jpg").write_bytes(buffer.getvalue().replace(described, b"\x01\x1f\x00\x02"))  # 287
    dataset = load_dataset(tmp_path)
    dataset.opener.check(dataset.samples[0])
    with Image.open(tmp_path / "cat" / "photo.jpg") as stored:
        assert stored.getexif()[0x011F] == "a camera's description"
        expected = np.asarray(stored.transpose(Image.Transpose.ROTATE_270).convert("RGB"))
    assert np.array_equal(np.asarray(dataset.opener(dataset.samples[0])), expected) and expected.shape == (30, 20, 3)
