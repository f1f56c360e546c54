"""Review 67 (task 232): no line past the readers' bound is ever written. A part's samples.jsonl row past
extract.layout.MAX_ROW_BYTES (a chat template's render, a library caller's rows) is refused by PartWriter before
anything is made, as every reader would refuse it; the zarr merge reads a shard's text/prompts.jsonl bounded
(MAX_PROMPT_LINE_BYTES), naming a longer line without holding it.

The real bounds are 4 GiB; each test patches a small one where the code under test reads it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.extract import PartWriter
from actstore.formats.extract import read as extract_read
from actstore.formats.extract import write as extract_write
from actstore.formats.extract.read import SampleRows
from actstore.formats.zarr import merge as zarr_merge
from test_spec_audit_lmprobe_zarr import STORE, copied_run, need, rerecord
from test_zarr import bert_run  # noqa: F401 (a fixture: two shards of 15 bert samples, merged)
from tiny import traced_peak

ROW_BOUND = 1000


def rows_of_line_bytes(size: int) -> list[dict]:
    """Two samples.jsonl rows, the second's line (its newline counted) exactly `size` bytes, its text not ASCII
    (ensure_ascii=False: "é" is 2 bytes, as the reader counts them)."""
    row = {"sample_idx": 1, "text": "", "label": None, "label_id": -1, "num_tokens": 1, "metadata": {}}
    fixed = len(json.dumps(row).encode()) + 1
    row["text"] = "é" * ((size - fixed) // 2) + "y" * ((size - fixed) % 2)
    return [{**row, "sample_idx": 0, "text": "short"}, row]


def test_part_writer_writes_a_row_at_the_bound_and_refuses_one_byte_more_before_making_anything(tmp_path,
                                                                                                 monkeypatch):
    for module in (extract_write, extract_read):  # the writer and the reader take the same bound
        monkeypatch.setattr(module, "MAX_ROW_BYTES", ROW_BOUND)
    offsets = np.array([0, 1, 2], dtype=np.int64)
    at_bound = tmp_path / "at-bound"
    PartWriter(at_bound, rows_of_line_bytes(ROW_BOUND), offsets)
    lines = (at_bound / "samples.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines[1]) == ROW_BOUND
    assert [row["text"] for row in SampleRows(at_bound / "samples.jsonl", 2)] == \
        [row["text"] for row in rows_of_line_bytes(ROW_BOUND)]  # the reader takes what the writer wrote
    past = tmp_path / "past"
    with pytest.raises(ValueError, match=rf"^{past}/samples\.jsonl: sample_idx 1's row is {ROW_BOUND + 1} bytes, "
                                         rf"past the {ROW_BOUND} a samples\.jsonl row may take"):
        PartWriter(past, rows_of_line_bytes(ROW_BOUND + 1), offsets)
    assert not past.exists()


BOUND = 1 << 20  # what the merge test puts in place of MAX_PROMPT_LINE_BYTES
LINE = 48 << 20  # the hostile line's bytes: the merge held them whole, then the dict parsed from them
# The most memory the refusal may hold: the merge's own (files.json records, its link job) came to 8.4 MiB.


def test_merge_refuses_a_shard_prompts_line_past_the_bound_naming_it_without_holding_it(
        bert_run, tmp_path, monkeypatch):  # noqa: F811
    """Shard 0's prompts.jsonl line 2 made LINE bytes long (in a metadata field no check reads), its files.json
    and the manifest recording it: the merge's checks of the shard pass, and its copy of the prompts names the
    line, holding none of it."""
    run = copied_run(bert_run, tmp_path)
    path = run / STORE / "text/prompts.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    records[1]["metadata"] = {**records[1]["metadata"], "pad": "x" * LINE}
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    rerecord(run, ["text/prompts.jsonl"])
    need(zs.verify(run) == [], "the run verifies clean under the real bound: only the line's length is wrong")
    shards = sorted((run / "shards").glob("*.zarr"))
    need(len(shards) == 2 and shards[0] == run / STORE, "two shards, the padded one first")
    monkeypatch.setattr(zarr_merge, "MAX_PROMPT_LINE_BYTES", BOUND)

    def refusal() -> str:
        with pytest.raises(FormatError) as refused:
            zs.merge_stores(shards, tmp_path / "merged" / zs.MERGED, progress=False)
        return str(refused.value)
    message, peak = traced_peak(refusal)
    assert message.startswith(f"{path}: line 2 is longer than the {BOUND} bytes a line may take"), message
    assert peak < LINE // 2, peak  # reading the line whole held it, and its text again
    assert not (tmp_path / "merged" / zs.MERGED).exists()
