"""Review 58 of the dataset readers: faults the scan passed (or a reader misread) that a part's job
met after the model was loaded, or never met: each on a real small file."""
from __future__ import annotations

import csv
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.datasets import load_dataset, scan_dataset
from actstore.errors import ConfigError

BAD_IDS = {"empty": ([], "no token ids"), "null_id": ([5, None], "a null token id"),
           "negative": ([5, -4], "token id -4 is not"), "past_int64": ([1 << 63], "token id 9223372036854775808")}


def write_table(path, table: pa.Table) -> None:
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=2)
    else:
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table, max_chunksize=2)


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
@pytest.mark.parametrize("bad", sorted(BAD_IDS))
def test_a_row_of_token_ids_its_part_would_refuse_fails_the_scan_naming_it(bad, suffix, tmp_path):
    """A row of no ids, a null id, an id below 0 or past int64 passed the scan (which checked only
    null rows, and skipped Parquet row groups whose footer counts no null) and failed its part's
    job after the model was loaded on a GPU node. The scan now names the shard and row."""
    ids, message = BAD_IDS[bad]
    kind = pa.uint64() if bad == "past_int64" else pa.int32()
    path = tmp_path / f"ids{suffix}"
    write_table(path, pa.table({"input_ids": pa.array([[1, 2], [3], [4], ids, [6]], pa.list_(kind))}))
    with pytest.raises(ConfigError, match=rf"ids{suffix}#3, column 'input_ids' \(dataset.tokens_field\): {message}"):
        scan_dataset(path, tokens_field="input_ids")
    assert scan_dataset(path, limit=3, tokens_field="input_ids").n_samples == 3  # rows past the limit are not read


def write_csv(path, header: list[str], rows: list[list]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)


def test_a_csv_template_column_of_numbers_is_read_as_written(tmp_path):
    """A template's CSV column of numbers was inferred as integers: "zip {zip}" of 007 was "zip 7",
    without a word. A prompt's columns are read as the text written, as the text column is."""
    write_csv(tmp_path / "t.csv", ["zip", "score"], [["007", "3.10"], ["12", "1"]])
    samples = load_dataset(tmp_path / "t.csv", prompt_template="zip {zip}, score {score}").samples
    assert [s.text for s in samples] == ["zip 007, score 3.10", "zip 12, score 1"]


def test_a_csv_kept_column_a_later_block_cannot_convert_fails_the_scan_naming_it(monkeypatch, tmp_path):
    """A kept column of numbers in the first CSV block and a word later passed the scan (which read
    no kept column) and failed the part's job of that row alone, naming the column by its number."""
    from actstore.datasets import tables

    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", 256)  # a 16 MiB block's boundary, in a small file
    write_csv(tmp_path / "k.csv", ["text", "extra"], [*([f"row {i}", i] for i in range(40)), ["last", "word"]])
    with pytest.raises(ConfigError, match=r"k.csv: cannot be read as CSV past its first \d+ rows \(In column 'extra': "
                                          r".*invalid value 'word'"):
        scan_dataset(tmp_path / "k.csv", keep_fields=["extra"])
    assert scan_dataset(tmp_path / "k.csv", keep_fields=["extra"], limit=5).n_samples == 5


def test_tsv_files_are_read_as_tab_separated(tmp_path):
    """A .tsv file (GLUE's, MTEB's) was read as JSON lines and refused at its first line, and a folder
    of them as holding no samples; Hugging Face's csv loader reads them split at tabs."""
    text = 'text\tlabel\nhello, world\t1\n"a\ttab"\t0\n'
    (tmp_path / "one.tsv").write_text(text)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "train.tsv.gz").write_bytes(gzip.compress(text.encode()))
    for path in (tmp_path / "one.tsv", tmp_path / "shards", tmp_path / "shards" / "*.tsv.gz"):
        dataset = load_dataset(path)
        assert [(s.text, s.label) for s in dataset.samples] == [("hello, world", 1), ("a\ttab", 0)]


@pytest.mark.parametrize("metadata, message", [
    (b"{oops", "not valid JSON"),
    (b"[1]", r"info.features: must be a JSON object of features by column, got \[1\]"),
    (json.dumps({"info": {"features": {"label": {"_type": "ClassLabel", "names": "neg"}}}}).encode(),
     "'label' ClassLabel's names must be a list of distinct strings, got \"neg\""),
    (json.dumps({"info": {"features": {"label": {"_type": "ClassLabel", "names": ["a", "a"]}}}}).encode(),
     "'label' ClassLabel's names must be a list of distinct strings"),
])
def test_huggingface_schema_metadata_that_holds_no_features_is_named(metadata, message, tmp_path):
    """The `huggingface` schema metadata not JSON was a bare JSONDecodeError, not an object an
    AttributeError; ClassLabel names given as a string were its letters, each a class."""
    table = pa.table({"text": ["a", "b"], "label": [0, 0]}).replace_schema_metadata({b"huggingface": metadata})
    pq.write_table(table, tmp_path / "m.parquet")
    with pytest.raises(ConfigError, match=rf"m.parquet: schema metadata 'huggingface'.*{message}"):
        scan_dataset(tmp_path / "m.parquet")


def test_a_csv_value_past_dataset_limit_is_never_converted(monkeypatch, tmp_path):
    """The block after dataset.limit's last row was parsed and converted too: a label column of
    numbers holding a word past the limit refused the scan (and a kept one failed the last part's
    job), for a row never read."""
    from actstore.datasets import tables

    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", 256)
    write_csv(tmp_path / "l.csv", ["text", "label", "extra"],
              [*([f"row {i}", i % 2, i] for i in range(40)), ["last", "word", "word"]])
    options = {"limit": 5, "keep_fields": ["extra"]}
    scan = scan_dataset(tmp_path / "l.csv", **options)
    assert (scan.n_samples, scan.labels) == (5, [0, 1])
    part = load_dataset(tmp_path / "l.csv", parts=(2, 1), scan=scan, **options)
    assert [(s.text, s.label, s.metadata) for s in part.samples] == [(f"row {i}", i % 2, {"extra": i}) for i in (3, 4)]
