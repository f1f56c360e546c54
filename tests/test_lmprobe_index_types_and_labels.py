"""lmprobe reader and verify, review 62: an index given as a bool or a float, and address columns
that are no integers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.errors import FormatError
from actstore.formats import lmprobe
from test_lmprobe_verify_addressing import rewrite_index

FULL = {"storage": "full_sequence", "shard_bytes": 32 * 4 * 12, "token_strings": False}


def build(extracted, tmp_path: Path, options: dict) -> Path:
    _, extract_dir = extracted("gpt2")
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, options, progress=False)
    return out


@pytest.mark.parametrize("call", [lambda ds: ds.get(True, 0), lambda ds: ds.get(1.0, 0),
                                  lambda ds: ds.get(1, True), lambda ds: ds.get(1, 0, token=True),
                                  lambda ds: ds.get(1, 0, token=1.0), lambda ds: ds.tokens(np.True_, 0),
                                  lambda ds: ds.logits(True), lambda ds: ds.row_of(1.5),
                                  lambda ds: ds.has_sample(True)])
def test_an_index_that_is_no_integer_is_refused(extracted, tmp_path, call):
    """get(True, 0) read index row 1, get(1.0, 0) and row_of(1.5) row 1 (int() truncates), layer True
    layer 1 (True == 1 to `in`), as the other formats' readers refuse (integrity.read_index)."""
    ds = lmprobe.open_dataset(build(extracted, tmp_path, FULL))
    with pytest.raises(TypeError, match="is not an integer"):
        call(ds)


def test_read_vector_refuses_an_index_that_is_no_integer(extracted, tmp_path):
    root = build(extracted, tmp_path, FULL)
    ds = lmprobe.open_dataset(root)
    sample = int(ds.sample_idx[1])
    assert np.array_equal(lmprobe.read_vector(root, sample, 2, 0), ds.get(1, 2, 0))
    for args in [(True, 2, 0), (sample, 2.0, 0), (sample, 2, False), (float(sample), 2, 0)]:
        with pytest.raises(TypeError, match="is not an integer"):
            lmprobe.read_vector(root, *args)


def retyped(table: pa.Table, name: str, type_: pa.DataType) -> pa.Table:
    at = table.schema.get_field_index(name)
    return table.set_column(at, pa.field(name, type_), table.column(name).cast(type_))


@pytest.mark.parametrize("name, type_", [("row_offset", pa.float64()), ("shard_index", pa.string()),
                                         ("num_tokens", pa.float32()), ("sample_idx", pa.float64())])
def test_an_address_column_that_holds_no_integers_is_named(extracted, tmp_path, name, type_):
    """A float (or string) shard_index/row_offset column was cast to int64 and verified: the spec's
    reader (`f.get_tensor(key)[row["row_offset"]]`) fails on it, and 2.7 was read as row 2."""
    root = build(extracted, tmp_path, {**FULL, "storage": "pooled"})
    index = rewrite_index(root, retyped(pq.read_table(lmprobe.find_index(root)), name, type_))
    problem = f"{index}: column {name!r} holds {type_} values, not integers"
    assert lmprobe.verify(root) == [problem]
    with pytest.raises(FormatError, match=problem.replace("(", r"\(")[len(str(index)) + 2:]):
        lmprobe.open_dataset(root)


@pytest.mark.parametrize("edit", ["null", "double", "no lists"])
def test_token_lists_that_hold_no_integers_are_named(extracted, tmp_path, edit):
    """A null inside a token_shard_offsets list (or a list<double> column, or an int64 one) made
    `get(p, l, t)` fail with numpy's "arrays used as indices must be of integer type" (or an
    AttributeError) and verify report an IndexError, ArrowInvalid or AttributeError, none naming the column."""
    root = build(extracted, tmp_path, FULL)
    table = pq.read_table(lmprobe.find_index(root))
    lists = table.column("token_shard_offsets").to_pylist()
    if edit == "null":
        lists[0][0] = None
        column = pa.array(lists, pa.list_(pa.int64()))
    elif edit == "double":
        column = pa.array(lists, pa.list_(pa.float64()))
    else:
        column = pa.array([values[0] for values in lists], pa.int64())
    at = table.schema.get_field_index("token_shard_offsets")
    rewrite_index(root, table.set_column(at, pa.field("token_shard_offsets", column.type), column))
    named = "column 'token_shard_offsets' "
    assert any(named in problem for problem in lmprobe.verify(root)), lmprobe.verify(root)
    ds = lmprobe.open_dataset(root)
    with pytest.raises(FormatError, match=named):
        ds.get(0, 0, 0)


def test_token_addresses_handed_out_cannot_change_later_lookups(extracted, tmp_path):
    """token_addresses returns views of the row group's lists the reader keeps: were they writable, a
    caller's `offsets -= offsets[0]` would make every later token lookup of the group read other rows."""
    ds = lmprobe.open_dataset(build(extracted, tmp_path, FULL))
    before = ds.tokens(3, 0)
    ids, offsets = ds.token_addresses(3)
    with pytest.raises(ValueError, match="read-only"):
        offsets -= offsets[0]
    assert np.array_equal(ds.tokens(3, 0), before)


def test_a_torch_item_that_is_no_integer_is_refused(extracted, tmp_path):
    """ProbeDataset[True] was item 1 and [1.0] failed in torch naming nothing."""
    items = lmprobe.open_dataset(build(extracted, tmp_path, {**FULL, "storage": "pooled"})).torch_dataset()
    assert items[1]["prompt"] == 1
    for item in (True, 1.0):
        with pytest.raises(TypeError, match="is not an integer"):
            items[item]



@pytest.mark.parametrize("name", ["label", "label_id"])
def test_a_label_column_of_floats_is_named_not_renumbered(extracted, tmp_path, name):
    """A float label column (pandas' int column with a null: classes 1.0, 3.0, NaN) was numbered by
    position in its sorted values, 0 and 1: a probe trained on `labels` learnt other classes, silently."""
    root = build(extracted, tmp_path, {**FULL, "storage": "pooled"})
    table = pq.read_table(lmprobe.find_index(root))
    if name == "label":
        table = table.drop_columns(["label_id"])
    classes = pa.array([[1.0, 3.0, None][row % 3] for row in range(table.num_rows)], pa.float64())
    rewrite_index(root, table.set_column(table.schema.get_field_index(name), pa.field(name, pa.float64()), classes))
    with pytest.raises(FormatError, match=f"column '{name}' holds double values"):
        lmprobe.open_dataset(root).labels


def test_a_label_column_of_nulls_alone_reads_as_no_labels(extracted, tmp_path):
    root = build(extracted, tmp_path, {**FULL, "storage": "pooled"})
    table = pq.read_table(lmprobe.find_index(root)).drop_columns(["label_id"])
    nulls = pa.nulls(table.num_rows)
    rewrite_index(root, table.set_column(table.schema.get_field_index("label"), pa.field("label", pa.null()), nulls))
    assert lmprobe.open_dataset(root).labels.tolist() == [-1] * table.num_rows


@pytest.mark.parametrize("seed", [None, True, -1])
def test_a_seed_no_job_can_repeat_is_refused_before_any_file(extracted, tmp_path, seed):
    """seed None through the library made each job's plan a fresh random permutation (one digest for
    all: the options are equal), so scattered jobs and the finisher each put other prompts in a row,
    silently; `default_rng(True)` is seed 1, and -1 failed in numpy naming no key."""
    from actstore.errors import ConfigError

    _, extract_dir = extracted("gpt2")
    with pytest.raises(ConfigError, match=rf"lmprobe.seed: {seed} is not a whole number"):
        lmprobe.write_dataset(extract_dir, tmp_path / "ds", {**FULL, "seed": seed}, progress=False)
    assert not (tmp_path / "ds").exists()


def test_a_label_column_of_booleans_reads_false_as_0_and_true_as_1(extracted, tmp_path):
    """A probe dataset's yes/no labels as a boolean column: numbered by their order, as before the type check."""
    root = build(extracted, tmp_path, {**FULL, "storage": "pooled"})
    table = pq.read_table(lmprobe.find_index(root)).drop_columns(["label_id"])
    flags = [row % 2 == 1 for row in range(table.num_rows)]
    rewrite_index(root, table.set_column(table.schema.get_field_index("label"), pa.field("label", pa.bool_()),
                                         pa.array(flags)))
    assert lmprobe.open_dataset(root).labels.tolist() == [int(flag) for flag in flags]


def test_a_last_token_shards_token_count_other_than_its_prompts_is_named(extracted, tmp_path):
    """The spec: a last-token shard's num_tokens always equals its num_prompts. Edited alone, it passed
    verify (the shards' headers are checked against num_prompts)."""
    import json

    root = build(extracted, tmp_path, FULL)
    table = pq.read_table(lmprobe.find_index(root))
    metadata = dict(table.schema.metadata)
    tensors = json.loads(metadata[b"lmprobe:tensors"])
    shard = tensors["hidden_layers"]["shards"][0]
    assert shard["num_tokens"] == shard["num_prompts"]
    shard["num_tokens"] += 1
    metadata[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    rewrite_index(root, table.replace_schema_metadata(metadata))
    assert lmprobe.verify(root) == [f"{lmprobe.find_index(root)}: hidden_layers.shards[0] num_tokens "
                                    f"{shard['num_tokens']} is not its num_prompts {shard['num_prompts']} "
                                    "(a last-token shard holds one token a prompt)"]
