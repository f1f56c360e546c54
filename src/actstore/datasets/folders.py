"""A folder of files, a sample each, in path order, labelled by their first-level folder (the
ImageFolder convention): images (image_folder), or texts (text_folder: every file under the path,
or those a glob matches, as IMDB's aclImdb and 20 Newsgroups ship: `aclImdb/train/[np]*/*.txt`;
UTF-8, or dataset.encoding: 20 Newsgroups' posts are latin-1).

The scan records each run of consecutive files in one folder (Scan.runs: folder, count, sha256 of
the names), so a part's job lists only the folders of its rows, each once and not into its
subfolders, and checks them against the scan: ImageNet's 1.28M images in 1,000 folders are
listed once by the scan, and ~16 folders by each of 64 parts. The scan reads every text file
(decoded, nothing kept), so a bad one is named before any part's job starts. An image folder's
metadata file (folder_metadata.py) gives its images their fields, and their labels when
dataset.label_field names one."""
from __future__ import annotations

import collections
import hashlib
import itertools
import os
import stat
from pathlib import Path

from tqdm import tqdm

from actstore.datasets.core import Fields, Sample, check_unicode, label_list
from actstore.datasets.folder_metadata import described, rows_of, scan_metadata
from actstore.datasets.json_array import MAX_ELEMENT_CHARS
from actstore.datasets.scan import Scan, check_metadata_unchanged, files_changed
from actstore.datasets.source import Source, folder_file
from actstore.errors import ConfigError


def scan_folder(source: Source, limit: int | None, by_folder: bool, fields: Fields, progress: bool = False) -> Scan:
    """The scan of the first `limit` files: labels, the first-level folder names (or the metadata
    file's label field); a text folder's files read and checked, an image folder's metadata file
    checked against every image. `by_folder` (a folder, not a glob's files, which a folder's listing
    would not match): the runs of files in one folder (Scan.runs) over every file."""
    files = source.files[:limit]
    if source.format == "text_folder":
        for path in tqdm(files, desc="scan dataset", unit="file", disable=not progress):
            read_text(path, fields.encoding)
    labels = [folder_label(_unicode_name(source, p)) for p in files]
    if source.metadata:  # every image checked against its row, the limit's labelled from theirs if asked
        named = [source.name(p) for p in source.files]
        labelled = scan_metadata(source.metadata, named, fields)
        labels = [labelled[name] for name in named[:limit]] if fields.label_required else labels
    runs = []
    for folder, paths in itertools.groupby(source.files, key=lambda path: path.parent) if by_folder else ():
        names = [path.name for path in paths]
        runs.append((_relative(folder, source.root), len(names), names_digest(names)))
    return Scan(len(files), label_list(labels), runs=tuple(runs), folder_format=source.format if by_folder else "")


def _unicode_name(source: Source, path: Path) -> str:
    """A file's name relative to the root; ConfigError naming it when it is not UTF-8 on disk (it is
    listed with surrogates: a sample's text no writer stores as UTF-8, failing after the model ran)."""
    name = source.name(path)
    check_unicode(name, str(source.root), f"the file name {name!r} (not UTF-8 on disk)")
    return name


def read_folder(source: Source, rows: range, fields: Fields) -> list[Sample]:
    """The samples of `rows` from the whole listing (`source.files`)."""
    named = {i: source.name(source.files[i]) for i in rows}
    return _samples(source.format, source.root, named, fields, source.metadata)


def read_folder_runs(root: Path, scan: Scan, rows: range, fields: Fields) -> list[Sample]:
    """The samples of `rows` from the scan's runs, listing only the folders they are in, each once
    and not into its subfolders. ConfigError naming a folder whose files changed since the scan:
    each folder is checked by every part reading from it, so all the parts together check every
    file the scan counted."""
    files_in = collections.Counter()
    for folder, count, _ in scan.runs:
        files_in[folder] += count
    check_metadata_unchanged(scan, root)
    listed: dict[str, list[str]] = {}
    named, start, before = {}, 0, collections.Counter()  # before: a folder's files in earlier runs
    for folder, count, digest in scan.runs:
        if start >= rows.stop:
            break
        if start + count > rows.start:
            if folder not in listed:
                listed[folder] = _files_of(root, folder, scan.folder_format, files_in[folder])
            run = listed[folder][before[folder]:before[folder] + count]
            if names_digest(run) != digest:
                raise files_changed(root / folder)
            for row in range(max(rows.start, start), min(rows.stop, start + count)):
                named[row] = f"{folder}/{run[row - start]}" if folder else run[row - start]
        before[folder] += count
        start += count
    return _samples(scan.folder_format, root, named, fields, root / scan.metadata if scan.metadata else None)


def _samples(fmt: str, root: Path, named: dict[int, str], fields: Fields, metadata: Path | None) -> list[Sample]:
    """The samples of rows -> names: an image's, its name (the image is decoded later) and its
    metadata row's fields; a text file's, its text, the name kept."""
    if fmt == "text_folder":
        return [Sample(row, read_text(root / name, fields.encoding), folder_label(name), {"file": name})
                for row, name in named.items()]
    if metadata is None:
        return [Sample(row, name, folder_label(name)) for row, name in named.items()]
    rows = rows_of(metadata, named.values())
    samples = []
    for row, name in named.items():
        label, kept = described(rows[name], fields, f"{metadata}: the row of {name!r}", csv=metadata.suffix == ".csv")
        samples.append(Sample(row, name, label if fields.label_required else folder_label(name), kept))
    return samples


# A text file larger than this is named rather than read: it is one sample's text, held whole
# (and tokenized whole before max_seq_length cuts it), as a JSON line is bounded (jsonl.MAX_LINE_CHARS).
MAX_TEXT_BYTES = MAX_ELEMENT_CHARS


def read_text(path: Path, encoding: str) -> str:
    """A text file's text, as written; ConfigError naming the file unless it is text in `encoding`
    of at most MAX_TEXT_BYTES bytes (never more read: a 5 GB log held 5 GB, and its text more)."""
    with path.open("rb") as fh:
        data = fh.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise ConfigError(f"{path}: a text file larger than {MAX_TEXT_BYTES} bytes, not one sample's text "
                          f"(split it, or leave it out with a glob in dataset.path)")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not {encoding} text (byte {exc.start + 1}: {exc.reason}; "
                          f"another encoding: dataset.encoding)") from None


def folder_label(name: str) -> str | None:
    """The first-level folder of a name relative to the root; None for a file in the root."""
    return name.split("/")[0] if "/" in name else None


def names_digest(names: list[str]) -> str:
    """The sha256 of a folder's file names in order (Scan.runs)."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


def _relative(folder: Path, root: Path) -> str:
    return folder.relative_to(root).as_posix() if folder != root else ""


def _files_of(root: Path, folder: str, fmt: str, expected: int) -> list[str]:
    """The names of the dataset's files directly in `folder` (relative to `root`; an image folder's:
    images), sorted as source.files_under orders them (links to files kept); ConfigError unless
    it is a folder of the dataset reached through no link (the walk that scanned it entered none)
    holding `expected` of them."""
    path = root
    for part in folder.split("/") if folder else ():
        path = path / part
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise files_changed(path, "no longer a folder")
        except FileNotFoundError:
            raise files_changed(path, "gone") from None
    try:
        with os.scandir(path) as entries:
            names = sorted(e.name for e in entries if e.is_file() and folder_file(e.name, fmt))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot list the files of this folder ({exc.strerror})") from None
    if len(names) != expected:
        raise files_changed(path, f"{len(names)} files, {expected} when scanned")
    return names
