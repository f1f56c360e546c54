"""Dataset inputs: JSONL, Parquet, Arrow, CSV and Hugging Face save_to_disk tables (texts, chat
messages or image bytes), and folders of images (ImageFolder convention).

Rooms: source.py (dataset.path -> format and files in read order), jsonl.py, tables.py (pyarrow,
block by block), images.py (image folders; decoding table bytes), chat.py (chat templates).
sample_idx of every sample is its row index in the order defined here, in every format.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

from actstore.datasets.chat import chat_renderer, load_tokenizer
from actstore.datasets.core import FIELD_KEYS, Dataset, Fields, Sample, part_range
from actstore.datasets.images import ImageOpener, read_image_folder, scan_image_folder
from actstore.datasets.jsonl import read_jsonl, scan_jsonl
from actstore.datasets.source import Source, identity_files, resolve_source
from actstore.datasets.tables import image_field, read_table, scan_table, schema_of, table_schemas
from actstore.errors import ConfigError

__all__ = ["FIELD_KEYS", "Dataset", "Sample", "check_dataset", "configured_dataset", "dataset_options",
           "identity_files", "load_dataset", "part_range", "resolve_source"]


def dataset_options(section: dict[str, Any]) -> dict[str, Any]:
    """The dataset.* keys that choose how rows are read, as load_dataset takes them."""
    return {k: section[k] for k in FIELD_KEYS if k in section}


def configured_dataset(config: dict[str, Any], model_path: Path, part: int | None = None) -> Dataset:
    """The dataset a resolved config names (its dataset section): every row, or only part `part`
    of extract.parts, as that part's extraction job reads it."""
    section = config["dataset"]
    parts = None if part is None else (config["extract"]["parts"], part)
    return load_dataset(section["path"], section["limit"], section["split"], model_path, parts,
                        **dataset_options(section))


def load_dataset(path: str | Path, limit: int | None = None, split: str = "train",
                 model_path: Path | None = None, parts: tuple[int, int] | None = None, **options: Any) -> Dataset:
    """Read `path` (options: the dataset.* keys in FIELD_KEYS); raise ConfigError naming the file
    and field if a column is missing or mistyped, or the path holds no samples. `model_path`: the
    model whose tokenizer renders chat messages (dataset.messages_field). `parts`: (parts, part),
    to keep only that part's rows (part_range): the others are counted and their labels read,
    so a job holds its own rows, never the whole dataset."""
    source = resolve_source(str(path), options.get("format", "auto"), split)
    fields = _fields(options, _renderer(options, model_path))
    if source.format == "image_folder":
        n_samples, labels = scan_image_folder(source, limit)
        read, modality, opener = partial(read_image_folder, source), "image", ImageOpener(source)
    elif source.format == "jsonl":
        if fields.image:
            raise ConfigError(f"dataset.image_field: {path} is JSONL, which holds no images")
        n_samples, labels = scan_jsonl(source.files, fields, limit)
        read, modality, opener = partial(read_jsonl, source.files, fields), "text", None
    else:
        fields = _table_fields(source, fields)
        schemas = table_schemas(source, fields)
        n_samples, labels = scan_table(source, fields, schemas, limit)
        read, modality = partial(read_table, source, fields, schemas), "image" if fields.image else "text"
        opener = ImageOpener(source, fields.image) if fields.image else None
    if not n_samples:
        raise ConfigError(f"dataset.path {path} holds no samples")
    samples = read(part_range(n_samples, *parts) if parts else range(n_samples))
    return Dataset(source.root.resolve(), modality, samples, n_samples, labels,
                   chat=fields.messages is not None and modality == "text", opener=opener)


def check_dataset(section: dict[str, Any]) -> None:
    """The cheap checks (at parse time): the path resolves to files, and every table shard has the
    columns the config reads, of the right types. Rows are not read."""
    options = dataset_options(section)
    source = resolve_source(section["path"], options.get("format", "auto"), section.get("split", "train"))
    if not source.files:
        raise ConfigError(f"dataset.path {section['path']} holds no samples")
    if source.table:
        table_schemas(source, _table_fields(source, _fields(options, None)))


def _renderer(options: dict[str, Any], model_path: Path | None) -> Callable[[Any, str], str] | None:
    """The chat template renderer when dataset.messages_field is set (it needs the model's tokenizer)."""
    if not options.get("messages_field"):
        return None
    if model_path is None:
        raise ConfigError("dataset.messages_field: rendering chat messages needs the model's tokenizer")
    return chat_renderer(load_tokenizer(model_path), model_path, options.get("add_generation_prompt", True))


def _fields(options: dict[str, Any], render: Callable[[Any, str], str] | None) -> Fields:
    keep = options.get("keep_fields")
    return Fields(text=options.get("text_field", "text"), label=options.get("label_field", "label"),
                  label_required="label_field" in options, image=options.get("image_field"),
                  messages=options.get("messages_field"), keep=tuple(keep) if keep is not None else None,
                  render=render)


def _table_fields(source: Source, fields: Fields) -> Fields:
    """Fields with the image column resolved from the first shard's schema (see tables.image_field)."""
    image = image_field(source, fields, schema_of(source.format, source.files[0])) if source.files else None
    if image and source.format == "csv":
        raise ConfigError(f"dataset.path {source.root}: CSV holds no image bytes; use Parquet, Arrow, "
                          f"save_to_disk or an image folder")
    return replace(fields, image=image)
