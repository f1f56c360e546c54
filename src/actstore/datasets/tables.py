"""Parquet, Arrow (IPC file or stream, as save_to_disk writes) and CSV tables, read with pyarrow one
block at a time (a Parquet row group, an Arrow record batch, a CSV block) and only the columns used,
so memory holds one block, never the whole table."""
from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from actstore.datasets.chat import checked_messages
from actstore.datasets.core import Fields, Sample, class_label_names, class_name, label_list, refuse_past_vocab
from actstore.datasets.jsonl import open_bytes
from actstore.datasets.source import COMPRESSED_SUFFIXES, Source
from actstore.errors import ConfigError

CSV_BLOCK_BYTES = 1 << 24
STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an Arrow stream's end: an empty message
LEGACY_STREAM_END = b"\x00\x00\x00\x00"  # as pyarrow before 0.15 wrote it
CHECK_ROWS = 4096  # rows of a column the scan converts to Python at once (chat messages, labels)


def schema_of(fmt: str, path: Path, csv_types: dict[str, pa.DataType] | None = None) -> pa.Schema:
    """The file's schema (`csv_types`: a CSV's columns of these types, not inferred: _text_columns)."""
    try:
        if fmt == "csv":
            with _open_csv(path, None, csv_types) as reader:
                return reader.schema
        if fmt == "parquet":
            import pyarrow.parquet as pq
            return pq.read_schema(path)
        return _open_ipc(pa.memory_map(str(path))).schema
    except (OSError, EOFError, ValueError) as exc:  # as _csv_batches
        raise ConfigError(f"{path}: cannot read as {fmt} ({exc})") from None


def blocks(fmt: str, path: Path, columns: list[str], csv_types: dict[str, pa.DataType] | None = None
           ) -> Iterator[tuple[int, Callable[[], pa.Table]]]:
    """(rows, read) of the file's blocks in order: read() gives the block with `columns` only
    ("image.path": that struct child only; `csv_types`: as schema_of). A Parquet row group is read
    only when asked for."""
    if fmt == "csv":
        for batch in _csv_batches(path, columns, csv_types):
            yield batch.num_rows, lambda batch=batch: pa.Table.from_batches([batch])
    elif fmt == "parquet":
        import pyarrow.parquet as pq
        parquet = pq.ParquetFile(path)
        for group in range(parquet.num_row_groups):
            yield (parquet.metadata.row_group(group).num_rows,
                   lambda group=group: _row_group(parquet, path, group, columns))
    else:
        for batch in _ipc_batches(path):
            yield batch.num_rows, lambda batch=batch: _select(pa.Table.from_batches([batch]), columns)


def _blocks_to(fmt: str, path: Path, columns: list[str], csv_types: dict[str, pa.DataType] | None,
               rows: int) -> Iterator[tuple[int, Callable[[], pa.Table]]]:
    """blocks() holding the file's first `rows` rows, the block after them never reached: a CSV block
    is parsed and converted when reached, and a value past dataset.limit (or a part's rows) that its
    column's type cannot hold failed the scan, or the part's job, for a row never read."""
    if rows <= 0:
        return
    for size, read in blocks(fmt, path, columns, csv_types):
        yield size, read
        rows -= size
        if rows <= 0:
            return


def count_rows(fmt: str, path: Path) -> int:
    """Rows of one table file, reading no values (Parquet: its footer; CSV: its first column alone,
    as bytes, which no value fails; Arrow: batch lengths of the memory-mapped file)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq
        return pq.ParquetFile(path).metadata.num_rows
    if fmt == "csv":  # one column, as bytes: every column converted failed the scan on a column the config
        # never reads (an id column of numbers in the first block and text in a later one)
        first = schema_of(fmt, path).names[:1]
        return sum(batch.num_rows for batch in _csv_batches(path, first, dict.fromkeys(first, pa.binary())))
    return sum(batch.num_rows for batch in _ipc_batches(path))


def largest_block_bytes(fmt: str, path: Path) -> int:
    """Bytes of the file's largest block as Arrow holds it, reading no values (Parquet: its row
    groups' uncompressed sizes; Arrow: the batches' buffers; CSV: the block size it is read in)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq
        metadata = pq.ParquetFile(path).metadata
        return max((metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)), default=0)
    if fmt == "csv":
        return CSV_BLOCK_BYTES
    return max((batch.nbytes for batch in _ipc_batches(path)), default=0)


def read_block(fmt: str, path: Path, index: int, column: str) -> pa.ChunkedArray:
    """Column `column` of block `index` (image bytes, read in the DataLoader worker that decodes them)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq
        return _row_group(pq.ParquetFile(path), path, index, [column]).column(column)
    reader = _open_ipc(pa.memory_map(str(path)))
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        return pa.chunked_array([reader.get_batch(index).column(column)])
    for i, batch in enumerate(reader):  # a stream has no batch index; memory-mapped, skipping is free
        if i == index:
            return pa.chunked_array([batch.column(column)])
    raise ConfigError(f"{path}: has no record batch {index} (the file changed since it was read)")


def _row_group(parquet: Any, path: Path, group: int, columns: list[str]) -> pa.Table:
    """Row group `group` of the open Parquet file `path`, `columns` only; ConfigError naming the file
    and group where its data is damaged (pyarrow's OSError, 'Corrupt snappy compressed data', named
    no file)."""
    try:
        return parquet.read_row_group(group, columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ConfigError(f"{path}: row group {group} cannot be read as Parquet, damaged ({exc})") from None


def _text_columns(fields: Fields) -> dict[str, pa.DataType]:
    """A CSV's columns read as strings, not by the types pyarrow infers from its first block: the
    prompt's (the text column, a template's each). A text column of numbers ("42", "007", "3.10", a
    probe of how a model reads numbers) was inferred as integers or floats and refused as no strings,
    a template's was read as numbers ("zip {zip}" of "007" was "zip 7", without a word), and one whose
    first block held only numbers failed at the first later block with words."""
    return dict.fromkeys(fields.prompts, pa.string()) if fields.prompt == fields.text else {}


@contextlib.contextmanager
def _open_csv(path: Path, columns: list[str] | None, types: dict[str, pa.DataType] | None):
    """A CSV reader (`types`: columns' types, not inferred); newlines_in_values: a quoted value may
    hold line breaks (as csv.writer and pandas write a multi-line text), which without it fail the
    read of any file past one block. A .gz or .zst file is decompressed as a JSON lines file is
    (jsonl.open_bytes): pyarrow's own gzip reader refused zero padding after the last member, which
    gzip, Python and a .jsonl.gz read."""
    from pyarrow import csv
    compressed = path.suffix.lower() in COMPRESSED_SUFFIXES
    with open_bytes(path) if compressed else contextlib.nullcontext(str(path)) as source:
        yield csv.open_csv(source, read_options=csv.ReadOptions(block_size=CSV_BLOCK_BYTES),
                           parse_options=csv.ParseOptions(delimiter=csv_delimiter(path), newlines_in_values=True),
                           convert_options=csv.ConvertOptions(include_columns=columns, column_types=types))


def csv_delimiter(path: Path) -> str:
    """A tab for a .tsv file (compressed too: .tsv.gz), as Hugging Face's csv loader reads one; else a comma."""
    data = path.with_suffix("") if path.suffix.lower() in COMPRESSED_SUFFIXES else path
    return "\t" if data.suffix.lower() == ".tsv" else ","


def _csv_batches(path: Path, columns: list[str] | None,
                 types: dict[str, pa.DataType] | None = None) -> Iterator[pa.RecordBatch]:
    """The CSV file's blocks; ConfigError naming the file and the rows read before one pyarrow cannot
    parse or decompress (a row of more values than the header's columns, a .csv.gz cut short: a bare
    ArrowInvalid or OSError named no file)."""
    rows = 0
    try:
        with _open_csv(path, columns, types) as reader:
            for batch in reader:
                yield batch
                rows += batch.num_rows
    except (OSError, EOFError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError; EOFError and
        # ValueError are also open_bytes' for a compressed file cut short or damaged
        raise ConfigError(f"{path}: cannot be read as CSV past its first {rows} rows "
                          f"({_column_named(path, str(exc))})") from None


def _column_named(path: Path, message: str) -> str:
    """pyarrow's error with its "CSV column #N" (the file's Nth column, from 0) given its header's
    name: a conversion error (a word in a column of numbers past the first block) named no column."""
    import csv
    import io

    found = re.search(r"CSV column #(\d+)", message)
    if found is None:
        return message
    with pa.input_stream(str(path), compression="detect") as raw:
        header = next(csv.reader(io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace", newline=""),
                                 delimiter=csv_delimiter(path)), [])
    index = int(found[1])
    return message if index >= len(header) else message.replace(found[0], f"column {header[index]!r}", 1)


def _open_ipc(source: pa.MemoryMappedFile):
    """A reader of the memory-mapped Arrow file (pages are read when touched: never loaded whole)."""
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(source)


def _ipc_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """The Arrow file's record batches; ConfigError naming the file where one is cut short or damaged
    (pyarrow's OSError or ArrowInvalid named no file), or a stream lacks its end marker."""
    try:
        source = pa.memory_map(str(path))
        reader = _open_ipc(source)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
            return
        end, rows = source.tell(), 0  # where the last message read ends
        for batch in reader:
            end, rows = source.tell(), rows + batch.num_rows
            yield batch
    except (pa.ArrowInvalid, OSError) as exc:
        raise ConfigError(f"{path}: cannot be read as Arrow, cut short or damaged ({exc})") from None
    _check_stream_end(path, source, end, rows)


def _check_stream_end(path: Path, source: pa.MemoryMappedFile, end: int, rows: int) -> None:
    """ConfigError unless the stream's last message, ending at byte `end`, is followed by its
    end-of-stream marker and nothing else. pyarrow ends a stream at the end of the file without one:
    a file cut at a record batch's end (a copy or a write stopped there) read as fewer rows."""
    source.seek(end)
    tail = source.read(len(STREAM_END) + 1)
    if tail not in (STREAM_END, LEGACY_STREAM_END):
        found = "the file ends" if not tail else f"{source.size() - end} more bytes"
        raise ConfigError(f"{path}: after its {rows} rows (byte {end}) the Arrow stream's end marker is missing "
                          f"({found}): cut short")


def _select(table: pa.Table, columns: list[str]) -> pa.Table:
    """`columns` of an Arrow block; "image.path": a struct of that child alone, as Parquet reads it,
    so the image bytes beside it are neither paged in nor converted to Python (a part's job read
    every image of its rows to name them)."""
    return pa.table(dict(_column(table, name) for name in columns))


def _column(table: pa.Table, name: str) -> tuple[str, pa.ChunkedArray]:
    """(name, column) of an Arrow block's column `name`, or of its struct's child ("image.path"). A
    column whose own name holds a dot (a flattened dataset's "answers.text") is that column, as
    Parquet reads it: taken for a struct's child, it failed the scan with a bare KeyError."""
    if name in table.column_names:
        return name, table.column(name)
    parent, _, child = name.partition(".")
    column = table.column(parent)
    chunks = [pa.StructArray.from_arrays([chunk.field(child)], names=[child], mask=chunk.is_null())
              for chunk in column.chunks]
    return parent, pa.chunked_array(chunks, pa.struct([column.type.field(child)]))


# --- Column checks: each shard's schema, before any row is read. ---

def is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_string_values(t: pa.DataType) -> bool:
    """Strings, plain or dictionary-encoded (a pandas Categorical column, as to_parquet writes it):
    to_pylist gives the strings either way."""
    return is_text(t) or (pa.types.is_dictionary(t) and is_text(t.value_type))


def is_bytes(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)


def _struct_of(t: pa.DataType, names: tuple[str, ...]) -> bool:
    return pa.types.is_struct(t) and all(t.get_field_index(n) >= 0 for n in names)


def _is_messages(t: pa.DataType) -> bool:
    """A list of {role, content} structs, or of ShareGPT's {from, value}."""
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
        _struct_of(t.value_type, ("role", "content")) or _struct_of(t.value_type, ("from", "value")))


def _is_image(t: pa.DataType) -> bool:
    return is_bytes(t) or is_text(t) or (_struct_of(t, ("bytes",)) and is_bytes(t.field("bytes").type))


def _is_token_ids(t: pa.DataType) -> bool:
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return lists and pa.types.is_integer(t.value_type)


def _is_scalar(t: pa.DataType) -> bool:
    return _is_string_values(t) or pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_label(t: pa.DataType) -> bool:
    """Strings, numbers (floats too, as JSON lines' labels: pandas writes an integer column with a
    missing value as floats, and STS-B's `label` is a score; each was refused, the dataset with it,
    though no label was asked for), booleans, or dictionary-encoded ones."""
    return (is_text(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
            or pa.types.is_null(t) or pa.types.is_dictionary(t))


def _is_json(t: pa.DataType) -> bool:
    """Values JSON holds at every depth: a struct's fields and a list's or map's items too. Checked at
    the top only, a struct holding a date or a list of decimals passed, and the part's samples.jsonl
    failed after the model ran (json.dumps: a TypeError naming no column)."""
    if is_bytes(t) or pa.types.is_fixed_size_binary(t) or pa.types.is_temporal(t) or pa.types.is_decimal(t):
        return False
    if pa.types.is_dictionary(t):
        return _is_json(t.value_type)
    return all(_is_json(t.field(i).type) for i in range(t.num_fields))


def image_field(source: Source, fields: Fields, schema: pa.Schema) -> str | None:
    """The image column: dataset.image_field; `image` for an image_table; and for an auto table
    with no `text` column (and no messages_field) an `image` column, as the Hub's vision sets have."""
    if fields.image or source.image_table:
        return fields.image or "image"
    auto = fields.messages is None and fields.tokens is None and fields.text == "text" and "text" not in schema.names
    return "image" if auto and "image" in schema.names and _is_image(schema.field("image").type) else None


def check_columns(path: Path, fields: Fields, schema: pa.Schema) -> None:
    """ConfigError naming the file and column if a column the config reads is missing or mistyped."""
    wanted = [("dataset.image_field", fields.image, _is_image, "image bytes, a {bytes, path} struct or a path")]
    if fields.tokens:
        wanted = [("dataset.tokens_field", fields.tokens, _is_token_ids, "a list of integers (token ids)")]
    elif fields.template:
        wanted = [("dataset.prompt_template", name, _is_scalar, "strings or numbers") for name in fields.prompts]
    elif not fields.image:
        messages = "a list of {role, content} (or ShareGPT's {from, value})"
        wanted = [("dataset.messages_field", fields.messages, _is_messages, messages)
                  if fields.messages else ("dataset.text_field", fields.text, _is_string_values, "a string column")]
    if fields.label_required or fields.label in schema.names:
        wanted.append(("dataset.label_field", fields.label, _is_label, "strings, numbers or a ClassLabel"))
    kept = "JSON values (no bytes, dates or decimals, nested ones too)"
    wanted += [("dataset.keep_fields", k, _is_json, kept) for k in fields.keep or ()]
    for key, name, ok, expected in wanted:
        if name not in schema.names:
            ids = [n for n in schema.names if key == "dataset.text_field" and _is_token_ids(schema.field(n).type)]
            ids.sort(key=lambda n: n not in ("input_ids", "tokens"))  # before an attention_mask
            hint = f" (token ids in {ids[0]!r}: set dataset.tokens_field)" if ids else ""
            raise ConfigError(f"{path}: no column {name!r} ({key}); columns: {', '.join(schema.names)}{hint}")
        if not ok(schema.field(name).type):
            raise ConfigError(f"{path}: column {name!r} ({key}) is {schema.field(name).type}, expected {expected}")


def with_classes(source: Source, fields: Fields, schema: pa.Schema | None) -> Fields:
    """`fields` with the label column's ClassLabel names (Fields.classes) from the Hugging Face
    features (save_to_disk's dataset_info.json, a Hub repository's README.md dataset_info, or the
    `huggingface` schema metadata the Hub writes in Parquet/Arrow, of the first shard's `schema`:
    table_schemas checks every shard's agrees; JSON lines: None), unchanged where the label is no
    ClassLabel."""
    features, where = _features(source, schema)
    names = class_label_names(features, fields.label, where)
    return fields if names is None else replace(fields, classes=tuple(names), classes_from=where)


def _features(source: Source, schema: pa.Schema | None) -> tuple[dict[str, Any], str]:
    """The Hugging Face features (dataset_info.json's or README.md's, which datasets casts the data
    files to, else the first shard's schema metadata's: _schema_features) and where they were read;
    ConfigError naming the file when they are no JSON object (a bare AttributeError named nothing)."""
    if not source.features:
        return _schema_features(source.files[0], schema) if schema is not None else ({}, "")
    where = f"{source.features_file}: features"
    if not isinstance(source.features, dict):
        raise ConfigError(f"{where}: must be a JSON object of features by column, got "
                          f"{json.dumps(source.features):.80}")
    return source.features, where


def _schema_features(path: Path, schema: pa.Schema) -> tuple[dict[str, Any], str]:
    """The info.features of shard `path`'s `huggingface` schema metadata, and where they were read;
    ({}, "") for a shard without it (written by pandas, polars or pyarrow). ConfigError naming the
    file where they are not JSON, or no object (a bare JSONDecodeError named nothing)."""
    if not schema.metadata or b"huggingface" not in schema.metadata:
        return {}, ""
    where = f"{path}: schema metadata 'huggingface'"
    try:
        features = json.loads(schema.metadata[b"huggingface"])
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    for key in ("info", "features"):
        features = features.get(key, {}) if isinstance(features, dict) else features
    where += " info.features"
    if not isinstance(features, dict):
        raise ConfigError(f"{where}: must be a JSON object of features by column, got {json.dumps(features):.80}")
    return features, where


def _check_shard_classes(source: Source, fields: Fields, schemas: list[pa.Schema]) -> None:
    """ConfigError naming two files whose features give the label column different ClassLabels
    (fields.classes: the README's or dataset_info.json's, else the first shard's). The labels were
    numbered by those names alone, so a shard written by another tool, with other names or none,
    was read with the wrong ones without a word. Under a README or dataset_info.json a shard may
    declare none (pandas' Parquet): datasets casts it to their features."""
    for path, schema in zip(source.files, schemas):
        features, where = _schema_features(path, schema)
        names = class_label_names(features, fields.label, where)
        if (names is None and source.features) or (None if names is None else tuple(names)) == fields.classes:
            continue
        other = (fields.classes_from if fields.classes else f"{source.features_file}: features" if source.features
                 else f"{source.files[0]}: schema metadata")
        raise ConfigError(f"{where or f'{path} (no huggingface schema metadata)'} makes column {fields.label!r} "
                          f"{_classes(names)}, but {other} makes it {_classes(fields.classes)}: every shard's features "
                          f"must agree (write the shards with one tool, or drop the metadata that differs)")


def _classes(names: Any) -> str:
    return f"a ClassLabel of names {', '.join(names):.120}" if names else "no ClassLabel"


# --- Rows. ---

def table_schemas(source: Source, fields: Fields) -> list[pa.Schema]:
    """Every shard's schema, each checked for the columns the config reads (check_columns)."""
    schemas = [schema_of(source.format, path, _text_columns(fields)) for path in source.files]
    for path, schema in zip(source.files, schemas):
        check_columns(path, fields, schema)
    _check_shard_classes(source, fields, schemas)
    if fields.classes is None:  # a ClassLabel's: ids or names (_check_class_ids)
        _check_label_kinds(source, fields, schemas)
    return schemas


def _check_label_kinds(source: Source, fields: Fields, schemas: list[pa.Schema]) -> None:
    """ConfigError naming two shards whose label columns hold different kinds of value (numbers in
    one, strings or booleans in another, as CSV shards' inferred types differ): label 1 and "1" were
    two classes, and True one with 1, without a word. A shard of null labels has no kind; integers
    and floats are one (1 and 1.0 are one label, as in JSON lines)."""
    first: tuple[Path, pa.DataType] | None = None
    for path, schema in zip(source.files, schemas):
        kind = schema.field(fields.label).type if fields.label in schema.names else pa.null()
        if pa.types.is_null(kind):
            continue
        if first is None:
            first = (path, kind)
        elif _label_kind(kind) != _label_kind(first[1]):
            raise ConfigError(f"{path}: column {fields.label!r} (dataset.label_field) is {kind}, but {first[0]}'s is "
                              f"{first[1]}: every shard's labels must be of one kind (numbers, strings or booleans)")


def _label_kind(t: pa.DataType) -> str:
    value = t.value_type if pa.types.is_dictionary(t) else t
    number = pa.types.is_integer(value) or pa.types.is_floating(value)
    return "number" if number else "boolean" if pa.types.is_boolean(value) else "string"


def scan_table(source: Source, fields: Fields, schemas: list[pa.Schema], limit: int | None) -> tuple[int, list]:
    """(rows, labels) of the first `limit` rows: rows from the files' metadata, labels from the
    features' ClassLabel names or else the label column alone."""
    counts, n_rows = [], 0
    for path in source.files:
        counts.append(count_rows(source.format, path))
        n_rows += counts[-1]
        if limit is not None and n_rows >= limit:
            n_rows = limit
            break
    if not fields.image:
        _check_prompts(source, fields, n_rows)
    if source.format == "csv" and fields.keep:
        _convert_csv_kept(source, fields, n_rows)
    if fields.classes is not None:
        _check_class_ids(source, fields, schemas, counts, n_rows)
        return n_rows, list(fields.classes)
    if not any(fields.label in schema.names for schema in schemas):
        return n_rows, []
    return n_rows, label_list(_labels(source, fields, schemas, counts, n_rows))


def _check_prompts(source: Source, fields: Fields, n_rows: int) -> None:
    """ConfigError naming the first of the first `n_rows` rows whose prompt is null (or NaN or infinite), or whose chat
    messages are no list of messages (checked_messages, as rendering checks them), as the part's
    job reading it would, but before any part's job starts. Parquet: row groups whose footer counts
    no null in a string column are not read; other blocks (a messages column's every one: it has
    several leaves) are read for the prompt's columns alone (a template's each)."""
    for column in fields.prompts:  # a template's columns, else the one prompt column
        start = 0
        for path in source.files:
            shard_start, known = start, _footer_null_counts(source.format, path, column, fields.vocab)
            for block, (size, read) in enumerate(_blocks_to(source.format, path, [column], _text_columns(fields),
                                                             n_rows - start)):
                if (known[block] if block < len(known) else None) != 0:
                    values, shard = read().column(column).slice(0, n_rows - start), f"{source.name(path)}#"
                    row = _first_missing(values)
                    if row >= 0:
                        raise ConfigError(f"{source.root}: {shard}{start - shard_start + row}, column {column!r}: "
                                          f"{_missing(values[row].as_py())} where a prompt is needed")
                    if column == fields.messages:
                        _check_messages(source, values, shard, start - shard_start, column)
                    if column == fields.tokens and (row := _first_bad_ids(values, fields.vocab)) >= 0:
                        where = f"{source.root}: {shard}{start - shard_start + row}, column {column!r}"
                        refuse_past_vocab(int(token_ids(values[row], f"{where} (dataset.tokens_field)").max()),
                                          fields.vocab, where)
                start += size


def _convert_csv_kept(source: Source, fields: Fields, n_rows: int) -> None:
    """Converts a CSV's keep_fields columns through the blocks of its first `n_rows` rows, as a part's
    job does: their types are inferred from the first block, and a value a later block holds that
    the type cannot (a word in a column of numbers) failed the part's job of its rows alone, after
    the parts before (_csv_batches names the file and column)."""
    start = 0
    for path in source.files:
        for size, _ in _blocks_to(source.format, path, list(fields.keep or ()), _text_columns(fields), n_rows - start):
            start += size


def _first_missing(values: pa.ChunkedArray) -> int:
    """The first row of a prompt column that is no value (_missing: null, NaN or infinite), else -1."""
    import pyarrow.compute as pc

    missing = pc.is_null(values, nan_is_null=True)
    if pa.types.is_floating(values.type):
        missing = pc.or_kleene(missing, pc.is_inf(values))
    return pc.index(missing, True).as_py()


def _first_bad_ids(values: pa.ChunkedArray, vocab: int | None) -> int:
    """The first row of a token-id column whose ids token_ids refuses, else -1: no ids (`[]`), a null
    id, one below 0 or past int64 (null rows: _first_missing's), or one at or past `vocab` (the model's
    vocab_size, when the scan knows it). The scan passed them, and each failed only in its part's job,
    after the model was loaded on a GPU node."""
    import pyarrow.compute as pc

    lists = values.combine_chunks()
    empty = pc.index(pc.equal(pc.list_value_length(lists), 0), True).as_py()
    ids = pc.list_flatten(lists)
    bad = pc.or_kleene(pc.is_null(ids), pc.less(ids, pa.scalar(0, ids.type)))  # a bare 0 is cast as int64
    most = _most_id(vocab)
    if most < np.iinfo(ids.type.to_pandas_dtype()).max:
        bad = pc.or_kleene(bad, pc.greater(ids, pa.scalar(most, ids.type)))
    first = pc.index(bad, True).as_py()
    bad_row = pc.list_parent_indices(lists)[first].as_py() if first >= 0 else -1
    return min((row for row in (empty, bad_row) if row >= 0), default=-1)


def _check_messages(source: Source, values: pa.ChunkedArray, shard: str, first: int, column: str) -> None:
    """ConfigError naming the first row of a block of the messages column whose value is no list of
    chat messages (checked_messages: what rendering the row checks); `first`: the block's first row
    in its shard. Before, a part's job found it when it rendered the row, after the parts before.
    Converted to Python a slice at a time (_python_values): GBs of dicts for a whole row group."""
    for row, messages in enumerate(_python_values(values)):
        checked_messages(messages, f"{source.root}: {shard}{first + row}, column {column!r}")


def _python_values(values: pa.ChunkedArray) -> Iterator[Any]:
    """`values` as Python objects, CHECK_ROWS converted at a time: a row group is 1Mi rows by pyarrow's
    default, whole a list of them all (chat messages' dicts, labels' strings) in memory at once."""
    for offset in range(0, len(values), CHECK_ROWS):
        yield from values.slice(offset, CHECK_ROWS).to_pylist()


def _check_class_ids(source: Source, fields: Fields, schemas: list[pa.Schema], counts: list[int], n_rows: int) -> None:
    """ConfigError naming the first of the first `n_rows` rows whose label is not of its ClassLabel
    (fields.classes): an integer id past its names (-1: Hugging Face's row without a label), or a
    string none of its names (class_name: datasets casts a Parquet column of names to their ids).
    The samples' labels come from the names, and such a label (or any value of a column of floats
    or booleans) was read as no label, without a word. `counts`: each shard's rows."""
    start = 0
    for path, schema, count in zip(source.files, schemas, counts):
        shard_start = start
        kind = schema.field(fields.label).type if fields.label in schema.names else pa.null()
        if pa.types.is_null(kind):
            start += count
            continue
        # floats: pandas writes an integer column with a missing value so (class_name reads whole ones as ids)
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)) and _label_kind(kind) != "string":
            raise ConfigError(f"{path}: column {fields.label!r} is {kind}, but the features make it a ClassLabel, "
                              f"whose values are integer ids or names of its classes")
        for size, read in blocks(source.format, path, [fields.label]):
            if start >= n_rows:
                return
            labels = _label_column(source.format, read().column(fields.label)).slice(0, n_rows - start)
            _check_block_classes(labels, fields, f"{source.root}: {source.name(path)}#", start - shard_start)
            start += size


def _check_block_classes(labels: pa.ChunkedArray, fields: Fields, shard: str, first: int) -> None:
    """ConfigError naming the first label of a block (its first row `first` of `shard`) that is not
    of the ClassLabel: integer ids compared at once, names looked up one by one (class_name)."""
    import pyarrow.compute as pc

    n_names = len(fields.classes or ())
    if not pa.types.is_integer(labels.type):
        for row, label in enumerate(_python_values(labels), first):
            class_name(label, fields, f"{shard}{row}")
        return
    row = pc.index(pc.or_(pc.less(labels, -1), pc.greater_equal(labels, n_names)), True).as_py()
    if row >= 0:
        raise ConfigError(f"{shard}{first + row}, column {fields.label!r}: class id {labels[row]} names no class (its "
                          f"ClassLabel has {n_names} names: ids 0 to {n_names - 1}; -1 is no label)")


def _footer_null_counts(fmt: str, path: Path, column: str, vocab: int | None = None) -> list[int | None]:
    """A Parquet file's null count of `column` in each row group, from its footer's statistics (None
    where not recorded). A list of token ids is stored as one leaf column (ids.list.element), whose
    count also counts null and empty lists and null ids: 0 there is no null row too, where its
    min and max hold the ids in token_ids' range, below `vocab` (_ids_in_range; else None). [] for other
    formats, a column of several leaves (chat messages) or of floats (a NaN is no null in the
    footer, and is one in a prompt), whose blocks are read instead."""
    if fmt != "parquet":
        return []
    import pyarrow.parquet as pq
    parquet = pq.ParquetFile(path)
    if pa.types.is_floating(parquet.schema_arrow.field(column).type):
        return []
    metadata = parquet.metadata
    counts = []
    for group in range(metadata.num_row_groups):
        chunks = [chunk for chunk in map(metadata.row_group(group).column, range(metadata.num_columns))
                  if chunk.path_in_schema == column or chunk.path_in_schema.startswith(column + ".")]
        if len(chunks) != 1:
            return []
        stats = chunks[0].statistics
        ids = chunks[0].path_in_schema != column  # a list's ids (token ids): their range counts too
        known = stats is not None and stats.has_null_count and (not ids or _ids_in_range(stats, vocab))
        counts.append(stats.null_count if known else None)
    return counts


def _ids_in_range(stats: Any, vocab: int | None) -> bool:
    """Whether a token-id leaf's statistics bound its ids to 0..int64's max, as token_ids takes them,
    and below `vocab` when known: its null count alone let a row group of an id below 0 pass the scan
    unread."""
    return stats.has_min_max and stats.min >= 0 and stats.max <= _most_id(vocab)


def _most_id(vocab: int | None) -> int:
    """The largest token id the scan takes: below the model's vocab_size, else int64's largest."""
    return vocab - 1 if vocab is not None else int(np.iinfo(np.int64).max)



def _labels(source: Source, fields: Fields, schemas: list[pa.Schema], counts: list[int],
            n_rows: int) -> Iterator[Any]:
    """The labels of the first `n_rows` rows, read from the label column alone (a shard without
    one, of `count` rows, has none), converted to Python a slice at a time (_python_values).
    ConfigError naming the row of an infinite label: the scan's JSON cannot hold it, and every
    part's job failed reading the scan, naming no row."""
    for path, schema, count in zip(source.files, schemas, counts):
        if fields.label not in schema.names:
            n_rows -= count
            continue
        first = 0  # the block's first row in its shard
        for size, read in _blocks_to(source.format, path, [fields.label], _text_columns(fields), n_rows):
            labels = _label_column(source.format, read().column(fields.label)).slice(0, n_rows)
            for row, label in enumerate(_python_values(labels), first):
                if isinstance(label, float) and math.isinf(label):
                    raise ConfigError(f"{source.root}: {source.name(path)}#{row}, column {fields.label!r}: label "
                                      f"{label}; a row without a label has null (or NaN) there")
                yield label
            n_rows -= size
            first += size


def _label_column(fmt: str, labels: pa.ChunkedArray) -> pa.ChunkedArray:
    """A block's label column, a row without a label null: a float column's NaN, which pandas writes
    for a missing label in a column of numbers (each NaN would be a class of its own), and a CSV's
    empty string: CSV has no null but the empty value, which csv.writer writes for None and pandas'
    to_csv for a missing label (and pandas, so Hugging Face, reads back as one). As a string it was a
    class "" of its own, without a word; in a column of integers pyarrow reads it as null already."""
    import pyarrow.compute as pc

    if pa.types.is_floating(labels.type):
        return pc.if_else(pc.is_nan(labels), pa.scalar(None, labels.type), labels)
    if fmt != "csv" or not is_text(labels.type):
        return labels
    return pc.if_else(pc.equal(labels, ""), pa.scalar(None, labels.type), labels)


def read_table(source: Source, fields: Fields, schemas: list[pa.Schema], rows: range) -> list[Sample]:
    """The samples of `rows`; blocks before and after them are not converted (Parquet: not read)."""
    samples: list[Sample] = []
    start = 0  # sample_idx of the block's first row
    for shard, (path, schema) in enumerate(zip(source.files, schemas)):
        columns, shard_start = _columns(fields, schema), start
        for block, (size, read) in enumerate(_blocks_to(source.format, path, columns, _text_columns(fields),
                                                         rows.stop - start)):
            if start + size > rows.start:
                first, stop = max(rows.start - start, 0), min(rows.stop - start, size)
                # Only the rows wanted are converted to Python: a Parquet row group is 1Mi rows by
                # pyarrow's default, and a part may want a few of them.
                row_of = _row_reader(source, fields, read().slice(first, stop - first), f"{source.name(path)}#",
                                     start - shard_start + first)
                for row in range(first, stop):
                    text, label, kept, tokens = row_of(row - first)
                    ref = (shard, block, row) if fields.image else None
                    samples.append(Sample(start + row, text, label, kept, ref, tokens))
            start += size
    return samples


def _columns(fields: Fields, schema: pa.Schema) -> list[str]:
    """Columns read for the samples. Images: only the struct's path (the bytes are read when decoded)."""
    if fields.image:
        kind = schema.field(fields.image).type
        first = [f"{fields.image}.path"] if _struct_of(kind, ("path",)) else [fields.image] if is_text(kind) else []
    else:
        first = list(fields.prompts)
    label = [fields.label] if fields.label in schema.names else []
    return list(dict.fromkeys(first + label + list(fields.keep or ())))


def _row_reader(source: Source, fields: Fields, table: pa.Table, shard: str,
                start: int) -> Callable[[int], tuple[str, Any, dict, np.ndarray | None]]:
    """row -> (text, label, kept fields, token ids) for rows of one block (`table`, its first row
    `start` in the shard), its columns converted to Python once; token ids stay Arrow data until a
    row's are asked for (Python ints take 4x the memory)."""
    ids = table.column(fields.tokens).combine_chunks() if fields.tokens else None
    values = {name: table.column(name).to_pylist() for name in table.column_names
              if name != fields.tokens or name in (fields.keep or ())}
    labels = (_label_column(source.format, table.column(fields.label)).to_pylist() if fields.label in values
              else [None] * table.num_rows)
    if fields.classes is not None:  # ids or names, as the scan checked them
        labels = [class_name(v, fields, f"{source.root}: {shard}{start + row}") for row, v in enumerate(labels)]

    def text(row: int) -> str:
        if fields.image:
            value = values.get(fields.image, [None] * table.num_rows)[row]
            value = value.get("path") if isinstance(value, dict) else value
            return value or f"{shard}{start + row}"
        if fields.tokens:
            return ""  # the ids' text, decoded by the model's tokenizer (extract.inputs.given_token_ids)
        if fields.template:
            for name in fields.prompts:
                if missing := _missing(values[name][row]):
                    raise ConfigError(f"{source.root}: {shard}{start + row}, column {name!r}: {missing} where a "
                                      f"prompt is needed")
            return fields.template.format_map({name: values[name][row] for name in fields.prompts})
        value = values[fields.prompt][row]
        where = f"{source.root}: {shard}{start + row}, column {fields.prompt!r}"
        if value is None:
            raise ConfigError(f"{where}: null where a prompt is needed")
        return fields.render(value, where) if fields.render else value

    def tokens(row: int) -> np.ndarray | None:
        return None if ids is None else token_ids(ids[row], f"{source.root}: {shard}{start + row}, column "
                                                            f"{fields.tokens!r} (dataset.tokens_field)")

    return lambda row: (text(row), labels[row], {k: values[k][row] for k in fields.keep or ()}, tokens(row))


def _missing(value: Any) -> str | None:
    """"null", "NaN" or "Infinity" (JSON's spelling) for a template field's value that is no value (a
    float column's NaN, as pandas and polars write a missing number, rendered as the text "nan"; an
    infinity rendered as "inf"), else None."""
    if value is None:
        return "null"
    return json.dumps(value) if isinstance(value, float) and not math.isfinite(value) else None


def token_ids(value: pa.Scalar, where: str) -> np.ndarray:
    """One row's token ids as int64; ConfigError naming `where` unless they are whole numbers from 0."""
    if not value.is_valid:
        raise ConfigError(f"{where}: null where a prompt is needed")
    ids = value.values
    if not len(ids) or ids.null_count:
        raise ConfigError(f"{where}: {'a null token id' if len(ids) else 'no token ids'}")
    array = ids.to_numpy().astype(np.int64)  # a uint64 id past int64 wraps below 0, and is named
    if array.min() < 0:
        raise ConfigError(f"{where}: token id {ids[int(array.argmin())]} is not a whole number from 0")
    return array
