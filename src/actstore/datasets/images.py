"""Images: a folder of image files (ImageFolder convention: label = first-level subfolder), a
table column of image bytes / {bytes, path} structs (the Hub's Image feature), or tar shards'
members (webdataset.py). ImageOpener decodes them in whichever process asks, so DataLoader workers
do the reading and decoding."""
from __future__ import annotations

import collections
import hashlib
import io
import itertools
import os
import stat
from pathlib import Path
from typing import Any

from actstore.datasets.core import Sample, label_list
from actstore.datasets.scan import RESCAN, Scan
from actstore.datasets.source import IMAGE_SUFFIXES, Source
from actstore.datasets.tables import read_block
from actstore.datasets.webdataset import member_file
from actstore.errors import ConfigError


def scan_image_folder(source: Source, limit: int | None, by_folder: bool) -> Scan:
    """The scan of the first `limit` images: labels, the first-level folder names; `by_folder` (a
    folder, not a glob's files, which a folder's listing would not match): the runs of images in
    one folder (Scan.runs) over every image, so that a part's job lists only its own folders."""
    files = source.files[:limit]
    runs = []
    for folder, paths in itertools.groupby(source.files, key=lambda path: path.parent) if by_folder else ():
        names = [path.name for path in paths]
        runs.append((folder.relative_to(source.root).as_posix() if folder != source.root else "", len(names),
                     names_digest(names)))
    return Scan(len(files), label_list(_folder_label(source.name(p)) for p in files), runs=tuple(runs))


def read_image_folder(source: Source, rows: range) -> list[Sample]:
    names = [source.name(source.files[i]) for i in rows]
    return [Sample(i, name, _folder_label(name)) for i, name in zip(rows, names)]


def read_image_folder_runs(root: Path, scan: Scan, rows: range) -> list[Sample]:
    """The samples of `rows` from the scan's runs (Scan.runs), listing only the folders they are in,
    each once and not into its subfolders: a part's job of ImageNet's 1.28M images in 1,000 folders
    lists its own share, where resolving the folder listed (and held) every image. ConfigError
    naming a folder whose images changed since the scan: each folder is checked by every part
    reading from it, so all the parts together check every image the scan counted."""
    images_in = collections.Counter()
    for folder, count, _ in scan.runs:
        images_in[folder] += count
    listed: dict[str, list[str]] = {}
    samples, start, before = [], 0, collections.Counter()  # before: a folder's images in earlier runs
    for folder, count, digest in scan.runs:
        if start >= rows.stop:
            break
        if start + count > rows.start:
            if folder not in listed:
                listed[folder] = _images_of(root, folder, images_in[folder])
            run = listed[folder][before[folder]:before[folder] + count]
            if names_digest(run) != digest:
                raise _changed(root / folder)
            for row in range(max(rows.start, start), min(rows.stop, start + count)):
                name = f"{folder}/{run[row - start]}" if folder else run[row - start]
                samples.append(Sample(row, name, _folder_label(name)))
        before[folder] += count
        start += count
    return samples


def names_digest(names: list[str]) -> str:
    """The sha256 of a folder's image names in order (Scan.runs)."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


def _images_of(root: Path, folder: str, expected: int) -> list[str]:
    """The image names directly in `folder` (relative to `root`), sorted as source.files_under
    orders them (links to files kept); ConfigError unless it is a folder of the dataset reached
    through no link (the walk that scanned it entered none) holding `expected` images."""
    path = root
    for part in folder.split("/") if folder else ():
        path = path / part
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise _changed(path, "no longer a folder")
        except FileNotFoundError:
            raise _changed(path, "gone") from None
    try:
        with os.scandir(path) as entries:
            names = sorted(e.name for e in entries if e.is_file() and Path(e.name).suffix.lower() in IMAGE_SUFFIXES)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot list the images of this folder ({exc.strerror})") from None
    if len(names) != expected:
        raise _changed(path, f"{len(names)} images, {expected} when scanned")
    return names


def _changed(folder: Path, how: str = "") -> ConfigError:
    return ConfigError(f"{folder}: its images changed since the dataset was scanned{f' ({how})' if how else ''}; "
                       f"{RESCAN}")


def _folder_label(name: str) -> str | None:
    return name.split("/")[0] if "/" in name else None


class ImageOpener:
    """sample -> RGB PIL image. Table images are read one block at a time (a Parquet row group or
    an Arrow record batch, the image column only); the last block stays cached as Arrow data, and only
    the rows asked for become Python bytes (converting a whole 100-row block of 70 KB JPEGs cost 3x
    reading it, and a worker decoding 16 images of a block may need none of its other rows)."""

    def __init__(self, source: Source, field: str | None = None):
        self.source = source
        self.field = field
        self._block: tuple[tuple[int, int], Any] | None = None  # (shard, block), its image column

    def __call__(self, sample: Sample) -> Any:
        """The sample's image decoded to RGB; ConfigError naming the file (and column) if it cannot be."""
        return _decode(*self._locate(sample))

    def check(self, sample: Sample) -> None:
        """The sample's image opened and its structure verified without decoding the pixels (PIL's
        verify: headers, chunk checksums); ConfigError naming it. Pixel data a header cannot vouch
        for (a JPEG's truncated scan) is named when it is decoded."""
        from PIL import Image

        file, where = self._locate(sample)
        try:
            with Image.open(file) as img:
                img.verify()
        except (OSError, SyntaxError, ValueError) as exc:  # PIL raises SyntaxError for broken headers
            raise ConfigError(f"{where}: not a readable image ({exc})") from None

    def _locate(self, sample: Sample) -> tuple[Any, str]:
        """(path or file object, its name for errors)."""
        if sample.ref is None:
            path = self.source.root / sample.text
            return path, str(path)
        if self.source.format == "webdataset":  # ref: the image member's (shard, offset, size)
            shard, offset, size = sample.ref
            path = self.source.files[shard]
            return member_file(path, offset, size), f"{path}: {sample.text}"
        shard, block, row = sample.ref
        where = f"{self.source.files[shard]}: {sample.text}, column {self.field!r}"
        return self._image_file(self._column(shard, block)[row].as_py(), shard, where), where

    def _column(self, shard: int, block: int) -> Any:
        if self._block is None or self._block[0] != (shard, block):
            self._block = ((shard, block), read_block(self.source.format, self.source.files[shard], block, self.field))
        return self._block[1]

    def _image_file(self, value: Any, shard: int, where: str) -> Any:
        """Bytes as a file object, or the path (relative to the shard's folder) when no bytes are stored."""
        if isinstance(value, dict):
            value = value.get("bytes") or value.get("path")
        if isinstance(value, bytes):
            return io.BytesIO(value)
        if isinstance(value, str):
            return self.source.files[shard].parent / value
        raise ConfigError(f"{where}: holds no image (null)")

    def __getstate__(self) -> dict[str, Any]:  # workers start with no cached block
        return {**self.__dict__, "_block": None}


def check_images(opener: ImageOpener, samples: list[Sample], threads: int) -> None:
    """Every sample's image verified (ImageOpener.check) in `threads` threads, before the weights
    load; ConfigError naming the first bad one in sample order."""
    from concurrent.futures import ThreadPoolExecutor

    if opener.field is not None:  # table images: blocks are read in order, one at a time
        for sample in samples:
            opener.check(sample)
        return
    with ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(opener.check, samples))


def _decode(file: Any, where: str) -> Any:
    """An RGB image from a path or file object; ConfigError naming `where` if it cannot be decoded."""
    from PIL import Image

    try:
        with Image.open(file) as img:
            return img.convert("RGB")
    except OSError as exc:  # truncated or not an image: PIL's message names no file
        raise ConfigError(f"{where}: cannot decode the image ({exc})") from None
