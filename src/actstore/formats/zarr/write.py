"""Writing Zarr activation logger stores: one shard per extraction part, the manifest (the merged
store: merge.py).

Metadata and the 1-D arrays go through zarr-python 3 (zarr_format=2); activation chunks are written
raw, the bytes zarr writes for an uncompressed chunk, at a fraction of its cost. Every store is built
in a temporary directory and renamed into place, so a half-written store never exists under its
final name.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from actstore.casts import float16_file
from actstore.errors import FormatError
from actstore.formats.extract import PartsCheck, layer_tensor, open_part, part_reads
from actstore.formats.zarr.layout import (ACTS, ACTS_DTYPE, FILES_JSON, MANIFEST, ORDER, PROMPTS_JSONL, SEPARATOR,
                                          SPLIT_CODES, ZARR_FORMAT, acts_chunk_key, choose_t_chunk, chunk_counts,
                                          chunk_shape, files_json_text, manifest_doc, prompt_line, run_attrs,
                                          sample_key, store_attrs, store_t_max, vector_chunks, vector_fill)
from actstore.formats.zarr.read import ZarrStore, check_entries, list_store_files
from actstore.integrity import file_records, read_json, stream_json_members, whole_number
from actstore.io_utils import BufferWorkers, atomic_path, errors_naming, sha256_file, utc_now, write_json_atomic

log = logging.getLogger(__name__)


def _now() -> str:
    return utc_now().isoformat(timespec="seconds")


def _create(group: Any, name: str, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str,
            fill: Any = 0) -> Any:
    """An uncompressed, unfiltered, C-order v2 array, '/'-separated keys; zarr-python writes every chunk
    of the 1-D arrays, even all-zero ones (the activations' chunks are written raw, by the callers)."""
    return group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=None, filters=None,
                              fill_value=fill, order=ORDER, chunk_key_encoding={"name": "v2", "separator": SEPARATOR},
                              config={"write_empty_chunks": True})


def _create_vector(arrays: Any, name: str, values: np.ndarray) -> None:
    n = len(values)
    z = _create(arrays, name, (n,), vector_chunks(n), values.dtype.str, fill=vector_fill(name))
    if n:
        z[:] = values


def _open_root(path: Path, attrs: dict[str, Any], shape: tuple[int, int, int, int], t_chunk: int) -> tuple[Any, Any]:
    """The store at `path`: the root group with `attrs`, its arrays/ group and the activations array's
    metadata, beside the chunk files already written there (raw, by the callers: mode "a" keeps
    them, where "w" would delete everything under `path` first)."""
    import zarr
    root = zarr.open_group(str(path), mode="a", zarr_format=ZARR_FORMAT, attributes=attrs)
    arrays = root.create_group("arrays")
    _create(arrays, "activations", shape, tuple(chunk_shape(t_chunk, shape[3])), ACTS_DTYPE)
    return root, arrays


def _write_vectors(arrays: Any, rows: list[dict], attrs: dict[str, Any]) -> None:
    """Per-sample numeric metadata as Zarr arrays (spec: 'Required per-sample numeric metadata')."""
    n = len(rows)
    seq_len = np.array([r["num_tokens"] for r in rows], dtype=np.int32)
    values = {"seq_len": seq_len, "sample_idx": np.array([r["sample_idx"] for r in rows], dtype=np.int64),
              "sample_key": np.array([sample_key(r["text"]) for r in rows], dtype="S64")}
    if attrs["modality"] == "text":  # the whole text is the prompt; images have no prompt tokens
        values["prompt_len"] = seq_len
    if attrs["label_names"]:
        values["label"] = np.array([r["label_id"] for r in rows], dtype=np.int32)
    split = SPLIT_CODES.get(str(attrs["dataset"].get("split")).lower())
    if split is not None:
        values["split"] = np.full(n, split, dtype=np.int8)
    for name, array in values.items():
        _create_vector(arrays, name, array)


def _write_text(store: Path, rows: list[dict]) -> None:
    (store / "text").mkdir()
    with errors_naming(store / PROMPTS_JSONL), (store / PROMPTS_JSONL).open("w", encoding="utf-8") as fh:
        for i, r in enumerate(rows):
            fh.write(prompt_line(i, r))


def _consolidate(store: Path) -> None:
    import zarr
    with warnings.catch_warnings():  # text/ and meta/ are plain files beside the hierarchy, by design
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(store))


def _write_files_json(store: Path, known: dict[str, dict] | None = None) -> None:
    """Record bytes + sha256 of every file in the store, reusing the `known` entries of the files
    written or copied with their hashes (each of which must be there)."""
    known = known or {}
    listed = list_store_files(store)
    missing = known.keys() - set(listed)
    if missing:
        raise FormatError(f"{store}/{min(missing)}: missing (written or moved in, then gone)")
    files = {}
    for rel in listed:
        if rel == FILES_JSON:
            continue
        size = (store / rel).stat().st_size
        entry = known.get(rel)
        files[rel] = entry if entry and entry["bytes"] == size else {"bytes": size, "sha256": sha256_file(store / rel)}
    (store / "meta").mkdir(exist_ok=True)
    with errors_naming(store / FILES_JSON):
        (store / FILES_JSON).write_text(files_json_text(files))


# A chunk's steps, timed for the job's log: its file (read, cast, its directories, write:
# casts.float16_file, one call without the GIL) and its sha256.
STAGES = ("file", "hash")


def _write_chunks(part: Any, layers: list[int], store: Path, t_max: int, t_chunk: int, threads: int,
                  progress: bool) -> tuple[dict[str, dict], int, dict[str, float]]:
    """The activation chunks of the part that hold tokens (layout.chunk_counts: those past a sample's tokens
    hold only the fill value and are left out, as zarr leaves empty chunks out), each read into a
    (T_chunk, H) float32 buffer, cast into a float16 one (a float16 part's read into it as stored), zero
    past the sample's end (hashed; a hole in the file), and written raw (casts.float16_file): the bytes
    zarr writes for an uncompressed C-order chunk. `threads` BufferWorkers each read, cast, write and hash
    the chunks of a sample (their files never read back), samples in any order, while the main thread
    only hands them out: a sample's files are independent of the others', and any one stage on one
    thread (the read and cast, one core's sha256, the filesystem's time per directory) would bound the
    job whatever its CPUs. A sample's directories are its thread's alone: a directory takes its new
    entries one at a time, so threads making chunk directories side by side in a sample's would wait on
    it. Returns {key: files.json entry}, the count of values that overflowed float16 and the workers'
    seconds in each of STAGES (summed over threads: where a job short of its disk's speed spends them)."""
    from tqdm import tqdm

    os.makedirs(store / ACTS)  # the samples' directories' parent
    if not part.samples:  # no chunk; nor a tensor file to open: an empty part's extraction declared none
        return {}, 0, dict.fromkeys(STAGES, 0.0)
    tensors = [part.tensor(layer_tensor(layer)) for layer in layers]
    hidden = tensors[0].shape[1]
    files, overflows, seconds, lock = {}, {}, dict.fromkeys(STAGES, 0.0), threading.Lock()

    def write_sample(buffers: tuple[np.ndarray, np.ndarray], i: int, rows: slice) -> None:
        rows_buffer, chunk = buffers
        spent = dict.fromkeys(STAGES, 0.0)
        for l, source in enumerate(sources):
            for c in range(int(chunk_counts(rows.stop - rows.start, t_chunk))):
                key, start = acts_chunk_key(i, l, c), rows.start + c * t_chunk  # {ACTS}/i/l/c/0
                chunk_dir = key.rsplit("/", 1)[0]
                # its directory, after the layer's (the layer's first chunk) and the sample's (its first layer's)
                made = [chunk_dir.rsplit("/", 2)[0]] if c == 0 and l == 0 else []
                made += [chunk_dir.rsplit("/", 1)[0]] if c == 0 else []
                began = time.perf_counter()
                overflows[key] = float16_file(source, start, min(start + t_chunk, rows.stop) - start, rows_buffer,
                                              chunk, [f"{store}/{d}" for d in [*made, chunk_dir]], f"{store}/{key}")
                written = time.perf_counter()
                files[key] = {"bytes": chunk.nbytes, "sha256": hashlib.sha256(chunk).hexdigest()}
                spent["file"] += written - began
                spent["hash"] += time.perf_counter() - written
        with lock:
            for stage, value in spent.items():
                seconds[stage] += value

    widened = t_chunk if any(tensor.stored_dtype != "float16" for tensor in tensors) else 0  # rows read as float32

    def make_buffers() -> tuple[np.ndarray, np.ndarray]:
        return np.empty((widened, hidden), dtype=np.float32), np.empty((t_chunk, hidden), dtype=np.float16)

    with contextlib.ExitStack() as opened:
        sources = [opened.enter_context(tensor.row_file()) for tensor in tensors]  # each layer's file, open
        workers = opened.enter_context(BufferWorkers(write_sample, threads, make_buffers))  # left first
        for i in tqdm(range(len(part.samples)), desc=f"zarr {store.name}", unit="sample", disable=not progress):
            rows = part.sample_slice(i)
            if rows.stop - rows.start > t_max:
                raise FormatError(f"{part.dir}: sample {i} has {rows.stop - rows.start} tokens, more than the "
                                  f"part's max_seq_length {t_max}")
            workers.submit(workers.buffer(), i, rows)
    return files, sum(overflows.values()), seconds


def _import_zarr() -> None:
    """import zarr, its error left to the importer that needs it (_open_root raises it there)."""
    with contextlib.suppress(ImportError):
        importlib.import_module("zarr")


def write_shard(part_dir: str | Path, out_path: str | Path, t_chunk: int | None = None,
                git_commit: str | None = None, progress: bool = True, threads: int = 2) -> dict[str, Any]:
    """Write one extraction part as a self-contained shard store (atomic); return its manifest entry.

    `git_commit` is the commit of the code that wrote it, recorded in the attrs (None: unknown);
    `threads` threads read, cast, write and hash the chunk files.
    """
    part = open_part(part_dir)
    rows = list(part.samples)  # one part's rows, held: the vectors and the text arrays each pass over them
    n, layers = len(rows), list(part.info.layers)
    t_max = store_t_max(part.info, int(np.diff(part.offsets).max(initial=0)))
    # An empty part has no tensor file, so no width: its store is (0, L, T_max, 0) (layout.WIDTH_ATTRS)
    hidden = int(part.tensor(layer_tensor(layers[0])).shape[1]) if n else 0
    tc = choose_t_chunk(t_max, hidden, t_chunk)
    attrs = store_attrs(part.info, n, t_max, tc, hidden, _now(), git_commit)
    # zarr's import (0.15-0.3 s on the 2-core VM, a sixth of a 1 GB part's job) runs beside the chunk
    # files, which need none of zarr; _open_root's own import then waits for it (the module's lock).
    threading.Thread(target=_import_zarr, daemon=True).start()
    reads = part_reads(part, [layer_tensor(layer) for layer in layers], samples=True)
    # PartsCheck: the files read checked against part.json as the chunks read them, before the rename
    with atomic_path(out_path) as tmp, PartsCheck(reads):
        began = time.perf_counter()
        files, overflow, seconds = _write_chunks(part, layers, tmp, t_max, tc, threads, progress)
        log.info("%s: %d chunk files of %d bytes in %.2f s by %d threads; their seconds: %s", out_path, len(files),
                 tc * hidden * 2, time.perf_counter() - began, threads,
                 ", ".join(f"{stage} {value:.2f}" for stage, value in seconds.items()))
        root, arrays = _open_root(tmp, attrs, (n, len(layers), t_max, hidden), tc)
        _write_vectors(arrays, rows, attrs)
        if overflow:
            log.warning("%s: %d activation values of %s exceed float16 range and are stored as +-inf", out_path,
                        overflow, part_dir)
            root.attrs["float16_overflow_count"] = overflow
        _consolidate(tmp)
        _write_text(tmp, rows)
        _write_files_json(tmp, files)
    return store_entry(out_path)


def store_entry(store: str | Path, rel_to: str | Path | None = None) -> dict[str, Any]:
    """The manifest record of a finished store: path, counts and the sha256 of its meta/files.json."""
    store = Path(store)
    # write_manifest's shards were written by other jobs, maybe since damaged: each field it takes is
    # checked, naming the file (a missing one raised a bare KeyError, a string bytes a TypeError)
    attrs = read_json(store / ".zattrs")
    counts = {key: attrs.get(key) if isinstance(attrs, dict) else None for key in ("num_samples", "global_index_start")}
    if not all(map(whole_number, counts.values())):
        raise FormatError(f"{store}/.zattrs: {counts}, expected whole numbers")
    n_files, n_bytes = 1, (store / FILES_JSON).stat().st_size
    for name, entry in stream_json_members(store / FILES_JSON, "files"):  # millions of entries when merged
        file_records({name: entry}, str(store / FILES_JSON))
        n_files, n_bytes = n_files + 1, n_bytes + entry["bytes"]
    return {"path": store.relative_to(rel_to).as_posix() if rel_to else store.name, **counts,
            "files_sha256": sha256_file(store / FILES_JSON), "n_files": n_files, "bytes": n_bytes}


def write_manifest(run_dir: str | Path, shards: Sequence[str | Path], merged: str | Path | None = None) -> dict:
    """manifest.json of a run: every shard's entry (global_index_start = sample_idx), merged when built."""
    run_dir = Path(run_dir)
    entries = [store_entry(s, run_dir) for s in shards]
    merged_entry = store_entry(merged, run_dir) if merged else None
    stores = [ZarrStore(s) for s in shards]
    manifest = manifest_doc(run_attrs([s.attrs for s in stores]), entries, merged_entry, _now())
    # what ZarrRun refuses, refused before it is written: shards out of order or one left out, or a
    # merged store of fewer samples than they hold, made a manifest no reader opened
    check_entries(manifest, run_dir / MANIFEST, entries, stores, merged=False)
    if merged:
        check_entries(manifest, run_dir / MANIFEST, [merged_entry], [ZarrStore(merged)], merged=True)
    write_json_atomic(run_dir / MANIFEST, manifest)
    return manifest
