"""lmprobe verify's and reader's memory, and nulls in the index, on datasets the project's own writer
built: verify's token check held a batch of rows whatever their lengths, string labels became a Python
string a prompt, and a null address column was read as -2**63."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.errors import FormatError
from actstore.formats import lmprobe
from actstore.formats.lmprobe import check, write
from actstore.formats.lmprobe.read import LmprobeDataset
from test_lmprobe_verify_addressing import rewrite_index, with_column
from tiny import traced_peak


@pytest.fixture(scope="module")
def long_extract(extracted, tmp_path_factory) -> Path:
    """An extraction of 160 prompts of 10 to 128 tokens (the tiny models' longest)."""
    path = tmp_path_factory.mktemp("long") / "long.jsonl"
    rows = [{"text": " ".join(f"w{(i * 13 + j) % 97} tok" for j in range(5 + i * 37 % 90)), "label": f"c{i % 3}"}
            for i in range(160)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return extracted("gpt2", path, extract={"max_seq_length": 128})[1]


def test_token_check_holds_a_bounded_batch_of_tokens(long_extract, tmp_path, monkeypatch):
    """verify read TOKEN_BATCH_ROWS (4096) index rows at a time and computed ~50 B a token from their
    lists: 4096 prompts of 32k tokens took 5 GB. Now a batch holds at most TOKEN_BATCH_TOKENS tokens
    (here 256; the longest prompt is 128), each row group's batches sized by its longest prompt."""
    monkeypatch.setattr(write, "ROW_GROUP_TOKENS", 2000)  # several row groups
    root = tmp_path / "ds"
    lmprobe.write_dataset(long_extract, root, {"storage": "full_sequence"}, progress=False)
    ds = LmprobeDataset(root)
    tokens = int(ds.num_tokens.sum())
    assert pq.ParquetFile(ds.index_path).metadata.num_row_groups > 3 and tokens > 8000
    monkeypatch.setattr(check, "TOKEN_BATCH_TOKENS", 256, raising=False)
    problems, peak = traced_peak(lambda: check._verify_token_addresses(ds))
    assert problems == []
    assert peak < 8 * tokens  # a token's two list entries alone are 16 B
    assert lmprobe.verify(root) == []


@pytest.mark.parametrize("batch_tokens", [1 << 21, 40])
def test_damaged_token_lists_name_their_rows_at_any_batch_size(extracted, tmp_path, monkeypatch, batch_tokens):
    """The index row a bad token entry belongs to is found for the entries named (no longer a np.repeat
    of the rows, 8 B a token): the first and last entries of the index, each its row's, named."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, {"storage": "full_sequence"}, progress=False)
    table = pq.read_table(lmprobe.find_index(root))
    offsets = table.column("token_shard_offsets").to_pylist()
    offsets[0][0] = offsets[-1][-1] = 10 ** 9
    index = rewrite_index(root, with_column(table, "token_shard_offsets", offsets))
    monkeypatch.setattr(check, "TOKEN_BATCH_TOKENS", batch_tokens, raising=False)
    problems = lmprobe.verify(root)
    named = [p for p in problems if "token_shard_offsets not a row of their sequence shard" in p]
    assert named and str(index) in named[0]
    assert (f"at row 0: {10 ** 9}, row {table.num_rows - 1}: {10 ** 9}" in named[0] if batch_tokens > 1000
            else named[0].endswith(f"at row 0: {10 ** 9}"))


ADDRESS_COLUMNS = ["num_tokens", "shard_index", "row_offset", "sample_idx", "shard_index_logits",
                   "row_offset_logits"]


@pytest.mark.parametrize("column", ADDRESS_COLUMNS)
def test_null_in_an_address_column_is_named(extracted, tmp_path, column):
    """A null became NaN, then -2**63: a pooled index's null num_tokens passed verify, and read_vector
    called the stored last token absent; the others failed as a row -9223372036854775808. Now opening
    the index (or reading the logits rows) and verify name the column and its first null row."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, {"storage": "pooled"}, progress=False)
    table = pq.read_table(lmprobe.find_index(root))
    values = table.column(column).to_pylist()
    values[3] = None
    index = rewrite_index(root, with_column(table, column, values))
    message = f"{index}: column {column!r} has 1 null(s), the first at row 3"
    with pytest.raises(FormatError) as raised:
        LmprobeDataset(root).logits_rows()
    assert str(raised.value) == message
    assert message in lmprobe.verify(root)


def test_string_labels_numbered_as_sorted_names_without_a_string_a_prompt(extracted, tmp_path):
    """A string `label` column (lmprobe's own, the spec's `int32 or string`) was read as a Python list
    of every prompt's name (~75 B a prompt, 7.5 GB at 100M prompts) when ProbeDataset started. Now
    numbered by arrow: the same positions in the sorted names, -1 where null, in a few bytes a prompt."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, {"storage": "pooled"}, progress=False)
    table = pq.read_table(lmprobe.find_index(root)).drop_columns(["label_id"])
    n = 100_000
    table = table.take(np.arange(n) % table.num_rows)
    names = [None if i % 11 == 0 else f"{'éZab'[i % 4]}-{i % 7}" for i in range(n)]
    table = with_column(table, "label", names)
    pq.write_table(table, lmprobe.find_index(root), row_group_size=30_000)  # several chunks
    classes = {name: i for i, name in enumerate(sorted({x for x in names if x is not None}))}
    ds = LmprobeDataset(root)
    ds._columns("label")  # imports and the footer, outside the count
    labels, peak = traced_peak(lambda: ds.labels)
    assert labels.tolist() == [classes.get(x, -1) for x in names]
    assert peak < 24 * n


def test_categorical_labels_numbered_as_their_names(extracted, tmp_path):
    """A label column pandas wrote from a categorical is a dictionary column: its names are numbered
    as a string column's are (arrow's index_in refuses a dictionary column against string names)."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, {"storage": "pooled"}, progress=False)
    table = pq.read_table(lmprobe.find_index(root)).drop_columns(["label_id"])
    names = table.column("label").to_pylist()
    names[2] = None
    encoded = pa.array(names, pa.string()).dictionary_encode()
    table = table.set_column(table.schema.get_field_index("label"), "label", encoded)
    pq.write_table(table, lmprobe.find_index(root))
    ds = LmprobeDataset(root)
    assert pa.types.is_dictionary(ds._columns("label").column("label").type)
    classes = {name: i for i, name in enumerate(sorted({x for x in names if x is not None}))}
    assert ds.labels.tolist() == [classes.get(x, -1) for x in names]
