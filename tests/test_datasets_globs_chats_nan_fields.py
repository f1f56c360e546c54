"""Second review of reading the user's datasets (source.py, chat.py, tables.py): faults a user's real
paths, chats and tables hit."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import tiny
from actstore.datasets import load_dataset, part_range, scan_dataset
from actstore.datasets.core import Fields
from actstore.datasets.source import resolve_source
from actstore.datasets.tables import read_table, table_schemas
from actstore.errors import ConfigError


def test_an_existing_path_with_brackets_is_itself_not_a_glob(tmp_path):
    """`corpus[v2]` was read as a glob, its [v2] a character class: the folder (or a file in it) that
    exists 'matches no file'. A glob still matches, with its brackets escaped as glob.escape does."""
    folder = tmp_path / "corpus[v2]"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "first"}) + "\n" + json.dumps({"text": "second"}) + "\n")
    for path in (folder, folder / "a.jsonl", tmp_path / "corpus[[]v2]" / "*.jsonl"):
        assert [s.text for s in load_dataset(path).samples] == ["first", "second"]


def test_a_glob_that_is_no_existing_path_is_still_a_glob(tmp_path):
    for name in ("a1.jsonl", "a2.jsonl", "b1.jsonl"):
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n")
    assert [s.text for s in load_dataset(tmp_path / "a[12].jsonl").samples] == ["a1.jsonl", "a2.jsonl"]


def test_an_empty_chat_is_named_with_its_row_by_the_scan(model_dir, tmp_path):
    """transformers refuses to render [] with a ValueError naming no file or row, raised in a part's job
    after the parts before; the scan passed it. Now the scan names the row."""
    chat_model = tiny.add_chat_template(model_dir("llama"), tmp_path / "chat-llama")
    hello = [{"role": "user", "content": "hello"}]
    lines = tmp_path / "chat.jsonl"
    lines.write_text(json.dumps({"messages": hello}) + "\n" + json.dumps({"messages": []}) + "\n")
    table = tiny.write_parquet(tmp_path / "chat", pa.table({"messages": [hello, []]}))
    for path, row in ((lines, "chat.jsonl:2"), (table, "train-00000-of-00001.parquet#1")):
        with pytest.raises(ConfigError, match=rf"{row}.*no messages"):
            scan_dataset(path, messages_field="messages")
        with pytest.raises(ConfigError, match=rf"{row}.*no messages"):
            load_dataset(path, model_path=chat_model, messages_field="messages")


def _scores(tmp_path, score: float | None):
    path = tmp_path / "scores.parquet"
    pq.write_table(pa.table({"review": ["good", "bad"], "score": pa.array([4.5, score], pa.float64())}), path)
    return path


@pytest.mark.parametrize("score, named", [(float("nan"), "NaN"), (None, "null")])
def test_a_nan_in_a_template_field_is_named_as_a_null_is(score, named, tmp_path):
    """A NaN (pandas' and polars' missing number) in a template's float column was rendered as the text
    'nan' ('Score: nan'), where a null is named by the scan: the footer counts no NaN as a null, so
    the scan skipped the row group."""
    with pytest.raises(ConfigError, match=rf"scores.parquet#1, column 'score': {named} where a prompt is needed"):
        scan_dataset(_scores(tmp_path, score), prompt_template="Review: {review} Score: {score}")


def test_a_part_job_names_a_nan_in_a_template_field(tmp_path):
    """The rows a part's job reads name a NaN as they name a null (the scan would have named both)."""
    source = resolve_source(str(_scores(tmp_path, float("nan"))))
    fields = Fields(template="Review: {review} Score: {score}")
    schemas = table_schemas(source, fields)
    assert read_table(source, fields, schemas, range(1))[0].text == "Review: good Score: 4.5"
    with pytest.raises(ConfigError, match=r"scores.parquet#1, column 'score': NaN where a prompt is needed"):
        read_table(source, fields, schemas, range(2))


def test_a_part_job_converts_its_rows_not_its_row_groups(tmp_path):
    """pyarrow writes a Parquet row group of up to 1Mi rows: a part's job converted every row of the
    group's columns to Python to take its few (LAION's captions and URLs: GBs). Its peak now follows
    its rows, and the rows are the ones the whole read gives."""
    n = 20_000
    path = tmp_path / "captions.parquet"
    pq.write_table(pa.table({"text": [f"a photo of thing {i} " * 4 for i in range(n)],
                             "url": [f"https://example.org/{i}.jpg" for i in range(n)],
                             "label": [i % 7 for i in range(n)]}), path, row_group_size=n)
    scan = scan_dataset(path, keep_fields=["url"])

    def peak(parts: int, part: int):
        return tiny.traced_peak(lambda: load_dataset(path, parts=(parts, part), scan=scan, keep_fields=["url"]).samples)

    (part, part_peak), (whole, whole_peak) = peak(1000, 7), peak(1, 0)
    assert part == whole[part_range(n, 1000, 7).start:part_range(n, 1000, 7).stop]
    assert whole_peak > 50 * part_peak, (whole_peak, part_peak)


def test_an_image_table_parts_refs_and_names_are_the_whole_reads(tmp_path):
    """A part starting inside a row group keeps each row's place in its block (the image's ref) and
    its name."""
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    images = [{"bytes": buffer.getvalue(), "path": None if i % 2 else f"img{i}.png"} for i in range(10)]
    path = tiny.write_parquet(tmp_path / "images", pa.table({"image": images}), row_group_size=4)
    whole = load_dataset(path).samples
    parts = [s for part in range(3) for s in load_dataset(path, parts=(3, part)).samples]
    assert [(s.sample_idx, s.text, s.ref) for s in parts] == [(s.sample_idx, s.text, s.ref) for s in whole]
    assert whole[5].text == "train-00000-of-00001.parquet#5" and whole[5].ref == (0, 1, 1)
