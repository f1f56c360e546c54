"""Datasets, review 63: a .gz file padded with zero bytes after its last member (as some tools pad
it; gzip and Python's gzip read it) is read, not refused; a Hub snapshot's JSON lines shards named
.json (data/train-00000-of-00001.json) are read as its split's shards."""
from __future__ import annotations

import gzip
import json

import pytest

from actstore.datasets import load_dataset, scan_dataset
from actstore.errors import ConfigError


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


@pytest.mark.parametrize("padding", [1, 512, 10_000])
def test_a_gzip_file_padded_with_zero_bytes_is_read(padding, tmp_path):
    """Zero padding after a member (tape and block tools write it) failed the scan as damaged data,
    though zcat and Python's gzip.open read the file; its rows are read, by the scan and a part alike."""
    texts = [f"row {i}" for i in range(5)]
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl(texts[:2])) + gzip.compress(jsonl(texts[2:])) + b"\0" * padding)
    assert gzip.decompress(path.read_bytes()) == jsonl(texts)  # as Python reads it
    scan = scan_dataset(path)
    assert scan.n_samples == 5
    part = load_dataset(path, parts=(2, 1), scan=scan)
    assert [(s.sample_idx, s.text) for s in part.samples] == [(3, "row 3"), (4, "row 4")]


def test_zero_bytes_between_gzip_members_are_skipped(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl(["a"])) + b"\0" * 7 + gzip.compress(jsonl(["b"])))
    assert [s.text for s in load_dataset(path).samples] == ["a", "b"]


@pytest.mark.parametrize("data", [b"\0" * 64, gzip.compress(jsonl(["a"])) + b"\0" * 9 + b"junk"],
                         ids=["zeros-alone", "junk-after-padding"])
def test_zero_bytes_are_no_gzip_file_and_junk_after_them_is_refused(data, tmp_path):
    """Padding follows a member: a file of zeros is no gzip file (never zero rows in silence), and
    bytes after the padding that are no member are damaged data."""
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=r"data\.jsonl\.gz: cannot be decompressed"):
        scan_dataset(path)


def hub_snapshot(root, suffix: str = ".json") -> None:
    """A Hub dataset repository of JSON lines shards, named as the Hub names them."""
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text("# a dataset\n")
    (root / "dataset_infos.json").write_text(json.dumps({"default": {"description": ""}}, indent=2))
    for split, n in (("test", 2), ("train", 3)):
        for shard in range(2):
            rows = [f"{split} {shard} {i}" for i in range(n)]
            (root / "data" / f"{split}-{shard:05d}-of-00002{suffix}").write_bytes(jsonl(rows))


@pytest.mark.parametrize("fmt", ["auto", "jsonl"])
def test_a_hub_snapshot_of_json_shards_is_read_as_its_split(fmt, tmp_path):
    """data/train-00000-of-00002.json (JSON lines, as the Hub names them) was no shard: the folder
    "held no samples". Its split's shards are read, in order; the repository's dataset_infos.json is none."""
    hub_snapshot(tmp_path)
    for split, n in (("train", 3), ("test", 2)):
        dataset = load_dataset(tmp_path, split=split, format=fmt)
        assert [s.text for s in dataset.samples] == [f"{split} {shard} {i}" for shard in range(2) for i in range(n)]
        assert [s.sample_idx for s in dataset.samples] == list(range(2 * n))
    scan = scan_dataset(tmp_path, split="train")
    part = load_dataset(tmp_path, split="train", parts=(2, 1), scan=scan)
    assert [(s.sample_idx, s.text) for s in part.samples] == [(3, "train 1 0"), (4, "train 1 1"), (5, "train 1 2")]


def test_hub_json_shards_beside_images_are_named(tmp_path):
    """A snapshot whose README shows a banner.png beside its JSON shards is not an image folder of that one image."""
    from PIL import Image

    hub_snapshot(tmp_path)
    Image.new("RGB", (4, 4)).save(tmp_path / "banner.png")
    with pytest.raises(ConfigError, match=r"holds images \(banner\.png, 1 in all\) and data files "
                                          r"\(data/test-00000-of-00002\.json\)"):
        scan_dataset(tmp_path)


@pytest.mark.parametrize("line, field", [('{"text": "a", "text": "b"}', "text"),
                                         ('{"text": "a", "label": 0, "label": 1}', "label"),
                                         ('{"text": "a", "src": "x", "src": "y"}', "src")])
def test_a_field_the_config_reads_twice_in_a_line_is_refused(line, field, tmp_path):
    """Python's json keeps a key's last value: a row naming its text (or label, or a kept field) twice
    was read as the second, without a word (Hugging Face's json loader refuses it: specified twice)."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine", "label": 0, "src": "x"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=rf"data\.jsonl:2: field {field!r} appears twice in the line"):
        scan_dataset(path, keep_fields=["src"])


def test_a_field_name_twice_in_a_line_but_once_in_the_row_is_read(tmp_path):
    """The name again inside a nested object or a string is no duplicate."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": 'say "text"', "meta": {"text": "inner", "label": 3}, "label": 1}) + "\n")
    dataset = load_dataset(path)
    assert [(s.text, s.label, s.metadata) for s in dataset.samples] == [
        ('say "text"', 1, {"meta": {"text": "inner", "label": 3}})]


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_a_non_ascii_label_field_twice_is_refused_as_either_spelling(ensure_ascii, tmp_path):
    """Python's json writes "\\u00e9tiquette"; other writers UTF-8 "étiquette": each is found."""
    name = json.dumps("étiquette", ensure_ascii=ensure_ascii)
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a", %s: 0, %s: 1}\n' % (name, name), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"data\.jsonl:1: field 'étiquette' appears twice in the line"):
        scan_dataset(path, label_field="étiquette")
