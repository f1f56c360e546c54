"""WebDataset tar shards: a sample is the consecutive members sharing a key (the member's path up
to the first dot of its name: `dir/000123.jpg` and `dir/000123.cls` are sample `dir/000123`, its
extensions `jpg` and `cls`). Only headers are read to find the samples, skipping over the data; the
scan marks where samples start (every shard's start, every MARK_SAMPLES samples), so a part's job
walks the headers from the mark before its rows, never the shards before it. Images are read by
byte offset (ImageOpener): a member's name is never a path on disk, so `/x` or `../x` reads nothing
outside its tar."""
from __future__ import annotations

import io
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

from tqdm import tqdm

from actstore.datasets import tar
from actstore.datasets.core import Fields, Sample, check_unicode, label_list
from actstore.datasets.scan import Mark, Scan, mark_before
from actstore.datasets.source import IMAGE_SUFFIXES, Source
from actstore.errors import ConfigError

MARK_SAMPLES = 1024  # samples between marks: what a job walks the headers of, at most, before its first row
FIRST = Mark(0, 0, 0, 0)
ESTIMATE_BYTES = 4 << 20  # bytes of the first shard whose samples estimate_samples counts


@dataclass(frozen=True)
class TarSample:
    shard: int
    start: int  # byte offset of its first member's first header (a pax or GNU long-name header's)
    key: str
    image: tuple[int, int]  # (byte offset, size) of the image member's data
    label: Any
    kept: dict[str, Any]  # dataset.keep_fields: the members of those extensions, decoded


def scan_webdataset(source: Source, fields: Fields, limit: int | None, progress: bool = False) -> Scan:
    """The scan of the first `limit` samples: each checked to have its image (and dataset.label_field
    member), its label read; no sample is kept, so memory holds the distinct labels and the marks."""
    n_rows, labels, marks = 0, {}, [FIRST]
    samples = itertools.islice(_samples(source, fields, FIRST), limit)  # no sample past the limit is read
    for sample in tqdm(samples, desc="scan dataset", unit="sample", disable=not progress):
        if sample.shard != marks[-1].file:  # every shard's first sample: its headers start at 0
            marks.append(Mark(n_rows, sample.shard, 0, 0))
        elif n_rows and n_rows % MARK_SAMPLES == 0:
            marks.append(Mark(n_rows, sample.shard, sample.start, 0))
        labels[sample.label] = None
        n_rows += 1
    return Scan(n_rows, label_list(labels), tuple(marks))


def read_webdataset(source: Source, fields: Fields, rows: range, scan: Scan) -> list[Sample]:
    """The samples of `rows` (text `<shard>/<key>`, ref = (shard, image offset, image size)), from
    the scan's last mark before them."""
    mark = mark_before(scan, rows.start)
    samples: list[Sample] = []
    read = itertools.islice(_samples(source, fields, mark), rows.stop - mark.row)  # not a shard after them
    for sample_idx, sample in enumerate(read, start=mark.row):
        if sample_idx >= rows.start:
            name = f"{source.name(source.files[sample.shard])}/{sample.key}"
            samples.append(Sample(sample_idx, name, sample.label, sample.kept, ref=(sample.shard, *sample.image)))
    return samples


def member_file(path: Path, offset: int, size: int) -> IO[bytes]:
    """`size` bytes at `offset` of tar `path` (one member's data) as a file object."""
    with path.open("rb") as fh:
        return io.BytesIO(_read(fh, path, offset, size))


def estimate_samples(files: tuple[Path, ...]) -> int:
    """Samples of tar `files`, for resource requests at parse time, which must not read the dataset:
    those starting in the first ESTIMATE_BYTES of the first shard, scaled by the shards' sizes
    (exact for one shard that small)."""
    if not files:
        return 0
    first = files[0].stat().st_size
    with files[0].open("rb") as fh:
        starts = (members[0].offset for _, members in _groups(fh, files[0], 0))
        count = sum(1 for _ in itertools.takewhile(lambda start: start < ESTIMATE_BYTES, starts))
    return round(count * sum(p.stat().st_size for p in files) / max(min(first, ESTIMATE_BYTES), 1))


def _samples(source: Source, fields: Fields, start: Mark) -> Iterator[TarSample]:
    """Every sample from mark `start` on, in shard order, then member order."""
    for shard in range(start.file, len(source.files)):
        path = source.files[shard]
        with path.open("rb") as fh:
            for key, members in _groups(fh, path, start.position if shard == start.file else 0):
                yield _sample(fh, path, shard, key, members, fields)


def _groups(fh: IO[bytes], path: Path, position: int) -> Iterator[tuple[str, list[tar.Member]]]:
    """(key, its members) of the consecutive file members sharing a key, from `position` on."""
    for key, members in itertools.groupby(_members(fh, path, position), key=lambda m: _split(m.name)[0]):
        yield key, list(members)


def _members(fh: IO[bytes], path: Path, position: int) -> Iterator[tar.Member]:
    """The file members whose headers start at `position` and after, their data skipped (tar.py);
    ConfigError naming the shard where it is not a tar, a header is damaged or the file ends inside
    a member."""
    try:
        tar.check_tar(fh)
    except tar.TarError as exc:
        raise ConfigError(f"{path}: not an uncompressed tar file ({exc})") from None
    try:
        yield from tar.members(fh, position, os.fstat(fh.fileno()).st_size)
    except tar.TarError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _split(name: str) -> tuple[str, str]:
    """A member name's (key, extension): split at the first dot of its last path component."""
    folder, slash, base = name.rpartition("/")
    stem, _, extension = base.partition(".")
    return folder + slash + stem, extension


def _sample(fh: IO[bytes], path: Path, shard: int, key: str, members: list[tar.Member],
            fields: Fields) -> TarSample:
    """One sample: its image (the member of dataset.image_field's extension, else the one with an
    image extension), its label (the member of dataset.label_field's extension, else `cls`) and
    the members of dataset.keep_fields' extensions, each required (the scan reads them too, so a
    missing or undecodable one is named before any part's job)."""
    extensions = [_split(m.name)[1] for m in members]
    where = _where(path, key, extensions)
    # A name of another encoding (latin-1) is read with surrogates: the sample's text, which no
    # writer can store as UTF-8, failed the extraction after the model ran.
    check_unicode(key, where, "its member name (not UTF-8 in the tar)")
    by_extension = {}
    for member, extension in zip(members, extensions):
        if extension in by_extension:  # which one is the sample's? webdataset refuses it too
            raise ConfigError(f"{where}: two {extension!r} members; a sample has one of each extension")
        by_extension[extension] = member
    images = [m for m, e in zip(members, extensions)
              if (e == fields.image if fields.image else f".{e.lower()}" in IMAGE_SUFFIXES)]
    if len(images) != 1:
        found = f"no {fields.image!r} member (dataset.image_field)" if fields.image else \
            f"{len(images) or 'no'} images; a sample has one (dataset.image_field picks it by extension)"
        raise ConfigError(f"{where}: {found}")

    def decoded(extension: str, option: str, parse_json: bool = True) -> Any:
        """The member of `extension`, decoded (_kept); ConfigError naming `option` when there is none."""
        if extension not in by_extension:
            raise ConfigError(f"{where}: no {extension!r} member ({option})")
        member = by_extension[extension]
        return _kept(_read(fh, path, member.offset_data, member.size), extension, where, parse_json)

    label = None  # a label member's text, stripped (a `json` one's too: a label is a name); a `cls` one's integer
    if fields.label_required or "cls" in by_extension:
        label = decoded(fields.label if fields.label_required else "cls", "dataset.label_field", parse_json=False)
        label = label.strip() if isinstance(label, str) else label
    kept = {extension: decoded(extension, "dataset.keep_fields") for extension in fields.keep or ()}
    return TarSample(shard, members[0].offset, key, (images[0].offset_data, images[0].size), label, kept)


def _where(path: Path, key: str, extensions: list[str]) -> str:
    return f"{path}: sample {key!r} (members: {', '.join(extensions)})"


def _kept(data: bytes, extension: str, where: str, parse_json: bool = True) -> Any:
    """A kept member's value, as it goes into the samples' metadata: a `json` member's value (its
    text when not `parse_json`), a `cls` member's integer, any other member's UTF-8 text (a caption,
    as written)."""
    kind = {"json": "JSON" if parse_json else "UTF-8 text", "cls": "an integer"}.get(extension, "UTF-8 text")
    try:
        text = data.decode("utf-8")
        return json.loads(text) if kind == "JSON" else int(text) if extension == "cls" else text
    except (UnicodeDecodeError, ValueError):
        raise ConfigError(f"{where}: its {extension!r} member is not {kind} ({data[:40]!r})") from None
    except RecursionError:  # json recurses once a level: ~1000 nested lists crashed naming no sample
        raise ConfigError(f"{where}: its {extension!r} member is not {kind} (nested too deeply to parse)") from None


def _read(fh: IO[bytes], path: Path, offset: int, size: int) -> bytes:
    fh.seek(offset)
    data = fh.read(size)
    if len(data) != size:  # checked by the scan, but the file may be cut short since
        raise ConfigError(f"{path}: ends inside the member at byte {offset}; the shard changed since it was scanned")
    return data
