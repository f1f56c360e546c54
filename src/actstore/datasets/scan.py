"""A dataset's scan: what every extraction job needs of the whole dataset (its row count, its labels)
and, for JSONL and tar shards, where rows start, from one pass over every row. The Snakemake
workflow scans once (rule extract_scan) and each part's job reads only its own rows; load_dataset
scans in-process when given no scan."""
from __future__ import annotations

import bisect
import hashlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

from actstore.datasets.core import Fields, label_list, one_kind
from actstore.datasets.source import FOLDER_FORMATS, METADATA_NAMES, Source
from actstore.datasets.splits import README
from actstore.errors import ConfigError, FormatError
from actstore.integrity import read_json, whole_number
from actstore.io_utils import write_json_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mark:
    """Where row `row` can be read from: `position` in file `file` of the dataset. JSONL: the text
    file's own tell(), after its line `line` (blank lines may follow it); tar shards: the byte offset
    of a sample's first header (line 0)."""

    row: int
    file: int
    position: int
    line: int


@dataclass(frozen=True)
class Scan:
    """n_samples: rows after dataset.limit; labels: label_id = position in this list; marks (JSONL
    and tar shards): the first at row 0, then every ~MARK_CHARS of text (JSONL), or at every
    shard's start and every MARK_SAMPLES samples (tar). What the data was when scanned, so
    that data changed since is refused rather than read at stale rows and positions: stamps, each
    data file's (size, mtime_ns); listing (a folder of files), the sha256 of the file names in order.
    runs (a folder of files, folder_format image_folder or text_folder): (folder relative to the
    root, "" for the root; files; the sha256 of their names, folders.names_digest) of each run of
    consecutive files in one folder, over every file, so that a part's job lists only the folders
    of its rows and checks them. metadata: an image folder's metadata file (source.METADATA_NAMES,
    at its root; "" for none), whose (size, mtime_ns) is then the one stamp. features: the file whose
    ClassLabel names the labels (source.features_file: README.md or dataset_info.json; "" for none),
    its stamp after the data files': its names, changed since, would label rows by other names."""

    n_samples: int
    labels: list
    marks: tuple[Mark, ...] = ()
    stamps: tuple[tuple[int, int], ...] = ()
    listing: str = ""
    runs: tuple[tuple[str, int, str], ...] = ()
    folder_format: str = ""
    metadata: str = ""
    features: str = ""


def mark_before(scan: Scan, row: int) -> Mark:
    """The scan's last mark at or before `row`: where a job reading from `row` on starts."""
    if not scan.marks:  # a table's scan, or one edited: JSON lines and tar shards are read from marks
        raise ConfigError(f"the dataset's scan holds no marks of where its rows start; {RESCAN}")
    return scan.marks[bisect.bisect_right([m.row for m in scan.marks], row) - 1]


def joined(scans: Iterable[Scan], files: tuple[Path, ...], fields: Fields) -> Scan:
    """The scan of a dataset's `files` from scans of each file alone, in file order: rows counted on
    across them, each file's marks moved to its rows and its file index (its first mark, at its
    start, stays: a job may start there), labels ordered as one pass over them all would order
    them (label_list keeps the first of labels with the same text), or a ClassLabel's names
    (scan_labels); ConfigError when one file's labels are booleans and another's not (one_kind)."""
    n_rows, labels, marks, first = 0, [], [], None
    for file, scan in enumerate(scans):
        marks += [Mark(m.row + n_rows, m.file + file, m.position, m.line) for m in scan.marks]
        for label in scan.labels:
            first = one_kind(first, label, str(files[file]))
        labels += scan.labels
        n_rows += scan.n_samples
    return Scan(n_rows, scan_labels(labels, fields), tuple(marks))


def scan_labels(labels: Iterable[Any], fields: Fields) -> list:
    """A scan's labels: the ClassLabel's names where the features name them (label_id = class id, in
    every split, whichever classes it holds), else the labels read, ordered by label_list."""
    return list(fields.classes) if fields.classes is not None else label_list(labels)


FEATURES_NAMES = (README, "dataset_info.json")  # a features file's (Source.features_file) names
RESCAN = "scan it again (the workflow: snakemake --forcerun extract_scan)"
DataState = tuple[tuple[tuple[int, int], ...], str]  # Scan.stamps, Scan.listing


def data_state(source: Source) -> DataState:
    """What `source`'s data is now (see Scan): each data file's (size, mtime_ns), or for a folder
    of files (images, texts) the digest of its listing. Taken before scanning, so that a change
    during the scan is seen too."""
    if source.format in FOLDER_FORMATS:
        return _stamps((source.metadata,) if source.metadata else ()), _listing(source)
    return _stamps(_stamped_files(source)), ""


def _stamped_files(source: Source) -> tuple[Path, ...]:
    """The files a table's or JSON lines' scan stamps: the data files, then its features file."""
    return (*source.files, *([source.features_file] if source.features_file else []))


def _features_name(source: Source) -> str:
    return source.features_file.name if source.features_file else ""


def _stamps(files: Iterable[Path]) -> tuple[tuple[int, int], ...]:
    return tuple((s.st_size, s.st_mtime_ns) for s in (p.stat() for p in files))


def stamped(scan: Scan, source: Source, state: DataState | None = None) -> Scan:
    """`scan` with `state` (default: what `source`'s data is now)."""
    stamps, listing = state or data_state(source)
    return replace(scan, stamps=stamps, listing=listing, metadata=source.metadata.name if source.metadata else "",
                   features=_features_name(source))


def check_unchanged(scan: Scan, source: Source) -> None:
    """ConfigError naming the data that changed since `scan` was taken (a file's size or mtime, the
    number of files, a folder's listing of images or texts, an image folder's metadata file, the
    features file naming the labels)."""
    stamps, listing = data_state(source)
    if listing != scan.listing:
        raise files_changed(source.root)
    if source.format in FOLDER_FORMATS:
        return check_metadata_unchanged(scan, source.root)
    if (features := _features_name(source)) != scan.features:
        raise ConfigError(f"{source.root}: its features file (the labels' ClassLabel names) is {features or 'none'}, "
                          f"{scan.features or 'none'} when the dataset was scanned; {RESCAN}")
    if len(stamps) != len(scan.stamps):
        raise ConfigError(f"{source.root}: holds {len(source.files)} data files, "
                          f"{len(scan.stamps) - bool(features)} when the dataset was scanned; {RESCAN}")
    for path, was, stamp in zip(_stamped_files(source), scan.stamps, stamps):
        if tuple(was) != stamp:
            raise ConfigError(f"{path}: changed since the dataset was scanned (size {was[0]} -> {stamp[0]} bytes, "
                              f"or its modification time); {RESCAN}")


def check_metadata_unchanged(scan: Scan, root: Path) -> None:
    """ConfigError naming an image folder's metadata file if it changed since `scan` (or is gone)."""
    if not scan.metadata:
        return
    try:
        stat = (root / scan.metadata).stat()
    except FileNotFoundError:
        raise ConfigError(f"{root / scan.metadata}: gone since the dataset was scanned; {RESCAN}") from None
    if (stat.st_size, stat.st_mtime_ns) != tuple(scan.stamps[0]):
        raise ConfigError(f"{root / scan.metadata}: changed since the dataset was scanned; {RESCAN}")


def files_changed(folder: Path, how: str = "") -> ConfigError:
    """The error for a folder of files (or one of its folders) whose listing changed since the scan."""
    return ConfigError(f"{folder}: its files changed since the dataset was scanned{f' ({how})' if how else ''}; "
                       f"{RESCAN}")


def _listing(source: Source) -> str:
    digest = hashlib.sha256()
    for path in source.files:
        digest.update(str(path).encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


def write_scan(scan: Scan, path: str | Path) -> None:
    """The scan as one JSON file, written atomically."""
    write_json_atomic(path, {"n_samples": scan.n_samples, "labels": scan.labels,
                             "marks": [[m.row, m.file, m.position, m.line] for m in scan.marks],
                             "stamps": [list(stamp) for stamp in scan.stamps], "listing": scan.listing,
                             "runs": [list(run) for run in scan.runs], "folder_format": scan.folder_format,
                             "metadata": scan.metadata, "features": scan.features},
                      indent=None)
    log.info("dataset scan: %d rows, %d labels, %d marks -> %s", scan.n_samples, len(scan.labels),
             len(scan.marks), path)


def read_scan(path: str | Path) -> Scan:
    """A scan write_scan wrote; FormatError naming the file and field when it is not one."""
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, dict):
        raise FormatError(f"{path}: a dataset scan is a JSON object")
    n_samples, labels, marks, stamps, listing = (data.get(k) for k in ("n_samples", "labels", "marks", "stamps",
                                                                       "listing"))
    if not whole_number(n_samples) or not n_samples:
        raise FormatError(f"{path}: n_samples must be a whole number of at least 1, got {n_samples!r:.60}")
    if not isinstance(labels, list) or not all(isinstance(label, (str, int, float)) for label in labels) \
            or len(set(labels)) < len(labels):  # label_id = position: a label twice, or a list, names no class
        raise FormatError(f"{path}: labels must be a list of distinct strings, numbers or booleans")
    if not isinstance(listing, str):
        raise FormatError(f"{path}: listing must be a string")
    marks = [Mark(*m) for m in _numbers(marks, (0, 0, 0, 0), path, "marks")]
    if marks and (marks[0] != Mark(0, 0, 0, 0) or any(a.row > b.row for a, b in zip(marks, marks[1:]))
                  or marks[-1].row > n_samples):
        raise FormatError(f"{path}: marks must start at row 0 of the first file and go up to n_samples")
    stamps = tuple(_numbers(stamps, (0, -1 << 63), path, "stamps"))  # (size, mtime_ns): see _numbers
    features = data.get("features", "")  # scans of earlier releases hold none
    if features not in ("", *FEATURES_NAMES) or (features and not stamps):
        raise FormatError(f"{path}: features must be one of {', '.join(FEATURES_NAMES)} with its stamp, or empty")
    if any(mark.file >= len(stamps) - bool(features) for mark in marks):  # a job would read no file from there
        raise FormatError(f"{path}: marks name file {max(mark.file for mark in marks)} (from 0), but stamps "
                          f"hold {len(stamps) - bool(features)} data files")
    runs = _runs(data.get("runs", []), n_samples, path)  # scans of earlier releases hold none
    folder_format = data.get("folder_format", "")
    if folder_format not in (FOLDER_FORMATS if runs else ("",)):
        raise FormatError(f"{path}: folder_format must be image_folder or text_folder with runs, empty without")
    metadata = data.get("metadata", "")
    if metadata not in ("", *METADATA_NAMES) or (metadata and len(stamps) != 1):
        raise FormatError(f"{path}: metadata must be one of {', '.join(METADATA_NAMES)} with its one stamp, or empty")
    return Scan(n_samples, labels, tuple(marks), stamps, listing, runs, folder_format, metadata, features)


def _runs(value: Any, n_samples: int, path: Path) -> tuple[tuple[str, int, str], ...]:
    """A scan's runs of files: [folder, files, sha256] each, the folder inside the dataset's root,
    together at least n_samples files."""
    def good(run: Any) -> bool:
        return (isinstance(run, list) and len(run) == 3 and isinstance(run[0], str) and _inside(run[0])
                and whole_number(run[1]) and run[1] > 0 and isinstance(run[2], str) and len(run[2]) == 64)

    if not isinstance(value, list) or not all(map(good, value)):
        raise FormatError(f"{path}: runs must be a list of [folder inside the dataset, files, sha256 of their names]")
    if value and sum(run[1] for run in value) < n_samples:
        raise FormatError(f"{path}: runs hold fewer files than n_samples")
    return tuple((folder, count, digest) for folder, count, digest in value)


def _inside(folder: str) -> bool:
    """A folder relative to the dataset's root that stays inside it ("" = the root)."""
    return folder == "" or not (folder.startswith("/") or "\0" in folder
                                or any(part in ("", ".", "..") for part in folder.split("/")))


def _numbers(value: Any, least: tuple[int, ...], path: Path, field: str) -> list[tuple[int, ...]]:
    """A list of lists of whole numbers, each at least its place's `least`, as tuples. A stamp's mtime_ns
    (os.stat's, an int64) is negative for a file dated before 1970, as an archive's members may be."""
    if not isinstance(value, list) or not all(
            isinstance(item, list) and len(item) == len(least) and all(map(whole_number, item, least))
            for item in value):
        raise FormatError(f"{path}: {field} must be a list of lists of {len(least)} whole numbers")
    return [tuple(item) for item in value]
