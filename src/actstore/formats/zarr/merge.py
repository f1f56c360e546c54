"""Merging shard stores into one store over every sample (spec Option B), scattered over jobs.

`link_chunks` (job zarr_merge_chunks, one per range of consecutive shards) hard-links the activation
chunk files under their merged names with their checksums; `finish_merge` (job zarr_merge) writes
the small parts and moves the linked chunk directories into place by rename. `merge_stores` is the
two run as one job. A merged chunk is the shard's chunk file itself (same bytes, by definition: the
chunking and encoding are the shards'), so the merged store costs no copy and no disk space for its
activations; zarr rewrites a chunk by replacing its file, never in place, so writing through either
store leaves the other as it was.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np

from actstore.errors import FormatError
from actstore.formats.zarr.check import MAX_PROMPT_LINE_BYTES, metadata_problems
from actstore.formats.zarr.layout import (ACTS, COMPATIBLE_ATTRS, FILES_JSON, PROMPTS_JSONL, acts_chunk_key,
                                          chunk_counts, chunk_keys_in_name_order, files_json_pieces, known_attrs,
                                          run_attrs)
from actstore.formats.zarr.read import ZarrStore, store_files
from actstore.formats.zarr.write import _consolidate, _create_vector, _now, _open_root, store_entry
from actstore.integrity import (file_record, file_records, links_out, listed_problem, read_json, refuse,
                                stream_json_members)
from actstore.io_utils import atomic_path, bounded_lines, errors_naming, scratch_beside, stale_temps
from actstore.jobs import JOB_RECORD, iter_job_records, job_items, write_job_record


def _check_compatible(stores: list[Path], attrs: list[dict], start: int = 0) -> None:
    """Shards of one run, consecutive from global sample `start`: refused before anything is written.
    Each against the store the run takes its attrs from (layout.run_attrs), an empty one but its width."""
    ref = run_attrs(attrs)
    ref_store = next((store for store, a in zip(stores, attrs) if a is ref), None)
    for store, a in zip(stores, attrs):
        for key in known_attrs(a, COMPATIBLE_ATTRS):
            if a.get(key) != ref.get(key):
                raise FormatError(f"{store}/.zattrs: {key}={a.get(key)!r} differs from {ref_store} ({ref.get(key)!r})")
    expected = start
    for store, a in zip(stores, attrs):
        if a["global_index_start"] != expected and a["num_samples"]:
            raise FormatError(f"{store}/.zattrs: global_index_start={a['global_index_start']}, expected {expected}")
        expected += a["num_samples"]


def _open_shards(shards: Sequence[str | Path], start: int | None = 0) -> tuple[list[Path], list[ZarrStore]]:
    """The shards opened and checked compatible (start None: consecutive from the first one's start)."""
    paths = [Path(s) for s in shards]
    readers = [ZarrStore(s) for s in paths]
    attrs = [r.attrs for r in readers]
    if start is None:
        start = attrs[0]["global_index_start"] if attrs else 0
    _check_compatible(paths, attrs, start)
    return paths, readers


def _merged_attrs(shards: list[Path], attrs: list[dict]) -> dict[str, Any]:
    """The run's attrs (layout.run_attrs) over every sample; float16 overflows summed over the shards."""
    merged = {**run_attrs(attrs), "num_samples": sum(a["num_samples"] for a in attrs), "global_index_start": 0,
              "merged_from": [s.name for s in shards], "created": _now()}
    merged.pop("float16_overflow_count", None)
    overflow = sum(a.get("float16_overflow_count", 0) for a in attrs)
    if overflow:
        merged["float16_overflow_count"] = overflow
    return merged


def merge_stores(shards: Sequence[str | Path], out_path: str | Path, progress: bool = True) -> dict[str, Any]:
    """Option B: one store over every shard, in shard order (atomic): the scattered merge run as one job,
    `link_chunks` over every shard into a scratch directory beside `out_path`, then `finish_merge`."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # Beside out_path, so finish_merge's renames stay on one filesystem; not named like one of
    # atomic_path's temps of out_path, which finish_merge clears as a killed writer's debris, but like
    # those of out_path-chunks, so that a killed merge's (a link to every chunk file) is swept here.
    with scratch_beside(out_path.parent / f"{out_path.name}-chunks") as scratch:
        chunk_dir = scratch / "merge-0"
        link_chunks(shards, chunk_dir, 1, 0, progress)
        return finish_merge(shards, [chunk_dir], out_path, progress)


def link_chunks(shards: Sequence[str | Path], out_dir: str | Path, jobs: int, job: int,
                progress: bool = True) -> int:
    """Job `job` of `jobs` of the scattered merge (atomic): the activation chunks of `shards`, its
    consecutive shards of the run (jobs.job_items), hard-linked file for file under their merged
    names (sample axis = the shard's global_index_start + local; chunking and encoding are
    identical, so the bytes are too; `out_dir` on the shards' filesystem, as the stage directory
    is), and its job record (jobs.write_job_record, with the shards' names) of their bytes + sha256
    as each shard's meta/files.json has them (no re-hash), streamed as each file is linked: the job
    holds one shard's files.json at a time. Returns the number of files linked. A shard with a link
    leading out of it, or a chunk file that is a link or reached through one, is refused by name."""
    from tqdm import tqdm

    refuse([problem for shard in shards for problem in links_out(Path(shard))])  # before a file of theirs is read
    shards, readers = _open_shards(shards, start=None)
    linked = 0

    def entries() -> Iterator[tuple[str, dict]]:
        nonlocal linked
        for shard, reader in zip(shards, tqdm(readers, desc="zarr merge chunks", unit="shard", disable=not progress)):
            for entry in _link_shard_chunks(shard, reader, tmp):
                linked += 1
                yield entry

    with atomic_path(out_dir) as tmp:
        (tmp / ACTS).mkdir(parents=True)
        write_job_record(tmp, jobs, job, entries(), shards=[s.name for s in shards])
    return linked


def _link_shard_chunks(shard: Path, reader: ZarrStore, dst: Path) -> Iterator[tuple[str, dict]]:
    """Every chunk of the shard linked into `dst` under its merged key, yielded as it is linked with
    its files.json entry: (merged key, entry)."""
    files_json = read_json(shard / FILES_JSON)  # its records go into the job record as they are: checked here
    shard_files = file_records(files_json.get("files") if isinstance(files_json, dict) else None,
                               str(shard / FILES_JSON))
    start = reader.attrs["global_index_start"]
    walked: list[str] = []
    for local in range(reader.n_samples):
        for key, target in _sample_chunk_keys(reader, local, start + local):
            if key not in shard_files:
                raise FormatError(f"{shard / FILES_JSON}: no entry for {key}")
            (dst / target).parent.mkdir(parents=True, exist_ok=True)
            _link(_own_file(shard, key, walked), dst / target, shard, dst)
            yield target, shard_files[key]


def _own_file(shard: Path, key: str, walked: list[str]) -> str:
    """shard/key when it is a regular file reached through directories, none of them a link: a hard
    link is made to what a path resolves to, so a linked directory (even one links_out lets pass,
    inside the shard) would put another file than the shard's own into the merged store. Each
    directory is lstat'ed once for the keys that share it (`walked`: the last key's directories,
    updated), about two lstats a chunk; paths as strings (pathlib's cost a chunk is several times
    the lstats')."""
    parts = key.split("/")
    same = 0
    while same < min(len(walked), len(parts) - 1) and parts[same] == walked[same]:
        same += 1
    path = "/".join([str(shard), *parts[:same]])
    for depth in range(same, len(parts)):
        path += "/" + parts[depth]
        mode = os.lstat(path).st_mode
        if not (stat.S_ISREG(mode) if depth == len(parts) - 1 else stat.S_ISDIR(mode)):
            what = "a link" if stat.S_ISLNK(mode) else "not a regular file or directory"
            raise FormatError(f"{path}: {what}; the merge hard-links only a shard's own chunk files")
    walked[:] = parts[:-1]
    return path


def _link(src: str, dst: Path, shard: Path, out_dir: Path) -> None:
    """Hard-link `src` (a file of `shard`) as `dst` (under `out_dir`), never what a link there points to.
    Across file systems there is no hard link, and no copy either (a merged store is the shards'
    files): that error says where the merged store must be."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        raise OSError(errno.EXDEV, f"{shard} and {out_dir} are on different file systems: the merged store "
                                   "must be on the shards' file system (the merge hard-links their chunk files, "
                                   "it never copies them)") from exc


def _sample_chunk_keys(reader: ZarrStore, local: int, g: int) -> Iterator[tuple[str, str]]:
    """(key in the shard, key in the merged store) of every chunk file of local sample `local`: those
    its tokens fill (a shard written before they alone were written has zero chunks past them, which
    the merged store leaves out, as zarr does)."""
    count = int(chunk_counts(reader.seq_len[local], reader.t_chunk))
    for l in range(len(reader.layers)):
        for c in range(count):
            yield acts_chunk_key(local, l, c), acts_chunk_key(g, l, c)


# The finisher's table of every chunk's {bytes, sha256}, in merged (sample, layer, chunk) order: a
# file, 40 B a chunk, where a dict of the records took ~1 KB a chunk (94 GB at 100 TB).
TABLE_ENTRY = struct.Struct("<q32s")


def finish_merge(shards: Sequence[str | Path], chunk_dirs: Sequence[str | Path], out_path: str | Path,
                 progress: bool = True) -> dict[str, Any]:
    """The merge's finishing job (atomic): the merged store over every shard from `chunk_dirs`, the
    outputs of `link_chunks` over consecutive runs of `shards`, in order. Writes the small parts
    (attrs, array metadata, the concatenated 1-D arrays, prompts.jsonl: each shard's first checked
    against its files.json), moves each sample's chunk directory in by rename (no copy), then
    files.json from the jobs' records. Every check comes before the first rename; a failure after
    it, until the store takes its name (its sync and rename too), renames them back, so the chunk
    dirs stay whole; a kill leaves them in its temp of `out_path`, from where the next run takes
    them back first.
    Memory does not grow with the chunk files: the records are streamed into a table on disk."""
    shards, readers = _open_shards(shards)
    refuse([problem for reader in readers for problem in _read_file_problems(reader)])
    # the merged .zarray is built from the first shard's attrs, around chunk files its .zarray made:
    # attrs that verify names (T_chunk, num_layers) made a store no read could use
    refuse([problem for shard, reader in zip(shards, readers) for problem in metadata_problems(shard, reader)])
    chunk_dirs, out_path = [Path(d) for d in chunk_dirs], Path(out_path)
    _take_back_killed_moves(chunk_dirs, _job_shards(shards, len(chunk_dirs)), readers, out_path)
    merged_attrs = _merged_attrs(shards, [r.attrs for r in readers])
    a0, n = run_attrs([r.attrs for r in readers]), merged_attrs["num_samples"]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out_path.parent) as table:  # unnamed: gone with the job, however it ends
        covered = _record_table(shards, readers, chunk_dirs, table)
        table.flush()
        # the sample directories moved in go back to the chunk dirs on a failure before the store takes its name
        with atomic_path(out_path, undo=functools.partial(_move_back, chunk_dirs, covered, readers)) as tmp:
            _, arrays = _open_root(tmp, merged_attrs, (n, a0["num_layers"], a0["T_max"], a0["hidden_size"]),
                                   a0["T_chunk"])
            for name in readers[0].vector_names:
                _create_vector(arrays, name, np.concatenate([r.vector(name) for r in readers]))
            _consolidate(tmp)
            _merge_text(shards, tmp)
            _move_in(chunk_dirs, covered, readers, tmp, progress)
            _write_merged_files_json(tmp, table.fileno(), np.concatenate([r.chunk_counts() for r in readers]),
                                     len(readers[0].layers))
    return store_entry(out_path)


def _job_shards(shards: list[Path], jobs: int) -> list[list[str]]:
    """The names of the shards each of `jobs` link jobs takes (jobs.job_items)."""
    return [[shards[i].name for i in job_items(len(shards), jobs, job)] for job in range(jobs)]


def _take_back_killed_moves(chunk_dirs: list[Path], covered: list[list[str]], readers: list[ZarrStore],
                            out_path: Path) -> None:
    """Rename back into its chunk dir each sample directory a killed finish_merge (a job's time or
    memory limit) had moved into its temp of `out_path`, which the next atomic_path deletes: else
    the chunk dirs lack them and every rerun is refused until the link jobs are rerun. Only into a
    chunk dir that lacks the sample, and only when its chunk files are the shard's own (the same
    inodes the link job made), so nothing but the link job's files ever goes back."""
    for stale in stale_temps(out_path):
        for d, reader, local, g in _record_samples(chunk_dirs, covered, readers):
            moved, home = stale / ACTS / str(g), d / ACTS / str(g)
            if moved.is_dir() and not os.path.lexists(home) and _links_to_shard(reader, local, g, stale):
                os.rename(moved, home)


def _links_to_shard(reader: ZarrStore, local: int, g: int, store: Path) -> bool:
    """Whether every chunk file of merged sample `g` under `store` is the file of the shard's
    sample `local` (a hard link to it)."""
    try:
        return all(os.path.samestat(os.lstat(reader.path / key), os.lstat(store / target))
                   for key, target in _sample_chunk_keys(reader, local, g))
    except FileNotFoundError:
        return False


def _read_file_problems(reader: ZarrStore) -> list[str]:
    """The shard's files whose bytes or fields the merged store takes (.zmetadata: attrs and arrays;
    the 1-D arrays' chunks; prompts.jsonl) against its meta/files.json, read for those names alone:
    a damaged one would become a merged store whose own files.json records it, and verifies clean."""
    names = {".zmetadata", PROMPTS_JSONL}
    names.update(key for name in reader.vector_names for key in reader.vector_chunk_names(name))
    files_json = reader.path / FILES_JSON
    records = {name: record for name, record in stream_json_members(files_json, "files") if name in names}
    return [problem for name in sorted(names)
            if (problem := listed_problem(reader.path, name, records.get(name), FILES_JSON, str(files_json)))]


def _record_table(shards: list[Path], readers: list[ZarrStore], chunk_dirs: list[Path], table: BinaryIO) -> list[list[str]]:
    """Each job linked the shards job_items gives it and lists every chunk of their samples, in order
    (as link_chunks writes them), still linked to the shard's files: their {bytes, sha256} appended
    to `table`, in merged order. Returns the shards each job covered."""
    covered = []
    for job, (d, extra, listed) in enumerate(iter_job_records(chunk_dirs)):
        record, names = d / JOB_RECORD, extra.get("shards")
        expected = [shards[i].name for i in job_items(len(shards), len(chunk_dirs), job)]
        if names != expected:
            raise FormatError(f"{record}: linked shards {names}, job {job} of {len(chunk_dirs)} takes {expected}")
        covered.append(names)
        for _, reader, local, g in _record_samples([d], [names], readers):
            for c, (key, target) in enumerate(_sample_chunk_keys(reader, local, g)):
                name, entry = next(listed, (None, None))
                if name != target:
                    raise FormatError(f"{record}: no entry for {target}" + (f" (next: {name})" if name else ""))
                if c == 0:
                    _check_still_linked(reader.path / key, d / target, record)
                # .get: jobs.read_job_records also takes a record of a sha256_tree alone, a KeyError here
                table.write(TABLE_ENTRY.pack(entry["bytes"], _digest(entry.get("sha256", ""), record, name)))
        for name, _ in listed:
            raise FormatError(f"{record}: lists {name}, not a chunk of its shards")
    return covered


def _check_still_linked(shard_file: Path, linked: Path, record: Path) -> None:
    """`linked` (a sample's first chunk) is still a link to the shard's file: a shard written again
    after its link job (every file new) leaves the links at its old files, whose bytes and records
    the merged store would take beside the new shard's 1-D arrays and prompts, and verify clean.
    A sample's first chunk stands for its others (a shard is written whole; two lstats a sample)."""
    if not os.path.samestat(os.lstat(shard_file), os.lstat(linked)):
        raise FormatError(f"{linked}: not a link to {shard_file} (the shard was written again after its link job):"
                          f" run the zarr_merge_chunks job of {record} again")


def _digest(sha256: str, record: Path, name: str) -> bytes:
    digest = bytes.fromhex(sha256) if len(sha256) == 64 else b""
    if not digest or digest.hex() != sha256:
        raise FormatError(f"{record}: sha256 of {name} is missing or not 64 lowercase hex digits")
    return digest


def _write_merged_files_json(store: Path, table: int, counts: np.ndarray, n_layers: int) -> None:
    """meta/files.json of the merged store (write._write_files_json's bytes), streamed in name order:
    the store's files walked in that order beside the chunks' keys, each chunk's entry from the table
    (one whose size is not the recorded one hashed again), every other file hashed; an expected chunk
    that is not there is refused."""
    entries = _merged_entries(store, table, chunk_keys_in_name_order(counts, n_layers))
    (store / "meta").mkdir(exist_ok=True)
    with errors_naming(store / FILES_JSON), (store / FILES_JSON).open("w", encoding="utf-8") as out:
        out.writelines(files_json_pieces(entries))


def _merged_entries(store: Path, table: int, chunks: Iterator[tuple[str, int]]) -> Iterator[tuple[str, dict]]:
    """(name, {bytes, sha256}) of every file of `store` in name order, `chunks` (key, table index)
    walked beside them in the same order."""
    want = next(chunks, None)
    for name in store_files(store):
        if name == FILES_JSON:
            continue
        entry = None
        if want and want[0] <= name:
            if want[0] < name:
                break
            size, digest = TABLE_ENTRY.unpack(os.pread(table, TABLE_ENTRY.size, TABLE_ENTRY.size * want[1]))
            entry = {"bytes": size, "sha256": digest.hex()} if size == os.stat(store / name).st_size else None
            want = next(chunks, None)
        yield name, entry or file_record(store / name)
    if want:
        raise FormatError(f"{store}/{want[0]}: missing (written or moved in, then gone)")


def _record_samples(chunk_dirs: list[Path], covered: list[list[str]],
                    readers: list[ZarrStore]) -> Iterator[tuple[Path, ZarrStore, int, int]]:
    """(chunk dir, shard, local index, merged index) of every sample, in merged order."""
    by_name = {r.path.name: r for r in readers}
    for d, names in zip(chunk_dirs, covered):
        for reader in (by_name[name] for name in names):
            start = reader.attrs["global_index_start"]
            for local in range(reader.n_samples):
                yield d, reader, local, start + local


def _sample_moves(chunk_dirs: list[Path], covered: list[list[str]], readers: list[ZarrStore],
                  dst: Path) -> Iterator[tuple[Path, Path]]:
    """(chunk directory in a chunk dir, its place in `dst`) of every merged sample with a token, in
    order: one of no token (seq_len 0) has no chunk file, so no directory, in the shard or the chunk dir."""
    for d, reader, local, g in _record_samples(chunk_dirs, covered, readers):
        if reader.seq_len[local]:
            yield d / ACTS / str(g), dst / ACTS / str(g)


def _move_in(chunk_dirs: list[Path], covered: list[list[str]], readers: list[ZarrStore], dst: Path,
             progress: bool) -> None:
    """Rename every sample directory of the chunk dirs into `dst`, in order."""
    from tqdm import tqdm

    for src, moved in tqdm(_sample_moves(chunk_dirs, covered, readers, dst), desc="zarr merge", unit="sample",
                           disable=not progress):
        os.rename(src, moved)


def _move_back(chunk_dirs: list[Path], covered: list[list[str]], readers: list[ZarrStore], dst: Path) -> None:
    """Rename back every sample directory `_move_in` moved into `dst` (the plan re-walked, never held
    in memory), so the chunk dirs can be finished again."""
    for src, moved in _sample_moves(chunk_dirs, covered, readers, dst):
        if os.path.lexists(moved):
            os.rename(moved, src)


def _merge_text(shards: list[Path], dst: Path) -> None:
    (dst / "text").mkdir()
    i = 0
    with errors_naming(dst / PROMPTS_JSONL), (dst / PROMPTS_JSONL).open("w", encoding="utf-8") as out:
        for shard in shards:
            # bounded: a hostile shard's 5 GB line (its files.json record rewritten to match) is named, never held
            with (shard / PROMPTS_JSONL).open("rb") as fh:
                for line in bounded_lines(fh, MAX_PROMPT_LINE_BYTES, shard / PROMPTS_JSONL):
                    # renumber "i" in place, every other field as the shard wrote it
                    out.write(json.dumps({**json.loads(line.decode("utf-8")), "i": i}, ensure_ascii=False) + "\n")
                    i += 1
