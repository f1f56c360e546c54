"""The lmprobe reader's token lookups hold one index row group of token addresses, not the whole
index's (16 B a token: 8 GB at 500M tokens), and read the same vectors as the spec's reader."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.errors import FormatError
from actstore.formats import lmprobe
from actstore.formats.lmprobe import write

SMALL = {"storage": "full_sequence", "shard_bytes": 32 * 4 * 12}  # dim 32 float32: 3 last-token shards


def build(extracted, tmp_path: Path, monkeypatch) -> Path:
    """A full-sequence dataset (30 prompts, ~700 tokens) whose index the writer cut into row groups
    of 64 tokens, as it cuts a large one into groups of 2**20."""
    _, extract_dir = extracted("llama")
    monkeypatch.setattr(write, "ROW_GROUP_TOKENS", 64)
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, SMALL, progress=False)
    return out


def held_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of the numpy arrays `obj` holds (through tuples, lists and dicts), memory-mapped shards aside."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, np.memmap):
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(held_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(held_bytes(x, seen) for x in obj.values())
    return 0


def group_rows(index: Path) -> list[int]:
    metadata = pq.ParquetFile(index).metadata
    return [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]


def spec_vector(root: Path, index: pa.Table, prompt: int, layer: int, token: int) -> np.ndarray:
    """The spec's per-token snippet: token_shard_ids[token] / token_shard_offsets[token] of the row."""
    from safetensors import safe_open

    hidden = lmprobe.read_info(lmprobe.find_index(root))["tensors"]["hidden_layers"]
    shard = index.column("token_shard_ids")[prompt].as_py()[token]
    offset = index.column("token_shard_offsets")[prompt].as_py()[token]
    with safe_open(str(root / hidden["file_pattern"].format(layer=layer, shard=shard)), framework="numpy") as f:
        return f.get_tensor(hidden["key_pattern"].format(layer=layer))[offset]


def test_token_lookups_hold_one_row_group_of_addresses(extracted, tmp_path, monkeypatch):
    """The first token lookup kept every token's shard id and offset of the whole index (16 B a token)
    for the life of the dataset; now the row group of the prompt looked up, one at a time."""
    ds = lmprobe.open_dataset(build(extracted, tmp_path, monkeypatch))
    rows = group_rows(ds.index_path)
    assert len(rows) > 3
    ends = np.cumsum(rows)
    group_tokens = [int(ds.num_tokens[end - n:end].sum()) for n, end in zip(rows, ends)]
    # a group's two flat int64 lists and its list offsets, and each group's first row
    bound = 16 * max(group_tokens) + 8 * (max(rows) + 1) + 8 * len(rows)
    assert 16 * int(ds.num_tokens.sum()) > 2 * bound
    before = held_bytes(vars(ds))
    for prompt in [0, *(ends - 1), 1]:  # every group, then back to the first
        ds.get(int(prompt), 0, 0)
        assert held_bytes(vars(ds)) - before <= bound


def test_token_reads_equal_the_specs_reader_across_row_groups(extracted, tmp_path, monkeypatch):
    """get and tokens of prompts in every row group, visited out of order, with tokens counted from
    either end, read what the spec's snippet reads through the index's lists."""
    root = build(extracted, tmp_path, monkeypatch)
    ds = lmprobe.open_dataset(root)
    index = pq.read_table(ds.index_path)
    prompts = [ds.num_prompts - 1, 0, 17, 3, 29, 12, 1, -1, -30]
    for prompt in prompts:
        row = prompt % ds.num_prompts
        n = int(ds.num_tokens[row])
        for layer in ds.layers:
            want = np.stack([spec_vector(root, index, row, layer, t) for t in range(n)])
            assert np.array_equal(ds.tokens(prompt, layer), want)
            for token in (0, 1, n // 2, n - 2, n - 1, -1, -2, -n):
                assert np.array_equal(ds.get(prompt, layer, token), want[token])


def test_a_short_token_list_in_a_later_row_group_names_its_row(extracted, tmp_path, monkeypatch):
    """A token_shard_ids list one short, in a row group past the first: the lookup of that prompt
    names its index row (not its row within the group), a prompt of another group still reads."""
    ds = lmprobe.open_dataset(build(extracted, tmp_path, monkeypatch))
    table = pq.read_table(ds.index_path)
    damaged = 22
    lists = table.column("token_shard_ids").to_pylist()
    lists[damaged] = lists[damaged][:-1]
    table = table.set_column(table.schema.get_field_index("token_shard_ids"), "token_shard_ids",
                             pa.array(lists, pa.list_(pa.int64())))
    pq.write_table(table, ds.index_path, row_group_size=8)  # another writer's groups: 8 rows each
    ds = lmprobe.open_dataset(ds.root)
    with pytest.raises(FormatError, match=rf"{re.escape(str(ds.index_path))}: row {damaged} token_shard_ids"):
        ds.get(damaged, 0, 0)
    assert np.array_equal(ds.get(3, 0, 0), ds.tokens(3, 0)[0])


def test_a_full_sequence_index_without_its_token_lists_is_named(extracted, tmp_path, monkeypatch):
    """pyarrow's read_row_group leaves out a column the file lacks, without an error: a token lookup
    raised a bare KeyError instead of naming the index and the column."""
    ds = lmprobe.open_dataset(build(extracted, tmp_path, monkeypatch))
    table = pq.read_table(ds.index_path)
    pq.write_table(table.drop_columns(["token_shard_offsets"]), ds.index_path)
    with pytest.raises(FormatError, match=rf"{re.escape(str(ds.index_path))}: .*\['token_shard_offsets'\]"):
        lmprobe.open_dataset(ds.root).get(0, 0, 0)
