"""Check an extraction (the Format interface): every part extract.json lists, every file each
part.json lists with its size and sha256, nothing unlisted, no name leading outside a part."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import numpy as np

from actstore.errors import FormatError
from actstore.formats.extract.layout import INDEX, PART_META, layer_tensor, part_dirname, tensor_file
from actstore.formats.extract.read import open_extraction, open_part
from actstore.formats.extract.write import index_of
from actstore.integrity import file_problem, inside, links_out, read_json


def detect(path: str | Path) -> bool:
    """An extraction stage directory (part-NNNN/part.json) or a single part directory."""
    path = Path(path)
    return (path / PART_META).is_file() or (path / part_dirname(0) / PART_META).is_file()


def _part_dirs(path: Path) -> list[Path]:
    return [path] if (path / PART_META).is_file() else sorted(path.glob("part-[0-9][0-9][0-9][0-9]"))


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary of an extraction (all parts) for `actstore inspect`."""
    parts = [open_part(p) for p in _part_dirs(Path(path))]
    info = parts[0].info
    first_layer = layer_tensor(info.layers[0])
    return {
        "format": "actstore-extract", "model": info.model.name, "layers": info.layers,
        "hooks": info.hooks, "n_examples": sum(p.info.n_samples for p in parts),
        "n_tokens": sum(p.info.n_tokens for p in parts),
        "d_model": parts[0].meta["files"].get(tensor_file(first_layer), {}).get("shape", [0, None])[1],
        "dtype": parts[0].meta["files"].get(tensor_file(first_layer), {}).get("dtype", "float32"),
        "n_shards": len(parts),
        "bytes": sum(info["bytes"] for p in parts for info in p.meta["files"].values()),
        # finite activations a float16 storage dtype turned into +-inf (part.json, when any)
        "float16_overflow_count": sum(int(p.meta.get("float16_overflow_count", 0)) for p in parts),
        # texts cut at max_seq_length (part.json; None where a part does not know: images, older parts)
        "n_truncated_samples": _total(p.meta.get("n_truncated_samples") for p in parts),
    }


def _total(counts: Iterable[int | None]) -> int | None:
    counts = list(counts)
    return None if None in counts else sum(counts)


def verify(path: str | Path) -> list[str]:
    """Every part extract.json lists present with its part.json (a stage directory without
    extract.json is a problem), every part's files present with the recorded size and sha256 and
    nothing unlisted, the parts covering the dataset's rows in order; problems name the file."""
    path = Path(path)
    if problems := links_out(path):
        return problems
    single = (path / PART_META).is_file()
    problems = [] if single else _index_problems(path) if (path / INDEX).is_file() else [
        f"{path / INDEX}: missing (it lists the parts, so that a deleted part is named)"]
    for part_dir in _part_dirs(path):
        try:
            open_part(part_dir).verify()
        except (FormatError, OSError, ValueError) as exc:
            problems.append(str(exc))
    return problems or ([] if single else _summary_problems(path))


def _summary_problems(extract_dir: Path) -> list[str]:
    """extract.json's totals, tensors, model and dataset against what its (whole) parts say. A key
    the parts give and the file lacks (written by an earlier release) is not a problem."""
    have = read_json(extract_dir / INDEX)
    try:
        want = index_of(open_extraction(extract_dir))
    except FormatError as exc:
        return [str(exc)]
    pairs = [(key, have.get(key), value) for key, value in want.items() if key != "parts" and key in have]
    listed = have.get("parts") if isinstance(have.get("parts"), list) else []
    pairs += [(f"parts[{i}].{key}", entry.get(key) if isinstance(entry, dict) else None, value)
              for i, (entry, part) in enumerate(zip(listed, want["parts"])) for key, value in part.items()]
    return [f"{extract_dir / INDEX}: {key} = {stored!r:.100} but the parts say {value!r:.100}"
            for key, stored, value in pairs if stored != value]


def _index_problems(extract_dir: Path) -> list[str]:
    try:
        parts = read_json(extract_dir / INDEX)["parts"]
        listed = {entry["dir"]: entry["part_json_sha256"] for entry in parts}
        records = {inside(extract_dir, d, str(extract_dir / INDEX)) / PART_META: {"sha256": sha}
                   for d, sha in listed.items()}
    except (FormatError, KeyError, TypeError) as exc:
        return [f"{extract_dir / INDEX}: unreadable ({exc})"]
    problems = [p for meta, record in records.items() if (p := file_problem(meta, record, INDEX))]
    unlisted = sorted(d.name for d in _part_dirs(extract_dir) if d.name not in listed)
    return problems + [f"{extract_dir / d}: not listed in {INDEX}" for d in unlisted]


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """The stored float32 vector of (dataset row, block output, token)."""
    extraction = open_extraction(path)
    if layer_idx not in extraction.info.layers:
        return None
    rows = extraction.activations(layer_tensor(layer_idx), sample_idx)
    return np.array(rows[token_idx]) if token_idx < len(rows) else None
