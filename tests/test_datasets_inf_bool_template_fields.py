"""Review of small leftovers (tables.py, jsonl.py, contract.py): the scan's memory on a large row
group of labels, an infinity or a boolean in a template field, and part.json's dataset.labels."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.datasets import scan_dataset
from actstore.errors import ConfigError, FormatError
from actstore.formats.extract import open_part, synthetic_extraction
from tiny import traced_peak


def test_the_scan_converts_a_large_row_groups_labels_in_slices(tmp_path):
    """The labels of a row group were converted to Python whole (pyarrow writes 1Mi rows a group):
    its strings and list (29 MB at 400k rows) held at once, where the distinct labels are kept."""
    def peak(rows: int) -> int:
        path = tmp_path / f"{rows}.parquet"
        pq.write_table(pa.table({"text": ["t"] * rows, "label": [f"class-{i % 5}" for i in range(rows)]}), path,
                       row_group_size=rows)
        scan, held = traced_peak(lambda: scan_dataset(path))
        assert (scan.n_samples, scan.labels) == (rows, [f"class-{i}" for i in range(5)])
        return held

    small, large = peak(20_000), peak(200_000)
    assert large < small + (1 << 20), (small, large)


@pytest.mark.parametrize("value, named", [("Infinity", "Infinity"), ("-Infinity", "-Infinity"),
                                          ("1e999", "Infinity")])
def test_an_infinity_in_a_json_template_field_is_named(value, named, tmp_path):
    """Python's json reads Infinity (and a number past float's range as one): 'Score: inf' was the prompt."""
    path = tmp_path / "scores.jsonl"
    path.write_text(f'{{"review": "good", "score": 4.5}}\n{{"review": "bad", "score": {value}}}\n')
    with pytest.raises(ConfigError, match=rf"scores.jsonl:2: field 'score': {named} where a prompt is needed"):
        scan_dataset(path, prompt_template="Review: {review} Score: {score}")


@pytest.mark.parametrize("value, named", [(float("inf"), "Infinity"), (float("-inf"), "-Infinity")])
def test_an_infinity_in_a_table_template_column_is_named(value, named, tmp_path):
    """As a NaN there is: a float column's infinity rendered as 'Score: inf'."""
    path = tmp_path / "scores.parquet"
    pq.write_table(pa.table({"review": ["good", "bad"], "score": [4.5, value]}), path)
    with pytest.raises(ConfigError, match=rf"scores.parquet#1, column 'score': {named} where a prompt is needed"):
        scan_dataset(path, prompt_template="Review: {review} Score: {score}")


def test_a_boolean_json_template_field_is_named(tmp_path):
    """A template's fields are strings or numbers (a table's bool column is refused): JSON's true
    passed as the number 1 and rendered as 'Spam: True'."""
    path = tmp_path / "mail.jsonl"
    path.write_text('{"text": "hi", "spam": false}\n{"text": "win", "spam": true}\n')
    with pytest.raises(ConfigError, match=r"mail.jsonl:1: field 'spam': false is a boolean, not a string or number"):
        scan_dataset(path, prompt_template="{text} Spam: {spam}")


@pytest.mark.parametrize("labels", ["positive", {"pos": 0}, [["pos"]]])
def test_part_json_labels_that_are_no_list_of_labels_are_named(labels, tmp_path):
    """A string was read as the list of its characters (label_id 0 = 'p'), a writer then failed on
    an unnamed TypeError or wrote the letters as class names."""
    part = synthetic_extraction(tmp_path / "extract", 10**5, 1, 16, [1], tokens=(4, 8)) / "part-0000"
    meta = json.loads((part / "part.json").read_text())
    meta["dataset"]["labels"] = labels
    (part / "part.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=re.escape(f"{part / 'part.json'}: field 'dataset.labels' must be a list "
                                                    f"of labels")):
        open_part(part)
