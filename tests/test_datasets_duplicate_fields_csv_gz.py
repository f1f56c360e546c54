"""Datasets, review 64: an element of a JSON array file naming a field the config reads twice is
refused, as a JSON line is (json kept the last value without a word); a .csv.gz padded with zero
bytes after its last member is read, as a .jsonl.gz is (pyarrow's own gzip reader refused it); a
text folder's file larger than one sample's bound is named, never read whole into memory."""
from __future__ import annotations

import csv
import gzip
import io
import json

import pytest

from actstore.datasets import folders, load_dataset, scan_dataset
from actstore.errors import ConfigError


def write_array(path, elements: list[str]) -> None:
    """A JSON file of one array whose elements are given as their JSON text (a duplicate key kept)."""
    data = ("[\n" + ",\n".join(elements) + "\n]\n").encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


@pytest.mark.parametrize("name", ["data.json", "data.json.gz"])
@pytest.mark.parametrize("field", ["text", "label"])
def test_a_json_array_element_naming_a_read_field_twice_is_refused(name, field, tmp_path):
    """{"text": "a", "text": "b"} was read as "b" (json keeps the last value); a JSON line so is refused."""
    path = tmp_path / name
    twice = {"text": '{"text": "first", "text": "second", "label": 1}',
             "label": '{"text": "b", "label": 1, "label": 2}'}[field]
    write_array(path, ['{"text": "a", "label": 0}', twice])
    with pytest.raises(ConfigError, match=rf"{name}: element 2: field '{field}' appears twice in the element"):
        scan_dataset(path, label_field="label")


def test_a_json_array_element_with_a_read_name_twice_in_a_nested_object_is_read(tmp_path):
    """A field's name again inside a nested object (or a value) is no duplicate: the row is read."""
    path = tmp_path / "data.json"
    write_array(path, ['{"text": "a", "meta": {"text": 1, "text": 2}, "label": "text"}', '{"text": "b"}'])
    dataset = load_dataset(path)
    assert [(s.sample_idx, s.text, s.label) for s in dataset.samples] == [(0, "a", "text"), (1, "b", None)]


def csv_bytes(rows: list[tuple[str, str]]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["text", "label"])
    writer.writerows(rows)
    return out.getvalue().encode()


@pytest.mark.parametrize("padding", [1, 512, 10_000])
def test_a_csv_gz_padded_with_zero_bytes_is_read(padding, tmp_path):
    """Zero padding after the last gzip member (tape and block tools write it; gzip and Python read it)
    failed the scan as 'unknown compression method', while a .jsonl.gz so padded is read."""
    rows = [(f"row {i}\nits second line", f"l{i % 3}") for i in range(7)]
    path = tmp_path / "data.csv.gz"
    path.write_bytes(gzip.compress(csv_bytes(rows[:3])) + gzip.compress(csv_bytes(rows[3:])[len(b"text,label\r\n"):])
                     + b"\0" * padding)
    assert gzip.decompress(path.read_bytes()) == csv_bytes(rows)  # as Python reads it
    scan = scan_dataset(path, label_field="label")
    assert (scan.n_samples, scan.labels) == (7, ["l0", "l1", "l2"])
    part = load_dataset(path, label_field="label", parts=(2, 1), scan=scan)
    assert [(s.sample_idx, s.text, s.label) for s in part.samples] == [(i, *rows[i]) for i in range(4, 7)]


def test_a_csv_gz_cut_short_or_with_junk_after_its_padding_is_named(tmp_path):
    """Reading the padding never reads a damaged file as fewer rows: cut or followed by junk, it is named."""
    packed = gzip.compress(csv_bytes([(f"row {i}", "a") for i in range(50_000)]))
    for name, data in (("cut.csv.gz", packed[:len(packed) // 2]), ("junk.csv.gz", packed + b"\0" * 9 + b"junk")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=rf"(?i){name}: cannot (be )?read as csv .*(cut short|damaged)"):
            scan_dataset(tmp_path / name)


def test_a_text_folder_file_over_the_bound_is_named_and_one_at_it_is_read_whole(monkeypatch, tmp_path):
    """A text folder's file was read whole: a 5 GB log held 5 GB (and its decoded text more) in the
    scan and in its part's job. One over MAX_TEXT_BYTES is named by the scan; one at it is read as written."""
    monkeypatch.setattr(folders, "MAX_TEXT_BYTES", 64)
    (tmp_path / "pos").mkdir()
    (tmp_path / "pos" / "a.txt").write_text("é" * 32)  # 64 bytes of UTF-8: at the bound
    dataset = load_dataset(tmp_path, format="text_folder")
    assert [(s.text, s.label) for s in dataset.samples] == [("é" * 32, "pos")]
    (tmp_path / "pos" / "b.txt").write_text("x" * 65)
    with pytest.raises(ConfigError, match=r"pos/b\.txt: a text file larger than 64 bytes"):
        scan_dataset(tmp_path, format="text_folder")


def test_a_json_lines_file_s_duplicate_check_is_unchanged(tmp_path):
    """The line's own check, which the array's now shares, still names the line."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + '{"text": "b", "text": "c"}\n')
    with pytest.raises(ConfigError, match=r"data\.jsonl:2: field 'text' appears twice in the line"):
        scan_dataset(path)


def test_a_readme_config_whose_split_pattern_matches_no_file_is_named(tmp_path):
    """A misspelt data_files pattern left its split no file: the error said the folder holds no
    samples (a folder of text files?), naming neither the README nor the pattern."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"text": ["t1", "t2"]}), tmp_path / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ["v1"]}), tmp_path / "data" / "validation-00000-of-00001.parquet")
    (tmp_path / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n"
                                        "  - split: train\n    path: data/trian-*\n"
                                        "  - split: validation\n    path: data/validation-*\n---\n# a dataset\n")
    assert [s.text for s in load_dataset(tmp_path, split="validation").samples] == ["v1"]
    with pytest.raises(ConfigError, match=r"README\.md: configs data_files of split 'train' \(data/trian-\*\) "
                                          r"match no data file under"):
        scan_dataset(tmp_path, split="train")


def photo_folder(root):
    """Two PNG images in class folders: cat/a.png and dog/b.png."""
    from PIL import Image

    for name, color in (("cat/a.png", (255, 0, 0)), ("dog/b.png", (0, 0, 255))):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), color).save(root / name)
    return root


@pytest.mark.parametrize("twice", ["kind", "file_name"])
def test_an_image_folder_metadata_line_naming_a_field_twice_is_refused(twice, tmp_path):
    """metadata.jsonl's {"file_name": .., "kind": "x", "kind": "y"} labelled its image "y" (json keeps
    the last value) without a word, where a dataset's own JSON line so is refused."""
    photos = photo_folder(tmp_path / "photos")
    second = {"kind": '{"file_name": "dog/b.png", "kind": "x", "kind": "y"}',
              "file_name": '{"file_name": "cat/a.png", "kind": "x", "file_name": "dog/b.png"}'}[twice]
    (photos / "metadata.jsonl").write_text('{"file_name": "cat/a.png", "kind": "p"}\n' + second + "\n")
    with pytest.raises(ConfigError, match=rf"metadata\.jsonl:2: field '{twice}' appears twice in the line"):
        scan_dataset(photos, label_field="kind")


def test_an_image_folder_metadata_line_with_a_name_in_a_value_is_read(tmp_path):
    """The check parses a line again only where a field's quoted name is in it twice: a value that
    holds the name is no duplicate, and the row is read as written."""
    photos = photo_folder(tmp_path / "photos")
    first = json.dumps({"file_name": "cat/a.png", "kind": "p", "note": 'say "kind'})
    assert first.count('"kind"') == 2  # the value's end spells the quoted name: the line is parsed again
    (photos / "metadata.jsonl").write_text(first + '\n{"file_name": "dog/b.png", "kind": "q", "note": ""}\n')
    dataset = load_dataset(photos, label_field="kind")
    assert [(s.text, s.label, s.metadata) for s in dataset.samples] == [
        ("cat/a.png", "p", {"note": 'say "kind'}), ("dog/b.png", "q", {"note": ""})]


def test_an_image_folder_metadata_csv_header_naming_a_column_twice_is_refused(tmp_path):
    """csv.DictReader kept the last of two `kind` columns (pandas, as Hugging Face reads the file,
    the first): each image silently took the other column's label."""
    photos = photo_folder(tmp_path / "photos")
    (photos / "metadata.csv").write_text("file_name,kind,kind\ncat/a.png,p,q\ndog/b.png,p,q\n")
    with pytest.raises(ConfigError, match=r"metadata\.csv:1: column 'kind' appears twice in the header"):
        scan_dataset(photos, label_field="kind")
