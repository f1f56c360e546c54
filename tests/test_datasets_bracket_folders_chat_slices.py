"""Third review of reading the user's datasets (jsonl.py, splits.py, __init__.py, tables.py): a NaN
in a JSON template field, folders whose path holds glob characters, and the scan's memory on a
chat column's large row group."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.datasets import load_dataset, scan_dataset
from actstore.errors import ConfigError
from tiny import traced_peak

NAN_ROWS = {"scores.jsonl": '{"review": "good", "score": 4.5}\n{"review": "bad", "score": NaN}\n',
            "scores.json": '[{"review": "good", "score": 4.5}, {"review": "bad", "score": NaN}]'}


@pytest.mark.parametrize("name, row", [("scores.jsonl", "scores.jsonl:2"), ("scores.json", "scores.json: element 2")])
def test_a_nan_in_a_json_template_field_is_named(name, row, tmp_path):
    """Python's json reads the NaN token: 'Score: nan' was the prompt, where a table's NaN is named."""
    path = tmp_path / name
    path.write_text(NAN_ROWS[name])
    with pytest.raises(ConfigError, match=rf"{row}: field 'score': NaN where a prompt is needed"):
        scan_dataset(path, prompt_template="Review: {review} Score: {score}")


def test_readme_data_files_match_under_a_folder_with_brackets(tmp_path):
    """A snapshot saved under data[v2]/: its README's data_files were globbed with the folder's
    brackets as a character class, matched no file, and the dataset 'held no samples'."""
    root = tmp_path / "data[v2]"
    (root / "d").mkdir(parents=True)
    (root / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n"
                                    "  - split: train\n    path: d/train*.jsonl\n"
                                    "  - split: test\n    path: d/test*.jsonl\n---\n")
    for split in ("train", "test"):
        (root / "d" / f"{split}.jsonl").write_text(json.dumps({"text": f"a {split} row"}) + "\n")
    assert [s.text for s in load_dataset(root, split="test").samples] == ["a test row"]


def test_a_folder_with_brackets_is_scanned_by_its_folders(tmp_path):
    """`imgs[train]` (an existing folder, so itself, not a glob) recorded no runs: each part's job
    listed the whole folder (ImageNet: 1.28M files per part). Its parts read from the runs now."""
    root = tmp_path / "texts[train]"
    for label in ("neg", "pos"):
        (root / label).mkdir(parents=True)
        for i in range(3):
            (root / label / f"{i}.txt").write_text(f"{label} {i}")
    scan = scan_dataset(root, format="text_folder")
    assert [run[:2] for run in scan.runs] == [("neg", 3), ("pos", 3)]
    whole = load_dataset(root, format="text_folder").samples
    part = load_dataset(root, parts=(2, 1), scan=scan, format="text_folder").samples
    assert [(s.sample_idx, s.text) for s in part] == [(s.sample_idx, s.text) for s in whole[3:]]


def _scan_peak(tmp_path, n: int, bad_row: int | None = None) -> int:
    """The traced peak of scanning a chat column of `n` rows in one row group ([] at `bad_row`)."""
    messages = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
                for i in range(n)]
    if bad_row is not None:
        messages[bad_row] = []
    path = tmp_path / f"chat-{n}.parquet"
    pq.write_table(pa.table({"messages": messages}), path, row_group_size=n)
    del messages
    scan, peak = traced_peak(lambda: scan_dataset(path, messages_field="messages"))
    assert scan.n_samples == n
    return peak


def test_the_scan_checks_a_chat_row_group_in_slices(tmp_path):
    """A row group of messages (1Mi rows by pyarrow's default) was converted to Python whole to check
    it: GBs of dicts. The peak no longer grows with the group; a bad row is named as before."""
    small, large = _scan_peak(tmp_path, 4_000), _scan_peak(tmp_path, 40_000)
    assert large < 3 * small, (large, small)
    with pytest.raises(ConfigError, match=r"chat-40000.parquet#9000, column 'messages'.*no messages"):
        _scan_peak(tmp_path, 40_000, bad_row=9_000)

