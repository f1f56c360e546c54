"""Dataset inputs: a JSONL file of texts or a folder of images (ImageFolder convention).

sample_idx of every sample is its row index in the order defined here, in every format.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actstore.errors import ConfigError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


@dataclass
class Sample:
    """One dataset row. `text` is the text, or the image path relative to the dataset root."""

    sample_idx: int
    text: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Dataset:
    root: Path
    modality: str  # "text" | "image"
    samples: list[Sample]

    @property
    def labels(self) -> list:
        """Sorted distinct labels (label_id = position in this list)."""
        return sorted({s.label for s in self.samples if s.label is not None}, key=str)

    def image_path(self, sample: Sample) -> Path:
        return self.root / sample.text


def _read_jsonl(path: Path, limit: int | None) -> list[Sample]:
    samples = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if limit is not None and len(samples) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ConfigError(f"{path}:{line_no}: line has no string field 'text'")
            extra = {k: v for k, v in row.items() if k not in ("text", "label")}
            samples.append(Sample(len(samples), row["text"], row.get("label"), extra))
    return samples


def _read_image_folder(root: Path, limit: int | None) -> list[Sample]:
    paths = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
    )
    if limit is not None:
        paths = paths[:limit]
    return [
        Sample(i, rel, rel.split("/")[0] if "/" in rel else None) for i, rel in enumerate(paths)
    ]


def load_dataset(path: str | Path, limit: int | None = None) -> Dataset:
    """Load a JSONL file (text) or a folder of images; raise ConfigError naming the path if empty."""
    root = Path(path)
    if root.is_file():
        dataset = Dataset(root.resolve(), "text", _read_jsonl(root, limit))
    elif root.is_dir():
        dataset = Dataset(root.resolve(), "image", _read_image_folder(root, limit))
    else:
        raise ConfigError(f"dataset.path does not exist: {root}")
    if not dataset.samples:
        raise ConfigError(f"dataset.path {root} holds no samples")
    return dataset


def part_range(n_samples: int, parts: int, part: int) -> range:
    """Contiguous slice of ceil(N/P) samples for part `part` (the last may be shorter or empty)."""
    per_part = math.ceil(n_samples / parts)
    return range(min(n_samples, part * per_part), min(n_samples, (part + 1) * per_part))
