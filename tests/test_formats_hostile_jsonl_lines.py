"""Review 67 (task 231): a store's JSON-lines line past the bound on a row (a hostile store's, its checksums
rewritten to match) is refused naming the file and line, never read whole: an extraction's samples.jsonl
(SampleRows: verify and every reader) and a zarr shard's text/prompts.jsonl (verify).

The real bound is 4 GiB (extract.layout.MAX_ROW_BYTES, as formats.extract.read takes it); the tests put
BOUND in its place, so that a line far past it is cheap to write, and hold the line's writer-made row
otherwise valid: with the real bound each store verifies clean, so only the line's length is refused."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from actstore.datasets.json_array import MAX_ELEMENT_CHARS
from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import open_extraction, verify
from actstore.formats.extract import read as extract_read
from actstore.formats.extract.read import MAX_ROW_BYTES, SampleRows
from actstore.formats.zarr import check as zarr_check
from actstore.io_utils import bounded_lines, sha256_file, sha256_tree_file
from test_spec_audit_lmprobe_zarr import STORE, copied_run, need, rerecord
from test_zarr import bert_run  # noqa: F401 (a fixture: two shards of 15 bert samples, merged)
from tiny import traced_peak

BOUND = 1 << 20  # what the tests put in place of the 4 GiB bound
LINE = 48 << 20  # the hostile line's bytes: reading it whole holds them, and decoding them as much again
# The most memory a refusal may hold: verify's own (hash blocks, metadata) came to 8.6 MiB on the clean
# stores and 12.7 MiB on these; reading the line whole held 151 MiB.
HELD = LINE // 2


def test_the_bound_holds_any_row_of_the_bounded_inputs():
    """A JSON row of MAX_ELEMENT_CHARS characters writes at most 4.5 bytes a character, a text file's row 6 a
    byte beside its metadata's 4.5, plus fixed fields (layout's comment): 10.5 x MAX_ELEMENT_CHARS."""
    assert MAX_ROW_BYTES >= 10.5 * MAX_ELEMENT_CHARS + 4096


def padded(record: dict) -> None:
    """`record` (a samples.jsonl row or a prompts.jsonl line) made LINE bytes longer in a metadata field no
    check reads: the line stays a valid one of its sample."""
    record["metadata"] = {**record["metadata"], "pad": "x" * LINE}


def written(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


@pytest.fixture(scope="module")
def hostile_extraction(extracted, tmp_path_factory) -> tuple[Path, Path]:
    """(copy of the bert extraction, its part 1's samples.jsonl) whose line 2 is LINE bytes long, part.json
    and extract.json recording the new bytes (as a writer that wrote them would have)."""
    _, extract_dir = extracted("bert")
    copy = tmp_path_factory.mktemp("hostile-extract") / "extract"
    shutil.copytree(extract_dir, copy)
    part_dir = copy / "part-0001"
    samples = part_dir / "samples.jsonl"
    rows = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
    need(len(rows) >= 2, "part 1 holds two samples")
    padded(rows[1])
    written(samples, rows)
    meta = json.loads((part_dir / "part.json").read_text())
    meta["files"]["samples.jsonl"] = {"bytes": samples.stat().st_size, "sha256_tree": sha256_tree_file(samples)}
    (part_dir / "part.json").write_text(json.dumps(meta))
    index = json.loads((copy / "extract.json").read_text())
    index["parts"][1]["part_json_sha256"] = sha256_file(part_dir / "part.json")
    (copy / "extract.json").write_text(json.dumps(index))
    need(verify(copy) == [], "the copy verifies clean under the real bound: only the line's length is wrong")
    return copy, samples


def test_verify_refuses_a_samples_line_past_the_bound_naming_it_without_reading_it(hostile_extraction,
                                                                                     monkeypatch):
    copy, samples = hostile_extraction
    monkeypatch.setattr(extract_read, "MAX_ROW_BYTES", BOUND)
    problems, peak = traced_peak(lambda: verify(copy))
    assert len(problems) == 1 and problems[0].startswith(f"{samples}: line 2 is ") and str(BOUND) in problems[0], \
        problems
    assert peak < HELD, peak


def test_every_reader_refuses_a_samples_line_past_the_bound(hostile_extraction, monkeypatch):
    """Opened without verify: one row, several rows, every row in order; each refused with the line named
    and its bytes never held."""
    copy, samples = hostile_extraction
    monkeypatch.setattr(extract_read, "MAX_ROW_BYTES", BOUND)
    first = open_extraction(copy).parts[1].sample_start
    reads = {"one row": lambda extraction: extraction.sample(first),
             "rows": lambda extraction: extraction.samples([first, first + 1]),
             "all rows": lambda extraction: list(extraction.iter_samples())}

    def refusal(read) -> str:
        with pytest.raises(FormatError) as refused:
            read(open_extraction(copy))
        return str(refused.value)
    for how, read in reads.items():
        message, peak = traced_peak(lambda: refusal(read))
        assert message.startswith(f"{samples}: line 2 is ") and peak < HELD, (how, message, peak)


def test_a_samples_line_at_the_bound_is_read_and_one_byte_more_is_refused(tmp_path, monkeypatch):
    """The bound counts a line's newline: a row of exactly MAX_ROW_BYTES comes back whole."""
    monkeypatch.setattr(extract_read, "MAX_ROW_BYTES", 1000)
    row = {"sample_idx": 0, "text": "", "label": None, "label_id": -1, "num_tokens": 1, "metadata": {}}
    row["text"] = "y" * (1000 - len(json.dumps(row)) - 1)
    for extra, refused in ((0, False), (1, True)):
        record = {**row, "text": row["text"] + "y" * extra}
        path = tmp_path / "samples.jsonl"
        written(path, [{**record, "sample_idx": 0}, {**record, "sample_idx": 1}])
        assert path.stat().st_size == 2 * (1000 + extra)
        if refused:
            with pytest.raises(FormatError, match=r"samples\.jsonl: line 1 is 1001 bytes, past the 1000 a row may"):
                SampleRows(path, 2)
        else:
            assert [r["text"] for r in SampleRows(path, 2)] == [record["text"]] * 2


def test_a_samples_file_of_more_lines_than_samples_is_refused_before_they_are_indexed(tmp_path, monkeypatch):
    """Two rows and then 16 MiB of newlines, part.json saying 2 samples: the index (8 bytes a line) was built
    for every line, 256 MiB, before the count refused them; the scan now stops at the block past 2."""
    monkeypatch.setattr(SampleRows, "SCAN_BYTES", 1 << 16)
    path = tmp_path / "samples.jsonl"
    written(path, [{"sample_idx": i, "text": "t", "label": None, "label_id": -1, "num_tokens": 1, "metadata": {}}
                   for i in range(2)])
    with path.open("ab") as fh:
        fh.write(b"\n" * (16 << 20))

    def refusal() -> str:
        with pytest.raises(FormatError) as refused:
            SampleRows(path, 2)
        return str(refused.value)
    message, peak = traced_peak(refusal)
    assert message.startswith(f"{path}: ") and "rows in its first 65536 bytes, part.json says 2 samples" in message
    assert peak < HELD, peak


def test_rows_are_read_as_indexed_when_the_file_has_changed_since(tmp_path):
    """A samples.jsonl replaced by one whose line 1 is LINE bytes after it was indexed (the part's job runs
    for hours): its rows are read as the index spans them, and line 1 is refused as what that span holds,
    never read whole."""
    path = tmp_path / "samples.jsonl"
    rows = [{"sample_idx": i, "text": "t", "label": None, "label_id": -1, "num_tokens": 1, "metadata": {}}
            for i in range(3)]
    written(path, rows)
    indexed = SampleRows(path, 3)
    padded(rows[0])
    written(tmp_path / "new.jsonl", rows)
    (tmp_path / "new.jsonl").replace(path)

    def refusal() -> str:
        with pytest.raises(FormatError) as refused:
            list(indexed)
        return str(refused.value)
    message, peak = traced_peak(refusal)
    assert message.startswith(f"{path}: line 1 is not valid JSON") and peak < HELD, (message, peak)


def test_bounded_lines_counts_the_newline_and_names_the_line():
    data = b"ab\n" + b"c" * 9 + b"\n" + b"d" * 11 + b"\nlast"
    lines = bounded_lines(io.BufferedReader(io.BytesIO(data)), 10, "f.jsonl")
    assert [next(lines), next(lines)] == [b"ab\n", b"c" * 9 + b"\n"]
    with pytest.raises(FormatError, match=r"^f\.jsonl: line 3 is longer than the 10 bytes"):
        next(lines)
    assert list(bounded_lines(io.BytesIO(b"x" * 10), 10, "g")) == [b"x" * 10]  # a last line without newline


def test_zarr_verify_refuses_a_prompts_line_past_the_bound_naming_it(bert_run, tmp_path, monkeypatch):  # noqa: F811
    """A shard's prompts.jsonl whose line 2 (its own i, sample_key and prompt) is LINE bytes long, files.json
    and the manifest recording it: verify names the line, holding none of it."""
    run = copied_run(bert_run, tmp_path)
    path = run / STORE / "text/prompts.jsonl"
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    padded(lines[1])
    written(path, lines)
    rerecord(run, ["text/prompts.jsonl"])
    need(zs.verify(run) == [], "the run verifies clean under the real bound: only the line's length is wrong")
    monkeypatch.setattr(zarr_check, "MAX_PROMPT_LINE_BYTES", BOUND)
    problems, peak = traced_peak(lambda: zs.verify(run))
    assert len(problems) == 1 and problems[0].startswith(f"{path}: line 2 is longer than the {BOUND} bytes"), \
        problems
    assert peak < HELD, peak
