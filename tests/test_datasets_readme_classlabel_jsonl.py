"""Review 64, labels as Hugging Face numbers them, continued: a Hub repository's README.md ClassLabel over JSON lines
shards (ids and names, as `datasets.load_dataset` casts them), a column of names in Parquet or CSV under it, and the
README stamped by the scan so that a part's job refuses names edited since. Each on real files."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from actstore.datasets import identity_files, load_dataset, read_scan, resolve_source, scan_dataset, write_scan
from actstore.errors import ConfigError, FormatError
from test_datasets_readme_classlabel_tables import README

NAMES = ["cat", "thing", "person"]


def hub_folder(root, splits: dict, suffix: str = "jsonl", readme: str | None = README):
    """data/{split}-0000i-of-0000n.{suffix}: one shard a list of labels, the Hub's names."""
    (root / "data").mkdir(parents=True)
    if readme is not None:
        (root / "README.md").write_text(readme)
    for split, shards in splits.items():
        for i, labels in enumerate(shards):
            path = root / "data" / f"{split}-{i:05d}-of-{len(shards):05d}.{suffix}"
            rows = [{"text": f"{split} {i} {j}", "label": label} for j, label in enumerate(labels)]
            if suffix in ("jsonl", "json"):
                path.write_text("".join(json.dumps(row) + "\n" for row in rows))
            else:
                table = pa.Table.from_pylist(rows)
                pq.write_table(table, path) if suffix == "parquet" else pcsv.write_csv(table, path)
    return root


def numbered(dataset) -> list[tuple]:
    """(sample_idx, label, label_id) as the extraction numbers them (extract.run.sample_rows)."""
    ids = {label: i for i, label in enumerate(dataset.labels)}
    return [(s.sample_idx, s.label, ids.get(s.label, -1) if s.label is not None else -1) for s in dataset.samples]


@pytest.mark.parametrize("suffix", ["jsonl", "json"])  # the Hub names JSON lines shards .json too
def test_a_jsonl_split_missing_a_class_keeps_the_readmes_class_ids(suffix, tmp_path):
    """datasets 5.0.1 loads the test split [0, 2, 2] as ClassLabel ids 0, 2, 2; by rank it was 0, 1, 1, the train
    split's `thing` then sharing id 1 with the test split's `person`, without a word."""
    root = hub_folder(tmp_path, {"train": [[0, 1, 2]], "test": [[0, 2, 2]]}, suffix)
    dataset = load_dataset(root, split="test")
    assert dataset.labels == NAMES
    assert numbered(dataset) == [(0, "cat", 0), (1, "person", 2), (2, "person", 2)]


def test_jsonl_names_ids_and_no_labels_are_read_as_datasets_classlabel_reads_them(tmp_path):
    """As datasets 5.0.1 casts them (ClassLabel.str2int for names): a name, a name with spaces, a string of a class id,
    a whole float (pandas writes ints with a missing value so), null, -1 and "-1" (no label) give
    ids 2, 2, 2, 1, None, -1, -1."""
    labels = ["person", " person ", "2", 1.0, None, -1, "-1"]
    root = hub_folder(tmp_path, {"train": [labels], "test": [[0]]})
    dataset = load_dataset(root, split="train")
    assert [row[1:] for row in numbered(dataset)] == [("person", 2)] * 3 + [("thing", 1)] + [(None, -1)] * 3


@pytest.mark.parametrize("label, error", [
    ("dog", r':2: field \'label\': "dog" is none of its ClassLabel\'s 3 names \(\S+README\.md'),  # datasets: refused
    (3, r":2: field 'label': class id 3 names no class \(its ClassLabel has 3 names"),  # datasets: loads id 3
    (-2, r":2: field 'label': class id -2 names no class"),  # datasets: loads id -2
    (True, r":2: field 'label': true is no class id or name of its ClassLabel"),  # datasets: id 1
    (1.5, r":2: field 'label': 1.5 is no class id or name of its ClassLabel"),  # datasets: refused
])
def test_a_jsonl_label_not_of_the_classlabel_is_named_with_its_line(label, error, tmp_path):
    root = hub_folder(tmp_path, {"train": [[0]], "test": [["cat", label]]})
    with pytest.raises(ConfigError, match=r"test-00000-of-00001\.jsonl" + error):
        scan_dataset(root, split="test")


def test_the_parallel_scan_a_limit_and_a_parts_read_agree_on_classlabel_ids(tmp_path):
    """Two shards, the first holding only `person`: the parallel scan's per-file label lists joined (label_list)
    sorted the names by their text; the part read from the written scan numbers as one whole read does."""
    root = hub_folder(tmp_path, {"train": [[2, 2], ["cat", 1, None]], "test": [[0]]})
    whole = scan_dataset(root, split="train")
    assert whole.labels == NAMES
    assert scan_dataset(root, split="train", workers=2).labels == NAMES
    assert scan_dataset(root, split="train", limit=1).labels == NAMES
    write_scan(scan_dataset(root, split="train", workers=2), tmp_path / "scan.json")
    scan = read_scan(tmp_path / "scan.json")
    parts = [numbered(load_dataset(root, split="train", parts=(2, part), scan=scan)) for part in (0, 1)]
    assert parts[0] + parts[1] == numbered(load_dataset(root, split="train"))
    assert parts[0] + parts[1] == [(0, "person", 2), (1, "person", 2), (2, "cat", 0), (3, "thing", 1), (4, None, -1)]


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_a_column_of_names_under_a_readme_classlabel_is_numbered_by_it(suffix, tmp_path):
    """datasets 5.0.1 casts a Parquet column of names to their ClassLabel ids (a test split of `person` and `cat`:
    2, 0); by their text they were numbered 1, 0 (refused since review 64's first fix). A CSV too, one way."""
    root = hub_folder(tmp_path, {"train": [["cat", "thing"]], "test": [["person", "cat", " person"]]}, suffix)
    dataset = load_dataset(root, split="test")
    assert dataset.labels == NAMES
    assert numbered(dataset) == [(0, "person", 2), (1, "cat", 0), (2, "person", 2)]


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_an_unknown_name_in_a_table_is_named_with_its_row(suffix, tmp_path):
    root = hub_folder(tmp_path, {"train": [["cat"]], "test": [["person", "dog"]]}, suffix)
    with pytest.raises(ConfigError, match=rf"test-00000-of-00001\.{suffix}#1: field 'label': \"dog\" is none of its "
                                          r"ClassLabel's 3 names"):
        scan_dataset(root, split="test")


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_readme_renamed_after_the_scan_is_refused_by_a_parts_job(suffix, tmp_path):
    """With dataset.identity: path the extraction's hash does not see the README; a part's job read `human` where
    the scan listed `person`, and its label_id was -1 (extract.run.sample_rows), without a word."""
    root = hub_folder(tmp_path, {"train": [[0, 2]], "test": [[0]]}, suffix)
    scan = scan_dataset(root, split="train")
    assert scan.features == "README.md"
    (root / "README.md").write_text(README.replace("person", "human!"))
    os.utime(root / "README.md", ns=(1, 1))
    with pytest.raises(ConfigError, match=r"README\.md: changed since the dataset was scanned"):
        load_dataset(root, split="train", parts=(1, 0), scan=scan)


def test_a_readme_classlabel_gone_after_the_scan_is_refused(tmp_path):
    root = hub_folder(tmp_path, {"train": [[0, 2]], "test": [[0]]})
    scan = scan_dataset(root, split="train")
    (root / "README.md").write_text(README[:README.index("dataset_info:")] + "---\n")
    with pytest.raises(ConfigError, match=r"its features file \(the labels' ClassLabel names\) is none, README\.md "
                                          r"when the dataset was scanned"):
        load_dataset(root, split="train", parts=(1, 0), scan=scan)


def test_a_dataset_without_a_features_file_is_stamped_as_before(tmp_path):
    """A README without dataset_info: one stamp a data file, no features file, labels by rank; editing it changes
    nothing the scan checks."""
    root = hub_folder(tmp_path, {"train": [[2, 0]], "test": [[0]]}, readme=README[:README.index("dataset_info:")]
                      + "---\n")
    scan = scan_dataset(root, split="train")
    assert (scan.labels, len(scan.stamps), scan.features) == ([0, 2], 1, "")
    assert identity_files(resolve_source(str(root), split="train")) == [root / "data" / "train-00000-of-00001.jsonl"]
    (root / "README.md").write_text((root / "README.md").read_text() + "\nmore words\n")
    assert numbered(load_dataset(root, split="train", parts=(1, 0), scan=scan)) == [(0, 2, 1), (1, 0, 0)]


def test_a_scan_naming_another_features_file_is_refused(tmp_path):
    root = hub_folder(tmp_path, {"train": [[0, 2]], "test": [[0]]})
    write_scan(scan_dataset(root, split="train"), tmp_path / "scan.json")
    data = json.loads((tmp_path / "scan.json").read_text())
    assert data["features"] == "README.md" and len(data["stamps"]) == 2
    (tmp_path / "scan.json").write_text(json.dumps({**data, "features": "../secrets.json"}))
    with pytest.raises(FormatError, match=r"scan\.json: features must be one of README\.md, dataset_info\.json"):
        read_scan(tmp_path / "scan.json")


def test_a_save_to_disk_folders_dataset_info_edited_after_the_scan_is_refused(tmp_path):
    """dataset_info.json names a save_to_disk folder's labels as a README does a Hub folder's: stamped too."""
    from tiny import write_hf_disk

    features = {"text": {"dtype": "string", "_type": "Value"},
                "label": {"names": ["neg", "pos"], "_type": "ClassLabel"}}
    table = pa.table({"text": [f"t{i}" for i in range(4)], "label": [0, 1, 1, 0]})
    root = write_hf_disk(tmp_path / "saved", {"train": table}, features)
    scan = scan_dataset(root)
    assert (scan.features, len(scan.stamps), scan.labels) == ("dataset_info.json", 3, ["neg", "pos"])
    info = root / "train" / "dataset_info.json"
    features["label"]["names"] = ["bad", "good"]
    info.write_text(json.dumps({"features": features}))
    os.utime(info, ns=(1, 1))
    with pytest.raises(ConfigError, match=r"train/dataset_info\.json: changed since the dataset was scanned"):
        load_dataset(root, parts=(2, 1), scan=scan)
