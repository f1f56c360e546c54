"""A dataset's scan: what every extraction job needs of the whole dataset (its row count, its labels)
and, for JSONL and tar shards, where rows start, from one pass over every row. The Snakemake
workflow scans once (rule extract_scan) and each part's job reads only its own rows; load_dataset
scans in-process when given no scan."""
from __future__ import annotations

import bisect
import hashlib
import logging
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

from actstore.datasets.core import Fields, label_list, one_kind, part_range
from actstore.datasets.source import FOLDER_FORMATS, METADATA_NAMES, Source, resolve_source
from actstore.datasets.splits import README
from actstore.errors import ConfigError, FormatError
from actstore.formats.extract.layout import PART_META
from actstore.integrity import SEAL_KEY, is_sha256, read_json, whole_number
from actstore.io_utils import canonical_sha256, write_json_atomic

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


def check_unchanged(scan: Scan, source: Source, advice: str = RESCAN) -> None:
    """ConfigError naming the data that changed since `scan` was taken (a file's size or mtime, the
    number of files, a folder's listing of images or texts, an image folder's metadata file, the
    features file naming the labels), ending with `advice` (what to do)."""
    stamps, listing = data_state(source)
    if listing != scan.listing:
        raise files_changed(source.root, _listing_change(scan, source), advice)
    if source.format in FOLDER_FORMATS:
        return check_metadata_unchanged(scan, source.root, advice)
    if (features := _features_name(source)) != scan.features:
        raise ConfigError(f"{source.root}: its features file (the labels' ClassLabel names) is {features or 'none'}, "
                          f"{scan.features or 'none'} when the dataset was scanned; {advice}")
    if len(stamps) != len(scan.stamps):
        raise ConfigError(f"{source.root}: holds {len(source.files)} data files, "
                          f"{len(scan.stamps) - bool(features)} when the dataset was scanned; {advice}")
    for path, was, stamp in zip(_stamped_files(source), scan.stamps, stamps):
        if tuple(was) != stamp:
            raise ConfigError(f"{path}: changed since the dataset was scanned ({_stamp_change(path, was, stamp)}); "
                              f"{advice}")


def _listing_change(scan: Scan, source: Source) -> str:
    """How a folder's listing moved: its number of files, where the scan counted them (its runs)."""
    scanned = sum(files for _, files, _ in scan.runs)
    if scan.runs and scanned != len(source.files):
        return f"{len(source.files)} files, {scanned} when scanned"
    return "other file names" if scan.runs else ""


def _stamp_change(path: Path, was: tuple[int, int], now: tuple[int, int]) -> str:
    """How a file's (size, mtime_ns) moved. The scan holds no digest of the bytes, so a file whose mtime
    alone moved (a touch, a copy without its times, an edit keeping the size) may hold other bytes."""
    if was[0] != now[0]:
        return f"size {was[0]} -> {now[0]} bytes"
    seconds, nanoseconds = divmod(was[1], 10**9)  # exactly: a float has no 19 digits
    return (f"its modification time moved, its size ({now[0]} bytes) did not, so it may have been edited in "
            f"place; if its bytes are those scanned, `touch -d @{seconds}.{nanoseconds:09d} "
            f"{shlex.quote(str(path))}` gives it back its scanned mtime")


def check_extraction_data_unchanged(section: dict[str, Any], extract_dir: Path, *,
                                    source: Source | None = None) -> None:
    """ConfigError naming the data file (or folder) if the finished extraction in `extract_dir` (its
    extract.json) was scanned from other data than dataset `section` names now: its dataset_scan.json's
    stamps and listing against the data (check_unchanged). Only where the extract hash names the data
    by its path alone (dataset.identity path, or unset on a config of earlier releases): there, data
    edited in place (rows appended) or another file at that path (a relative path in another checkout)
    would find the old activations by hash. Under `stat` other data hashes apart, and a file touched
    under `content` is the same data. For the main Snakemake process's parse: it stats the data files
    (an image folder: names its listing, made for the hash already) and reads the scan, never a row.
    `source`: the section's data as resolve_source found it, where the caller has it (resolved here if not)."""
    from actstore.hashing import dataset_identity  # hashing imports the datasets (its data digest)

    index, scan_file = extract_dir / "extract.json", extract_dir / "dataset_scan.json"
    if dataset_identity(section) or not index.is_file() or not scan_file.is_file():
        return
    identity = "dataset.identity: path" if section.get("identity") else \
        "dataset.identity unset on a config of earlier releases, which hashes as `path`"
    if source is None:
        source = resolve_source(section["path"], section.get("format", "auto"), section.get("split", "train"))
    check_unchanged(read_scan(scan_file), source,
                    advice=f"the finished extraction {extract_dir} holds the activations of the data as it was "
                           f"scanned ({scan_file}), and its hash names the data by its path alone ({identity}). Set "
                           f"dataset.identity: stat (or content) to extract the data as it is now under a new "
                           f"hash, restore the data as it was, or move {extract_dir} away to extract the data "
                           f"again under the same hash")


def cut_from_scan(part_dir: Path, scan_file: Path, parts: int) -> bool:
    """Whether finished extraction part `part_dir` (one of `parts`), written before scan file `scan_file`,
    holds rows of the data that scan saw: a scan lost since (a temp file up to 2026-11-27) and scanned again
    to redo another part. Its part.json records the scan's row count, its own rows and the labels, and no data
    file the scan stamps was modified after that part.json was written (the stamps' own blind spot: an mtime
    set back). Then the part is kept, not extracted again (rules/common.smk part_scan). A folder of files
    (image_folder, text_folder) is stamped by its listing alone, which the part does not record: its parts
    are redone."""
    scan, part_json = read_scan(scan_file), part_dir / PART_META
    record = read_json(part_json)
    if scan.listing or not scan.stamps or not isinstance(record, dict):
        return False
    rows = part_range(scan.n_samples, parts, int(part_dir.name.removeprefix("part-")))
    written = part_json.stat().st_mtime_ns
    return (record.get("n_dataset_samples") == scan.n_samples
            and record.get("sample_range") == ([rows.start, rows.stop] if rows else [0, 0])  # as part_meta writes it
            and (record.get("dataset") or {}).get("labels") == scan.labels
            and all(mtime <= written for _, mtime in scan.stamps))


def check_metadata_unchanged(scan: Scan, root: Path, advice: str = RESCAN) -> None:
    """ConfigError naming an image folder's metadata file if it changed since `scan` (or is gone)."""
    if not scan.metadata:
        return
    try:
        stat = (root / scan.metadata).stat()
    except FileNotFoundError:
        raise ConfigError(f"{root / scan.metadata}: gone since the dataset was scanned; {advice}") from None
    if (stat.st_size, stat.st_mtime_ns) != tuple(scan.stamps[0]):
        raise ConfigError(f"{root / scan.metadata}: changed since the dataset was scanned; {advice}")


def files_changed(folder: Path, how: str = "", advice: str = RESCAN) -> ConfigError:
    """The error for a folder of files (or one of its folders) whose listing changed since the scan."""
    return ConfigError(f"{folder}: its files changed since the dataset was scanned{f' ({how})' if how else ''}; "
                       f"{advice}")


def _listing(source: Source) -> str:
    digest = hashlib.sha256()
    for path in source.files:
        digest.update(str(path).encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


def write_scan(scan: Scan, path: str | Path) -> None:
    """The scan as one JSON file, written atomically, sealed: SEAL_KEY holds the canonical sha256 of the
    rest (as a stage config's hash does its config), which read_scan checks."""
    content = {"n_samples": scan.n_samples, "labels": scan.labels,
               "marks": [[m.row, m.file, m.position, m.line] for m in scan.marks],
               "stamps": [list(stamp) for stamp in scan.stamps], "listing": scan.listing,
               "runs": [list(run) for run in scan.runs], "folder_format": scan.folder_format,
               "metadata": scan.metadata, "features": scan.features}
    write_json_atomic(path, {**content, SEAL_KEY: canonical_sha256(content)}, indent=None)
    log.info("dataset scan: %d rows, %d labels, %d marks -> %s", scan.n_samples, len(scan.labels),
             len(scan.marks), path)


def read_scan(path: str | Path) -> Scan:
    """A scan write_scan wrote; FormatError naming the file and field when it is not one, or naming the
    file when its content, well formed, is not what write_scan sealed."""
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
    _check_seal(data, path)  # after the fields: one malformed is named by its own check
    return Scan(n_samples, labels, tuple(marks), stamps, listing, runs, folder_format, metadata, features)


SEAL_ADVICE = ("delete it to have the data scanned again (the workflow: snakemake --forcerun extract_scan, "
               "which extracts every part again)")


def _check_seal(record: dict[str, Any], path: Path) -> None:
    """FormatError naming scan file `path` if `record`, its content, is not what write_scan sealed: its stamps
    match the untouched data, so a row count cut by hand passed every other check, and every part redone
    from it silently left the rows past it out (review 65). A scan without a seal, written before scans
    were sealed (2026-11-29), is read as it stands: a run finished then still redoes a lost part from it."""
    if SEAL_KEY not in record:
        return
    seal = record[SEAL_KEY]
    if not is_sha256(seal):
        raise FormatError(f"{path}: {SEAL_KEY} must be a sha256 (64 lowercase hex digits), got {seal!r:.70}; "
                          f"{SEAL_ADVICE}")
    digest = canonical_sha256({key: value for key, value in record.items() if key != SEAL_KEY})
    if digest != seal:
        raise FormatError(f"{path}: edited since it was written (its content hashes to {digest}, its {SEAL_KEY} "
                          f"records {seal}), so the rows it gives each part cannot be trusted; {SEAL_ADVICE}")


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
