"""Integrity checks every format shares: file records ({bytes, sha256} or {bytes, sha256_tree}),
checked files, JSON reads, directory sizes and names resolved inside a store. Each format keeps its
own spec key names and passes in where a record comes from; every message names the file it is
about."""
from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from actstore.errors import FormatError
from actstore.io_utils import is_temp, sha256_file, sha256_tree_file

# The resolved config the workflow records in every stage directory (hashing.write_stage_config).
STAGE_CONFIG_FILE = "actstore_config.json"
# Files the workflow adds to a store (Snakemake's directory() marker, the stage config): never data,
# so never "unlisted".
TOOL_FILES = frozenset({".snakemake_timestamp", STAGE_CONFIG_FILE})
# A record's digest: the plain sha256 the format specs name, or the SHA-256 tree hash (1 MiB leaves,
# io_utils.sha256_tree_file) of files written out of order, which can be hashed as they fill.
TREE_HASH_KEY = "sha256_tree"
DIGESTS = {"sha256": sha256_file, TREE_HASH_KEY: sha256_tree_file}


def memory_budget() -> int:
    """Bytes one allocation sized by a file's own claims may take: a quarter of physical memory.
    Past it a reader refuses, naming the file, instead of failing with a MemoryError or worse."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4


def file_record(path: str | os.PathLike) -> dict[str, Any]:
    """{bytes, sha256} of a finished file, as every format records it."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


def file_problem(path: Path, record: dict[str, Any] | None, source: str, required: bool = True) -> str | None:
    """None when `path` is a file with the recorded bytes and sha256 (each checked when recorded),
    else what is wrong, naming the file and `source` (where the record comes from). `required`:
    a record with neither is itself a problem (where the format's own writer always records them)."""
    if not path.is_file():
        return f"{path}: missing (listed in {source})"
    if not isinstance(record, dict) or not ({"bytes", *DIGESTS} & set(record)):
        return f"{path}: no size or sha256 recorded in {source}" if required else None
    size = path.stat().st_size
    if "bytes" in record and size != record["bytes"]:
        return f"{path}: {size} bytes, {source} says {record['bytes']}"
    for key, digest in DIGESTS.items():
        if key in record and digest(path) != record[key]:
            return f"{path}: {key} differs from {source}"
    return None


def listed_problem(root: Path, name: Any, record: dict[str, Any] | None, source: str,
                   name_source: str | None = None, required: bool = True) -> str | None:
    """file_problem of a file that `source` lists by `name`, the name first resolved inside `root`
    (a name leading outside is itself the problem, reported against `name_source`)."""
    try:
        return file_problem(inside(root, name, name_source or source), record, source, required)
    except FormatError as exc:
        return str(exc)


def check_file(path: Path, record: dict[str, Any] | None, source: str) -> None:
    """file_problem as an exception (FormatError naming the file)."""
    problem = file_problem(path, record, source)
    if problem:
        raise FormatError(problem)


def read_json(path: Path) -> Any:
    """A JSON file's content; FormatError naming the file when it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{path}: missing") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: not valid JSON ({exc})") from None


def refuse(problems: list[str]) -> None:
    """A reader opened with verify=True: FormatError naming every problem the format's verify found."""
    if problems:
        raise FormatError("; ".join(problems))


def unlisted(root: Path, listed: set[str], source: str) -> list[str]:
    """A problem for every file under `root` (relative POSIX path) that `listed` does not name:
    an extra shard or tensor is as wrong as a missing one."""
    extra = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.name not in TOOL_FILES)
    return [f"{root / rel}: not listed in {source}" for rel in extra if rel not in listed]


def dir_bytes(root: Path) -> int:
    """Bytes of every file under `root`, not counting a killed writer's temps (io_utils.is_temp)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not is_temp(p.relative_to(root)))


def inside(root: Path, name: Any, source: str) -> Path:
    """`name` (a relative POSIX path read from metadata) as a path inside `root`; FormatError when
    it is not a string, is absolute, climbs out with `..`, or resolves outside through a link."""
    rel = PurePosixPath(name) if isinstance(name, str) and name else None
    if rel is None or rel.is_absolute() or ".." in rel.parts:
        raise FormatError(f"{source}: {name!r} is not a relative path inside {root}")
    path = root.joinpath(*rel.parts)
    if _through_link(root, rel) and not path.resolve().is_relative_to(root.resolve()):
        raise FormatError(f"{source}: {name!r} leads outside {root} (through a link)")
    return path


def _through_link(root: Path, rel: PurePosixPath) -> bool:
    """Whether a component of `rel` below `root` is a symbolic link: without one the path cannot
    leave root, and resolving it (an lstat per component of root too) is skipped; a merge finisher
    checks millions of names."""
    path = root
    for part in rel.parts:
        path = path / part
        if path.is_symlink():
            return True
    return False
