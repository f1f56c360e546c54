"""The Format-protocol functions of the Zarr activation logger (`actstore inspect / verify`, the
validate stage): detect, inspect, read_vector and the full integrity check."""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from actstore.errors import FormatError
from actstore.formats.extract.read import MAX_ROW_BYTES
from actstore.formats.zarr.layout import (ACTS, FILES_JSON, FORMAT_NAME, GROUP_KEYS, MANIFEST, NO_LABEL, PROMPTS_JSONL,
                                          SPLIT_VALUES, ZARR_METADATA_NAMES, chunk_keys_in_name_order, chunk_shape,
                                          run_attrs)
from actstore.formats.zarr.read import (ZarrRun, ZarrStore, entry_problem, open_zarr, run_field_problems, same_json,
                                         start_problems, store_files)
from actstore.integrity import (dir_bytes, inside, links_out, listed_problem, open_regular, problems_of, read_index,
                                read_json, stream_json_members, whole_number)
from actstore.io_utils import bounded_lines, sha256_file

# The longest text/prompts.jsonl line verify reads (bounded_lines). prompt_line writes a samples.jsonl row's
# text, label and metadata as the row holds them (MAX_ROW_BYTES), adding i and sample_key (~110 bytes).
MAX_PROMPT_LINE_BYTES = MAX_ROW_BYTES + 1024


def detect(path: str | Path) -> bool:
    """True for a run directory (manifest.json of this format) or a single store of this format."""
    path = Path(path)
    for file, key in ((path / MANIFEST, "format"), (path / ".zattrs", "format")):
        try:  # read_json: never waits on a FIFO, names nothing when it is not this format's
            if read_json(file).get(key) == FORMAT_NAME:
                return True
        except (FormatError, AttributeError):
            continue
    return False


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary of a run directory or store (the `actstore inspect` fields plus zarr specifics)."""
    path = Path(path)
    reader = open_zarr(path)
    stores = reader.stores if isinstance(reader, ZarrRun) else [reader]
    attrs = run_attrs([s.attrs for s in stores])
    manifest = reader.manifest if isinstance(reader, ZarrRun) else None
    return {
        "format": FORMAT_NAME, "model": attrs.get("model_id"), "layers": list(reader.layers),
        "n_examples": reader.n_samples, "n_tokens": int(sum(int(s.seq_len.sum()) for s in stores)),
        "d_model": reader.hidden, "dtype": "float16", "n_shards": len(stores), "bytes": dir_bytes(path),
        "T_max": attrs.get("T_max"), "T_chunk": attrs.get("T_chunk"), "chunk_bytes": attrs.get("chunk_bytes"),
        "merged": bool(manifest and manifest.get("merged")), "schema_version": attrs.get("schema_version"),
        "float16_overflow_count": _overflow_count(stores),
    }


def _overflow_count(stores: list[ZarrStore]) -> int:
    """Activations the writer made +-inf, over the stores (attr float16_overflow_count, absent: none):
    `actstore inspect` notes what a store lost, and a zarr store is float16 whatever its extraction."""
    for store in stores:
        if problem := _overflow_count_problem(store):
            raise FormatError(problem)
    return sum(store.attrs.get("float16_overflow_count", 0) for store in stores)


def _overflow_count_problem(store: ZarrStore) -> str | None:
    """A float16_overflow_count that is no whole number (the merge sums the shards'), named."""
    count = store.attrs.get("float16_overflow_count", 0)
    return None if whole_number(count) else (f"{store.path}/.zattrs: float16_overflow_count={count!r:.40}, "
                                             "expected a whole number")


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """float32 (H,) of dataset row `sample_idx`, block `layer_idx`, token `token_idx`; None if layer not stored."""
    token_idx = read_index(token_idx, "token", Path(path))  # True indexed numpy's way: a (1, H) array
    reader = open_zarr(path)
    if layer_idx not in reader.layers:
        return None
    # a single store (a shard) holds rows from its global_index_start on: row 15 of a shard starting
    # at 15 was read as its local sample 15, another row's or none; True (== 1) as row 1
    store, local = reader.locate(sample_idx)
    x = store.read(local, layer_idx)
    if not 0 <= token_idx < x.shape[0]:
        raise IndexError(f"{path}: token {token_idx} out of range [0, {x.shape[0]}) for sample {sample_idx}")
    return x[token_idx].astype(np.float32)


def verify(path: str | Path) -> list[str]:
    """Full integrity check of a run (manifest + every store) or of one store; problems name the file."""
    path = Path(path)
    if problems := links_out(path):
        return problems
    try:
        if (path / MANIFEST).is_file():
            return _verify_run(path)
        if (path / "shards").is_dir():  # a run's folder: its manifest is what lists the stores
            return [f"{path / MANIFEST}: missing"]
        return _verify_store(path)
    except Exception as exc:  # a bad store must yield problems, never an exception
        return [f"{path}: cannot verify ({type(exc).__name__}: {exc})"]


def _verify_run(run: Path) -> list[str]:
    try:
        manifest = read_json(run / MANIFEST)
    except FormatError as exc:
        return [str(exc)]
    where = run / MANIFEST
    if not isinstance(manifest, dict):
        return [f"{where}: not a JSON object, got {manifest!r:.60}"]
    problems = [] if manifest.get("format") == FORMAT_NAME else [f"{where}: format={manifest.get('format')!r}"]
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        return problems + [f"{where}: 'shards' must be a non-empty list"]
    expected_start = 0
    for k, entry in enumerate(shards):
        if problem := entry_problem(entry, f"{where}: shards[{k}]"):
            problems.append(problem)
            continue
        if entry["global_index_start"] != expected_start:
            problems.append(f"{where}: shards[{k}].global_index_start={entry['global_index_start']}, expected {expected_start}")
        expected_start += entry["num_samples"]
        problems += _verify_listed(run, _Listing(manifest, where, f"shards[{k}]", entry))
    if not same_json(manifest.get("num_samples"), expected_start):  # 67.0 and true are counts only to Python
        problems.append(f"{where}: num_samples={manifest.get('num_samples')}, shards hold {expected_start}")
    merged = manifest.get("merged")
    if merged:
        if problem := entry_problem(merged, f"{where}: merged"):
            return problems + [problem]
        if merged["num_samples"] != expected_start:  # Option B's reads would lose the samples past it
            problems.append(f"{where}: merged.num_samples={merged['num_samples']}, the shards hold {expected_start}")
        problems += _verify_listed(run, _Listing(manifest, where, "merged", merged))
    return problems


def _verify_listed(run: Path, listing: _Listing) -> list[str]:
    """_verify_store of a store the manifest lists; an entry's path leading outside the run is its
    problem (it was the whole run's "cannot verify", which dropped every other store's problems)."""
    try:
        store = inside(run, listing.entry["path"], str(listing.path))
    except FormatError as exc:
        return [str(exc)]
    return _verify_store(store, listing)


class _Listing(NamedTuple):
    """A store's entry in its run's manifest.json: the manifest, its path, the entry's name there
    ("shards[k]" or "merged") and the entry."""
    manifest: dict
    path: Path
    name: str
    entry: dict


def _verify_store(store: Path, listing: _Listing | None = None) -> list[str]:
    """Checksums of every file, no file missing or extra, spec fields, consolidated == per-file metadata,
    sample_idx == global_index_start + local index; in a run, the manifest's run-wide fields and the
    entry's counts and start against the store's."""
    files_json = store / FILES_JSON
    entry = listing.entry if listing else None
    if not files_json.is_file():
        return [f"{files_json}: missing"]
    if entry is not None and sha256_file(files_json) != entry["files_sha256"]:
        return [f"{files_json}: sha256 differs from manifest.json"]
    try:
        reader = ZarrStore(store)
    except FormatError as exc:
        return _verify_files(store, None, entry) + [str(exc)]
    problems = (_verify_files(store, reader, entry) + metadata_problems(store, reader) + _sample_idx_problems(reader)
                + _per_sample_problems(reader))
    if listing is not None:
        problems += run_field_problems(listing.manifest, reader, str(listing.path))
        problems += start_problems(entry, reader, f"{listing.path}: {listing.name}", listing.name == "merged")
    if entry is not None and entry["num_samples"] != reader.n_samples:
        problems.append(f"{store}/.zattrs: num_samples={reader.n_samples}, manifest.json says {entry['num_samples']}")
    return problems


def _sample_idx_problems(reader: ZarrStore) -> list[str]:
    """arrays/sample_idx against .zattrs' global_index_start: the sample at local i is dataset row
    start + i, which the run reader and the merge place it by."""
    start, where = reader.attrs["global_index_start"], f"{reader.path}/arrays/sample_idx"
    try:
        sample_idx = reader.vector("sample_idx")
    except FormatError as exc:
        return [str(exc)]
    if sample_idx.dtype.kind not in "iu":
        return [f"{where}: dtype {sample_idx.dtype}, expected integers"]
    wrong = np.flatnonzero(sample_idx != start + np.arange(reader.n_samples))
    return [f"{where}: [{wrong[0]}] = {sample_idx[wrong[0]]}, expected global_index_start {start} + {wrong[0]} "
            f"(.zattrs)"] if wrong.size else []


def _per_sample_problems(reader: ZarrStore) -> list[str]:
    """arrays/split, arrays/label and text/prompts.jsonl against the spec and the store's attrs and arrays:
    each a pass over a file the store holds one a sample, so each is one validate share's (problems_of)."""
    checks = [_split_problems, _label_problems, _prompts_problems]
    return problems_of(lambda check: check(reader), checks, desc="verify zarr per-sample files")


def _out_of_set_problem(reader: ZarrStore, name: str, allowed: str, bad: Callable[[np.ndarray], np.ndarray]
                        ) -> list[str]:
    """arrays/`name`'s first value where `bad` (of integers: `allowed` says which are the spec's), and how
    many, named; [] where none is or the store has no such array."""
    where = f"{reader.path}/arrays/{name}"
    if f"arrays/{name}/.zarray" not in reader.metadata:
        return []
    try:
        first, count, start = None, 0, 0
        for values in reader.vector_chunks(name):
            if values.dtype.kind not in "iu":
                return [f"{where}: dtype {values.dtype}, expected integers ({allowed})"]
            at = np.flatnonzero(bad(values))
            if first is None and at.size:
                first = (start + int(at[0]), values[at[0]])
            count, start = count + at.size, start + len(values)
    except FormatError as exc:
        return [str(exc)]
    return [f"{where}: [{first[0]}] = {first[1]} is not {allowed} ({count} samples)"] if count else []


def _split_problems(reader: ZarrStore) -> list[str]:
    """arrays/split holds the spec's codes only: a sample of another was in no split a reader filters on."""
    allowed = ", ".join(map(str, SPLIT_VALUES)) + " (train, val, test)"
    return _out_of_set_problem(reader, "split", allowed, lambda codes: ~np.isin(codes, SPLIT_VALUES))


def _label_problems(reader: ZarrStore) -> list[str]:
    """arrays/label holds positions in the label_names attr or NO_LABEL: another named no class."""
    if "arrays/label/.zarray" not in reader.metadata:
        return []
    names = reader.attrs.get("label_names")
    if not isinstance(names, list):
        return [f"{reader.path}/.zattrs: label_names={names!r:.40}, expected the list arrays/label indexes"]
    return _out_of_set_problem(reader, "label", f"{NO_LABEL} (none) or a position in label_names (0..{len(names) - 1})",
                               lambda labels: (labels != NO_LABEL) & ((labels < 0) | (labels >= len(names))))


def _prompts_problems(reader: ZarrStore) -> list[str]:
    """text/prompts.jsonl (optional in the spec): a JSON object a sample, line i its sample's, with `i` =
    i, a `prompt`, and the `sample_key` of arrays/sample_key (where the store has one); read a line at a
    time, none past MAX_PROMPT_LINE_BYTES. The first line wrong is named (a line missing made every later
    one another sample's)."""
    path = reader.path / PROMPTS_JSONL
    if not path.exists():
        return []
    keys = (itertools.chain.from_iterable(_sample_key_chunks(reader))
            if "arrays/sample_key/.zarray" in reader.metadata else itertools.repeat(None))
    lines = 0
    try:
        with open_regular(path) as fh:
            read = bounded_lines(fh, MAX_PROMPT_LINE_BYTES, path)
            for lines, (key, line) in enumerate(zip(keys, read), start=1):  # keys first: no line taken past them
                if problem := _prompt_line_problem(line, lines - 1, key):
                    return [f"{path}: line {lines} (sample {lines - 1}): {problem}"]
            rest = sum(1 for _ in read)  # the lines past the samples' (zip stops at the shorter)
    except FormatError as exc:  # a line too long, or arrays/sample_key not bytes: each names its file
        return [str(exc)]
    except OSError as exc:
        return [f"{path}: unreadable ({exc})"]
    held = lines + rest
    return [] if held == reader.n_samples else [f"{path}: {held} lines, the store holds {reader.n_samples} samples "
                                                f"(.zattrs num_samples)"]


def _sample_key_chunks(reader: ZarrStore) -> Iterator[np.ndarray]:
    """arrays/sample_key's values a chunk at a time; FormatError naming the array where they are not the
    spec's fixed-length bytes (a number has no text to compare a line's sample_key with)."""
    for values in reader.vector_chunks("sample_key"):
        if values.dtype.kind != "S":
            raise FormatError(f"{reader.path}/arrays/sample_key: dtype {values.dtype}, expected fixed-length bytes "
                              "(the spec's |S64 sha256 hex)")
        yield values


def _prompt_line_problem(line: bytes, i: int, key: bytes | None) -> str | None:
    """Why `line` is not local sample `i`'s prompts.jsonl line (its sample_key `key`; None: not stored)."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        return f"not JSON ({exc})"
    if not isinstance(record, dict):
        return f"{record!r:.40} is not a JSON object"
    if not same_json(record.get("i"), i):
        return f"i={record.get('i')!r:.40}, expected {i} (the sample of its line)"
    if not isinstance(record.get("prompt"), str):
        return f"prompt={record.get('prompt')!r:.40}, expected a string"
    stored = None if key is None else key.decode("ascii", "replace")
    if stored is not None and record.get("sample_key") != stored:
        return f"sample_key={record.get('sample_key')!r:.80}, arrays/sample_key[{i}] is {stored!r}"
    return None


def _verify_files(store: Path, reader: ZarrStore | None, entry: dict | None = None) -> list[str]:
    """files.json (in name order, as written) read 1 MiB at a time beside the store's files and the
    activations' chunk keys walked in the same order: a merged store lists millions, none held. Each
    listed file checked against its record (problems_of: several at once), each file on disk listed,
    each chunk recorded at chunk_bytes, each file past a sample's chunks recorded as zeros; the files
    and bytes it records against the manifest `entry`'s n_files and bytes (store_entry's counts), in
    the same pass."""
    return problems_of(lambda check: check(), _file_checks(store, reader, entry), desc="verify zarr files", batch=64)


def _found(problem: str) -> Callable[[], list[str]]:
    return lambda: [problem]


def _listed(store: Path, name: str, info: Any) -> Callable[[], list[str]]:
    def check() -> list[str]:
        problem = listed_problem(store, name, info, FILES_JSON, str(store / FILES_JSON))
        return [problem] if problem else []
    return check


def _file_checks(store: Path, reader: ZarrStore | None, entry: dict | None) -> Iterator[Callable[[], list[str]]]:
    """_verify_files' walk: each problem it finds, and each listed file's check, in name order."""
    files_json = store / FILES_JSON
    on_disk = (name for name in store_files(store) if name != FILES_JSON)
    chunks = (key for key, _ in chunk_keys_in_name_order(reader.chunk_counts(), len(reader.layers))) \
        if reader else iter(())
    disk, chunk, lost, first_lost, previous = next(on_disk, None), next(chunks, None), 0, None, None
    totals = {"n_files": 1, "bytes": files_json.stat().st_size}  # files.json counts itself
    try:
        for name, info in stream_json_members(files_json, "files", "a files.json (needs a files object)"):
            if previous is not None and name <= previous:
                yield _found(f"{files_json}: {name!r} out of name order (after {previous!r})")
                return
            previous = name
            if reader is not None and PurePosixPath(name).name in ZARR_METADATA_NAMES and name not in reader.metadata:
                # zarr.open_consolidated reads .zmetadata alone: a group it lacks does not open, an array
                # it lacks is not there (a client reading the files sees it)
                yield _found(f"{store / name}: a zarr metadata document that {store}/.zmetadata does not hold")
            while disk is not None and disk <= name:
                if disk < name:
                    yield _found(f"{store / disk}: not listed in {FILES_JSON}")
                disk = next(on_disk, None)
            holds_tokens = False
            while chunk is not None and chunk <= name:
                if chunk < name:
                    lost, first_lost = lost + 1, first_lost or chunk
                holds_tokens = chunk == name
                chunk = next(chunks, None)
            if holds_tokens and (recorded := _recorded_bytes(info)) is not None and recorded != reader.chunk_bytes:
                # the record is what _listed holds the file to: a chunk cut short before files.json
                # was written passed, then failed every read of its sample
                yield _found(f"{store / name}: {FILES_JSON} records {recorded} bytes, an activations chunk "
                             f"holds {reader.chunk_bytes} (T_chunk x hidden_size x 2)")
            elif reader is not None and not holds_tokens and _past_tokens(name, info, reader.chunk_bytes):
                # the writer leaves these out (zarr reads the fill value 0); an older store's are zeros
                yield _found(f"{store / name}: an activations chunk past its sample's seq_len, {FILES_JSON} records "
                             "non-zero bytes (a zarr client reads them as the padding, which is zero)")
            totals["n_files"] += 1
            totals["bytes"] += _recorded_bytes(info) or 0
            yield _listed(store, name, info)
    except FormatError as exc:
        yield _found(f"{files_json}: unreadable ({exc})")
        return
    for rest in itertools.chain([disk] if disk else [], on_disk):
        yield _found(f"{store / rest}: not listed in {FILES_JSON}")
    for rest in itertools.chain([chunk] if chunk else [], chunks):
        lost, first_lost = lost + 1, first_lost or rest
    if lost:
        yield _found(f"{store}/{ACTS}: {lost} chunk files not recorded, e.g. {first_lost}")
    for key, recorded in totals.items():
        if entry is not None and key in entry and entry[key] != recorded:
            yield _found(f"{store}: {FILES_JSON} records {recorded} {key.removeprefix('n_')}, manifest.json says "
                         f"{entry[key]}")


def _past_tokens(name: str, info: Any, chunk_bytes: int) -> bool:
    """True for a file under the activations array, no zarr metadata and no chunk holding tokens, whose
    record is not a chunk of zeros: _listed holds the file to its record, so no byte of it is read twice."""
    return (name.startswith(f"{ACTS}/") and PurePosixPath(name).name not in ZARR_METADATA_NAMES
            and not (isinstance(info, dict) and info.get("bytes") == chunk_bytes
                     and info.get("sha256") == _zeros_sha256(chunk_bytes)))


@functools.cache
def _zeros_sha256(size: int) -> str:
    """sha256 of `size` zero bytes, hashed a block at a time (the size comes from .zattrs: never allocated)."""
    digest, block = hashlib.sha256(), memoryview(bytes(1 << 22))
    for start in range(0, size, len(block)):
        digest.update(block[: size - start])
    return digest.hexdigest()


def _recorded_bytes(info: Any) -> int | None:
    """The bytes a files.json record gives its file, None when it gives no whole number (_listed names that)."""
    return info["bytes"] if isinstance(info, dict) and whole_number(info.get("bytes")) else None


def metadata_problems(store: Path, reader: ZarrStore) -> list[str]:
    """A store's metadata as zarr clients read it and as its attrs describe it (verify's; the merge's
    check of each shard before it builds the merged store from the first one's attrs)."""
    problems = [f"{store}/.zmetadata: no entry {key!r} (zarr.open_consolidated opens no group it lacks)"
                for key in GROUP_KEYS if key not in reader.metadata]
    for key, value in reader.metadata.items():  # what plain zarr clients see must equal the files
        try:
            path = inside(store, key, f"{store}/.zmetadata")
        except FormatError as exc:
            problems.append(str(exc))
            continue
        if PurePosixPath(key).name not in ZARR_METADATA_NAMES:
            problems.append(f"{store}/.zmetadata: {key!r} is not a zarr metadata name ({', '.join(ZARR_METADATA_NAMES)})")
            continue
        try:  # read_json: never waits on a FIFO put in its place, nor reads a file no writer made whole
            on_disk = read_json(path)
        except FormatError as exc:
            problems.append(f"{exc} (listed in .zmetadata)")
            continue
        if isinstance(value, dict):  # zarr-python nests a consolidated_metadata stub in sub-group entries
            value = {k: v for k, v in value.items() if k != "consolidated_metadata"}
        if on_disk != value:
            problems.append(f"{path}: differs from its entry in {store}/.zmetadata")
    fill = reader.metadata[f"{ACTS}/.zarray"].get("fill_value")
    if not (isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill == 0):
        # the chunks past a sample's tokens have no file: a zarr client reads them as the fill value
        problems.append(f"{store}/{ACTS}/.zarray: fill_value={fill!r:.40}, expected 0 (tokens past seq_len are zero)")
    if reader.attrs.get("dtype") != "float16":
        problems.append(f"{store}/.zattrs: dtype={reader.attrs.get('dtype')!r}, expected 'float16'")
    if reader.attrs.get("num_layers") != len(reader.layers):
        problems.append(f"{store}/.zattrs: num_layers={reader.attrs.get('num_layers')} != len(layers)")
    if overflow := _overflow_count_problem(reader):
        problems.append(overflow)
    return problems + _vector_problems(reader) + _chunk_attr_problems(store, reader)


def _vector_problems(reader: ZarrStore) -> list[str]:
    """Each 1-D array's name and .zarray as reads and the merge take them: a name of "." or "" (its
    chunks looked up outside arrays/) verified clean, and read or merged the store's other files."""
    try:
        names = reader.vector_names
    except FormatError as exc:
        return [str(exc)]
    problems = []
    for name in names:
        try:
            reader.vector_chunk_names(name)
        except FormatError as exc:
            problems.append(str(exc))
    return problems


def _chunk_attr_problems(store: Path, reader: ZarrStore) -> list[str]:
    """The chunk attrs in .zattrs against the activations' .zarray, as JSON (true is not 1): the
    merge builds the merged .zarray from the attrs' T_chunk and links the shard's chunk files into
    it, so a store whose attrs disagree verified clean and merged into one no read could use."""
    chunks = {"T_chunk": reader.t_chunk, "chunk_shape": chunk_shape(reader.t_chunk, reader.hidden),
              "chunk_bytes": reader.chunk_bytes}
    return [f"{store}/.zattrs: {key}={reader.attrs[key]!r:.40}, but {store}/{ACTS}/.zarray gives {value!r}"
            for key, value in chunks.items() if key in reader.attrs and not same_json(reader.attrs[key], value)]
