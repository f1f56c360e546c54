"""Review 65: which prompts max_seq_length cut is recorded row by row. The extraction marks each cut
text's samples.jsonl row `"truncated": true` (and only those rows: every other row keeps its bytes),
its check holds the marks to num_tokens and part.json's count, lmprobe stores a `truncated` column (null
where an extraction made before the marks cannot tell), and saev, pickle and Zarr write the same bytes
with or without the marks."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

import tiny
from actstore.datasets import Sample
from actstore.errors import FormatError
from actstore.extract import run_part
from actstore.extract.inputs import given_token_ids, tokenize
from actstore.formats import lmprobe
from actstore.formats.extract import check, open_extraction, open_part, write_index
from actstore.hashing import stage_dir
from actstore.integrity import sha256_tree_file
from actstore.io_utils import sha256_file

MAX_LEN = 16
INDEX = "index/train-00000-of-00001.parquet"
LMPROBE = {"storage": "full_sequence", "prompt_ordering": "original", "token_strings": False}


def texts() -> list[str]:
    """12 texts from one word to far past MAX_LEN tokens."""
    return [" ".join(["ok"] * (1 + (5 * i) % 12)) for i in range(12)]


def full_lengths(model: Path) -> list[int]:
    """Each text's token count uncut, by the model's own tokenizer."""
    return [len(ids) for ids in AutoTokenizer.from_pretrained(model)(texts())["input_ids"]]


@pytest.fixture(scope="module")
def extraction(tmp_path_factory, model_dir):
    """A tiny Llama's one-part extraction of texts(), some cut at MAX_LEN tokens."""
    tmp = tmp_path_factory.mktemp("truncation")
    data = tmp / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": ("a", "b")[i % 2]}) + "\n" for i, t in enumerate(texts())))
    model = model_dir("llama")
    config = tiny.make_config(tmp, model, data, extract={"layers": [0, 2], "max_seq_length": MAX_LEN, "parts": 1})
    out = stage_dir(config, "extract")
    run_part(config, 0, out / "part-0000", progress=False)
    write_index(out, out / "extract.json")
    return {"dir": out, "model": model}


def rows_of(part_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (part_dir / "samples.jsonl").read_text().splitlines()]


def rewritten(extract_dir: Path, out: Path, change) -> Path:
    """A copy of the extraction whose samples.jsonl rows went through `change(rows)`, written as the
    extraction's writer writes them, its part.json and extract.json recording the new bytes."""
    shutil.copytree(extract_dir, out)
    part_dir = out / "part-0000"
    rows = rows_of(part_dir)
    change(rows)
    (part_dir / "samples.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    meta = json.loads((part_dir / "part.json").read_text())
    meta["files"]["samples.jsonl"] = {"bytes": (part_dir / "samples.jsonl").stat().st_size,
                                      "sha256_tree": sha256_tree_file(part_dir / "samples.jsonl")}
    (part_dir / "part.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    index = json.loads((out / "extract.json").read_text())
    index["parts"][0]["part_json_sha256"] = sha256_file(part_dir / "part.json")
    (out / "extract.json").write_text(json.dumps(index))
    return out


def unmarked(rows: list[dict]) -> None:
    """The rows as an extraction made before the marks wrote them (part.json still counts the cut)."""
    for row in rows:
        row.pop("truncated", None)


def test_tokenize_marks_each_text_the_tokenizer_cuts(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    samples = [Sample(i, text) for i, text in enumerate(texts())]
    cut = [n > MAX_LEN for n in full_lengths(model_dir("llama"))]
    assert any(cut) and not all(cut)
    token_ids = tokenize(tokenizer, samples, MAX_LEN)
    assert token_ids.cut.tolist() == cut and token_ids.truncated == sum(cut)


def test_given_token_ids_mark_each_row_cut(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    lengths = [1, MAX_LEN - 1, MAX_LEN, MAX_LEN + 1, 3 * MAX_LEN]
    samples = [Sample(i, "", tokens=np.arange(n, dtype=np.int64) % 50) for i, n in enumerate(lengths)]
    token_ids = given_token_ids(tokenizer, 300, samples, MAX_LEN)
    assert token_ids.cut.tolist() == [False, False, False, True, True] and token_ids.truncated == 2


def test_only_the_cut_rows_are_marked_and_the_part_verifies(extraction, model_dir):
    part = open_part(extraction["dir"] / "part-0000")
    cut = [n > MAX_LEN for n in full_lengths(extraction["model"])]
    rows = list(part.samples)
    assert [row.get("truncated") for row in rows] == [True if c else None for c in cut]
    assert all(row["num_tokens"] == MAX_LEN for row, c in zip(rows, cut) if c)
    assert part.info.n_truncated_samples == part.meta["n_truncated_samples"] == sum(cut) > 0
    assert check.verify(extraction["dir"]) == []


@pytest.mark.parametrize("damage, named", [
    ("short", "line {line} says truncated (cut at max_seq_length 16), but holds {n} tokens"),
    ("count", "1 rows say truncated, where part.json's n_truncated_samples says {count}"),
    ("false", "line {line} (sample {idx}): field 'truncated' holds False"),
])
def test_a_mark_that_disagrees_is_named(extraction, tmp_path, damage, named):
    """A mark on a row shorter than max_seq_length, marks fewer than part.json counts (but some), and a
    mark other than true are each named by the part's file and line, its sha256 re-recorded."""
    rows = rows_of(extraction["dir"] / "part-0000")
    short = next(i for i, r in enumerate(rows) if r["num_tokens"] < MAX_LEN)
    cut = [i for i, r in enumerate(rows) if r.get("truncated")]

    def change(rows):
        if damage == "short":
            rows[short]["truncated"] = True
            rows[cut[0]].pop("truncated")  # the count still matches: the length alone is at fault
        elif damage == "count":
            for i in cut[1:]:
                rows[i].pop("truncated")
        else:
            rows[short]["truncated"] = False
    copy = rewritten(extraction["dir"], tmp_path / "damaged", change)
    line = short + 1
    want = named.format(line=line, n=rows[short]["num_tokens"], count=len(cut), idx=short)
    problems = check.verify(copy)
    assert len(problems) == 1 and want in problems[0] and "samples.jsonl" in problems[0], problems


def test_lmprobe_refuses_marks_its_part_does_not_count(extraction, tmp_path):
    def change(rows):
        for row in [r for r in rows if r.get("truncated")][1:]:
            row.pop("truncated")
    copy = rewritten(extraction["dir"], tmp_path / "damaged", change)
    with pytest.raises(FormatError, match=r"part-0000/samples.jsonl: 1 rows say truncated, where .*says [2-9]"):
        lmprobe.write_dataset(copy, tmp_path / "lmprobe", LMPROBE, progress=False)


def test_lmprobe_of_an_extraction_made_before_the_marks_leaves_unknown_rows_null(extraction, tmp_path):
    """Its part.json counts the cut texts, its rows do not say which: each row of max_seq_length tokens
    is null (cut, or exactly that long), each shorter one false; the count is part.json's, the card says
    both, and the dataset verifies."""
    copy = rewritten(extraction["dir"], tmp_path / "old", unmarked)
    root = tmp_path / "lmprobe"
    lmprobe.write_dataset(copy, root, LMPROBE, progress=False)
    table = pq.read_table(root / INDEX)
    at_limit = [n == MAX_LEN for n in table.column("num_tokens").to_pylist()]
    assert table.column("truncated").to_pylist() == [None if full else False for full in at_limit]
    count = open_part(copy / "part-0000").info.n_truncated_samples
    info = lmprobe.read_info(root / INDEX)
    assert info["dataset"]["n_truncated_samples"] == count > 0 and lmprobe.verify(root) == []
    card = (root / "README.md").read_text()
    assert f"{count} of {len(at_limit)} prompts were longer than max_seq_length ({MAX_LEN} tokens)" in card
    assert f"`truncated` is null for the {sum(at_limit)} prompts of {MAX_LEN} tokens" in card


def rewrite_index(root: Path, change) -> None:
    """The dataset's index parquet as `change(table)` makes it, its metadata and SHA256SUMS kept in step."""
    table = change(pq.read_table(root / INDEX))
    pq.write_table(table, root / INDEX, write_page_checksum=True)
    sums = [line.split("  ", 1) for line in (root / "SHA256SUMS").read_text().splitlines()]
    (root / "SHA256SUMS").write_text("".join(f"{sha256_file(root / INDEX) if rel == INDEX else digest}  {rel}\n"
                                             for digest, rel in sums))


def test_lmprobe_verify_knows_the_column_and_a_dataset_without_it(extraction, tmp_path):
    """A dataset written before the column (no column, no count) verifies; a flag on a prompt shorter
    than max_seq_length, and a count the flags do not make, are named; inspect shows the count."""
    import pyarrow as pa

    root = tmp_path / "lmprobe"
    lmprobe.write_dataset(extraction["dir"], root, LMPROBE, progress=False)
    n_cut = sum(n > MAX_LEN for n in full_lengths(extraction["model"]))
    assert lmprobe.verify(root) == [] and lmprobe.inspect(root)["n_truncated_samples"] == n_cut
    flags = pq.read_table(root / INDEX).column("truncated").to_pylist()
    short = next(i for i, n in enumerate(pq.read_table(root / INDEX).column("num_tokens").to_pylist()) if n < MAX_LEN)

    def flag_short(table):
        marked = [flag or i == short for i, flag in enumerate(flags)]
        return table.set_column(table.schema.get_field_index("truncated"), "truncated", pa.array(marked))
    damaged = tmp_path / "damaged"
    shutil.copytree(root, damaged)
    rewrite_index(damaged, flag_short)
    problems = lmprobe.verify(damaged)
    assert any(f"truncated marks a prompt cut at max_seq_length {MAX_LEN} that holds another number of tokens at "
               f"row {short}" in p for p in problems), problems
    assert any(f"column 'truncated' flags {n_cut + 1} prompts, lmprobe:dataset.n_truncated_samples says {n_cut}"
               in p for p in problems), problems

    def before(table):
        info = json.loads(table.schema.metadata[b"lmprobe:dataset"])
        del info["n_truncated_samples"], info["max_seq_length"]
        metadata = {**table.schema.metadata, b"lmprobe:dataset": json.dumps(info).encode()}
        return table.drop_columns(["truncated"]).replace_schema_metadata(metadata)
    rewrite_index(root, before)
    assert lmprobe.verify(root) == [] and lmprobe.inspect(root)["n_truncated_samples"] is None


def test_a_metadata_field_named_truncated_keeps_its_values_beside_the_column(extraction, tmp_path):
    def change(rows):
        for row in rows:
            row["metadata"]["truncated"] = f"field {row['sample_idx']}"
    copy = rewritten(extraction["dir"], tmp_path / "meta", change)
    lmprobe.write_dataset(copy, tmp_path / "lmprobe", LMPROBE, progress=False)
    table = pq.read_table(tmp_path / "lmprobe" / INDEX)
    assert table.column("meta_truncated").to_pylist() == [f"field {i}" for i in range(len(texts()))]
    assert table.column("truncated").to_pylist() == [n > MAX_LEN for n in full_lengths(extraction["model"])]


def store_bytes(root: Path) -> dict[str, bytes]:
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_saev_pickle_and_zarr_bytes_do_not_change_with_the_marks(extraction, tmp_path, monkeypatch):
    """The same activations, rows marked or not (an extraction made before the marks): every file of
    each store is the same bytes."""
    from actstore.formats.pickle import write_machine
    from actstore.formats.saev import write_store
    from actstore.formats.zarr import write_shard

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    old = rewritten(extraction["dir"], tmp_path / "old" / "extract", unmarked)
    params = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "vocab_size": 300}
    stores = {}
    for name, source in (("marked", extraction["dir"]), ("unmarked", old)):
        out = tmp_path / name
        assert any("truncated" in r for r in rows_of(source / "part-0000")) == (name == "marked")
        write_machine(source / "part-0000", out / "pickle", model_params=params, progress=False)
        write_shard(source / "part-0000", out / "zarr", progress=False)
        saev = write_store(open_extraction(source), {"patches_per_shard": 1000, "tokens_per_window": 4},
                           out / "saev", model_config=None, progress=False)
        stores[name] = {fmt: store_bytes(path) for fmt, path in
                        (("pickle", out / "pickle"), ("zarr", out / "zarr"), ("saev", saev))}
    for fmt in ("pickle", "zarr", "saev"):
        assert stores["marked"][fmt] and stores["marked"][fmt] == stores["unmarked"][fmt], fmt
