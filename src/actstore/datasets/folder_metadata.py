"""An image folder's metadata file, as Hugging Face's `imagefolder` reads it: `metadata.jsonl` (an
object a line) or `metadata.csv` (a header line) at the folder's root, a row per image, whose
`file_name` is the image's path relative to the root and whose other fields describe it (a caption,
attributes to probe for, a label). Every image has exactly one row and every row names an image of
the folder: an image left out, or a row for an image that is not there, would silently be a sample
without its fields or a field without its sample, so each is named. CSV values are text.

The scan reads the file once, keeping a name per image (and its label); a part's job reads it again,
keeping the rows of its own images only."""
from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

from actstore.datasets.core import Fields, checked_label, json_spellings, refuse_repeated
from actstore.datasets.jsonl import not_utf8
from actstore.errors import ConfigError

log = logging.getLogger(__name__)

NAME_FIELD = "file_name"
_NO_ROW = object()  # an image no row has described yet


def metadata_rows(path: Path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(where, image name, row) for every row of the file, in file order; ConfigError naming the
    line if it is not a row with a `file_name`."""
    with open(path, encoding="utf-8-sig", newline="") as fh:  # -sig: a CSV saved by Excel starts with a BOM
        try:
            if path.suffix == ".csv":
                reader = csv.DictReader(fh)
                if NAME_FIELD not in (reader.fieldnames or ()):
                    raise ConfigError(f"{path}: the header names no {NAME_FIELD!r} column (the image a row describes)")
                _check_distinct(reader.fieldnames, f"{path}:1", "column", "header")
                lines: Iterable[tuple[int, Any]] = ((reader.line_num, _csv_row(row, path, reader.line_num))
                                                    for row in reader)
            else:
                lines = ((number, _parsed(line, path, number)) for number, line in enumerate(fh, 1) if line.strip())
            for number, row in lines:
                name = row.get(NAME_FIELD)
                if not isinstance(name, str) or not name:
                    raise ConfigError(f"{path}:{number}: no {NAME_FIELD!r} naming the image the row describes")
                yield f"{path}:{number}", Path(name).as_posix().removeprefix("./"), row
        except UnicodeDecodeError:
            raise not_utf8(path) from None  # names the line (text mode decodes ahead, by blocks)
        except csv.Error as exc:
            raise ConfigError(f"{path}: not CSV ({exc})") from None


def _csv_row(row: dict[Any, Any], path: Path, number: int) -> dict[str, Any]:
    """A CSV row as csv.DictReader read it; ConfigError naming the line unless it has a value for each
    of the header's columns (DictReader puts values past them under None, and None for columns past
    the row's values: a row cut short read as null fields and label)."""
    if None in row:
        raise ConfigError(f"{path}:{number}: more values than the header has columns")
    if None in row.values():
        missing = next(column for column, value in row.items() if value is None)
        raise ConfigError(f"{path}:{number}: fewer values than the header has columns (none for {missing!r}; "
                          f"an empty value is written as two commas)")
    return row


def _check_distinct(names: Iterable[str], where: str, noun: str, place: str) -> None:
    """ConfigError naming a name `names` holds twice: csv.DictReader and json keep the last value, so an
    image was read with its second label or name without a word (pandas, which Hugging Face's
    imagefolder reads metadata.csv with, keeps the first column)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ConfigError(f"{where}: {noun} {name!r} appears twice in the {place} (which value is meant?)")
        seen.add(name)


def _parsed(line: str, path: Path, number: int) -> Any:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    except ValueError as exc:  # a whole number of over 4300 digits: Python refuses it, naming no line
        raise ConfigError(f"{path}:{number}: cannot be read ({exc})") from None
    except RecursionError:  # json recurses once a level: ~1000 nested lists crashed naming no line
        raise ConfigError(f"{path}:{number}: not valid JSON (nested too deeply to parse)") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{path}:{number}: not a JSON object")
    # every field: an image's label or name read from its second value (a hook on every line made an
    # ImageNet metadata file's read 3 times slower than refuse_repeated's count of spellings)
    refuse_repeated(line, ((key, spelled) for key in row for spelled in json_spellings(key)), f"{path}:{number}",
                    "line")
    return row


def scan_metadata(path: Path, names: list[str], fields: Fields) -> dict[str, Any]:
    """Each image's label from the file (dataset.label_field; None when it is unset), checking that
    every image of `names` has exactly one row, every row names one of them and has the fields the
    config reads. ConfigError naming the file and line, or the image."""
    images = dict.fromkeys(names, _NO_ROW)  # one entry an image: 1.28M of them are ~150 MB
    described_rows = unread_labels = 0
    for where, name, row in metadata_rows(path):
        if name not in images:
            raise ConfigError(f"{where}: {NAME_FIELD} {name!r} is not an image of the folder")
        if images[name] is not _NO_ROW:
            raise ConfigError(f"{where}: a second row for {name!r}")
        images[name] = described(row, fields, where, csv=path.suffix == ".csv")[0]
        described_rows += 1
        unread_labels += not fields.label_required and fields.label in row
    if unread_labels:
        _warn_unread_labels(path, fields.label, unread_labels)
    if described_rows < len(images):
        missing = next(name for name in names if images[name] is _NO_ROW)
        raise ConfigError(f"{path}: no row for the image {missing!r} ({len(images) - described_rows} images have none)")
    return images


def _warn_unread_labels(path: Path, field: str, rows: int) -> None:
    """A warning for a metadata file whose rows have a label field while dataset.label_field is unset:
    Hugging Face's imagefolder labels the images by it, and here their folders label them (none at
    the folder's root: every label_id -1), the field kept as metadata. Not read by default: that
    would change the labels of extractions made before, under the same hash."""
    log.warning("%s: %d rows have a %r field, not read as labels since dataset.label_field is unset (the images' "
                "first-level folders label them, an image at the root none; Hugging Face's imagefolder labels "
                "them by the field): set dataset.label_field: %s to label them by it", path, rows, field, field)


def rows_of(path: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The rows of the images `names` (a part's), read from the file; ConfigError naming an image
    without one (the file changed since the scan)."""
    wanted = set(names)
    rows = {name: row for _, name, row in metadata_rows(path) if name in wanted}
    if len(rows) < len(wanted):
        raise ConfigError(f"{path}: no row for the image {min(wanted - set(rows))!r}; it changed since the "
                          f"dataset was scanned")
    return rows


def described(row: dict[str, Any], fields: Fields, where: str, csv: bool) -> tuple[Any, dict[str, Any]]:
    """(label, kept fields) of an image's row (`csv`: of metadata.csv): the label from
    dataset.label_field (None when unset: the image's folder is its label; a CSV's empty value,
    which csv.writer and pandas' to_csv write for a missing label and Hugging Face's imagefolder
    reads as one, not a class "" of its own), and dataset.keep_fields, or every field but the name
    and label."""
    label = None
    if fields.label_required:
        if fields.label not in row:
            raise ConfigError(f"{where}: no field {fields.label!r} (dataset.label_field)")
        label = None if csv and row[fields.label] == "" else checked_label(row[fields.label], fields.label, where)
    if fields.keep is None:
        skip = {NAME_FIELD, fields.label} if fields.label_required else {NAME_FIELD}
        return label, {k: v for k, v in row.items() if k not in skip}
    missing = [k for k in fields.keep if k not in row]
    if missing:
        raise ConfigError(f"{where}: no field {missing[0]!r} (dataset.keep_fields)")
    return label, {k: row[k] for k in fields.keep}
