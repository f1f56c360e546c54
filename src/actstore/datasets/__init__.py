"""Dataset inputs: JSONL, Parquet, Arrow, CSV and Hugging Face save_to_disk tables (texts, chat
messages, token ids or image bytes), folders of images or texts (ImageFolder convention) and
WebDataset tar shards.

Rooms: source.py (dataset.path -> format and files in read order), scan.py (what every job needs
of the whole dataset), jsonl.py (and json_array.py: a file of one JSON array), tables.py (pyarrow,
block by block), webdataset.py (tar shards, sample by sample) and tar.py (their headers),
folders.py (folders of images or texts, a part's folders listed from the scan's runs; an image
folder's metadata file: folder_metadata.py), images.py (decoding files, table and tar bytes), chat.py
(chat templates).
sample_idx of every sample is its row index in the order defined here, in every format.
"""
from __future__ import annotations

import codecs
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from actstore.datasets.chat import chat_renderer, load_tokenizer
from actstore.datasets.core import (FIELD_KEYS, Dataset, Fields, Sample, forked_pool, in_order, part_range,
                                    template_fields)
from actstore.datasets.folders import read_folder, read_folder_runs, scan_folder
from actstore.datasets.images import ImageOpener
from actstore.datasets.jsonl import read_jsonl, scan_jsonl
from actstore.datasets.scan import (RESCAN, Scan, check_extraction_data_unchanged, check_unchanged, data_state, joined,
                                   read_scan, stamped, write_scan)
from actstore.datasets.source import (FOLDER_FORMATS, METADATA_NAMES, Source, files_under, identity_files,
                                      resolve_source)
from actstore.datasets.splits import split_folder
from actstore.datasets.tables import image_field, read_table, scan_table, schema_of, table_schemas, with_classes
from actstore.datasets.webdataset import read_webdataset, scan_webdataset
from actstore.errors import ConfigError
from actstore.model_config import config_int, run_config, trusted
from actstore.parse_memo import remembered

__all__ = ["FIELD_KEYS", "Dataset", "Sample", "Scan", "check_dataset", "check_extraction_data_unchanged",
           "configured_dataset", "configured_scan", "dataset_options", "identity_files", "load_dataset", "part_range",
           "read_scan", "resolve_source", "scan_dataset", "write_scan"]


def dataset_options(section: dict[str, Any]) -> dict[str, Any]:
    """The dataset.* keys that choose how rows are read, as load_dataset takes them."""
    return {k: section[k] for k in FIELD_KEYS if k in section}


def configured_dataset(config: dict[str, Any], model_path: Path, part: int | None = None,
                       scan: Scan | None = None) -> Dataset:
    """The dataset a resolved config names (its dataset section): every row, or only part `part`
    of extract.parts, as that part's extraction job reads it (from `scan`, configured_scan's)."""
    section = config["dataset"]
    parts = None if part is None else (config["extract"]["parts"], part)
    return load_dataset(section["path"], section["limit"], section["split"], model_path, parts, scan,
                        trust_remote_code=trusted(config["model"]), **dataset_options(section))


def configured_scan(config: dict[str, Any], progress: bool = False, workers: int = 1) -> Scan:
    """The scan of the dataset a resolved config names (see scan_dataset); token ids (dataset.tokens_field)
    checked against the model's vocab_size, so a row holding one past it fails here, before any part's job
    (the part's job, on its GPU, named it after the parts before it had run)."""
    section = config["dataset"]
    vocab = config_int(run_config(config["model"]), "vocab_size") if section.get("tokens_field") else None
    return scan_dataset(section["path"], section["limit"], section["split"], progress, workers, vocab,
                        **dataset_options(section))


def scan_dataset(path: str | Path, limit: int | None = None, split: str = "train", progress: bool = False,
                 workers: int = 1, vocab: int | None = None, **options: Any) -> Scan:
    """One pass over every row of `path` (options: the dataset.* keys in FIELD_KEYS): its row count
    and labels, and for JSONL where rows start, each line parsed and checked (ConfigError naming the
    file, line or field); Parquet, Arrow and CSV rows from the metadata, labels from the label
    column, the first null prompt named and an Arrow stream's end marker checked; image folders
    listed; tar shards' headers read to their end-of-archive blocks, each sample's image found and its
    label read. Chat messages (JSONL, Parquet, Arrow) are checked to be messages, not rendered.
    `workers`: JSONL or tar files scanned at once, each in its own process (scanned_files). `vocab`:
    token ids (dataset.tokens_field) at or past it are refused, naming the row."""
    source, fields, schemas = _opened(path, split, options)
    return _scan(path, source, replace(fields, vocab=vocab), schemas, limit, progress, workers)


def load_dataset(path: str | Path, limit: int | None = None, split: str = "train",
                 model_path: Path | None = None, parts: tuple[int, int] | None = None,
                 scan: Scan | None = None, trust_remote_code: bool = False, **options: Any) -> Dataset:
    """Read `path` (options: the dataset.* keys in FIELD_KEYS); raise ConfigError naming the file
    and field if a column is missing or mistyped, or the path holds no samples. `model_path`: the
    model whose tokenizer renders chat messages (dataset.messages_field), loaded with
    `trust_remote_code` (model.trust_remote_code). `parts`: (parts, part),
    to keep only that part's rows (part_range), so a job holds its own rows, never the whole
    dataset. `scan`: scan_dataset's for the same path and options, else scanned here."""
    if scan is not None and scan.runs:  # a folder of files: only the folders of these rows are listed
        rows = part_range(scan.n_samples, *parts) if parts else range(scan.n_samples)
        # the runs are the split's folder's, as the scan read them (train/<label>/...: every part job
        # looked for <label>/ at the root, "gone")
        root = split_folder(Path(path), split) if scan.folder_format == "image_folder" else Path(path)
        samples = read_folder_runs(root, scan, rows, _fields(options, None))
        return _folder_dataset(Source(scan.folder_format, root, ()), samples, scan)
    source, fields, schemas = _opened(path, split, options)
    scan = scan or _scan(path, source, fields, schemas, limit)
    check_unchanged(scan, source)
    rows = part_range(scan.n_samples, *parts) if parts else range(scan.n_samples)
    if source.format in FOLDER_FORMATS:
        return _folder_dataset(source, read_folder(source, rows, fields), scan)
    fields = replace(fields, render=_renderer(options, model_path, trust_remote_code))
    if source.format == "webdataset":
        samples, modality, opener = read_webdataset(source, fields, rows, scan), "image", ImageOpener(source)
    elif source.format == "jsonl":
        samples, modality, opener = read_jsonl(source.files, fields, rows, scan), "text", None
    else:
        samples = read_table(source, fields, schemas, rows)
        modality, opener = ("image", ImageOpener(source, fields.image)) if fields.image else ("text", None)
    if len(samples) < len(rows):  # the scan's row count or marks are not this data's: never fewer rows in silence
        raise ConfigError(f"{source.files[-1]}: the dataset ends before row {rows.start + len(samples)}, which its "
                          f"scan counts ({scan.n_samples} rows); {RESCAN}")
    return Dataset(source.root.resolve(), modality, samples, scan.n_samples, scan.labels,
                   chat=fields.messages is not None and modality == "text", opener=opener,
                   pretokenized=fields.tokens is not None)


def _folder_dataset(source: Source, samples: list[Sample], scan: Scan) -> Dataset:
    """The dataset of a folder's files: images (opened by name in the root) or texts."""
    image = source.format == "image_folder"
    return Dataset(source.root.resolve(), "image" if image else "text", samples, scan.n_samples, scan.labels,
                   opener=ImageOpener(source) if image else None)


def _opened(path: str | Path, split: str, options: dict[str, Any]) -> tuple[Source, Fields, list]:
    """The source, the fields read (no chat renderer) and each table file's schema (checked)."""
    source = resolve_source(str(path), options.get("format", "auto"), split)
    fields = _fields(options, None)
    if source.format == "jsonl" and fields.image:
        raise ConfigError(f"dataset.image_field: {path} is JSONL, which holds no images")
    if fields.tokens and source.format in (*FOLDER_FORMATS, "webdataset"):
        raise ConfigError(f"dataset.tokens_field: {path} is {source.format.replace('_', ' ')}, which holds "
                          f"{'texts' if source.format == 'text_folder' else 'images'}, not token ids")
    if source.format in FOLDER_FORMATS and not source.metadata and (fields.label_required or fields.keep is not None):
        key = "label_field" if fields.label_required else "keep_fields"
        what = "a text folder" if source.format == "text_folder" else \
            f"an image folder without a metadata file ({' or '.join(METADATA_NAMES)} at its root)"
        raise ConfigError(f"dataset.{key}: {path} is {what}: its labels are its folders, and it has no other fields")
    if source.format == "jsonl":
        return source, with_classes(source, fields, None), []
    if not source.table:
        return source, fields, []
    fields = _table_fields(source, fields)
    return source, fields, table_schemas(source, fields)


def _scan(path: str | Path, source: Source, fields: Fields, schemas: list, limit: int | None,
          progress: bool = False, workers: int = 1) -> Scan:
    before = data_state(source)
    if source.format in FOLDER_FORMATS:
        by_folder = Path(path).is_dir()  # an existing path is itself, never a glob (resolve_source)
        scan = scan_folder(source, limit, by_folder, fields, progress)
    elif source.format in ("jsonl", "webdataset"):
        scan = scanned_files(source, fields, limit, progress, workers)
    else:
        scan = Scan(*scan_table(source, fields, schemas, limit))
    if not scan.n_samples:
        raise _no_samples(path, source)
    return stamped(scan, source, before)


def scanned_files(source: Source, fields: Fields, limit: int | None, progress: bool = False,
                  workers: int = 1) -> Scan:
    """The scan of JSONL lines or tar headers, which reads every row: with several files, no limit
    and `workers` > 1, each file in its own process (a corpus of shards scans at the speed of
    `workers` cores) and the scans joined, as one pass would have made them. With a limit, one pass
    that stops at its row (nothing past it is read, or refused)."""
    if limit is not None or workers < 2 or len(source.files) < 2:
        return _scanned_file(source, fields, limit, progress)
    singles = [replace(source, files=(path,)) for path in source.files]
    processes = min(workers, len(singles))
    sizes = [path.stat().st_size for path in source.files]
    with (forked_pool(processes) as pool,
          tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"scan dataset ({processes} processes)",
               disable=not progress) as bar):
        futures = [pool.submit(_scanned_file, single, fields, None) for single in singles]
        scans = []
        for size, scan in zip(sizes, in_order(futures)):  # in file order: the first file's error is raised
            scans.append(scan)
            bar.update(size)
    return joined(scans, source.files, fields)


def _scanned_file(source: Source, fields: Fields, limit: int | None, progress: bool = False) -> Scan:
    if source.format == "webdataset":
        return scan_webdataset(source, fields, limit, progress)
    return scan_jsonl(source.files, fields, limit, progress)


def check_dataset(section: dict[str, Any]) -> None:
    """The cheap checks (at parse time): the path resolves to files, and every table shard has the
    columns the config reads, of the right types. Rows are not read. Once per Snakefile parse: a
    job's parse takes the main process's word for it (parse_memo)."""
    remembered("dataset checked", section, lambda: _check_dataset(section))


def _check_dataset(section: dict[str, Any]) -> None:
    source = _opened(section["path"], section.get("split", "train"), dataset_options(section))[0]
    if not source.files:
        raise _no_samples(section["path"], source)


def _no_samples(path: str | Path, source: Source) -> ConfigError:
    return ConfigError(f"dataset.path {path} holds no samples{_why_no_files(source)}")


def _why_no_files(source: Source) -> str:
    """A hint for a folder in which no file was taken for data. Its .json files are not shards (a
    folder's other .json files are no rows: an image folder's annotations, a Hub snapshot's
    dataset_infos.json): a snapshot's data/train.json was sent to text_folder, which reads each
    file whole as one sample's text."""
    if source.files or not source.root.is_dir():
        return ""
    json_file = next((p for p in files_under(source.root) if p.suffix.lower() == ".json"), None)
    if json_file is not None:
        return (f" (its .json files, such as {source.name(json_file)}, are not read as a folder's shards: set "
                f"dataset.path to one, or to a glob of them)")
    if source.format == "image_folder":
        return " (no images or data files: a folder of text files is read with dataset.format: text_folder)"
    return ""


def _renderer(options: dict[str, Any], model_path: Path | None,
              trust_remote_code: bool) -> Callable[[Any, str], str] | None:
    """The chat template renderer when dataset.messages_field is set (it needs the model's tokenizer)."""
    if not options.get("messages_field"):
        return None
    if model_path is None:
        raise ConfigError("dataset.messages_field: rendering chat messages needs the model's tokenizer")
    return chat_renderer(load_tokenizer(model_path, trust_remote_code), model_path,
                         options.get("add_generation_prompt", True))


def _fields(options: dict[str, Any], render: Callable[[Any, str], str] | None) -> Fields:
    keep = options.get("keep_fields")
    fields = Fields(text=options.get("text_field", "text"), label=options.get("label_field", "label"),
                    label_required="label_field" in options, image=options.get("image_field"),
                    messages=options.get("messages_field"), tokens=options.get("tokens_field"),
                    template=options.get("prompt_template"), keep=tuple(keep) if keep is not None else None,
                    render=render, encoding=options.get("encoding", "utf-8"))
    try:
        codecs.lookup(fields.encoding)
    except LookupError:
        raise ConfigError(f"dataset.encoding: {fields.encoding!r} is not an encoding Python knows") from None
    if fields.tokens and (fields.messages or fields.image):
        other = "messages_field" if fields.messages else "image_field"
        raise ConfigError(f"dataset.tokens_field: a row's token ids are its whole input; unset dataset.{other}")
    if fields.template is not None:
        others = [k for k in ("text_field", "messages_field", "tokens_field", "image_field") if options.get(k)]
        if others:
            raise ConfigError(f"dataset.prompt_template makes the prompt of the row's fields; unset "
                              f"dataset.{others[0]} (name the field in the template: {{{options[others[0]]}}})")
        template_fields(fields.template)  # its placeholders checked here, at parse time
    return fields


def _table_fields(source: Source, fields: Fields) -> Fields:
    """Fields with the image column resolved from the first shard's schema (see tables.image_field)
    and the label column's ClassLabel names (tables.with_classes)."""
    schema = schema_of(source.format, source.files[0]) if source.files else None
    image = image_field(source, fields, schema) if schema is not None else None
    if image and source.format == "csv":
        raise ConfigError(f"dataset.path {source.root}: CSV holds no image bytes; use Parquet, Arrow, "
                          f"save_to_disk or an image folder")
    return replace(with_classes(source, fields, schema), image=image)
