"""JSONL files: one JSON object per line (blank lines skipped), read line by line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from actstore.datasets.core import Fields, Sample
from actstore.errors import ConfigError


def read_jsonl(files: tuple[Path, ...], fields: Fields, limit: int | None) -> list[Sample]:
    samples: list[Sample] = []
    for where, row in _rows(files):
        if limit is not None and len(samples) >= limit:
            break
        samples.append(Sample(len(samples), _prompt(row, fields, where), row.get(fields.label),
                              _kept(row, fields, where)))
    return samples


def _rows(files: tuple[Path, ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path in files:
        with path.open(encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}:{line_no}: line is not a JSON object")
                yield f"{path}:{line_no}", row


def _prompt(row: dict[str, Any], fields: Fields, where: str) -> str:
    if fields.render is not None:
        if fields.messages not in row:
            raise ConfigError(f"{where}: line has no field {fields.messages!r} (dataset.messages_field)")
        return fields.render(row[fields.messages], where)
    if not isinstance(row.get(fields.text), str):
        raise ConfigError(f"{where}: line has no string field {fields.text!r}")
    return row[fields.text]


def _kept(row: dict[str, Any], fields: Fields, where: str) -> dict[str, Any]:
    if fields.keep is None:
        return {k: v for k, v in row.items() if k not in fields.own()}
    missing = [k for k in fields.keep if k not in row]
    if missing:
        raise ConfigError(f"{where}: line has no field {missing[0]!r} (dataset.keep_fields)")
    return {k: row[k] for k in fields.keep}
