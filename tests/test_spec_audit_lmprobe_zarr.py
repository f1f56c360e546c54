"""Spec conformance audit (review 66) of lmprobe 2.0 and the Zarr activation logger: what `verify` passes
though the spec (../shared/specs/lmprobe-format-2.0.md, zarr-activation-logger.md) says otherwise.

Each test builds a real store with actstore's writers, makes the one change the spec rules out while
keeping every checksum consistent (what a writer bug, not a flipped byte, leaves), and asserts that
verify names it (each was a strict xfail before verify checked it). A precondition the test relies on
fails with pytest.fail, naming it, so a broken precondition is never taken for verify's fault.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.formats import lmprobe
from actstore.formats import zarr as zs
from actstore.formats.zarr.layout import FILES_JSON, files_json_text
from actstore.integrity import check_share, file_record
from test_zarr import bert_run  # noqa: F401 (a fixture: two shards of 15 bert samples, merged)

INDEX = "index/train-00000-of-00001.parquet"
SHARD_BYTES = 32 * 4 * 12  # tiny gpt2: dim 32 float32; 3 last-token shards of 12 prompts, many sequence shards


def need(condition: bool, what: str) -> None:
    """A precondition of the test's store; its failure is a test error, never the expected AssertionError."""
    if not condition:
        pytest.fail(f"precondition: {what}")


@pytest.fixture(scope="module")
def gpt2_dataset(extracted, tmp_path_factory) -> Path:
    """A full_sequence lmprobe dataset of the tiny gpt2 (top-k logits, token columns), verified clean."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path_factory.mktemp("lmprobe") / "ds"
    lmprobe.write_dataset(extract_dir, root, {"storage": "full_sequence", "shard_bytes": SHARD_BYTES}, progress=False)
    need(lmprobe.verify(root) == [], "the dataset as written verifies")
    return root


def edited_dataset(source: Path, out: Path, info_edit: Callable[[dict], None] | None = None,
                   table_edit: Callable[[pa.Table], pa.Table] | None = None) -> Path:
    """A copy of `source` whose index (its lmprobe: metadata and/or columns) is edited and written again,
    SHA256SUMS' line for it rehashed: every checksum agrees with the edited index."""
    shutil.copytree(source, out)
    table = pq.read_table(out / INDEX)
    info = {k.decode().removeprefix("lmprobe:"): json.loads(v) for k, v in table.schema.metadata.items()}
    if info_edit:
        info_edit(info)
    if table_edit:
        table = table_edit(table)
    pq.write_table(table.replace_schema_metadata({f"lmprobe:{k}": json.dumps(v) for k, v in info.items()}),
                   out / INDEX)
    digest = hashlib.sha256((out / INDEX).read_bytes()).hexdigest()
    sums = [f"{digest}  {INDEX}" if line.endswith(f"  {INDEX}") else line
            for line in (out / "SHA256SUMS").read_text().splitlines()]
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return out


def problems_naming(problems: list[str], *words: str) -> list[str]:
    return [p for p in problems if all(w in p for w in words)]


# --- lmprobe 2.0 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("row_bytes", 999), ("dtype", "float16")])
def test_verify_names_a_logits_descriptor_that_misstates_its_rows(gpt2_dataset, tmp_path, key, value):
    """Spec, Logits (top-k): the descriptor gives `dtype` ("float32") and `row_bytes` (600 for k = 50:
    a float32 value and an int64 index per k). A descriptor stating another dtype or row size than its
    shards hold (F32 values, I64 indices, k wide) verifies clean; a reader sizing rows by it misreads."""
    root = edited_dataset(gpt2_dataset, tmp_path / "ds",
                          lambda info: info["tensors"]["logits_topk"].update({key: value}))
    need(lmprobe.open_dataset(root).logits_desc[key] == value, f"logits_topk.{key} edited")
    assert problems_naming(lmprobe.verify(root), "logits_topk", key), lmprobe.verify(root)


def test_verify_names_a_sequence_shard_whose_num_prompts_is_wrong(gpt2_dataset, tmp_path):
    """Spec, Tensor descriptors: `num_prompts is the number of prompts (rows) in that shard`. A sequence
    shard's num_prompts 5 more than the prompts its tokens belong to (token_shard_ids) verifies clean."""
    first_sequence = lmprobe.open_dataset(gpt2_dataset).last_token_shards

    def edit(info: dict) -> None:
        info["tensors"]["hidden_layers"]["shards"][first_sequence]["num_prompts"] += 5

    root = edited_dataset(gpt2_dataset, tmp_path / "ds", edit)
    ds = lmprobe.open_dataset(root)
    held = sum(first_sequence in set(ids) for ids in pq.read_table(ds.index_path).column("token_shard_ids").to_pylist())
    need(ds.hidden["shards"][first_sequence]["num_prompts"] == held + 5, "the shard's num_prompts overstates it")
    assert problems_naming(lmprobe.verify(root), "num_prompts"), lmprobe.verify(root)


def shorten_first_list(column: str) -> Callable[[pa.Table], pa.Table]:
    """A table edit: row 0's list in `column` loses its last entry (one fewer than its num_tokens)."""
    def edit(table: pa.Table) -> pa.Table:
        values = table.column(column).to_pylist()
        values[0] = values[0][:-1]
        at = table.schema.get_field_index(column)
        return table.set_column(at, column, pa.array(values, table.schema.field(column).type))
    return edit


@pytest.mark.parametrize("column", ["token_ids", "token_perplexity", "token_strings"])
def test_verify_names_a_token_column_of_another_length_than_num_tokens(gpt2_dataset, tmp_path, column):
    """Spec, Token-level data: token_ids are the prompt's token IDs, token_perplexity / token_strings one
    value per token; num_tokens is the prompt's token count. Row 0 holding one fewer than its num_tokens
    (every other token then paired with its neighbour's vector) verifies clean."""
    root = edited_dataset(gpt2_dataset, tmp_path / "ds", table_edit=shorten_first_list(column))
    table = pq.read_table(root / INDEX, columns=[column, "num_tokens"])
    need(len(table.column(column)[0]) == table.column("num_tokens")[0].as_py() - 1, f"{column} row 0 shortened")
    assert problems_naming(lmprobe.verify(root), column), lmprobe.verify(root)


def retyped(column: str, type_: pa.DataType, value: Any = None) -> Callable[[pa.Table], pa.Table]:
    """A table edit: `column` stored as `type_` (cast, or every row `value` where given)."""
    def edit(table: pa.Table) -> pa.Table:
        at = table.schema.get_field_index(column)
        data = pa.array([value] * table.num_rows, type_) if value is not None else table.column(at).cast(type_)
        return table.set_column(at, column, data)
    return edit


@pytest.mark.parametrize("column, type_, value", [("label", pa.float64(), 1.5), ("num_tokens", pa.int64(), None),
                                                   ("shard_index", pa.int64(), None)])
def test_verify_names_a_core_column_of_a_type_the_spec_rules_out(gpt2_dataset, tmp_path, column, type_, value):
    """Spec, Core columns: label `int32 or string`, num_tokens / shard_index / row_offset `int32`. An index
    whose label is float64 (pandas' labels with a null) or whose num_tokens or shard_index is int64
    verifies clean, though a reader of the spec's schema (a typed loader, `datasets` features) differs."""
    root = edited_dataset(gpt2_dataset, tmp_path / "ds", table_edit=retyped(column, type_, value))
    need(pq.read_schema(root / INDEX).field(column).type == type_, f"{column} stored as {type_}")
    assert problems_naming(lmprobe.verify(root), column), lmprobe.verify(root)


@pytest.mark.parametrize("type_, value", [(pa.string(), "cat"), (pa.dictionary(pa.int32(), pa.string()), "cat"),
                                           (pa.null(), None)])
def test_verify_passes_a_label_column_of_strings_categories_or_nulls(gpt2_dataset, tmp_path, type_, value):
    """The spec's `int32 or string` label: strings, pandas' categorical of strings (a string column in the
    parquet) and a column of nulls alone (every label null, which the spec allows) verify clean."""
    def edit(table: pa.Table) -> pa.Table:
        at = table.schema.get_field_index("label")
        return table.set_column(at, "label", pa.array([value] * table.num_rows, type_))

    root = edited_dataset(gpt2_dataset, tmp_path / "ds", table_edit=edit)
    need(pq.read_schema(root / INDEX).field("label").type == type_, f"label stored as {type_}")
    assert lmprobe.verify(root) == []


def test_verify_checks_the_token_columns_in_one_share_of_a_validate_job(gpt2_dataset, tmp_path):
    """A validate job of 3 shares names a short token_ids list once: the pass over the index is share 0's."""
    root = edited_dataset(gpt2_dataset, tmp_path / "ds", table_edit=shorten_first_list("token_ids"))
    found = []
    for share in range(3):
        with check_share(share, 3):
            found.append(len(problems_naming(lmprobe.verify(root), "token_ids")))
    assert found == [1, 0, 0]


@pytest.mark.parametrize("name, value", [("hidden_layers", "logits_topk"), ("logits_topk", "hidden")])
def test_verify_names_a_descriptor_of_another_type(gpt2_dataset, tmp_path, name, value):
    """Spec, Tensor descriptors: "The two tensor types are hidden_layers (hidden-state activations) and
    logits_topk", their descriptors' `type` "hidden" and "logits_topk". Either saying the other's verifies."""
    root = edited_dataset(gpt2_dataset, tmp_path / "ds", lambda info: info["tensors"][name].update(type=value))
    assert problems_naming(lmprobe.verify(root), name, "type"), lmprobe.verify(root)


# --- Zarr activation logger -------------------------------------------------------------------------------

STORE = "shards/shard-0000.zarr"


def copied_run(bert_run, tmp_path: Path) -> Path:  # noqa: F811
    _, run_dir = bert_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    need(zs.verify(run) == [], "the run as written verifies")
    return run


def rerecord(run: Path, rels: list[str]) -> None:
    """STORE's meta/files.json records `rels` anew, and manifest.json that files.json: every checksum agrees."""
    store = run / STORE
    files = json.loads((store / FILES_JSON).read_text())["files"]
    files.update({rel: file_record(store / rel) for rel in rels})
    (store / FILES_JSON).write_text(files_json_text(files))
    manifest = json.loads((run / zs.MANIFEST).read_text())
    entry = next(e for e in manifest["shards"] if e["path"] == STORE)
    entry.update(files_sha256=hashlib.sha256((store / FILES_JSON).read_bytes()).hexdigest(),
                 bytes=sum(f["bytes"] for f in files.values()) + (store / FILES_JSON).stat().st_size)
    (run / zs.MANIFEST).write_text(json.dumps(manifest))


def test_verify_names_a_split_code_the_spec_does_not_define(bert_run, tmp_path):  # noqa: F811
    """Spec, Required per-sample numeric metadata: `split: (N,) int8 (optional; 0=train,1=val,2=test)`.
    A sample whose split is 7 verifies clean (a reader filtering on split drops it from every split)."""
    run = copied_run(bert_run, tmp_path)
    chunk = run / STORE / "arrays/split/0"
    need(chunk.is_file(), "the store has a split array (one chunk)")
    codes = np.frombuffer(chunk.read_bytes(), np.int8).copy()
    codes[0] = 7
    chunk.write_bytes(codes.tobytes())
    rerecord(run, ["arrays/split/0"])
    assert problems_naming(zs.verify(run), "split"), zs.verify(run)


def edit_prompt_lines(lines: list[dict], fault: str) -> None:
    if fault == "line missing":
        lines.pop()
    elif fault == "i not its line":
        lines[1]["i"] = 7
    else:  # "sample_key not the array's"
        lines[1]["sample_key"] = "0" * 64


@pytest.mark.parametrize("fault", ["line missing", "i not its line", "sample_key not the array's"])
def test_verify_names_prompts_jsonl_that_disagrees_with_the_arrays(bert_run, tmp_path, fault):  # noqa: F811
    """Spec, Variable-length text fields: `text/prompts.jsonl: one JSON object per line, including at least
    { "i": <int>, "sample_key": "…", "prompt": "…" }`, and Sample identity: sample_key in Zarr or in a
    JSONL relying on row order. A prompts file one line short, or whose line 1 says another `i` or another
    sample_key than arrays/sample_key, verifies clean: the text read for a sample is not its own."""
    run = copied_run(bert_run, tmp_path)
    path = run / STORE / "text/prompts.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    need(len(lines) == 15 and lines[1]["i"] == 1, "prompts.jsonl has a line per sample, i its line")
    edit_prompt_lines(lines, fault)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rerecord(run, ["text/prompts.jsonl"])
    assert problems_naming(zs.verify(run), "prompts.jsonl"), zs.verify(run)


def test_verify_names_a_bad_split_code_in_exactly_one_share_of_a_validate_job(bert_run, tmp_path):  # noqa: F811
    """arrays/split is read by one share of a validate job of 3 (each per-sample file by one)."""
    run = copied_run(bert_run, tmp_path)
    chunk = run / STORE / "arrays/split/0"
    codes = np.frombuffer(chunk.read_bytes(), np.int8).copy()
    codes[0] = 7
    chunk.write_bytes(codes.tobytes())
    rerecord(run, ["arrays/split/0"])
    found = []
    for share in range(3):
        with check_share(share, 3):
            found += problems_naming(zs.verify(run), "arrays/split")
    assert len(found) == 1, found


@pytest.mark.parametrize("past_names", [True, False])
def test_verify_names_a_label_outside_label_names(bert_run, tmp_path, past_names):  # noqa: F811
    """actstore's arrays/label (int32) is a position in the label_names attr, -1 for none. A sample whose
    label is past label_names, or below -1, verified clean: a reader naming its class fails or names none."""
    run = copied_run(bert_run, tmp_path)
    chunk = run / STORE / "arrays/label/0"
    names = json.loads((run / STORE / ".zattrs").read_text())["label_names"]
    need(chunk.is_file() and len(names) >= 1, "the store has a label array (one chunk) and label names")
    labels = np.frombuffer(chunk.read_bytes(), "<i4").copy()
    label = len(names) if past_names else -2
    labels[3] = label
    chunk.write_bytes(labels.tobytes())
    rerecord(run, ["arrays/label/0"])
    assert problems_naming(zs.verify(run), "arrays/label", f"[3] = {label}"), zs.verify(run)


def test_verify_passes_labels_of_none_and_a_split_of_each_code(bert_run, tmp_path):  # noqa: F811
    """The values the checks above refuse are the only ones: -1 (no label) and every label position, split
    codes 0, 1 and 2, verify clean."""
    run = copied_run(bert_run, tmp_path)
    store = run / STORE
    labels = np.frombuffer((store / "arrays/label/0").read_bytes(), "<i4").copy()
    names = json.loads((store / ".zattrs").read_text())["label_names"]
    need(len(labels) > len(names), "more samples than label names")
    labels[:len(names) + 1] = [-1, *range(len(names))]
    (store / "arrays/label/0").write_bytes(labels.tobytes())
    codes = np.frombuffer((store / "arrays/split/0").read_bytes(), np.int8).copy()
    codes[:3] = [0, 1, 2]
    (store / "arrays/split/0").write_bytes(codes.tobytes())
    rerecord(run, ["arrays/label/0", "arrays/split/0"])
    assert zs.verify(run) == []
