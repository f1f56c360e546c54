"""Writing pickle-shard stores: one complete store per extraction part (machine), then a merged
`metadata.json` beside them that references the machine shards in place (relative `filename`,
`shard_id` renumbered 1..N across the store), so no byte is copied.

Shards are pickled (protocol 5) and gzipped with mtime 0 and no file name: equal inputs, equal bytes.
The deflate stream comes from ISA-L (`compressor: isal`, ~15x zlib's speed at the same ratio on
activations) or zlib (earlier releases' bytes); both are standard gzip, which gzip.open reads.
"""
from __future__ import annotations

import gzip
import logging
import math
import os
import pickle  # absolute import: the standard library, not this package
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from isal import igzip
from tqdm import tqdm

from actstore.errors import FormatError
from actstore.formats.extract import Part, PartInfo, PartsCheck, layer_tensor, open_part, part_reads
from actstore.formats.pickle.layout import (CHECKSUM_PREFIX, FORMAT, METADATA, PICKLE_PROTOCOL, PREVIEW_CHARS,
                                            distributed_config, layer_key, shard_filename, statistics,
                                            store_metadata)
from actstore.formats.pickle.check import checked_metadata
from actstore.formats.pickle.read import shard_path
from actstore.integrity import inside, whole_number
from actstore.io_utils import HashingWriter, atomic_path, errors_naming, fsync_named, sha256_file, write_json_atomic

log = logging.getLogger(__name__)

COMPRESSIONS = ("gzip", "none")
# gzip writers by compressor, and the levels each has: ISA-L's 0 stores float32 *larger* (a fixed
# Huffman code), so its levels start at 1.
GZIP_FILES = {"isal": igzip.GzipFile, "zlib": gzip.GzipFile}
LEVELS = {"isal": range(1, 4), "zlib": range(1, 10)}
MERGE_MUST_AGREE = ("model_name", "layers_extracted", "max_seq_length")


def extraction_config(info: PartInfo, model_params: dict[str, int | None]) -> dict[str, Any]:
    """The spec's extraction_config block, from a part and the model's parameters."""
    return {
        "model_name": info.model.name,
        "model_architecture": info.model.model_type or info.model.architecture,
        "model_params": model_params,
        "dataset_name": info.dataset.name,
        "dataset_config": None,  # local JSONL/image folder: no Hugging Face config name
        "dataset_split": info.dataset.split,
        "layers_extracted": list(info.layers),
        "max_seq_length": info.max_seq_length,
        "batch_size": info.batch_size,
    }


def plan_shards(part: Part, n_layers: int, d: int, target_bytes: float) -> list[range]:
    """Contiguous local-sample ranges whose raw float32 bytes (all layers) stay under the target;
    a shard always holds at least one sample."""
    sizes = np.diff(part.offsets) * (n_layers * d * 4)
    groups, start, acc = [], 0, 0
    for i, size in enumerate(sizes.tolist()):
        if i > start and acc + size > target_bytes:
            groups.append(range(start, i))
            start, acc = i, 0
        acc += size
    if len(sizes) > start:
        groups.append(range(start, len(sizes)))
    return groups


def shard_items(part: Part, layers: list[int], local: range, machine_id: int) -> dict[str, list[dict]]:
    """The shard dict for local samples `local` of a part. Activations must be writable arrays: one
    pickles as a bytearray, which loads writable (a read-only view would pickle as bytes). float32
    parts give views of a copy-on-write mapping, so no shard is copied into memory (a copy took a
    quarter of a shard's time and `threads` shards of memory); bfloat16 and float16 are converted."""
    shard: dict[str, list[dict]] = {}
    for layer in layers:
        tensor = part.tensor(layer_tensor(layer), private=True)
        items = []
        for i in local:
            row = part.samples[i]
            act = np.ascontiguousarray(tensor[part.sample_slice(i)], dtype=np.float32)
            items.append({
                "sample_idx": int(row["sample_idx"]),
                "activation": act,
                "shape": tuple(act.shape),
                "text_preview": str(row["text"])[:PREVIEW_CHARS],
                "metadata": {"token_count": int(row["num_tokens"]), "dataset_idx": int(row["sample_idx"]),
                             "machine_id": machine_id, "label": row.get("label"),
                             "label_id": row.get("label_id")},
            })
        shard[layer_key(layer)] = items
    return shard


def dump_shard(shard: dict, path: Path, compressed: bool, compresslevel: int, compressor: str) -> str:
    """Pickle one shard; gzip with mtime 0 and no file name so equal inputs give equal bytes. Returns
    the file's sha256, taken as it was written. Errors name the file (a buffered file's flush at close
    names none, and would replace the write's named error)."""
    with errors_naming(path), open(path, "wb") as raw:
        with HashingWriter(raw, str(path)) as out:
            if compressed:
                with GZIP_FILES[compressor](filename="", mode="wb", fileobj=out, compresslevel=compresslevel,
                                            mtime=0) as fh:
                    pickle.dump(shard, fh, protocol=PICKLE_PROTOCOL)
            else:
                pickle.dump(shard, out, protocol=PICKLE_PROTOCOL)
        raw.flush()
        fsync_named(raw.fileno(), path)
    return out.digest.hexdigest()


def check_sample_ids(part: Part) -> int:
    """Spec: sample_idx = machine_id * samples_per_machine + local_idx. Holds for our contiguous parts
    of ceil(N/P) samples; checked rather than assumed. Returns samples_per_machine."""
    per_machine = math.ceil(part.info.n_dataset_samples / part.info.parts)
    machine_id = part.info.part
    for local, row in enumerate(part.samples):
        if row["sample_idx"] != machine_id * per_machine + local:
            raise FormatError(f"{part.dir}/samples.jsonl: sample_idx {row['sample_idx']} at local index {local} "
                              f"is not machine_id*{per_machine}+local")
    return per_machine


def write_shard(part: Part, layers: list[int], local: range, path: Path, compressed: bool,
                compresslevel: int, compressor: str) -> dict[str, Any]:
    """Dump the shard of local samples `local` to `path`; return its metadata.json entry (shard_id unset)."""
    sha256 = dump_shard(shard_items(part, layers, local, part.info.part), path, compressed, compresslevel, compressor)
    ids = [part.samples[i]["sample_idx"] for i in local]
    return {"filename": path.name, "size_bytes": path.stat().st_size, "num_samples": len(local),
            "layers": layers, "sample_id_range": [ids[0], ids[-1]], "compressed": compressed,
            "checksum": CHECKSUM_PREFIX + sha256,
            "num_tokens": int(part.offsets[local.stop] - part.offsets[local.start])}


def write_machine(part_dir: str | Path, out_dir: str | Path, *, model_params: dict[str, int | None],
                  shard_size_mb: float = 100.0, compression: str = "gzip", compresslevel: int = 1,
                  compressor: str = "isal", threads: int = 1, progress: bool = True) -> dict[str, Any]:
    """Write one extraction part as a complete pickle-shard store (atomic); return its metadata.
    `model_params`: the spec's hidden_size / num_hidden_layers / num_attention_heads / vocab_size.
    `threads` shards are dumped at once, one per thread (ISA-L, zlib and file writes release the
    GIL); memory holds their compressed blocks in flight (and, for a 16-bit part, their rows
    converted to float32). The bytes do not depend on it."""
    if compression not in COMPRESSIONS:
        raise FormatError(f"pickle.compression: {compression!r} must be 'gzip' or 'none'")
    # no level is used (or recorded, or hashed) when nothing is compressed
    if compression == "gzip" and (compressor not in LEVELS or compresslevel not in LEVELS[compressor]):
        raise FormatError(f"pickle.compressor {compressor!r} with compresslevel {compresslevel}: levels are "
                          + ", ".join(f"{name} {levels.start}-{levels.stop - 1}" for name, levels in LEVELS.items()))
    part = open_part(part_dir)
    info, machine_id = part.info, part.info.part
    layers = list(info.layers)
    per_machine = check_sample_ids(part)
    d = part.tensor(layer_tensor(layers[0])).shape[1] if info.n_tokens else 0
    compressed = compression == "gzip"
    groups = plan_shards(part, len(layers), d, shard_size_mb * 1e6)
    reads = part_reads(part, [layer_tensor(layer) for layer in layers], samples=True)
    # PartsCheck: the files read checked against part.json as the shards read them, before the rename
    with atomic_path(out_dir) as tmp, PartsCheck(reads), ThreadPoolExecutor(max_workers=threads) as pool:
        tmp.mkdir()

        def dump(shard_id: int) -> dict[str, Any]:
            path = tmp / shard_filename(shard_id, compressed)
            return {"shard_id": shard_id, **write_shard(part, layers, groups[shard_id - 1], path, compressed,
                                                        compresslevel, compressor)}
        shards = list(tqdm(pool.map(dump, range(1, len(groups) + 1)), total=len(groups),
                           desc=f"pickle machine {machine_id}", unit="shard", disable=not progress))
        metadata = store_metadata(extraction_config(info, model_params),
                                  distributed_config(machine_id, info.parts, per_machine),
                                  shards, statistics(shards, layers, info.extraction_duration_seconds),
                                  actstore_block(info, d, compression, compresslevel, compressor))
        write_json_atomic(tmp / METADATA, metadata)
    log.info("machine %d: %d samples in %d shards -> %s", machine_id, info.n_samples, len(shards), out_dir)
    return metadata


def actstore_block(info: PartInfo, d: int, compression: str, compresslevel: int, compressor: str) -> dict[str, Any]:
    """Optional extension key: what the spec does not say but a reader may want (the compressor
    only when it is not zlib, so stores that zlib wrote keep their bytes)."""
    return {"format": FORMAT, "d_model": d, "dtype": "float32", "modality": info.modality,
            "model_kind": info.model_kind, "model_path": info.model.path,
            "n_dataset_samples": info.n_dataset_samples, "compression": compression,
            "compresslevel": compresslevel if compression == "gzip" else None,
            "pickle_protocol": PICKLE_PROTOCOL, "sample_idx": "dataset row index"} | (
            {"compressor": compressor} if compression == "gzip" and compressor != "zlib" else {})


def relative(path: Path, start: Path) -> str:
    """`path` relative to `start`, with forward slashes (metadata.json is portable)."""
    return os.path.relpath(path, start).replace(os.sep, "/")


def check_same_extraction(mdir: Path, meta: dict[str, Any], first_dir: Path, first: dict[str, Any]) -> None:
    """Machines merge only when they come from one extraction."""
    for key in MERGE_MUST_AGREE:
        if meta["extraction_config"][key] != first["extraction_config"][key]:
            raise FormatError(f"{mdir / METADATA}: extraction_config.{key} = {meta['extraction_config'][key]!r} "
                              f"differs from {first_dir / METADATA}")


def machine_id_of(mdir: Path, meta: dict[str, Any]) -> int:
    """A machine store's distributed_config.machine_id (the merge orders machines by it)."""
    machine_id = meta.get("distributed_config", {}).get("machine_id")
    if not whole_number(machine_id):
        raise FormatError(f"{mdir / METADATA}: distributed_config.machine_id must be a whole number, "
                          f"got {machine_id!r:.40}")
    return machine_id


def machine_shards(mdir: Path, meta: dict[str, Any], out_dir: Path, first_id: int) -> list[dict]:
    """One machine's shard entries, re-pointed from `out_dir` and numbered from `first_id`; each shard
    file checked present at its size, its sample_id_range at its num_samples."""
    shards = []
    for info in meta["shards"]:
        path = shard_path(mdir, info)
        if not path.is_file() or path.stat().st_size != info["size_bytes"]:
            raise FormatError(f"{path}: missing or not {info['size_bytes']} bytes as {mdir / METADATA} says")
        lo, hi = info["sample_id_range"]
        if hi - lo + 1 != info["num_samples"]:
            raise FormatError(f"{path}: sample ids {lo}..{hi} disagree with num_samples={info['num_samples']}")
        shards.append({**info, "shard_id": first_id + len(shards), "filename": relative(path, out_dir),
                       "machine_id": meta["distributed_config"]["machine_id"]})
    return shards


def check_no_overlap(out_dir: Path, shards: list[dict]) -> None:
    """No sample id in two shards, compared as the shards' ranges in order (a set of every id held
    560 MB for 10M samples, in a merge job of 1000 MB)."""
    ordered = sorted(shards, key=lambda s: s["sample_id_range"][0])
    for before, after in zip(ordered, ordered[1:]):
        if after["sample_id_range"][0] <= before["sample_id_range"][1]:
            raise FormatError(f"{out_dir / after['filename']}: sample ids {after['sample_id_range']} overlap "
                              f"{out_dir / before['filename']}'s {before['sample_id_range']}")


def check_every_machine(machines: list[tuple[Path, dict[str, Any]]], out_dir: Path) -> None:
    """The machines merged are all of their extraction, 0..total_machines-1, each saying the same
    total: verify refuses a merged store whose total_machines differs from the machines it lists, so
    a subset (a machine whose job failed) was merged into a store that then failed verify."""
    first_dir, first = machines[0]
    total = first["distributed_config"].get("total_machines")
    if not whole_number(total, 1):
        raise FormatError(f"{first_dir / METADATA}: distributed_config.total_machines must be a whole number "
                          f"of at least 1, got {total!r:.40}")
    for mdir, meta in machines:
        if meta["distributed_config"].get("total_machines") != total:
            raise FormatError(f"{mdir / METADATA}: distributed_config.total_machines = "
                              f"{meta['distributed_config'].get('total_machines')!r:.40} differs from "
                              f"{first_dir / METADATA}'s {total!r:.40}")
    ids = {machine_id_of(mdir, meta) for mdir, meta in machines}
    if len(machines) != total or ids != set(range(len(machines))):
        missing = list(islice((m for m in range(total) if m not in ids), 8))
        raise FormatError(f"{out_dir}: refused to merge machines {sorted(ids)[:8]}: not the machines 0..{total - 1} "
                          f"that {first_dir / METADATA} gives the extraction (missing {missing})")


def machine_entry(mdir: Path, meta: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The merged store's record of a machine: its directory, which must lie under `out_dir` (a path
    that climbs out is one every reader of the merged store refuses), and its metadata.json's sha256."""
    rel = relative(mdir, out_dir)
    inside(out_dir, rel, f"{mdir / METADATA}: a machine merged into {out_dir}")
    return {"machine_id": meta["distributed_config"]["machine_id"], "dir": rel,
            "metadata_sha256": sha256_file(mdir / METADATA)}


def merge_machines(machine_dirs: list[str | Path], out_dir: str | Path) -> dict[str, Any]:
    """Write `out_dir/metadata.json` over per-machine stores under it (each checked as a reader checks
    it): shards referenced in place by relative path, shard_id renumbered 1..N in machine order; sample
    ids checked unique."""
    out_dir = Path(out_dir)
    if not machine_dirs:  # the first machine gives the extraction's fields: an IndexError named nothing
        raise FormatError(f"{out_dir}: no machine stores to merge")
    machines = [(Path(m), checked_metadata(m)) for m in machine_dirs]
    machines.sort(key=lambda m: machine_id_of(*m))
    first_dir, first = machines[0]
    shards: list[dict] = []
    for mdir, meta in machines:
        check_same_extraction(mdir, meta, first_dir, first)
        shards += machine_shards(mdir, meta, out_dir, len(shards) + 1)
    check_no_overlap(out_dir, shards)
    check_every_machine(machines, out_dir)
    duration = sum((meta["statistics"]["extraction_duration_seconds"] for _, meta in machines), 0.0)
    listing = [machine_entry(mdir, meta, out_dir) for mdir, meta in machines]
    first_dc = first["distributed_config"]
    merged = store_metadata(first["extraction_config"],
                            distributed_config(None, first_dc["total_machines"], first_dc.get("samples_per_machine"),
                                               machines=listing),
                            shards, statistics(shards, first["extraction_config"]["layers_extracted"], duration),
                            {**first["actstore"], "merged": True})
    write_json_atomic(out_dir / METADATA, merged)
    return merged
