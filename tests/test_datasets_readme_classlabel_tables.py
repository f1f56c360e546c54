"""Review 64, labels as Hugging Face numbers them: a Hub repository's README.md declaring a ClassLabel over
Parquet or CSV files that carry no features of their own (written by pandas or polars), each on real files."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import yaml

from actstore.datasets import identity_files, load_dataset, resolve_source, scan_dataset
from actstore.errors import ConfigError
from actstore.hashing import dataset_identity

README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: test
    path: data/test-*
dataset_info:
  features:
  - name: text
    dtype: string
  - name: label
    dtype:
      class_label:
        names:
          '0': cat
          '1': thing
          '2': person
---
"""
SPLITS = {"train": [0, 1, 2, 1], "test": [0, 2, 2]}


def hub_folder(root, readme: str | None = README, splits: dict = SPLITS, label_type: pa.DataType = pa.int64(),
               suffix: str = "parquet"):
    """A Hub repository's layout: data/{split}-00000-of-00001.{suffix}, no `huggingface` schema metadata."""
    (root / "data").mkdir(parents=True)
    if readme is not None:
        (root / "README.md").write_text(readme)
    for split, labels in splits.items():
        table = pa.table({"text": [f"{split} {i}" for i in range(len(labels))], "label": pa.array(labels, label_type)})
        path = root / "data" / f"{split}-00000-of-00001.{suffix}"
        pq.write_table(table, path) if suffix == "parquet" else pcsv.write_csv(table, path)
    return root


def numbered(dataset) -> list[tuple]:
    return [(s.label, dataset.labels.index(s.label)) for s in dataset.samples]


def readme_with(dataset_info) -> str:
    front = yaml.safe_load(README.strip().strip("-"))
    front["dataset_info"] = dataset_info
    return f"---\n{yaml.safe_dump(front, sort_keys=False)}---\n"


def test_a_hub_readme_class_label_numbers_a_split_missing_a_class_as_the_dataset_does(tmp_path):
    """Parquet written by pandas or polars carries no `huggingface` schema metadata; the repository's README
    declares the ClassLabel, and `datasets.load_dataset` reads it from there. A test split holding classes
    0 and 2 only must keep label_id 2 (its class id, as in the train split), not its rank 1."""
    dataset = load_dataset(hub_folder(tmp_path), split="test")
    assert numbered(dataset) == [("cat", 0), ("person", 2), ("person", 2)]


def test_readme_class_label_names_given_as_a_list(tmp_path):
    info = {"features": [{"name": "text", "dtype": "string"},
                         {"name": "label", "dtype": {"class_label": {"names": ["cat", "thing", "person"]}}}]}
    dataset = load_dataset(hub_folder(tmp_path, readme_with(info)), split="test")
    assert dataset.labels == ["cat", "thing", "person"]
    assert numbered(dataset) == [("cat", 0), ("person", 2), ("person", 2)]


def test_readme_dataset_info_per_config_takes_the_default_configs(tmp_path):
    """dataset_info as a list of one entry a config: the default config's names, not the first entry's."""
    def entry(config, names):
        return {"config_name": config, "features": [{"name": "text", "dtype": "string"},
                                                    {"name": "label", "dtype": {"class_label": {"names": names}}}]}
    info = [entry("other", {"0": "x", "1": "y", "2": "z", "3": "w"}), entry("default", {"0": "a", "1": "b", "2": "c"})]
    dataset = load_dataset(hub_folder(tmp_path, readme_with(info)), split="test")
    assert numbered(dataset) == [("a", 0), ("c", 2), ("c", 2)]


def test_a_label_id_past_the_readmes_names_is_named(tmp_path):
    """datasets 5.0.1 loads id 3 of 3 names without a word; here it is named."""
    root = hub_folder(tmp_path, splits={"train": [0, 1], "test": [2, 3, 0]})
    with pytest.raises(ConfigError, match=r"test-00000-of-00001\.parquet#1, column 'label': class id 3 names no class "
                                          r"\(its ClassLabel has 3 names"):
        scan_dataset(root, split="test")


def test_readme_class_label_ids_that_skip_one_are_named(tmp_path):
    info = {"features": [{"name": "label", "dtype": {"class_label": {"names": {"0": "cat", "2": "person"}}}}]}
    root = hub_folder(tmp_path, readme_with(info))
    with pytest.raises(ConfigError, match=r"README\.md: dataset_info feature 'label' class_label names: ids 0, 2 are "
                                          r"not 0 to 1"):
        scan_dataset(root, split="test")


def test_a_readme_without_dataset_info_numbers_labels_as_before(tmp_path):
    """No ClassLabel declared: integer labels are their own values, in order (label_list), and the README
    is not part of the data's identity (a Hub snapshot's hash is unchanged)."""
    readme = README[:README.index("dataset_info:")] + "---\n"
    root = hub_folder(tmp_path, readme)
    dataset = load_dataset(root, split="test")
    assert dataset.labels == [0, 2] and numbered(dataset) == [(0, 0), (2, 1), (2, 1)]
    assert [p.name for p in identity_files(resolve_source(str(root), split="test"))] == ["test-00000-of-00001.parquet"]


def test_a_readme_that_names_the_labels_is_part_of_the_datas_identity(tmp_path):
    """Its names decide the labels: edited later, the extraction is another one, never stale labels."""
    root = hub_folder(tmp_path)
    assert root / "README.md" in identity_files(resolve_source(str(root), split="test"))
    section = {"path": str(root), "split": "test", "format": "parquet"}
    before = dataset_identity(section)
    (root / "README.md").write_text(README.replace("person", "human"))
    os.utime(root / "README.md", ns=(1, 1))  # another mtime whatever the clock's resolution
    assert dataset_identity(section) != before
    assert numbered(load_dataset(root, split="test"))[1] == ("human", 2)


def test_an_undecodable_table_image_is_named_by_its_row(tmp_path):
    """Rows of an image table may all name one file (`image.png`, as a PIL image saved to a Parquet column
    is named): the row of the undecodable image is what finds it."""
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 10, 10)).save(png, "PNG")
    images = [{"bytes": png.getvalue(), "path": "image.png"}] * 3 + [{"bytes": b"not a png", "path": "image.png"}]
    pq.write_table(pa.table({"image": images, "label": [0, 1, 0, 1]}), tmp_path / "train.parquet", row_group_size=2)
    dataset = load_dataset(tmp_path / "train.parquet", format="image_table")
    *readable, broken = dataset.samples
    for sample in readable:
        dataset.opener.check(sample)
    with pytest.raises(ConfigError, match=r"sample 3 of \S+train\.parquet: image\.png, column 'image': not a readable"):
        dataset.opener.check(broken)


@pytest.mark.parametrize("metadata", ["metadata.csv", "metadata.jsonl"])
def test_an_image_folders_metadata_label_field_left_unread_is_warned_of(metadata, tmp_path, caplog):
    """Hugging Face's imagefolder labels images by a metadata file's `label` field; with dataset.label_field
    unset the images' folders label them here (none at the root: -1), which the scan says, naming the file."""
    from PIL import Image

    rows = [("a.png", "cat"), ("b.png", "dog")]
    for name, _ in rows:
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    if metadata == "metadata.csv":
        (tmp_path / metadata).write_text("file_name,label\n" + "".join(f"{n},{label}\n" for n, label in rows))
    else:
        (tmp_path / metadata).write_text("".join(f'{{"file_name": "{n}", "label": "{label}"}}\n' for n, label in rows))
    with caplog.at_level("WARNING", logger="actstore.datasets.folder_metadata"):
        assert scan_dataset(tmp_path).labels == []
    assert f"{tmp_path / metadata}: 2 rows have a 'label' field" in caplog.text
    assert "set dataset.label_field: label" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="actstore.datasets.folder_metadata"):
        assert scan_dataset(tmp_path, label_field="label").labels == ["cat", "dog"]
    assert caplog.text == ""
