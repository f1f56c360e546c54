"""Merging shard stores into one store over every sample (spec Option B), scattered over jobs.

`copy_chunks` (job zarr_merge_chunks, one per range of consecutive shards) copies the activation
chunk files under their merged names with their checksums; `finish_merge` (job zarr_merge) writes
the small parts and moves the copied chunk directories into place by rename. `merge_stores` is the
two run as one job.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from actstore.errors import FormatError
from actstore.formats.zarr.layout import ACTS, COMPATIBLE_ATTRS, FILES_JSON, PROMPTS_JSONL, acts_chunk_key
from actstore.formats.zarr.read import ZarrStore
from actstore.formats.zarr.write import (_consolidate, _create_vector, _now, _open_root, _write_files_json,
                                         store_entry)
from actstore.integrity import read_json
from actstore.io_utils import TEMP_SUFFIX, atomic_path
from actstore.jobs import JOB_RECORD, JobFiles, job_items, read_job_records, write_job_record


def _check_compatible(stores: list[Path], attrs: list[dict], start: int = 0) -> None:
    """Shards of one run, consecutive from global sample `start`: refused before anything is written."""
    for store, a in zip(stores[1:], attrs[1:]):
        for key in COMPATIBLE_ATTRS:
            if a.get(key) != attrs[0].get(key):
                raise FormatError(f"{store}/.zattrs: {key}={a.get(key)!r} differs from {stores[0]} ({attrs[0].get(key)!r})")
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
    """The first shard's attrs over every sample; float16 overflows summed over the shards."""
    merged = {**attrs[0], "num_samples": sum(a["num_samples"] for a in attrs), "global_index_start": 0,
              "merged_from": [s.name for s in shards], "created": _now()}
    merged.pop("float16_overflow_count", None)
    overflow = sum(a.get("float16_overflow_count", 0) for a in attrs)
    if overflow:
        merged["float16_overflow_count"] = overflow
    return merged


def merge_stores(shards: Sequence[str | Path], out_path: str | Path, progress: bool = True) -> dict[str, Any]:
    """Option B: one store over every shard, in shard order (atomic): the scattered merge run as one job,
    `copy_chunks` over every shard into a scratch directory beside `out_path`, then `finish_merge`."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # Beside out_path, so finish_merge's renames stay on one filesystem; not named like one of
    # atomic_path's temps of out_path, which finish_merge clears as a killed writer's debris.
    with tempfile.TemporaryDirectory(prefix=f".{out_path.name}-chunks.", suffix=TEMP_SUFFIX,
                                     dir=out_path.parent) as scratch:
        chunk_dir = Path(scratch) / "merge-0"
        copy_chunks(shards, chunk_dir, 1, 0, progress)
        return finish_merge(shards, [chunk_dir], out_path, progress)


def copy_chunks(shards: Sequence[str | Path], out_dir: str | Path, jobs: int, job: int,
                progress: bool = True) -> dict[str, dict]:
    """Job `job` of `jobs` of the scattered merge (atomic): the activation chunks of `shards`, its
    consecutive shards of the run (jobs.job_items), copied file for file under their merged names
    (sample axis = the shard's global_index_start + local; chunking and encoding are identical, so
    the bytes are too), and its job record (jobs.write_job_record, with the shards' names) of their
    bytes + sha256 as each shard's meta/files.json has them (no re-hash). Returns those entries."""
    from tqdm import tqdm

    shards, readers = _open_shards(shards, start=None)
    files: dict[str, dict] = {}
    with atomic_path(out_dir) as tmp:
        (tmp / ACTS).mkdir(parents=True)
        for shard, reader in zip(shards, tqdm(readers, desc="zarr merge chunks", unit="shard", disable=not progress)):
            files.update(_copy_shard_chunks(shard, reader, tmp))
        write_job_record(tmp, jobs, job, files, shards=[s.name for s in shards])
    return files


def _copy_shard_chunks(shard: Path, reader: ZarrStore, dst: Path) -> dict[str, dict]:
    """Every chunk of the shard copied to `dst` under its merged key; merged key -> its files.json entry."""
    shard_files = read_json(shard / FILES_JSON)["files"]
    start = reader.attrs["global_index_start"]
    copied = {}
    for local in range(reader.n_samples):
        for key, target in _sample_chunk_keys(reader, local, start + local):
            if key not in shard_files:
                raise FormatError(f"{shard / FILES_JSON}: no entry for {key}")
            (dst / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shard / key, dst / target)
            copied[target] = shard_files[key]
    return copied


def _sample_chunk_keys(reader: ZarrStore, local: int, g: int) -> Iterator[tuple[str, str]]:
    """(key in the shard, key in the merged store) of every chunk of local sample `local` (every chunk
    file exists: write_empty_chunks)."""
    for l in range(len(reader.layers)):
        for c in range(reader.n_chunks):
            yield acts_chunk_key(local, l, c), acts_chunk_key(g, l, c)


def finish_merge(shards: Sequence[str | Path], chunk_dirs: Sequence[str | Path], out_path: str | Path,
                 progress: bool = True) -> dict[str, Any]:
    """The merge's finishing job (atomic): the merged store over every shard from `chunk_dirs`, the
    outputs of `copy_chunks` over consecutive runs of `shards`, in order. Writes the small parts
    (attrs, array metadata, the concatenated 1-D arrays, prompts.jsonl), moves each sample's chunk
    directory in by rename (no copy), then files.json from the jobs' records. Every check comes
    before the first rename; a failure after it renames them back, so the chunk dirs stay whole."""
    shards, readers = _open_shards(shards)
    chunk_dirs = [Path(d) for d in chunk_dirs]
    found = read_job_records(chunk_dirs)  # each chunk there with its recorded size
    covered = [extra.get("shards") for extra in found.extras]
    _check_records(shards, readers, chunk_dirs, covered, found.files)
    merged_attrs = _merged_attrs(shards, [r.attrs for r in readers])
    a0, n = readers[0].attrs, merged_attrs["num_samples"]
    with atomic_path(out_path) as tmp:
        _, arrays = _open_root(tmp, merged_attrs, (n, a0["num_layers"], a0["T_max"], a0["hidden_size"]),
                               a0["T_chunk"])
        for name in readers[0].vector_names:
            _create_vector(arrays, name, np.concatenate([r.vector(name) for r in readers]))
        _consolidate(tmp)
        _merge_text(shards, tmp)
        moves = functools.partial(_sample_moves, chunk_dirs, covered, readers, tmp)
        with _renamed_back_on_error(moves, progress):
            _write_files_json(tmp, {key: entry for key, (_, entry) in found.files.items()})
    return store_entry(out_path)


def _check_records(shards: list[Path], readers: list[ZarrStore], chunk_dirs: list[Path], covered: list[Any],
                   files: JobFiles) -> None:
    """Each job copied the shards job_items gives it and lists every chunk of their samples."""
    for job, (d, names) in enumerate(zip(chunk_dirs, covered)):
        expected = [shards[i].name for i in job_items(len(shards), len(chunk_dirs), job)]
        if names != expected:
            raise FormatError(f"{d / JOB_RECORD}: copied shards {names}, job {job} of {len(chunk_dirs)} "
                              f"takes {expected}")
    for d, reader, local, g in _record_samples(chunk_dirs, covered, readers):
        for _, target in _sample_chunk_keys(reader, local, g):
            if files.get(target, (None,))[0] != d:
                raise FormatError(f"{d / JOB_RECORD}: no entry for {target}")


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
    """(chunk directory in a chunk dir, its place in `dst`) of every merged sample, in order."""
    for d, _, _, g in _record_samples(chunk_dirs, covered, readers):
        yield d / ACTS / str(g), dst / ACTS / str(g)


@contextlib.contextmanager
def _renamed_back_on_error(moves: Callable[[], Iterator[tuple[Path, Path]]], progress: bool) -> Iterator[None]:
    """Rename every (src, dst) of `moves()`, then run the body; if anything fails, rename back the
    ones done, so the chunk dirs can be finished again (the plan is re-walked, never held in memory)."""
    from tqdm import tqdm

    done = 0
    try:
        for src, dst in tqdm(moves(), desc="zarr merge", unit="sample", disable=not progress):
            os.rename(src, dst)
            done += 1
        yield
    except BaseException:
        for src, dst in itertools.islice(moves(), done):
            os.rename(dst, src)
        raise


def _merge_text(shards: list[Path], dst: Path) -> None:
    (dst / "text").mkdir()
    i = 0
    with (dst / PROMPTS_JSONL).open("w", encoding="utf-8") as out:
        for shard in shards:
            with (shard / PROMPTS_JSONL).open(encoding="utf-8") as fh:
                for line in fh:  # renumber "i" in place, every other field as the shard wrote it
                    out.write(json.dumps({**json.loads(line), "i": i}, ensure_ascii=False) + "\n")
                    i += 1
