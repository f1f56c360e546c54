"""JSON lines files: one JSON object per line (blank lines skipped), or a file holding one JSON
array of objects (json_array.py), read row by row in two passes: the scan parses and checks every
row for the row count and the labels, marking where rows start every MARK_CHARS of text; a job
then reads its rows from the mark before them."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import IO, Any, Callable, Iterator, NamedTuple

import numpy as np
from isal import isal_zlib
from tqdm import tqdm

from actstore.datasets.chat import checked_messages, refuse_repeated_message_keys
from actstore.datasets.core import (Fields, Sample, check_unicode, checked_label, class_name, one_kind,
                                    refuse_past_vocab, refuse_repeated)
from actstore.datasets.json_array import MAX_ELEMENT_CHARS, ArrayError, elements, starts_array
from actstore.datasets.scan import Mark, Scan, mark_before, scan_labels
from actstore.datasets.source import COMPRESSED_SUFFIXES
from actstore.errors import ConfigError

MARK_CHARS = 1 << 20  # text between marks: what a job reads past, at most, before its first row
# A line longer than this is named rather than read whole: a file of one JSON object on one line
# (SQuAD's {"data": [...]}) of gigabytes held them all, twice, before its first field was checked.
MAX_LINE_CHARS = MAX_ELEMENT_CHARS
FIRST = Mark(0, 0, 0, 0)


def scan_jsonl(files: tuple[Path, ...], fields: Fields, limit: int | None, progress: bool = False,
               mark_chars: int = MARK_CHARS) -> Scan:
    """The scan of the first `limit` rows, each parsed and checked for the fields the config reads;
    no row is kept, so memory holds one line (or array element), the distinct labels and the marks.
    Labels under a ClassLabel (fields.classes) are its names, label_id its class id, in every split."""
    n_rows, labels, marks, chars, first = 0, {}, [FIRST], 0, None
    # Text read, against the files' sizes (unknown for compressed files, whose text is larger).
    total = None if any(map(_compressed, files)) else sum(path.stat().st_size for path in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="scan dataset", disable=not progress) as bar:
        for row in _rows(files, FIRST):
            if limit is not None and n_rows >= limit:
                break
            parsed = _checked(row, fields)
            label = _label(parsed, fields, row.where)
            first = one_kind(first, label, row.where)
            labels[label] = None
            n_rows += 1
            chars += row.chars
            if chars >= mark_chars:
                marks.append(Mark(n_rows, row.file, row.position(), row.number))
                bar.update(chars)
                chars = 0
    return Scan(n_rows, scan_labels(labels, fields), tuple(marks))


def read_jsonl(files: tuple[Path, ...], fields: Fields, rows: range, scan: Scan) -> list[Sample]:
    """The samples of `rows`, read from the scan's last mark before them: the lines between are
    counted, not parsed (an array's elements are parsed to find where each ends)."""
    mark = mark_before(scan, rows.start)
    samples: list[Sample] = []
    for sample_idx, row in enumerate(_rows(files, mark), start=mark.row):
        if sample_idx >= rows.stop:
            break
        if sample_idx >= rows.start:
            parsed = _checked(row, fields)
            samples.append(Sample(sample_idx, _prompt(parsed, fields, row.where),
                                  _label(parsed, fields, row.where), _kept(parsed, fields),
                                  tokens=np.asarray(parsed[fields.tokens], np.int64) if fields.tokens else None))
    return samples


class Row(NamedTuple):
    file: int
    number: int  # its line (JSON lines) or element (an array) in the file, from 1
    where: str  # for errors: file:line, or file: element N
    item: Any  # the line's text, or the element's value (parsed to find its end)
    text: str  # the row's JSON text: the line, or the element's
    position: Callable[[], int]  # where the next row starts: a Mark's position

    @property
    def noun(self) -> str:
        return "line" if isinstance(self.item, str) else "element"

    @property
    def chars(self) -> int:
        return len(self.text)


def _rows(files: tuple[Path, ...], start: Mark) -> Iterator[Row]:
    """Every row from `start` on: each non-blank line of a JSON lines file, or each element of a
    file holding one JSON array (json_array.py)."""
    for file in range(start.file, len(files)):
        begin = start if file == start.file else FIRST
        number = begin.line  # the last element read: the one after it is named when it cannot be parsed
        try:
            if _is_array(files[file]):
                with open_bytes(files[file]) as fh:
                    for number, value, text, position in elements(fh, begin.position, begin.line):
                        yield Row(file, number, f"{files[file]}: element {number}", value, text, position)
            else:
                yield from _lines(files, file, begin)
        except ArrayError as exc:
            raise ConfigError(f"{files[file]}: not one JSON array of objects: {exc}") from None
        except RecursionError:  # in elements(), which parses each element as _parse parses a line
            raise ConfigError(f"{files[file]}: element {number + 1}: not valid JSON (nested too deeply to "
                              f"parse)") from None
        except UnicodeDecodeError:
            raise not_utf8(files[file]) from None
        except (EOFError, ValueError) as exc:  # a .gz or .zst file cut short or damaged (_decompressed_blocks)
            raise ConfigError(f"{files[file]}: cannot be decompressed ({exc})") from None


def _is_array(path: Path) -> bool:
    """Whether the file's text starts with `[` (a compressed file's start decompressed unchecked:
    a damaged or cut file is named by the read that follows, with its line)."""
    if not _compressed(path):
        with path.open("rb") as fh:
            return starts_array(fh.read(4096))
    for block in _decompressed_blocks(path, HEAD_BYTES):  # a zstd block gives nothing until it is whole
        if block.strip():
            return starts_array(block)
    return False


HEAD_BYTES = 1 << 20  # compressed bytes _is_array decompresses, at most, to find the text's first character


def _lines(files: tuple[Path, ...], file: int, start: Mark) -> Iterator[Row]:
    """The non-blank lines of JSON lines file `file` from `start`; a row's position is the file's
    tell() just after its line, where the next line starts."""
    with open_text(files[file]) as fh:
        line_no = 0
        try:
            fh.seek(start.position)
            line_no = start.line
            while line := fh.readline(MAX_LINE_CHARS + 1):  # not `for line in fh`, which disables tell()
                line_no += 1
                if len(line) > MAX_LINE_CHARS:
                    raise ConfigError(f"{files[file]}:{line_no}: a line longer than {MAX_LINE_CHARS} characters, "
                                      f"not a JSON lines row")
                if line.strip():
                    yield Row(file, line_no, f"{files[file]}:{line_no}", line, line, fh.tell)
        except UnicodeDecodeError:
            raise  # named by _rows
        except (EOFError, ValueError) as exc:  # a .gz or .zst file cut short or damaged (_decompressed_blocks)
            raise ConfigError(f"{files[file]}: cannot be decompressed after line {line_no} ({exc})") from None


def open_text(path: Path) -> IO[str]:
    """A JSONL file as UTF-8 text; a .gz or .zst file decompressed as it is read. Positions (tell,
    seek) are in the decompressed text, so the scan's marks work alike: a compressed stream cannot
    be entered midway, so seeking to one decompresses the file up to it. A UTF-8 byte order mark
    at its start (files saved on Windows) is skipped, as Hugging Face's json loader skips it."""
    return io.TextIOWrapper(open_bytes(path), encoding="utf-8-sig")


def _compressed(path: Path) -> bool:
    return path.suffix.lower() in COMPRESSED_SUFFIXES


def open_bytes(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed when it is .gz or .zst."""
    return io.BufferedReader(_Decompressed(path)) if _compressed(path) else path.open("rb")


class _Decompressed(io.RawIOBase):
    """A compressed file's decompressed bytes, seekable as text files need (TextIOWrapper's tell()
    and seek()): a seek forward reads up to the position, one backward starts the file again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._start()

    def _start(self) -> None:
        self.blocks, self.block, self.offset, self.position = _decompressed_blocks(self.path), b"", 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self.offset == len(self.block):
            block = next(self.blocks, None)
            if block is None:
                return 0
            self.block, self.offset = block, 0
        n = min(len(buffer), len(self.block) - self.offset)
        buffer[:n] = self.block[self.offset:self.offset + n]
        self.offset += n
        self.position += n
        return n

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_SET:
            raise io.UnsupportedOperation("a decompressed stream seeks to absolute positions only")
        if position < self.position:
            self.blocks.close()
            self._start()
        if self.position < position:
            skipped = memoryview(bytearray(min(1 << 20, position - self.position)))
            while self.position < position and self.readinto(skipped[:position - self.position]):
                pass
        return self.position

    def close(self) -> None:
        self.blocks.close()
        super().close()


COMPRESSED_INPUT = 4096  # compressed bytes one call decompresses: its output is at most ~32768x that (zstd RLE)


def _decompressed_blocks(path: Path, limit: int | None = None) -> Iterator[bytes]:
    """The decompressed bytes of a .gz or .zst file (its members or frames one after another), a
    block at a time, memory bounded whatever the ratio; EOFError when the file ends inside a member
    or frame (cut short: never fewer rows in silence), ValueError when its data is not that format's or
    fails its checksum (gzip always has one; zstd where the writer kept it, as the zstd tool does).
    `limit`: decompress the first `limit` bytes of the file alone (an estimate's sample; not checked)."""
    # padding: bytes skipped after a member, as Python's gzip skips zeros (some tools pad a .gz to a block)
    if path.suffix.lower() == ".gz":
        new, errors, padding = lambda: isal_zlib.decompressobj(wbits=31), isal_zlib.error, b"\0"  # isal: ~3x zlib
    else:
        import zstandard  # only where a dataset is .zst
        new, errors, padding = lambda: zstandard.ZstdDecompressor().decompressobj(), zstandard.ZstdError, b""
    try:
        with path.open("rb") as fh:
            stream, inside, ended, left = new(), False, False, limit
            while data := fh.read(COMPRESSED_INPUT if left is None else min(COMPRESSED_INPUT, left)):
                left = None if left is None else left - len(data)
                while data := data.lstrip(padding) if ended and not inside else data:
                    yield stream.decompress(data)
                    data, inside = b"", True
                    if stream.eof:  # the next member or frame (bgzip, pzstd, appended files) in what is left
                        data, stream, inside, ended = stream.unused_data, new(), False, True
            if inside and limit is None:
                raise EOFError(f"the file ends inside a compressed {path.suffix[1:]} stream (cut short)")
    except errors as exc:
        raise ValueError(f"damaged {path.suffix[1:]} data: {exc}") from None


ESTIMATE_FILES = 8  # files whose starts give size_estimate's sample, spread over the dataset
ESTIMATE_BYTES = 4 << 20  # bytes read from each one's start (compressed bytes, for a compressed file)


def size_estimate(files: tuple[Path, ...], arrays: bool = False) -> tuple[int, int]:
    """(lines, bytes of text) of JSONL or CSV `files`, for resource requests at parse time, which every
    Snakemake parse on every node computes and so must not read the dataset: the lines and text of
    the first ESTIMATE_BYTES of up to ESTIMATE_FILES files spread over the dataset, scaled by the
    files' sizes. Exact when that reads every file whole (a compressed one's text: decompressed).
    `arrays` (JSON rows): a file holding a JSON array counts the elements whole in its start, not
    its lines (one line may hold them all, or an element span many)."""
    sizes = [path.stat().st_size for path in files]
    k = min(ESTIMATE_FILES, len(files))
    picked = sorted({i * (len(files) - 1) // max(k - 1, 1) for i in range(k)})  # the first, the last, between
    lines = text = 0
    for i in picked:
        if _compressed(files[i]):
            blocks: Iterator[bytes] = _decompressed_blocks(files[i], ESTIMATE_BYTES)
        else:
            with files[i].open("rb") as fh:
                blocks = iter([fh.read(ESTIMATE_BYTES)])
        head = b"".join(blocks)
        lines += _elements_in(head) if arrays and starts_array(head) else head.count(b"\n")
        text += len(head)
    scale = sum(sizes) / max(sum(min(sizes[i], ESTIMATE_BYTES) for i in picked), 1)
    return round(lines * scale), round(text * scale)


def _elements_in(head: bytes) -> int:
    """The elements whole in the start of a JSON array file."""
    count = 0
    try:
        for count, *_ in elements(io.BytesIO(head)):
            pass
    # the start ends inside an element (or a character), or an element is nested too deeply to parse
    # (the scan names it; at parse time a bare RecursionError stopped every Snakemake run)
    except (ArrayError, UnicodeDecodeError, RecursionError):
        pass
    return count


def not_utf8(path: Path) -> ConfigError:
    """The error naming the first line that is not UTF-8 (text mode decodes ahead, by blocks)."""
    with open_bytes(path) as fh:
        for line_no, line in enumerate(fh, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return ConfigError(f"{path}:{line_no}: not UTF-8 text (byte {exc.start + 1} of the line: {exc.reason})")
    return ConfigError(f"{path}: not UTF-8 text")


def _checked(row: Row, fields: Fields) -> dict[str, Any]:
    """The row parsed (_parse) and checked for the fields the config reads (refuse_repeated, _check), a
    chat row's messages for keys given twice (refuse_repeated_message_keys)."""
    parsed = _parse(row.item, row.where, row.noun)
    refuse_repeated(row.text, fields.json_names, row.where, row.noun)
    _check(parsed, fields, row.where, row.noun)
    if fields.messages is not None:  # a list of objects, as _check found it
        refuse_repeated_message_keys(row.text, fields.messages, parsed[fields.messages], row.where)
    return parsed


def _parse(item: Any, where: str, noun: str) -> dict[str, Any]:
    """A row: a line's JSON parsed, or an array's element (parsed already); ConfigError unless an object."""
    try:
        row = json.loads(item) if isinstance(item, str) else item
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from None
    except ValueError as exc:  # a whole number of over 4300 digits: Python refuses it, naming no line
        raise ConfigError(f"{where}: cannot be read ({exc})") from None
    except RecursionError:  # json recurses once a level: ~1000 nested lists crashed naming no line
        raise ConfigError(f"{where}: not valid JSON (nested too deeply to parse)") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: {noun} is not a JSON object")
    return row


def _check(row: dict[str, Any], fields: Fields, where: str, noun: str) -> None:
    """ConfigError naming the line (or element) and field if the row lacks a field the config reads."""
    if fields.messages is not None:
        if fields.messages not in row:
            raise ConfigError(f"{where}: {noun} has no field {fields.messages!r} (dataset.messages_field)")
        checked_messages(row[fields.messages], where)
    elif fields.template is not None:
        for name in fields.prompts:
            if isinstance(row.get(name), bool):  # str.format writes "True"; a table's bool column is refused
                raise ConfigError(f"{where}: field {name!r}: {json.dumps(row[name])} is a boolean, not a string or "
                                  f"number (dataset.prompt_template)")
            if not isinstance(row.get(name), (str, int, float)):
                raise ConfigError(f"{where}: {noun} has no string or number field {name!r} (dataset.prompt_template)")
            if isinstance(row[name], float) and not math.isfinite(row[name]):  # Python's json reads NaN, Infinity
                # and 1e999 (infinity): "Score: nan", "Score: inf"
                raise ConfigError(f"{where}: field {name!r}: {json.dumps(row[name])} where a prompt is needed "
                                  f"(dataset.prompt_template)")
    elif fields.tokens is not None:
        if not _token_ids(row.get(fields.tokens)):
            raise ConfigError(f"{where}: field {fields.tokens!r} (dataset.tokens_field) must be a non-empty "
                              f"list of token ids, whole numbers from 0, got {_short(row.get(fields.tokens))}")
        refuse_past_vocab(max(row[fields.tokens]), fields.vocab, f"{where}: field {fields.tokens!r}")
    elif not isinstance(row.get(fields.text), str):
        ids = [k for k in ("input_ids", "tokens") if _token_ids(row.get(k))]
        hint = f" (token ids in {ids[0]!r}: set dataset.tokens_field)" if ids else ""
        raise ConfigError(f"{where}: {noun} has no string field {fields.text!r}{hint}")
    for name in fields.prompts:  # a text or a template's fields (messages and token ids are no string)
        check_unicode(row[name], where, f"field {name!r}")
    if fields.label_required and fields.label not in row:  # a misspelt label_field: every label None
        raise ConfigError(f"{where}: {noun} has no field {fields.label!r} (dataset.label_field; a row without a "
                          f"label has null there)")
    missing = [k for k in fields.keep or () if k not in row]
    if missing:
        raise ConfigError(f"{where}: {noun} has no field {missing[0]!r} (dataset.keep_fields)")


def _token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(type(i) is int and 0 <= i < 1 << 63 for i in value))  # type(): a bool is no id


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _label(row: dict[str, Any], fields: Fields, where: str) -> Any:
    label = checked_label(row.get(fields.label), fields.label, where)
    return label if fields.classes is None else class_name(label, fields, where)


def _prompt(row: dict[str, Any], fields: Fields, where: str) -> str:
    if fields.tokens is not None:
        return ""  # the ids' text, decoded by the model's tokenizer (extract.inputs.given_token_ids)
    if fields.template is not None:
        return fields.template.format_map({name: row[name] for name in fields.prompts})
    return fields.render(row[fields.messages], where) if fields.messages is not None else row[fields.text]


def _kept(row: dict[str, Any], fields: Fields) -> dict[str, Any]:
    if fields.keep is None:
        return {k: v for k, v in row.items() if k not in fields.own()}
    return {k: row[k] for k in fields.keep}
