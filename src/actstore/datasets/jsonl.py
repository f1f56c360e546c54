"""JSONL files: one JSON object per line (blank lines skipped), read line by line in two passes: every
line parsed and checked for the row count and the labels, then only the rows asked for kept."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from actstore.datasets.core import Fields, Sample, label_list
from actstore.errors import ConfigError


def scan_jsonl(files: tuple[Path, ...], fields: Fields, limit: int | None) -> tuple[int, list]:
    """(rows, labels) of the first `limit` rows, each parsed and checked for the fields the config
    reads; no row is kept, so memory holds one line and the distinct labels."""
    n_rows, labels = 0, {}
    for where, line in _lines(files):
        if limit is not None and n_rows >= limit:
            break
        row = _parse(line, where)
        _check(row, fields, where)
        labels[_label(row, fields, where)] = None
        n_rows += 1
    return n_rows, label_list(labels)


def read_jsonl(files: tuple[Path, ...], fields: Fields, rows: range) -> list[Sample]:
    """The samples of `rows`; lines before them are counted, not parsed."""
    samples: list[Sample] = []
    for sample_idx, (where, line) in enumerate(_lines(files)):
        if sample_idx >= rows.stop:
            break
        if sample_idx >= rows.start:
            row = _parse(line, where)
            _check(row, fields, where)
            samples.append(Sample(sample_idx, _prompt(row, fields, where), row.get(fields.label), _kept(row, fields)))
    return samples


def _lines(files: tuple[Path, ...]) -> Iterator[tuple[str, str]]:
    """(file:line, line) of every non-blank line."""
    for path in files:
        with path.open(encoding="utf-8") as fh:
            try:
                for line_no, line in enumerate(fh, start=1):
                    if line.strip():
                        yield f"{path}:{line_no}", line
            except UnicodeDecodeError:
                raise _not_utf8(path) from None


def _not_utf8(path: Path) -> ConfigError:
    """The error naming the first line that is not UTF-8 (text mode decodes ahead, by blocks)."""
    with path.open("rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return ConfigError(f"{path}:{line_no}: not UTF-8 text (byte {exc.start + 1} of the line: {exc.reason})")
    return ConfigError(f"{path}: not UTF-8 text")


def _parse(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: line is not a JSON object")
    return row


def _check(row: dict[str, Any], fields: Fields, where: str) -> None:
    """ConfigError naming the line and field if the row lacks a field the config reads."""
    if fields.render is not None:
        if fields.messages not in row:
            raise ConfigError(f"{where}: line has no field {fields.messages!r} (dataset.messages_field)")
    elif not isinstance(row.get(fields.text), str):
        raise ConfigError(f"{where}: line has no string field {fields.text!r}")
    missing = [k for k in fields.keep or () if k not in row]
    if missing:
        raise ConfigError(f"{where}: line has no field {missing[0]!r} (dataset.keep_fields)")


def _label(row: dict[str, Any], fields: Fields, where: str) -> Any:
    label = row.get(fields.label)
    if isinstance(label, (list, dict)):
        raise ConfigError(f"{where}: field {fields.label!r} is a JSON {type(label).__name__}; a label is a string, "
                          f"number, boolean or null")
    return label


def _prompt(row: dict[str, Any], fields: Fields, where: str) -> str:
    return fields.render(row[fields.messages], where) if fields.render is not None else row[fields.text]


def _kept(row: dict[str, Any], fields: Fields) -> dict[str, Any]:
    if fields.keep is None:
        return {k: v for k, v in row.items() if k not in fields.own()}
    return {k: row[k] for k in fields.keep}
