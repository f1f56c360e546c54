"""A part's samples.jsonl read row by row (extract.read.SampleRows): the same dicts the writer
joined, errors naming the file and line, and memory that does not hold the rows."""
from __future__ import annotations

import json
import re
import tracemalloc

import pytest

from actstore.errors import FormatError
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.formats.extract.read import SampleRows


def write_rows(path, rows, final_newline=True):
    text = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + ("\n" if final_newline else "")
    path.write_text(text, encoding="utf-8")


def row(i: int, text: str, label=None, **fields) -> dict:
    """A samples.jsonl row as the extraction writes it (every field a writer reads)."""
    return {"sample_idx": i, "text": text, "label": label, "label_id": -1 if label is None else 0,
            "num_tokens": 1, "metadata": {}, **fields}


ROWS = [row(0, "line\u2028separator and \u00e9"), row(1, "", "b", metadata={"k": [1, 2]}), row(2, "x" * 70_000, "a")]


@pytest.mark.parametrize("final_newline", [True, False])
def test_rows_are_the_lines_parsed(tmp_path, final_newline):
    write_rows(tmp_path / "samples.jsonl", ROWS, final_newline)
    rows = SampleRows(tmp_path / "samples.jsonl", len(ROWS))
    assert len(rows) == 3 and list(rows) == ROWS and rows[-1] == ROWS[2]
    with pytest.raises(IndexError):
        rows[3]


def test_rows_across_scan_blocks(tmp_path, monkeypatch):
    """Newlines found block by block: rows straddling a block boundary come back whole."""
    monkeypatch.setattr(SampleRows, "SCAN_BYTES", 7)
    many = [row(i, "t" * (i % 13)) for i in range(200)]
    write_rows(tmp_path / "samples.jsonl", many)
    assert list(SampleRows(tmp_path / "samples.jsonl", 200)) == many


def test_empty_part(tmp_path):
    (tmp_path / "samples.jsonl").write_bytes(b"")
    assert len(SampleRows(tmp_path / "samples.jsonl", 0)) == 0


def test_row_count_must_match_part_json(tmp_path):
    write_rows(tmp_path / "samples.jsonl", ROWS)
    with pytest.raises(FormatError, match=r"samples\.jsonl: 3 rows, part\.json says 4 samples"):
        SampleRows(tmp_path / "samples.jsonl", 4)


def test_bad_line_is_named(tmp_path):
    (tmp_path / "samples.jsonl").write_text(f'{json.dumps(row(0, "a"))}\n{{"sample_idx": \n{json.dumps(row(2, "c"))}\n')
    rows = SampleRows(tmp_path / "samples.jsonl", 3)
    assert rows[0] == row(0, "a") and rows[2] == row(2, "c")
    with pytest.raises(FormatError, match=r"samples\.jsonl: line 2 is not valid JSON"):
        rows[1]


@pytest.mark.parametrize("damage, named", [
    ({"text": None}, "field 'text' holds NoneType None"), ({"label": ["a", "b"]}, "field 'label' holds list"),
    ({"label_id": True}, "field 'label_id' holds bool True"), ({"label_id": 1.5}, "field 'label_id' holds float"),
    ({"metadata": []}, "field 'metadata' holds list"), ({"num_tokens": "3"}, "field 'num_tokens' holds str")])
def test_a_row_a_writer_cannot_read_is_named_with_its_field(tmp_path, damage, named):
    """Every format writer reads a row's text, label, label_id, num_tokens and metadata: a row missing one or
    holding another type stopped the writer with a bare KeyError or TypeError naming no file."""
    write_rows(tmp_path / "samples.jsonl", [row(0, "a"), {**row(1, "b"), **damage}])
    rows = SampleRows(tmp_path / "samples.jsonl", 2)
    with pytest.raises(FormatError, match=rf"samples\.jsonl: line 2 \(sample 1\): {re.escape(named)}"):
        rows[1]
    dropped = row(1, "b")
    del dropped["metadata"]
    write_rows(tmp_path / "samples.jsonl", [row(0, "a"), dropped])
    with pytest.raises(FormatError, match=r"line 2 \(sample 1\): no field 'metadata'"):
        list(SampleRows(tmp_path / "samples.jsonl", 2))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FormatError, match=r"samples\.jsonl: missing"):
        SampleRows(tmp_path / "samples.jsonl", 1)


def test_reading_every_row_holds_none_of_them(tmp_path):
    """200,000 rows of ~100 B: the index is 8 B a row (1.6 MB); as dicts they took ~100 MB."""
    n = 200_000
    write_rows(tmp_path / "samples.jsonl", (row(i, f"sample text number {i}" * 3) for i in range(n)))
    tracemalloc.start()
    try:
        rows = SampleRows(tmp_path / "samples.jsonl", n)
        seen = sum(row["sample_idx"] for row in rows)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == n * (n - 1) // 2
    assert held < 8 * n + 1_000_000 and peak < 4 * 8 * n + 10_000_000, (held, peak)


def test_extraction_rows_read_through_the_part(tmp_path):
    extract = synthetic_extraction(tmp_path / "extract", 2 * 10**6, 2, 16, [1])
    extraction = open_extraction(extract)
    by_line = [json.loads(line) for p in extraction.parts for line in (p.dir / "samples.jsonl").read_text().splitlines()]
    assert [extraction.sample(i) for i in range(extraction.n_samples)] == by_line
    assert [row for _, _, row in extraction.iter_samples()] == by_line


def test_samples_jsonl_outside_the_part_is_refused(tmp_path):
    extract = synthetic_extraction(tmp_path / "extract", 10**6, 1, 16, [1])
    part = extract / "part-0000"
    outside = tmp_path / "elsewhere.jsonl"
    (part / "samples.jsonl").rename(outside)
    (part / "samples.jsonl").symlink_to(outside)
    with pytest.raises(FormatError, match="samples.jsonl"):
        open_extraction(extract).sample(0)


def test_rows_by_sample_idx_skip_empty_parts(tmp_path):
    """Parts left empty (more parts than samples) record sample_range [0, 0], as extraction writes
    them: sample(), samples() and iter_samples() still address every row by its sample_idx."""
    extract = synthetic_extraction(tmp_path / "extract", 5 * 64 * 16 * 4, 8, 16, [1], tokens=(64, 64))
    for meta_path in extract.glob("part-*/part.json"):
        meta = json.loads(meta_path.read_text())
        if meta["sample_range"][0] >= meta["sample_range"][1]:
            meta["sample_range"] = [0, 0]
            meta_path.write_text(json.dumps(meta))
    extraction = open_extraction(extract)
    assert 0 < sum(not p.info.n_samples for p in extraction.parts) and extraction.n_samples == 5
    by_line = [json.loads(line) for p in extraction.parts for line in (p.dir / "samples.jsonl").read_text().splitlines()]
    order = [4, 0, 3, 3, 1, 2]
    assert extraction.samples(order) == [by_line[i] for i in order] == [extraction.sample(i) for i in order]
    assert [row["sample_idx"] for _, _, row in extraction.iter_samples()] == list(range(5))
    with pytest.raises(IndexError):
        extraction.samples([5])
