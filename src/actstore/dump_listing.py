"""What a dump_to holds: each stage directory ({dump_to}/{stage}/{hash}/), its state, its size on disk,
the extraction it was made from and which of some configs name it (`actstore list`).

Nothing is deleted, hashed or read but the stage configs and saev's pointers: the walk stats each
entry once (os.scandir), so a dump_to of millions of files lists at the speed of its metadata server.
"""
from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from actstore.errors import ActstoreError, ConfigError
from actstore.formats.saev.layout import POINTER as SAEV_POINTER
from actstore.hashing import STAGES, is_stage_dir
from actstore.integrity import STAGE_CONFIG_FILE, is_sha256, read_json, read_stage_config
from actstore.io_utils import is_temp


@dataclass
class StageRow:
    """One stage directory. state: done (its stage config written), incomplete (a run cut short),
    temp (an atomic_path temp or lock file left: a writer running now, or killed) or damaged (its
    stage config unreadable or not the one the workflow wrote: `reason` says how)."""
    stage: str
    hash: str
    path: str
    state: str
    reason: str | None
    bytes: int
    written: str | None  # the stage config's mtime, UTC
    extraction: str | None  # the extraction hash its stage config records (None for extract itself)
    extraction_exists: bool | None
    store: str | None = None  # saev: the store its pointer names, outside the stage directory
    used_by: list[str] | None = None  # the given configs naming it; None when none were given


@dataclass
class DumpListing:
    rows: list[StageRow]
    other: dict[str, int] = field(default_factory=dict)  # {path relative to dump_to: bytes}

    @property
    def total_bytes(self) -> int:
        return sum(row.bytes for row in self.rows) + sum(self.other.values())


def stage_state(directory: Path) -> str:
    """done, incomplete or not built: a stage's last job writes its stage config, so a directory
    without one is a run cut short."""
    if (directory / STAGE_CONFIG_FILE).is_file():
        return "done"
    return "incomplete" if directory.is_dir() else "not built"


def list_dump(dump_to: Path, used: dict[tuple[str, str], list[str]] | None = None) -> DumpListing:
    """Every stage directory under `dump_to` in chain order, then hash; everything else under "other".
    `used`: {(stage, hash): the configs naming it} (configs_using), or None when no config was given.
    A file hard-linked several times (zarr's merged/ store) is counted once, where first met."""
    dump_to = Path(os.path.abspath(dump_to))
    walk = _Walk()
    rows = [_row(dump_to, stage, directory, used, walk)
            for stage in STAGES for directory in _stage_dirs(dump_to / stage)]
    skip = frozenset(row.path for row in rows) | {str(dump_to / row.store) for row in rows if row.store}
    other = {}
    for entry in sorted(os.scandir(dump_to), key=lambda e: e.name):
        inner = sorted(os.scandir(entry.path), key=lambda e: e.name) \
            if entry.name in STAGES and entry.is_dir(follow_symlinks=False) else [entry]
        other |= {os.path.relpath(e.path, dump_to): walk.allocated(Path(e.path), skip)[0]
                  for e in inner if e.path not in skip}
    return DumpListing(rows, other)


def _stage_dirs(folder: Path) -> list[Path]:
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(Path(entry.path) for entry in os.scandir(folder)
                  if entry.is_dir(follow_symlinks=False) and is_stage_dir(Path(entry.path)))


def _row(dump_to: Path, stage: str, directory: Path, used: dict[tuple[str, str], list[str]] | None,
         walk: _Walk) -> StageRow:
    state, reason, record, store = stage_state(directory), None, None, None
    written = _mtime(directory / STAGE_CONFIG_FILE) if state == "done" else None
    if state == "done":
        record, reason = _stage_config(directory, stage)
        state = "damaged" if reason else state
    if stage == "saev" and record is not None:
        store, problem = _saev_store(dump_to, directory)
        state, reason = ("damaged", problem) if problem else (state, reason)
    size, temp = walk.allocated(directory)
    if store is not None and store not in walk.stores:  # a store two pointers name: counted with the first
        walk.stores.add(store)
        size += walk.allocated(dump_to / store)[0]
    if temp:
        state, reason = "temp", f"{temp}: a writer's temp (a run writing now, or killed)"
    extraction = record["upstream"].get("extract") if record is not None else None
    extraction = extraction if is_sha256(extraction) else None
    return StageRow(stage, directory.name, str(directory), state, reason, size, written, extraction,
                    None if extraction is None else (dump_to / "extract" / extraction).is_dir(), store,
                    None if used is None else used.get((stage, directory.name), []))


def _stage_config(directory: Path, stage: str) -> tuple[dict[str, Any] | None, str | None]:
    """The stage config and why it is damaged (None when it is not): integrity.read_stage_config's
    problems, or another stage's. Its seal's records are not checked against the files (each hashed:
    `actstore verify` does)."""
    try:
        record, problems = read_stage_config(directory, required=True)
    except ActstoreError as exc:
        return None, str(exc)
    if problems:
        return record, problems[0]
    if record["stage"] != stage:
        return record, f"{directory / STAGE_CONFIG_FILE}: the config of stage {record['stage']!r}, found in {stage}/"
    return record, None


def _saev_store(dump_to: Path, directory: Path) -> tuple[str | None, str | None]:
    """The store a saev stage directory's pointer names (relative to dump_to), and why it cannot be
    (the pointer unreadable, or naming a place outside dump_to/saev/, which is never walked)."""
    pointer = directory / SAEV_POINTER
    try:
        target = read_json(pointer)["store"]
    except (ActstoreError, TypeError, KeyError):
        return None, f"{pointer}: not a saev pointer (an object with the store's path)"
    store = Path(os.path.normpath(directory / str(target)))
    if not store.is_relative_to(dump_to / "saev") or store.is_symlink() or not store.is_dir():
        return None, f"{pointer}: names {target}, no store directory under {dump_to / 'saev'}"
    return str(store.relative_to(dump_to)), None


class _Walk:
    """Sizes on disk, each file of several hard links counted once, at the first name met: `linked`
    holds {inode: its names still to meet}, emptied as they are met, so it holds only the links whose
    other names lie ahead."""

    def __init__(self) -> None:
        self.linked: dict[tuple[int, int], int] = {}
        self.stores: set[str] = set()  # saev stores counted, relative to dump_to

    def allocated(self, path: Path, skip: frozenset[str] = frozenset()) -> tuple[int, str | None]:
        """Bytes allocated to `path` and everything under it (st_blocks, as du counts them), links never
        followed, the paths in `skip` left out; and the first atomic_path temp or lock file met under it
        (io_utils.is_temp), relative to `path`."""
        try:
            info = path.lstat()
        except FileNotFoundError:  # a writer's temp beside the stage directories, renamed since listed
            return 0, None
        total, temp, folders = self._once(info), None, [str(path)] if stat.S_ISDIR(info.st_mode) else []
        while folders:
            for entry in _entries(folders.pop()):
                if entry.path in skip:
                    continue
                if temp is None and is_temp(Path(entry.name)):
                    temp = os.path.relpath(entry.path, path)
                try:
                    total += self._once(entry.stat(follow_symlinks=False))
                except FileNotFoundError:  # a running writer's temp, renamed or swept since it was listed
                    continue
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
        return total, temp

    def _once(self, info: os.stat_result) -> int:
        if info.st_nlink < 2 or stat.S_ISDIR(info.st_mode):
            return info.st_blocks * 512
        key = (info.st_dev, info.st_ino)
        first = key not in self.linked
        remaining = (info.st_nlink if first else self.linked[key]) - 1
        if remaining:
            self.linked[key] = remaining
        else:
            self.linked.pop(key, None)
        return info.st_blocks * 512 if first else 0


def _entries(folder: str) -> Iterator[os.DirEntry]:
    """The entries of `folder`, one at a time, none when it is gone since it was listed (a running writer's
    temp folder, renamed into place): a listing taken while a run writes is the one that must not fail."""
    try:
        entries = os.scandir(folder)
    except FileNotFoundError:
        return
    with entries:
        yield from entries


def _mtime(path: Path) -> str:
    return datetime.fromtimestamp(path.lstat().st_mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def configs_using(dump_to: Path, configfiles: list[Path], directory: Path) -> dict[tuple[str, str], list[str]]:
    """{(stage, hash): the configs naming that stage directory}, each config's enabled stages, read as
    `actstore locate` reads it (from the workflow's working directory `directory`). ConfigError for a
    config whose dump_to is another directory: every stage here would read as unreferenced by it."""
    from actstore.config import enabled_stages, load_config
    from actstore.hashing import stage_dirs

    used: dict[tuple[str, str], list[str]] = {}
    for configfile in configfiles:
        absolute = configfile.absolute()  # as Snakemake reads --configfile: from where the command runs
        with contextlib.chdir(directory):
            config = load_config(absolute)
            dirs = stage_dirs(config)
            its_dump_to = Path(config["dump_to"]).resolve()
        if its_dump_to != dump_to.resolve():
            raise ConfigError(f"{configfile}: its dump_to is {its_dump_to}, not {dump_to.resolve()} (read from "
                              f"-d {directory}): it names nothing listed here")
        for stage in enabled_stages(config):
            used.setdefault((stage, dirs[stage].name), []).append(str(configfile))
    return used


def listing_json(listing: DumpListing) -> list[dict[str, Any]]:
    """The rows as objects, then each other entry as one of state "other" (its path and bytes, no stage)."""
    empty = dict.fromkeys(StageRow.__dataclass_fields__)
    return [asdict(row) for row in listing.rows] + [
        {**empty, "state": "other", "path": path, "bytes": size} for path, size in listing.other.items()]


def listing_lines(listing: DumpListing) -> list[str]:
    """One line per stage directory, "other" with its entries' sizes, and the total."""
    lines = [f"{'stage':9s} {'hash':12s} {'state':10s} {'size':>10s}  {'written':20s} {'from extraction':22s} use"]
    for row in listing.rows:
        source = "-" if row.extraction is None else \
            f"{row.extraction[:12]}{'' if row.extraction_exists else ' (gone)'}"
        use = "" if row.used_by is None else \
            f"used by {', '.join(row.used_by)}" if row.used_by else "unreferenced by the given configs"
        line = f"{row.stage:9s} {row.hash[:12]} {row.state:10s} {human_bytes(row.bytes):>10s}  " \
               f"{row.written or '-':20s} {source:22s} {use}".rstrip()
        lines.append(line + (f"  ({row.reason})" if row.reason else ""))
    if listing.other:
        lines.append(f"other: {human_bytes(sum(listing.other.values()))} in " +
                     ", ".join(f"{name} ({human_bytes(size)})" for name, size in listing.other.items()))
    lines.append(f"total: {human_bytes(listing.total_bytes)} ({listing.total_bytes} bytes) in {len(listing.rows)} "
                 "stage directories")
    return lines


def human_bytes(count: int) -> str:
    """`count` bytes in the largest binary unit under 1024 of it (B to TiB)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0 if count < 1024 else min(len(units) - 1, (count.bit_length() - 1) // 10)
    return f"{count} B" if power == 0 else f"{count / 1024 ** power:.1f} {units[power]}"
