"""Integrity checks every format shares: file records ({bytes, sha256} or {bytes, sha256_tree}),
checked files, JSON reads, directory sizes, names resolved inside a store, and the one store or shard
a reader keeps while its files are unchanged (LastBuilt). Each format keeps its own spec key names and
passes in where a record comes from; every message names the file it is about."""
from __future__ import annotations

import datetime as dt
import io
import itertools
import json
import math
import os
import re
import resource
import stat
import tokenize
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Callable, Generic, Iterable, Iterator, Sized, TypeVar

import numpy as np
from tqdm import tqdm

from actstore.errors import ConfigError, FormatError
from actstore.formats import is_metadata_name
from actstore.io_utils import canonical_sha256, is_temp, sha256_file, sha256_tree_file

# The resolved config the workflow records in every stage directory (hashing.write_stage_config).
STAGE_CONFIG_FILE = "actstore_config.json"
# Files the workflow adds to a store (Snakemake's directory() marker, the stage config): never data,
# so never "unlisted".
TOOL_FILES = frozenset({".snakemake_timestamp", STAGE_CONFIG_FILE})
# Files the rules leave inside stage directories besides the stores (rules/*.smk): the writers' scatter
# folders, temp() outputs Snakemake deletes once the stage is done, and the dataset scan, kept so that
# a lost part is redone from it; none is sealed or counted as unlisted.
STAGE_TEMPS = frozenset({"scatter", "dataset_scan.json"})
# The stage config's record of the metadata files the stage wrote ({name: {bytes, sha256}}): no
# format's own record covers every one of them (a store's top metadata file records the others), so
# without it one changed value there (a k_active, a model_config field) would pass every check.
SEAL_KEY = "sealed"
# A record's digest: the plain sha256 the format specs name, or the SHA-256 tree hash (1 MiB leaves,
# io_utils.sha256_tree_file) of files written out of order, which can be hashed as they fill.
TREE_HASH_KEY = "sha256_tree"
DIGESTS = {"sha256": sha256_file, TREE_HASH_KEY: sha256_tree_file}


# Files a verify checks at once: hashing and reading release the GIL, so a store's files go at the
# cores' and disks' speed instead of one sha256 at a time; at most 8, as login nodes are shared.
CHECK_THREADS = min(8, len(os.sched_getaffinity(0)))
Item = TypeVar("Item")
Value = TypeVar("Value")


@contextmanager
def check_threads(threads: int) -> Iterator[None]:
    """problems_of's default thread count within the block (`actstore verify --threads`)."""
    global CHECK_THREADS
    before, CHECK_THREADS = CHECK_THREADS, threads
    try:
        yield
    finally:
        CHECK_THREADS = before


# (share, shares): the items problems_of checks, and the rows fingerprints reads, are those at positions i
# with i % shares == share; a validate job takes one share of a store (one job's checks of a 100 TB store
# ran past Slurm's 48 h cap).
CHECK_SHARE = (0, 1)


@contextmanager
def check_share(share: int, shares: int) -> Iterator[None]:
    """Within the block, only share `share` of `shares` of each list of items is checked (in_share)."""
    global CHECK_SHARE
    before, CHECK_SHARE = CHECK_SHARE, (share, shares)
    try:
        yield
    finally:
        CHECK_SHARE = before


def in_share(position: int) -> bool:
    """Whether the item at `position` of a list is this process's to check (check_share)."""
    share, shares = CHECK_SHARE
    return position % shares == share


def share_places(share: tuple[int, int]) -> tuple[int, int]:
    """A reader's `share` argument (k, n), checked: the items at places k, k + n, k + 2n, ... of a list
    (in_share's pick); a ConfigError for one that picks nothing (it would read nothing, with no error)."""
    first, every = share
    if not (whole_number(every, least=1) and whole_number(first) and first < every):
        raise ConfigError(f"share={share!r}: must be (k, n) with n >= 1 and 0 <= k < n")
    return first, every


def problems_of(check: Callable[[Item], list[str]], items: Iterable[Item], threads: int | None = None,
                desc: str = "verify files", batch: int = 1) -> list[str]:
    """Every item's problems, in item order, `threads` (default CHECK_THREADS) tasks of `batch` items
    at once (a batch per task where items are small files, whose checks are mostly Python that holds
    the GIL: one per task would cost more in handing over than the threads gain); items are taken a
    window at a time, so a list of millions of files costs no memory. An exception a check raises is
    raised here. A progress bar (`desc`) on a terminal, from 20 items or when they are not counted
    beforehand. Within check_share, only the share's items are checked."""
    threads = threads or CHECK_THREADS
    problems: list[str] = []
    todo = (item for position, item in enumerate(items) if in_share(position))
    share, shares = CHECK_SHARE
    total = len(range(share, len(items), shares)) if isinstance(items, Sized) else None
    quiet = True if total is not None and total < 20 else None  # None: tqdm shows a bar on a terminal only

    def check_batch(batch_items: list[Item]) -> list[str]:
        return [problem for item in batch_items for problem in check(item)]

    with ThreadPoolExecutor(threads) as pool, tqdm(total=total, desc=desc, unit="file", disable=quiet) as bar:
        while window := list(itertools.islice(todo, 4 * threads * batch)):
            for found in pool.map(check_batch, [window[i:i + batch] for i in range(0, len(window), batch)]):
                problems += found
            bar.update(len(window))
    return problems


def file_identity(path: Path) -> tuple[int, int, int, int] | None:
    """(st_dev, st_ino, st_size, st_mtime_ns) of `path`, links followed; None when it cannot be looked
    at (absent: whoever reads it names why). A file replaced by a rename has another inode, one
    rewritten in place another mtime or size."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class LastBuilt(Generic[Value]):
    """The last value built from some files (a store opened, a shard loaded), kept while none of them
    changed (file_identity): a reader asked for one coordinate at a time (validate reads thousands of
    one store) opens or loads once, and still sees a file rewritten or replaced since. One entry, so
    it holds one store's or shard's memory at most."""

    def __init__(self) -> None:
        self._entry: tuple[tuple, Value] | None = None

    def get(self, files: Iterable[Path], build: Callable[[], Value], extra: Any = None) -> Value:
        """The kept value when `files` (and `extra`, whatever else the value was built from) are as
        they were, else `build()`, kept."""
        # Taken before building: a file changed while it is built changes the next call's key.
        key = (extra, *((str(file), file_identity(file)) for file in files))
        entry = self._entry  # one read: another thread may replace it meanwhile
        if entry is not None and entry[0] == key:
            return entry[1]
        self._entry = None  # the old value's memory (a shard: hundreds of MB) is let go before the new is built
        value = build()
        self._entry = (key, value)
        return value


def memory_budget() -> int:
    """Bytes one allocation sized by a file's own claims may take: a quarter of the memory this process
    may use, physical memory or less where its cgroup (a Slurm job's --mem) or its address-space limit
    caps it. Past it a reader refuses, naming the file, instead of failing with a MemoryError or worse
    (a job given 16 GB of a 512 GB node had a budget of 128 GB: the kernel killed it, naming nothing)."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    limits = [physical, *_cgroup_memory_limits()]
    if address_space != resource.RLIM_INFINITY:
        limits.append(address_space)
    return min(limits) // 4


CGROUP_MEMORY_FILES = {"": ("/sys/fs/cgroup", "memory.max"),  # v2: the unified hierarchy
                       "memory": ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")}  # v1


def memory_cgroups() -> list[tuple[Path, Path, str]]:
    """(hierarchy root, this process's cgroup in it, its memory limit file's name) of each memory
    hierarchy /proc/self/cgroup names, v1 or v2; none where unreadable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    groups = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        kind = "" if not controllers else "memory" if "memory" in controllers.split(",") else None
        if kind is not None:
            root, name = CGROUP_MEMORY_FILES[kind]
            groups.append((Path(root), Path(root) / path.lstrip("/"), name))
    return groups


def _cgroup_memory_limits() -> list[int]:
    """The memory limits of this process's cgroup and of those above it (Slurm sets --mem on the job's,
    above the step's and task's)."""
    limits = []
    for root, group, name in memory_cgroups():
        for folder in [group, *group.parents][:len(group.relative_to(root).parts) + 1]:
            try:
                text = (folder / name).read_text().strip()
            except OSError:
                continue
            limits += [int(text)] if text.isdigit() else []  # "max": none
    return limits


def open_files_budget() -> int:
    """Files (or memory maps, each holding a descriptor) a reader keeps open at once: a quarter of this
    process's open-file limit, at least 16, leaving the rest to the caller (a training job's own files,
    a DataLoader's shared tensors). Past it a reader lets its least recently used file go."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 16 if soft == resource.RLIM_INFINITY else max(16, soft // 4)


def stage_config_problems(directory: Path, required: bool = False) -> list[str]:
    """The stage config a workflow stage directory holds (hashing.write_stage_config): read_stage_config's
    problems, and every file it seals must hold the bytes the stage wrote."""
    record, problems = read_stage_config(directory, required)
    if problems or record is None:
        return problems
    return seal_problems(directory, record[SEAL_KEY], directory / STAGE_CONFIG_FILE,
                         sealed_names(directory, str(record["stage"])))


def read_stage_config(directory: Path, required: bool = False) -> tuple[dict[str, Any] | None, list[str]]:
    """The stage config a workflow stage directory holds and its problems short of its seal's files (none
    hashed): its recorded hash must be the sha256 of the config in it (so it was not edited), a directory
    named by a stage hash must be named by this one (so it is not another run's config), and it must hold
    its seal. `required`: a missing stage config is itself a problem (a directory the workflow wrote; a
    store written by the library has none). One linked out of the directory is never read, and is named;
    a file that is not JSON is a FormatError."""
    path = directory / STAGE_CONFIG_FILE
    if problem := link_out(directory, path):
        # Named here too, not left to a format's verify: none looks at a stage directory holding no
        # store (sae, validate) or above a store given by its own path (lut/, dataset/), and passing
        # it in silence would skip its seal, the only record of some metadata values.
        return None, [f"{problem}: not read, so nothing it seals is checked"]
    if not path.is_file():
        return None, [f"{path}: missing (the workflow writes one in every stage directory)"] if required else []
    record = read_json(path)
    if not isinstance(record, dict) or not {"stage", "config", "upstream", "hash"} <= set(record) \
            or not isinstance(record["upstream"], dict):
        return None, [f"{path}: not a stage config (an object with stage, config, upstream and hash)"]
    digest = canonical_sha256({k: v for k, v in record.items() if k not in ("hash", SEAL_KEY)})  # as stage_hash
    if digest != record["hash"]:
        return record, [f"{path}: its content hashes to {digest}, not to its recorded hash {record['hash']!r:.70}: "
                        "edited"]
    name = directory.absolute().name  # `actstore verify .` in a stage directory: "." has no name
    if is_sha256(name) and name != digest:
        return record, [f"{path}: the config of stage directory {digest}, found in {name}"]
    if SEAL_KEY not in record:  # every stage config the workflow writes holds one
        return record, [f"{path}: no {SEAL_KEY!r} record, so the stage's metadata files cannot be checked against "
                        f"it (its key removed, or written by an actstore from before stages were sealed: rerun the "
                        f"stage to seal it)"]
    return record, []


def seal_problems(root: Path, records: Any, sealer: Path, must_seal: Iterable[str]) -> list[str]:
    """The files under `root` against the seal `records` ({name: {bytes, sha256}}, SEAL_KEY) that
    file `sealer` holds: each recorded file, its name resolved inside `root`, of the bytes
    recorded; and each of `must_seal` recorded (one the seal does not list was written after the
    stage, or its record was removed)."""
    try:
        sealed = file_records(records, f"{sealer} {SEAL_KEY}")
    except FormatError as exc:
        return [str(exc)]
    problems = [problem for name, entry in sealed.items()
                if (problem := listed_problem(root, name, entry, f"{sealer} ({SEAL_KEY})"))]
    return problems + [f"{root / rel}: not sealed by {sealer} (written after the stage, or its record removed)"
                       for rel in must_seal if rel not in sealed]


def sealed_names(directory: Path, stage: str) -> list[str]:
    """The files of stage directory `directory` that its stage config seals (relative names, sorted):
    every metadata document (formats.is_metadata_name) or, for the sae stage, which writes no
    format's store, every file; never the tool's own files, a writer's temps, links, or the
    workflow's temps (STAGE_TEMPS)."""
    sealed_name = (lambda name: True) if stage == "sae" else is_metadata_name

    def sealed(rel: str) -> bool:  # string splits: a zarr stage walks millions of chunk names
        name = rel.rpartition("/")[2]
        return (sealed_name(name) and name not in TOOL_FILES and rel.partition("/")[0] not in STAGE_TEMPS
                and not is_temp(Path(rel)) and not (directory / rel).is_symlink())

    return [rel for rel in sorted_files(directory) if sealed(rel)]


def seal(directory: Path, stage: str) -> dict[str, dict[str, Any]]:
    """{relative name: {bytes, sha256}} of the files of stage `stage` its stage config seals
    (sealed_names), for hashing.write_stage_config to record under SEAL_KEY."""
    return {rel: file_record(directory / rel) for rel in sealed_names(directory, stage)}


def file_record(path: str | os.PathLike) -> dict[str, Any]:
    """{bytes, sha256} of a finished file, as every format records it."""
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


SHA256_HEX = re.compile("[0-9a-f]{64}")  # hashlib's hexdigest


def is_sha256(value: Any) -> bool:
    """A sha256 as hashlib's hexdigest spells it: a string of 64 lowercase hex digits."""
    return isinstance(value, str) and SHA256_HEX.fullmatch(value) is not None


def whole_number(value: Any, least: int = 0) -> bool:
    """A count, from JSON or an argument: an int (numpy's too; not a bool, which Python counts as one)
    of at least `least`."""
    return is_integer(value) and value >= least


def is_integer(value: Any) -> bool:
    """A Python or numpy integer, not a bool (True == 1 to every range and `in` check)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def read_index(value: Any, what: str, where: Path) -> int:
    """`value`, a sample, token or layer index given to a reader, as an int; TypeError naming `where`
    for a bool (True read index 1) or a float (1.0 matched layer 1, others failed naming nothing)."""
    if not is_integer(value):
        raise TypeError(f"{where}: {what} {value!r:.40} is not an integer")
    return int(value)


def vector_indices(sample_idx: Any, layer_idx: Any, token_idx: Any, where: Path) -> tuple[int, int, int]:
    """A format's read_vector arguments, each checked by read_index and named as the argument: token
    True read a sample's every token as its vector, True row 1."""
    return (read_index(sample_idx, "sample_idx", where), read_index(layer_idx, "layer_idx", where),
            read_index(token_idx, "token_idx", where))


def whole_numbers(values: Any) -> bool:
    """A JSON list of counts (layer numbers, a shape, a sample range)."""
    return isinstance(values, list) and all(map(whole_number, values))


def version_string(value: Any) -> bool:
    """A format version as the specs write it: "1.0", "2.1"."""
    return isinstance(value, str) and re.fullmatch(r"\d+(\.\d+)*", value) is not None


def iso_timestamp(value: Any) -> bool:
    """An ISO 8601 time as the specs' created_at fields hold it ("2025-01-09T12:00:00Z")."""
    try:
        dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (AttributeError, TypeError, ValueError):
        return False
    return True


def file_records(records: Any, source: str) -> dict[str, dict[str, Any]]:
    """A metadata file's {name: {bytes, sha256, ...}} map, its shape checked before anything sums
    or looks up its fields: FormatError naming `source` and the entry when it is not an object of
    objects each with a whole number of bytes (every writer records them)."""
    if not isinstance(records, dict):
        raise FormatError(f"{source}: files must be an object of name -> {{bytes, sha256}}, "
                          f"got {type(records).__name__}")
    for name, record in records.items():
        if not whole_number(record.get("bytes") if isinstance(record, dict) else None):
            raise FormatError(f"{source}: files[{name!r}] must be an object with a whole number of bytes, "
                              f"got {record!r:.80}")
    return records


def file_problem(path: Path, record: dict[str, Any] | None, source: str, required: bool = True,
                 digest: bool = True) -> str | None:
    """None when `path` is a file with the recorded bytes and sha256 (each checked when recorded),
    else what is wrong, naming the file and `source` (where the record comes from). `required`:
    a record with neither is itself a problem (where the format's own writer always records them).
    `digest`: a record with a size must have its sha256 too (every writer records both: one left
    with its size alone would let any changed byte pass); off only where sizes are all that is checked."""
    if not path.is_file():
        return f"{path}: missing (listed in {source})"
    if not isinstance(record, dict) or not ({"bytes", *DIGESTS} & set(record)):
        return f"{path}: no size or sha256 recorded in {source}" if required else None
    if digest and not set(DIGESTS) & set(record):
        return f"{path}: no sha256 recorded in {source}"
    try:  # what is hashed is the file opened: a FIFO put in its place since the look above never blocks
        fh = open_regular(path)
    except FormatError as exc:
        return f"{exc} (listed in {source})"
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if "bytes" in record and size != record["bytes"]:
            return f"{path}: {size} bytes, {source} says {record['bytes']}"
        for key, digest in DIGESTS.items():
            if key in record and digest(fh.fileno()) != record[key]:
                return f"{path}: {key} differs from {source}"
    return None


def listed_problem(root: Path, name: Any, record: dict[str, Any] | None, source: str,
                   name_source: str | None = None, required: bool = True, digest: bool = True) -> str | None:
    """file_problem of a file that `source` lists by `name`, the name first resolved inside `root`
    (a name leading outside is itself the problem, reported against `name_source`)."""
    try:
        return file_problem(inside(root, name, name_source or source), record, source, required, digest)
    except FormatError as exc:
        return str(exc)


def check_file(path: Path, record: dict[str, Any] | None, source: str) -> None:
    """file_problem as an exception (FormatError naming the file)."""
    problem = file_problem(path, record, source)
    if problem:
        raise FormatError(problem)


# The largest JSON file read_json reads (whole, before parsing): a guard against a file no writer made
# (gigabytes of data in a metadata file's place), not a budget. Some metadata lists every file of a
# store or dataset (a zarr shard's meta/files.json, a merge job's record, dataset_scan.json, a big
# store's shards.json) and runs to hundreds of MB at millions of files, so the cap is that generous.
JSON_MAX_BYTES = 1 << 30


class _StrictJsonError(ValueError):
    """JSON that json.loads takes but no writer writes (a duplicate key, NaN or Infinity)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict, refusing a key given twice: json.loads keeps the last value,
    where a hash of the text (a seal, a store's name) saw both."""
    members = dict(pairs)
    if len(members) < len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _StrictJsonError(f"key {twice!r} given twice")
    return members


def _no_constant(name: str) -> Any:
    """NaN, Infinity, -Infinity: not JSON numbers (json.dumps writes them, json.loads reads them)."""
    raise _StrictJsonError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A JSON number past the largest float (1e999), which Python reads as the infinity that
    _no_constant refuses by name: so spelt, it passed (a pickle store's statistics verified)."""
    value = float(text)
    if not math.isfinite(value):
        raise _StrictJsonError(f"{text[:40]} is past the largest float, read as {value}")
    return value


# json.loads options: what read_json takes
STRICT_JSON = {"object_pairs_hook": unique_keys, "parse_constant": _no_constant, "parse_float": _finite_float}


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading; FormatError naming it when it is missing, cannot be opened, or is
    not a regular file: a FIFO would block the read forever (O_NONBLOCK: the open itself would
    wait for a writer; O_NOCTTY: a terminal is never made this process's), a device might never
    end, a directory is no document."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise FormatError(f"{path}: missing") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FormatError(f"{path}: not a regular file (a FIFO, device or directory is never read)")
    return os.fdopen(fd, "rb")


def read_sized(path: Path, size: int, source: str) -> bytes:
    """The bytes of `path`, a regular file of the `size` bytes `source` gives it (a record, a chunk
    layout). What is read is the file opened (open_regular), never one looked at before: a FIFO or
    device put in its place since would block or never end. Its size is compared before anything is
    read (a sparse file of gigabytes costs nothing to refuse). FormatError naming the file and both
    sizes when they differ, or when it is missing or not a regular file."""
    with open_regular(path) as fh:
        found = os.fstat(fh.fileno()).st_size
        if found != size:
            raise FormatError(f"{path}: {found} bytes, expected {size} from {source}")
        return _read_whole(fh, path, size)


def _read_whole(fh: BinaryIO, path: Path, size: int) -> bytes:
    """The `size` bytes that file `path`, open as `fh`, had when opened; FormatError when it changed
    while it was read (a writer still at it?). Exactly one byte more is asked for: it tells a file
    grown since, where a larger read (a cap) would allocate all it asks for."""
    data = fh.read(size + 1)
    if len(data) != size:
        read = f"more than {size}" if len(data) > size else len(data)
        raise FormatError(f"{path}: {read} bytes read, {size} when opened: it changed while it was read "
                          "(a writer still at it?)")
    return data


def read_json(path: Path) -> Any:
    """A JSON file's content; FormatError naming the file when it is missing, not a regular file,
    over JSON_MAX_BYTES, or not strict JSON: not UTF-8, not JSON, a duplicate key, NaN or Infinity,
    or nested too deeply to parse (a RecursionError otherwise)."""
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > JSON_MAX_BYTES:
            raise FormatError(f"{path}: {size} bytes, over the {JSON_MAX_BYTES} of any metadata file")
        data = _read_whole(fh, path, size)
    try:
        return json.loads(data.decode("utf-8"), **STRICT_JSON)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, _StrictJsonError
        raise FormatError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise FormatError(f"{path}: not valid JSON (nested too deeply to parse)") from None


JSON_BLOCK_CHARS = 1 << 20  # what stream_json_object reads at a time
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_NUMBER_GOES_ON = re.compile(r"\.|[eE][-+]?")  # a window's last characters that a number's next ones complete
_JSON_DECODER = json.JSONDecoder(**STRICT_JSON)


def stream_json_object(path: Path, big: str, what: str = "a JSON object") -> Iterator[tuple[str, Any]]:
    """The members (key, value) of the JSON object in `path`, in file order, read 1 MiB at a time;
    the value of member `big`, an object, comes as an iterator of its own members, to be consumed
    before the next one is asked for. For files that list millions of files (a merged zarr store's
    meta/files.json, a zarr merge job's record): parsed whole, each listed file takes ~1 KB.
    FormatError names the file: missing, not valid JSON, or not `what` (not an object, or `big`
    not an object)."""
    try:
        with io.TextIOWrapper(open_regular(path), encoding="utf-8") as fh:
            stream = _JsonStream(fh, path, what)
            yield from stream.members(big)
            stream.end()
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: not valid JSON ({exc})") from None


def stream_json_members(path: Path, big: str, what: str = "a JSON object") -> Iterator[tuple[str, Any]]:
    """stream_json_object's members of member `big` alone (none when it is absent)."""
    for key, value in stream_json_object(path, big, what):
        if key == big:
            yield from value


class _JsonStream:
    """A JSON text read in blocks: the scanner of the json module on a window of the file."""

    def __init__(self, fh: Any, path: Path, what: str) -> None:
        self.fh, self.path, self.what = fh, path, what
        self.buf, self.pos, self.consumed, self.eof = "", 0, 0, False

    def members(self, big: str | None = None) -> Iterator[tuple[str, Any]]:
        """The members of the object that starts here; `big`'s value as a nested iterator, drained
        (what the caller left unread) before going on."""
        if self._peek() != "{":
            raise FormatError(f"{self.path}: not {self.what}")
        self.pos += 1
        if self._peek() == "}":
            self.pos += 1
            return
        seen: set[str] = set()  # the top level's few keys: `big`'s millions of names are never held
        while True:
            self._peek()
            at, key = self._offset(), self._value()
            if not isinstance(key, str):
                raise FormatError(f"{self.path}: not valid JSON (a key that is not a string at character {at})")
            if big is not None and (key in seen or seen.add(key)):
                raise FormatError(f"{self.path}: not valid JSON (key {key!r} given twice)")
            self._take(":")
            if key == big:
                nested = self.members()
                yield key, nested
                for _ in nested:
                    pass
            else:
                yield key, self._value()
            if self._take(",}") == "}":
                return

    def end(self) -> None:
        """Nothing but white space after the object."""
        if self._peek():
            raise FormatError(f"{self.path}: not valid JSON (extra data at character {self._offset()})")

    def _offset(self) -> int:
        return self.consumed + self.pos

    def _more(self) -> bool:
        """Append the next block (dropping what was parsed); False at the end of the file. A block is
        as long as the unparsed text it follows, at least JSON_BLOCK_CHARS: a value that runs on is
        parsed again from its start once per block, so its blocks double (a 1 MiB block each made that
        quadratic: an unterminated 128 MB string took 11 s, one of gigabytes hung every verify). A value
        running past JSON_MAX_BYTES, more than any metadata file read whole holds, is refused: the
        window held it all, so a damaged record (a tail of NUL bytes a crash left, sparse on disk: no
        JSON error is final before the end) took memory as large as the file. The last block stops a
        character past the cap (read whole, the window reached twice the cap, its refusal ~5 caps of memory)."""
        held = len(self.buf) - self.pos
        if held > JSON_MAX_BYTES:
            raise FormatError(f"{self.path}: not valid JSON (a value at character {self._offset()} runs past "
                              f"{JSON_MAX_BYTES} characters, more than any metadata value)")
        block = "" if self.eof else self.fh.read(min(max(JSON_BLOCK_CHARS, held), JSON_MAX_BYTES + 1 - held))
        if not block:
            self.eof = True
            return False
        self.consumed += self.pos
        self.buf, self.pos = self.buf[self.pos:] + block, 0
        return True

    def _peek(self) -> str:
        """The next character that is not white space ("" at the end), not taken."""
        while True:
            self.pos = _JSON_SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self._more():
                return self.buf[self.pos:self.pos + 1]

    def _take(self, chars: str) -> str:
        c = self._peek()
        if not c or c not in chars:
            raise FormatError(f"{self.path}: not valid JSON (expected {' or '.join(chars)} at character "
                              f"{self._offset()})")
        self.pos += 1
        return c

    def _value(self) -> Any:
        """The value that starts here (a value ending at the window's end may go on: a number; so may
        one the window cuts after its "." or exponent, parsed as its first digits)."""
        self._peek()
        while True:
            try:
                value, end = _JSON_DECODER.raw_decode(self.buf, self.pos)
                if self.eof or (end < len(self.buf) and not _NUMBER_GOES_ON.fullmatch(self.buf, end)):
                    self.pos = end
                    return value
            except json.JSONDecodeError as exc:
                if self.eof:
                    raise FormatError(f"{self.path}: not valid JSON ({exc.msg} at character "
                                      f"{self.consumed + exc.pos})") from None
            except ValueError as exc:  # _StrictJsonError, an int past Python's 4300 digits: raised on a
                # whole value only, so more text cannot mend it
                raise FormatError(f"{self.path}: not valid JSON ({exc})") from None
            except RecursionError:
                raise FormatError(f"{self.path}: not valid JSON (nested too deeply to parse)") from None
            self._more()


def refuse(problems: list[str]) -> None:
    """A reader opened with verify=True: FormatError naming every problem the format's verify found."""
    if problems:
        raise FormatError("; ".join(problems))


def unlisted(root: Path, listed: set[str], source: str) -> list[str]:
    """A problem for every file under `root` (relative POSIX path) that `listed` does not name:
    an extra shard or tensor is as wrong as a missing one, and so is any link (sorted_files lists
    links, to files or directories, dangling or not, as files and never follows them)."""
    return [f"{root / rel}: not listed in {source}" for rel in sorted_files(root)
            if rel not in listed and PurePosixPath(rel).name not in TOOL_FILES]


def sorted_files(root: Path) -> Iterator[str]:
    """Every file under `root` as a relative POSIX name, in sorted() order, one directory listed at a
    time (a store's millions of chunk files are never held): a directory's entries are ordered by
    name + "/" for subdirectories, which is where sorted() puts their files ("a.x" before "a/b").
    Links are listed as files, never followed."""
    def walk(directory: str, prefix: str) -> Iterator[str]:
        with os.scandir(directory) as it:
            entries = sorted((e.name + "/" if e.is_dir(follow_symlinks=False) else e.name, e.path) for e in it)
        for name, path in entries:
            if name.endswith("/"):
                yield from walk(path, prefix + name)
            else:
                yield prefix + name

    return walk(str(root), "")


def link_out(root: Path, path: Path) -> str | None:
    """The problem of `path`, under `root`, when it is a link that resolves outside it or cannot be
    resolved (a loop, `loop -> loop`: a link nothing can be read through is no part of a store);
    None for any other path."""
    if not path.is_symlink():
        return None
    target = resolved(path)
    if target is None:
        return f"{path}: a link that cannot be resolved (a loop of links)"
    return None if target.is_relative_to(root.resolve()) else f"{path}: a link to {target}, outside {root}"


def resolved(path: Path) -> Path | None:
    """`path` with every link followed; None when a loop of links makes that impossible (pathlib
    raises RuntimeError for one before Python 3.13, OSError from it)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return None


def links_out(root: Path) -> list[str]:
    """A problem for every link under `root` (a file's or a directory's; `root` itself as given)
    that resolves outside it or cannot be resolved (link_out): a verify reports these before it reads
    anything, so that no metadata or data outside the store is ever read. Directory links are not
    entered."""
    if not root.is_dir():
        return []  # the format names what is missing
    problems, folders = [], [str(root)]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    if problem := link_out(root, Path(entry.path)):
                        problems.append(problem)
                elif entry.is_dir():
                    folders.append(entry.path)
    return sorted(problems)


# The .npy versions np.save writes (3.0 only for a dtype's field names outside latin-1: no store has one).
_NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
# What numpy's header parser raises for a header that is no Python dict literal of shape, order and
# dtype: its own ValueError, and what escapes it from ast.literal_eval and tokenize (its retry).
_NPY_HEADER_ERRORS = (ValueError, TypeError, SyntaxError, tokenize.TokenError)
_ZIP_MAGIC = b"PK\x03\x04"


def check_npy(path: Path, what: str = "a .npy file") -> None:
    """FormatError naming `path` (and `what` it must be) unless it is a .npy file whose header parses
    and describes exactly the data bytes that follow it. np.load trusts the header: a negative
    dimension raised OverflowError, a huge one was allocated before a byte was read (MemoryError, or
    gigabytes taken), a garbled one raised tokenize's TokenError, none naming the file."""
    with open_regular(path) as fh:
        if fh.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC:  # np.load opens a zip archive (.npz) whatever its name
            raise FormatError(f"{path}: not {what} (an .npz archive)")
        fh.seek(0)
        try:
            read_header = _NPY_HEADER_READERS.get(np.lib.format.read_magic(fh))
            if read_header is None:
                raise ValueError("a .npy version other than 1.0 and 2.0")
            shape, _, dtype = read_header(fh)
        except _NPY_HEADER_ERRORS as exc:
            raise FormatError(f"{path}: not {what} (its header: {exc})") from None
        held = os.fstat(fh.fileno()).st_size - fh.tell()
    described = math.prod(shape) * dtype.itemsize
    if min(shape, default=0) < 0 or held != described:
        raise FormatError(f"{path}: not {what}: its header describes {dtype} {list(shape)} ({described} bytes "
                          f"of data), the file holds {held} after it")


def dir_bytes(root: Path) -> int:
    """Bytes of every file under `root`, not counting a killed writer's temps (io_utils.is_temp); a
    link counts as itself, never as what it points to (nothing outside the store is looked at)."""
    return sum(os.lstat(root / rel).st_size for rel in sorted_files(root) if not is_temp(Path(rel)))


def inside(root: Path, name: Any, source: str) -> Path:
    """`name` (a relative POSIX path read from metadata) as a path inside `root`; FormatError when
    it is not a string, is no file name (_file_name), is absolute, climbs out with `..`, is a path the
    file system refuses to look up (a component over 255 bytes), or resolves outside through a link
    or through a loop of links."""
    rel = PurePosixPath(name) if _file_name(name) else None
    if rel is None or rel.is_absolute() or ".." in rel.parts:
        raise FormatError(f"{source}: {name!r} is not a relative path inside {root}")
    path = root.joinpath(*rel.parts)
    try:
        through_link = _through_link(root, rel)
    except OSError as exc:  # ENAMETOOLONG and the like: raised here, the error can name `source`
        raise FormatError(f"{source}: {name!r} cannot be looked up under {root} ({exc.strerror})") from None
    if through_link:
        target = resolved(path)
        if target is None:
            raise FormatError(f"{source}: {name!r} leads through a loop of links under {root}")
        if not target.is_relative_to(root.resolve()):
            raise FormatError(f"{source}: {name!r} leads outside {root} (through a link)")
    return path


def _file_name(name: Any) -> bool:
    """Whether `name` is text the operating system can take as a path: not empty, with no NUL byte
    and encodable to bytes (a lone surrogate, which a JSON "\\ud800" escape gives, is not). A path
    with either is "missing" to pathlib's is_file(), then a bare ValueError naming no file from the
    open (a zarr manifest's store path so made crashed open_zarr)."""
    if not isinstance(name, str) or not name or "\0" in name:
        return False
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        return False
    return True


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
