"""Writing Zarr activation logger stores: one shard per extraction part, the merged store, the manifest.

Writes go through zarr-python 3 (zarr_format=2); every store is built in a temporary directory and
renamed into place, so a half-written store never exists under its final name.
"""
from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from actstore.errors import FormatError
from actstore.formats.extract import layer_tensor, open_part
from actstore.formats.zarr.layout import (ACTS, ACTS_DTYPE, COMPATIBLE_ATTRS, FILES_JSON, MANIFEST, ORDER,
                                          PROMPTS_JSONL, SEPARATOR, SPLIT_CODES, WRITE_BLOCK_BYTES,
                                          ZARR_FORMAT, choose_t_chunk, files_json_text, manifest_doc,
                                          prompt_line, sample_key, store_attrs, vector_chunks, vector_fill)
from actstore.formats.zarr.read import ZarrStore, list_store_files
from actstore.io_utils import atomic_path, sha256_file, utc_now, write_json_atomic

log = logging.getLogger(__name__)


def _now() -> str:
    return utc_now().isoformat(timespec="seconds")


def _create(group: Any, name: str, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str,
            fill: Any = 0) -> Any:
    """An uncompressed, unfiltered, C-order v2 array whose every chunk is written, '/'-separated keys."""
    return group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=None, filters=None,
                              fill_value=fill, order=ORDER, chunk_key_encoding={"name": "v2", "separator": SEPARATOR},
                              config={"write_empty_chunks": True})


def _create_vector(arrays: Any, name: str, values: np.ndarray) -> None:
    n = len(values)
    z = _create(arrays, name, (n,), vector_chunks(n), values.dtype.str, fill=vector_fill(name))
    if n:
        z[:] = values


def _open_root(path: Path, attrs: dict[str, Any], shape: tuple[int, int, int, int], t_chunk: int) -> tuple[Any, Any, Any]:
    """A new store at `path`: the root group with `attrs`, its arrays/ group and the activations array."""
    import zarr
    root = zarr.open_group(str(path), mode="w", zarr_format=ZARR_FORMAT, attributes=attrs)
    arrays = root.create_group("arrays")
    acts = _create(arrays, "activations", shape, (1, 1, t_chunk, shape[3]), ACTS_DTYPE)
    return root, arrays, acts


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
    with (store / PROMPTS_JSONL).open("w", encoding="utf-8") as fh:
        for i, r in enumerate(rows):
            fh.write(prompt_line(i, r))


def _consolidate(store: Path) -> None:
    import zarr
    with warnings.catch_warnings():  # text/ and meta/ are plain files beside the hierarchy, by design
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(store))


def _write_files_json(store: Path, known: dict[str, dict] | None = None) -> None:
    """Record bytes + sha256 of every file in the store (reusing `known` hashes of copied files)."""
    known = known or {}
    files = {}
    for rel in list_store_files(store):
        if rel == FILES_JSON:
            continue
        size = (store / rel).stat().st_size
        entry = known.get(rel)
        files[rel] = entry if entry and entry["bytes"] == size else {"bytes": size, "sha256": sha256_file(store / rel)}
    (store / "meta").mkdir(exist_ok=True)
    (store / FILES_JSON).write_text(files_json_text(files))


def _fill_block(part: Any, layers: list[int], start: int, stop: int, buf: np.ndarray) -> int:
    """Copy samples [start, stop) of a part into a zeroed float16 block; return float16 overflows."""
    buf[: stop - start] = 0
    overflow = 0
    with np.errstate(over="ignore"):
        for j, local in enumerate(range(start, stop)):
            for l, layer in enumerate(layers):
                x = part.activations(layer_tensor(layer), local)
                buf[j, l, : x.shape[0]] = x
                overflow += int(np.isinf(buf[j, l, : x.shape[0]]).sum() - np.isinf(x).sum())
    return overflow


def write_shard(part_dir: str | Path, out_path: str | Path, t_chunk: int | None = None,
                git_commit: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Write one extraction part as a self-contained shard store (atomic); return its manifest entry.

    `git_commit` is the commit of the code that wrote it, recorded in the attrs (None: unknown).
    """
    from tqdm import tqdm

    part = open_part(part_dir)
    rows = part.samples
    n, layers, t_max = len(rows), list(part.info.layers), int(part.info.max_seq_length)
    hidden = int(part.tensor(layer_tensor(layers[0])).shape[1])
    tc = choose_t_chunk(t_max, hidden, t_chunk)
    attrs = store_attrs(part.info, n, tc, hidden, _now(), git_commit)
    with atomic_path(out_path) as tmp:
        root, arrays, acts = _open_root(tmp, attrs, (n, len(layers), t_max, hidden), tc)
        _write_vectors(arrays, rows, attrs)
        per_block = max(1, WRITE_BLOCK_BYTES // (len(layers) * t_max * hidden * 2))
        buf = np.zeros((min(per_block, max(n, 1)), len(layers), t_max, hidden), dtype=np.float16)
        overflow = 0
        for start in tqdm(range(0, n, per_block), desc=f"zarr {Path(out_path).name}", unit="block",
                          disable=not progress):
            stop = min(n, start + per_block)
            overflow += _fill_block(part, layers, start, stop, buf)
            acts[start:stop] = buf[: stop - start]  # whole samples: chunk-aligned writes
        if overflow:
            log.warning("%s: %d activation values exceed float16 range and are stored as +-inf", part_dir, overflow)
            root.attrs["float16_overflow_count"] = overflow
        _consolidate(tmp)
        _write_text(tmp, rows)
        _write_files_json(tmp)
    return store_entry(out_path)


def store_entry(store: str | Path, rel_to: str | Path | None = None) -> dict[str, Any]:
    """The manifest record of a finished store: path, counts and the sha256 of its meta/files.json."""
    store = Path(store)
    attrs = json.loads((store / ".zattrs").read_text())
    files = json.loads((store / FILES_JSON).read_text())["files"]
    return {"path": store.relative_to(rel_to).as_posix() if rel_to else store.name,
            "num_samples": attrs["num_samples"], "global_index_start": attrs["global_index_start"],
            "files_sha256": sha256_file(store / FILES_JSON), "n_files": len(files) + 1,
            "bytes": sum(f["bytes"] for f in files.values()) + (store / FILES_JSON).stat().st_size}


def _check_compatible(stores: list[Path], attrs: list[dict]) -> None:
    for store, a in zip(stores[1:], attrs[1:]):
        for key in COMPATIBLE_ATTRS:
            if a.get(key) != attrs[0].get(key):
                raise FormatError(f"{store}/.zattrs: {key}={a.get(key)!r} differs from {stores[0]} ({attrs[0].get(key)!r})")
    expected = 0
    for store, a in zip(stores, attrs):
        if a["global_index_start"] != expected and a["num_samples"]:
            raise FormatError(f"{store}/.zattrs: global_index_start={a['global_index_start']}, expected {expected}")
        expected += a["num_samples"]


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
    """Option B: one store over every shard, in shard order (atomic).

    Chunking and encoding are identical, so activation chunks are copied file for file (renumbered on
    the sample axis) instead of decoded and re-encoded; the 1-D arrays are concatenated through zarr.
    """
    from tqdm import tqdm

    shards = [Path(s) for s in shards]
    readers = [ZarrStore(s) for s in shards]
    attrs = [r.attrs for r in readers]
    _check_compatible(shards, attrs)
    merged_attrs = _merged_attrs(shards, attrs)
    a0, n = attrs[0], merged_attrs["num_samples"]
    with atomic_path(out_path) as tmp:
        _, arrays, _ = _open_root(tmp, merged_attrs, (n, a0["num_layers"], a0["T_max"], a0["hidden_size"]),
                                  a0["T_chunk"])
        for name in readers[0].vector_names:
            _create_vector(arrays, name, np.concatenate([r.vector(name) for r in readers]))
        known: dict[str, dict] = {}
        g = 0
        for shard, reader in zip(shards, tqdm(readers, desc="zarr merge", unit="shard", disable=not progress)):
            shard_files = json.loads((shard / FILES_JSON).read_text())["files"]
            for local in range(reader.n_samples):
                _copy_sample_chunks(shard, tmp, local, g, shard_files, known)
                g += 1
        _consolidate(tmp)
        _merge_text(shards, tmp)
        _write_files_json(tmp, known)
    return store_entry(out_path)


def _copy_sample_chunks(src: Path, dst: Path, local: int, g: int, src_files: dict, known: dict) -> None:
    for chunk in sorted((src / ACTS / str(local)).rglob("*")):
        if chunk.is_dir():
            continue
        rel = chunk.relative_to(src / ACTS / str(local)).as_posix()
        target = f"{ACTS}/{g}/{rel}"
        (dst / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(chunk, dst / target)
        known[target] = src_files[f"{ACTS}/{local}/{rel}"]


def _merge_text(shards: list[Path], dst: Path) -> None:
    (dst / "text").mkdir()
    i = 0
    with (dst / PROMPTS_JSONL).open("w", encoding="utf-8") as out:
        for shard in shards:
            with (shard / PROMPTS_JSONL).open(encoding="utf-8") as fh:
                for line in fh:  # renumber "i" in place, every other field as the shard wrote it
                    out.write(json.dumps({**json.loads(line), "i": i}, ensure_ascii=False) + "\n")
                    i += 1


def write_manifest(run_dir: str | Path, shards: Sequence[str | Path], merged: str | Path | None = None) -> dict:
    """manifest.json of a run: every shard's entry (global_index_start = sample_idx), merged when built."""
    run_dir = Path(run_dir)
    entries = [store_entry(s, run_dir) for s in shards]
    merged_entry = store_entry(merged, run_dir) if merged else None
    manifest = manifest_doc(ZarrStore(shards[0]).attrs, entries, merged_entry, _now())
    write_json_atomic(run_dir / MANIFEST, manifest)
    return manifest
