"""saev and lmprobe readers on real stores: an example or prompt outside the store is an error naming
it, and a chunk size range() cannot step by is refused instead of reading nothing."""
from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from actstore.errors import ConfigError
from actstore.formats import lmprobe, saev

from test_saev import synthetic_store

SMALL = {"shard_bytes": 32 * 4 * 12}  # tiny models: dim 32 float32; 3 last-token shards for 30 prompts


def test_an_example_outside_the_store_is_named(tmp_path):
    """store.example(-1) mapped a shard named acts-00001.bin (FileNotFoundError of a file no store has),
    one past the end raised a bare IndexError 'list index out of range'."""
    store = saev.open_store(synthetic_store(tmp_path / "store", n=5, tokens=3, d=2, per_shard=2))
    assert np.array_equal(store.example(4), next(c for first, c in store.iter_ordered(1) if first == 4)[0])
    named = rf"{re.escape(str(store.dir))}: example -?\d+ out of range \[0, 5\)"
    for example in (-1, 5, 6):
        with pytest.raises(IndexError, match=named):
            store.example(example)
        with pytest.raises(IndexError, match=named):
            store.locate(example, 0, 0)


@pytest.mark.parametrize("chunk", [-1, 0, 1.5])
def test_a_chunk_size_range_cannot_step_by_is_refused(tmp_path, chunk):
    """iter_ordered(chunk_examples=-1) yielded no example and no error (range(0, n, -1) is empty); 0 and
    1.5 failed in range() naming nothing."""
    store = saev.open_store(synthetic_store(tmp_path / "store", n=5, tokens=3, d=2, per_shard=2))
    with pytest.raises(ConfigError, match=rf"chunk_examples={chunk} must be a whole number >= 1"):
        list(store.iter_ordered(chunk_examples=chunk))


def test_token_addresses_outside_the_index_are_named(extracted, tmp_path):
    """token_addresses(prompt) looked the row up in the row groups unchecked: a prompt past the last
    row raised a bare numpy IndexError, a negative one said the index columns cannot be read. A
    negative prompt counts from the end, as get and tokens do; empty row groups change nothing."""
    _, extract_dir = extracted("llama")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, {"storage": "full_sequence", **SMALL}, progress=False)
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    with pq.ParquetWriter(index, table.schema) as writer:  # row groups of 0, 7, 0, 23, 0 rows
        for lo, n in ((0, 0), (0, 7), (7, 0), (7, None), (30, 0)):
            writer.write_table(table.slice(lo, n))
    ds = lmprobe.open_dataset(root)
    want = [(table.column("token_shard_ids")[p].as_py(), table.column("token_shard_offsets")[p].as_py())
            for p in range(ds.num_prompts)]
    for prompt in (0, 6, 7, 29, -1, -30):
        ids, offsets = ds.token_addresses(prompt)
        assert (ids.tolist(), offsets.tolist()) == want[prompt]
    named = rf"{re.escape(str(ds.index_path))}: prompt -?\d+ out of range \(30 prompts\)"
    for prompt in (30, 35, -31):
        with pytest.raises(IndexError, match=named):
            ds.token_addresses(prompt)
