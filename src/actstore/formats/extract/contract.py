"""The extraction contract: what a part's part.json says about how it was made, typed. Every format
writer reads a part through PartInfo (`Part.info`, `Extraction.info`) instead of string keys, so
only this module and the writer in actstore.extract know part.json's field names."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actstore.errors import FormatError
from actstore.integrity import whole_number, whole_numbers
from actstore.formats.extract.layout import COUNT_KEYS


@dataclass(frozen=True)
class ModelInfo:
    """The model a part was extracted with."""

    path: str                  # the resolved local folder
    name: str
    revision: str | None
    model_type: str | None     # config.json model_type
    architecture: str          # config.json architectures[0], else the loaded class
    torch_dtype: str
    n_blocks: int | None
    record: dict[str, Any] = field(repr=False, compare=False)  # as part.json has it, for formats that embed it


@dataclass(frozen=True)
class DatasetInfo:
    """The dataset a part's samples come from (sample_idx = its row)."""

    path: str
    name: str
    split: str
    labels: list[Any]          # sorted distinct labels: label_id = position
    record: dict[str, Any] = field(repr=False, compare=False)


@dataclass(frozen=True)
class PartInfo:
    """One part.json, typed. For an extraction (all parts) the run-wide fields are the same in every
    part; the counts are the part's own (Extraction.n_samples / n_tokens give the totals)."""

    part: int
    parts: int
    sample_range: tuple[int, int]  # dataset rows [start, stop) of this part
    n_dataset_samples: int
    n_samples: int
    n_tokens: int
    tensors: list[str]             # layer_<i> and hook specs, as captured
    layers: list[int]
    hooks: list[str]
    modality: str                  # text | image
    model_kind: str                # encoder | causal | vision
    max_seq_length: int
    batch_size: int
    logits_topk: int | None        # causal LMs only
    created_at: str | None
    extraction_duration_seconds: float
    versions: dict[str, str]
    model: ModelInfo
    dataset: DatasetInfo
    # texts cut at max_seq_length (each one's samples.jsonl row says "truncated": true, in parts written
    # since 2026-11-29); None where the part cannot tell: images (never cut), a slow tokenizer, older parts
    n_truncated_samples: int | None = None

    @classmethod
    def parse(cls, meta: dict[str, Any], source: Path) -> PartInfo:
        """part.json as a PartInfo; FormatError naming `source` and the field that is missing or of
        the wrong type (every field a reader or writer computes with is checked before it is used)."""
        try:
            _check_types(meta, source)
            model, dataset = meta["model"], meta["dataset"]
            return cls(
                part=meta["part"], parts=meta["parts"], sample_range=tuple(meta["sample_range"]),
                n_dataset_samples=meta["n_dataset_samples"], n_samples=meta["n_samples"],
                n_tokens=meta["n_tokens"], tensors=list(meta["tensors"]), layers=list(meta["layers"]),
                hooks=list(meta.get("hooks", [])), modality=meta["modality"], model_kind=meta["model_kind"],
                max_seq_length=meta["max_seq_length"], batch_size=meta["batch_size"],
                logits_topk=meta.get("logits_topk"),
                created_at=meta.get("created_at"),
                extraction_duration_seconds=meta.get("extraction_duration_seconds", 0.0),
                versions=meta.get("versions", {}),
                model=ModelInfo(path=model["path"], name=model["name"], revision=model.get("revision"),
                                model_type=model.get("model_type"), architecture=model["architecture"],
                                torch_dtype=model.get("torch_dtype", "float32"), n_blocks=model.get("n_blocks"),
                                record=model),
                dataset=DatasetInfo(path=dataset["path"], name=dataset["name"], split=dataset["split"],
                                    labels=list(dataset.get("labels") or []), record=dataset),
                n_truncated_samples=meta.get("n_truncated_samples"))
        except (KeyError, TypeError) as exc:
            raise FormatError(f"{source}: field {exc} missing or malformed") from None


# part.json fields the readers and writers compute with, and their JSON types.
COUNTS = ("part", "parts", "n_dataset_samples", "n_samples", "n_tokens", "max_seq_length", "batch_size")
STRINGS = ("modality", "model_kind")


def _check_types(meta: dict[str, Any], source: Path) -> None:
    def bad(field: str, want: str) -> FormatError:
        return FormatError(f"{source}: field {field!r} must be {want}, got {meta.get(field)!r:.80}")
    for key in COUNTS:
        if key in meta and not whole_number(meta[key]):
            raise bad(key, "a whole number")
    for key in STRINGS:
        if key in meta and not isinstance(meta[key], str):
            raise bad(key, "a string")
    if "sample_range" in meta and not (whole_numbers(meta["sample_range"]) and len(meta["sample_range"]) == 2):
        raise bad("sample_range", "[start, stop]")
    if "layers" in meta and not (whole_numbers(meta["layers"]) and meta["layers"]):  # formats size from layers[0]
        raise bad("layers", "a non-empty list of block numbers")
    for key in ("tensors", "hooks"):
        if key in meta and not (isinstance(meta[key], list) and all(isinstance(x, str) for x in meta[key])):
            raise bad(key, "a list of strings")
    for key in ("logits_topk", "n_truncated_samples", *COUNT_KEYS):
        if meta.get(key) is not None and not whole_number(meta[key]):
            raise bad(key, "a whole number or null")
    # extract.json sums it over the parts (write_index, and verify comparing extract.json with them)
    duration = meta.get("extraction_duration_seconds", 0.0)
    if not (isinstance(duration, (int, float)) and not isinstance(duration, bool) and duration >= 0):
        raise bad("extraction_duration_seconds", "a number of seconds")
    files = meta.get("files")
    for name, record in files.items() if isinstance(files, dict) else ():
        shape, dtype = (record.get("shape", []), record.get("dtype", "")) if isinstance(record, dict) else (None, None)
        if not (whole_numbers(shape) and isinstance(dtype, str)):
            raise FormatError(f"{source}: files[{name!r}] shape must be a list of sizes and dtype a string, "
                              f"got {record!r:.80}")
    if meta.get("created_at") is not None and not isinstance(meta["created_at"], str):
        raise bad("created_at", "a string or null")
    versions = meta.get("versions", {})  # lmprobe's provenance looks its versions up
    if not (isinstance(versions, dict) and all(isinstance(v, str) for v in versions.values())):
        raise bad("versions", "an object of version strings")
    for key in ("model", "dataset"):
        if key in meta and not isinstance(meta[key], dict):
            raise bad(key, "an object")
        _check_strings(meta.get(key, {}), key, source)
    _check_labels(meta.get("dataset", {}).get("labels"), source)


# model and dataset fields the formats copy into their metadata or open as paths: strings, those
# the extraction writer may record as null (OPTIONAL) or null.
STRING_FIELDS = {"model": ("path", "name", "architecture", "torch_dtype", "revision", "model_type"),
                 "dataset": ("path", "name", "split")}
OPTIONAL = ("revision", "model_type")


def _check_strings(record: dict[str, Any], key: str, source: Path) -> None:
    """FormatError naming `key.field` when a field of STRING_FIELDS present in `record` is not a string
    (a missing one is named where PartInfo.parse reads it)."""
    for name in STRING_FIELDS[key]:
        value = record.get(name)
        if name in record and not (isinstance(value, str) or (value is None and name in OPTIONAL)):
            raise FormatError(f"{source}: field '{key}.{name}' must be a string"
                              f"{' or null' if name in OPTIONAL else ''}, got {value!r:.80}")


def _check_labels(labels: Any, source: Path) -> None:
    """FormatError unless dataset.labels is null or a list of labels: a string read as the list of its
    characters, each a class (label_id 0 = its first letter), without an error."""
    if labels is not None and not (isinstance(labels, list)
                                   and all(isinstance(label, (str, int, float)) for label in labels)):
        raise FormatError(f"{source}: field 'dataset.labels' must be a list of labels (strings, numbers or "
                          f"booleans), got {labels!r:.80}")
