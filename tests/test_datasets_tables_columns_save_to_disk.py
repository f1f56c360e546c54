"""Review 57: tables (kept columns' nested types, a CSV's text column of numbers) and save_to_disk
folders downloaded from the Hub."""
from __future__ import annotations

import csv
import datetime
import decimal
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tiny
from actstore.datasets import load_dataset, scan_dataset
from actstore.errors import ConfigError


@pytest.mark.parametrize("column, kind", [
    (pa.array([{"when": datetime.datetime(2020, 1, 1), "n": 1}] * 2), r"struct<when: timestamp\[us\], n: int64>"),
    (pa.array([[decimal.Decimal("1.50")], []], pa.list_(pa.decimal128(5, 2))), r"list<element: decimal128\(5, 2\)>"),
    (pa.array([b"ab", b"cd"], pa.binary(2)), r"fixed_size_binary\[2\]"),
    (pa.array([{"a": b"x"}, {"a": b"y"}]), r"struct<a: binary>")])
def test_a_kept_column_holding_no_json_values_at_any_depth_is_refused(column, kind, tmp_path):
    """dataset.keep_fields naming a struct holding a date or bytes, a list of decimals or fixed-size
    bytes was accepted (only the column's own type was checked) and the part's samples.jsonl failed
    after the model ran: json.dumps' TypeError naming no column. Now refused by the checks, naming
    the file, the column and its type; nested JSON values are kept as they are."""
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "meta": column,
                             "tags": pa.array([{"k": ["x"], "n": 1.5}, None])}), path)
    with pytest.raises(ConfigError, match=rf"rows\.parquet: column 'meta' \(dataset\.keep_fields\) is {kind}, "
                                          r"expected JSON values"):
        load_dataset(path, keep_fields=["meta"])
    kept = [s.metadata for s in load_dataset(path, keep_fields=["tags"]).samples]
    assert json.loads(json.dumps(kept)) == [{"tags": {"k": ["x"], "n": 1.5}}, {"tags": None}]


def test_a_csv_text_column_of_numbers_is_read_as_written(monkeypatch, tmp_path):
    """A CSV's text column of numbers ("007", "42", "3.10": prompts probing how a model reads
    numbers) was inferred as numbers and refused as no string column; one of numbers in its first
    block and words later failed at that block. Now read as the text written, in the scan and the
    part's job alike; the label column's type is still inferred (integers)."""
    from actstore.datasets import tables

    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", 256)  # a 16 MiB block's boundary, in a small file
    texts = ["007", "42", "3.10", *(str(i) for i in range(40)), "forty", "1e3"]
    with open(tmp_path / "numbers.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text", "label"])
        writer.writerows([text, i % 2] for i, text in enumerate(texts))
    scan = scan_dataset(tmp_path / "numbers.csv")
    assert (scan.n_samples, scan.labels) == (len(texts), [0, 1])
    part = load_dataset(tmp_path / "numbers.csv", parts=(2, 1), scan=scan)
    assert [s.text for s in load_dataset(tmp_path / "numbers.csv").samples] == texts
    assert [(s.sample_idx, s.text, s.label) for s in part.samples] == [
        (i, text, i % 2) for i, text in enumerate(texts) if i >= 23]


def test_a_save_to_disk_folder_from_the_hub_cache_reads_through_its_links_to_files(tmp_path):
    """huggingface_hub's cache holds a snapshot's files as links into ../../blobs: a save_to_disk
    DatasetDict pushed to the Hub and downloaded so was refused, each data file named in state.json
    "leads outside" (a link to a file, which every other layout's listing keeps). Now read; a
    folder linked out, `..` and absolute names are still refused."""
    built = tiny.write_hf_disk(tmp_path / "built", {"train": pa.table({"text": ["a", "b", "c"], "label": [0, 1, 0]})},
                               {"label": {"names": ["neg", "pos"], "_type": "ClassLabel"}})
    blobs, snapshot = tmp_path / "cache" / "blobs", tmp_path / "cache" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    for i, file in enumerate(sorted(p for p in built.rglob("*") if p.is_file())):
        (blobs / f"blob{i}").write_bytes(file.read_bytes())
        link = snapshot / file.relative_to(built)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(f"{'../' * (len(link.relative_to(snapshot).parts) + 1)}blobs/blob{i}")
    dataset = load_dataset(snapshot)
    assert [(s.text, s.label) for s in dataset.samples] == [("a", "neg"), ("b", "pos"), ("c", "neg")]

    state = snapshot / "train" / "state.json"
    files = json.loads(state.read_text())["_data_files"]
    (tmp_path / "elsewhere").mkdir()  # a folder linked out, holding a link to a file
    (tmp_path / "elsewhere" / "x.arrow").symlink_to(built / "train" / "data-00000-of-00002.arrow")
    (snapshot / "train" / "out").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    absolute = str(snapshot / "train" / "data-00000-of-00002.arrow")  # a link to a file, named absolutely
    for name, refused in (("out/x.arrow", "'out' leads outside"), (absolute, "is not a relative path inside"),
                          ("../train/data-00000-of-00002.arrow", "is not a relative path inside")):
        state.unlink()
        state.write_text(json.dumps({"_data_files": [{"filename": name}, *files[1:]]}))
        with pytest.raises(ConfigError, match=rf"state\.json: _data_files\[0\]\.filename: .*{re.escape(refused)}"):
            load_dataset(snapshot)


def test_a_float_label_column_is_read_as_json_lines_labels_are(tmp_path):
    """A float label column was refused, and the dataset with it, though no label was asked for: an
    integer column with a missing label as pandas writes it (floats, NaN for the missing one) and
    STS-B's `label` score. Now read as a JSON lines file of the same rows reads them: numbers, NaN no
    label (not a class per row), 1 and 1.0 one label across shards; an infinite label is named by
    the scan (its JSON cannot hold one: every part's job failed reading it, naming no row)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["a", "b"], "label": [1, 0]}), folder / "0.parquet")
    pq.write_table(pa.table({"text": ["c", "d", "e"], "label": [0.0, float("nan"), 2.0]}), folder / "1.parquet")
    scan = scan_dataset(folder)
    assert scan.labels == [0, 1, 2.0]
    assert [(s.text, s.label) for s in load_dataset(folder, scan=scan, parts=(2, 1)).samples] == [
        ("d", None), ("e", 2.0)]
    stsb = tmp_path / "stsb.parquet"
    pq.write_table(pa.table({"sentence1": ["x", "y"], "label": pa.array([3.5, 0.25], pa.float32())}), stsb)
    assert [s.label for s in load_dataset(stsb, text_field="sentence1").samples] == [3.5, 0.25]
    pq.write_table(pa.table({"text": ["a", "b"], "label": [1.0, float("-inf")]}), tmp_path / "inf.parquet")
    with pytest.raises(ConfigError, match=r"inf\.parquet#1, column 'label': label -inf; a row without a label"):
        scan_dataset(tmp_path / "inf.parquet")
