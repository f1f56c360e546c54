"""Pickle shard format (specs/pickle-shard-format.md, version 1.0): the only place that knows it.

One store = `metadata.json` + `shard_NNNN.pkl.gz` (or `.pkl`). A shard is a pickled dict
`layer_{idx}` -> list of {sample_idx, activation float32 (tokens, d), shape, text_preview, metadata}.
Each extraction part (machine) writes its own store `machine-NNNN/`; the merge writes a combined
`metadata.json` beside them that references the machine shards in place (relative `filename`,
`shard_id` renumbered 1..N across the store), so no byte is copied.

Loading never trusts a shard: size and sha256 are checked against metadata.json first, then the
bytes go through a restricted unpickler that can only build dict/list/tuple/str/int/float/bool/None
and numeric numpy arrays.
"""
from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import io
import json
import logging
import math
import os
import pickle
import re
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

from actstore.errors import FormatError
from actstore.formats.parts import Part, layer_tensor, open_part
from actstore.integrity import file_problem, inside, read_json, unlisted
from actstore.io_utils import atomic_path, sha256_file, utc_now, write_json_atomic

log = logging.getLogger(__name__)

FORMAT = "pickle"
VERSION = "1.0"
METADATA = "metadata.json"
PICKLE_PROTOCOL = 5  # in-band buffers: arrays unpickle without an extra copy
PREVIEW_CHARS = 200
REQUIRED = ("version", "created_at", "extraction_config", "shards", "statistics")
CONFIG_FIELDS = ("model_name", "model_architecture", "model_params", "dataset_name", "dataset_config",
                 "dataset_split", "layers_extracted", "max_seq_length", "batch_size")
SHARD_FIELDS = ("shard_id", "filename", "size_bytes", "num_samples", "layers", "sample_id_range",
                "compressed", "checksum")
STAT_FIELDS = ("total_shards", "total_samples", "total_size_bytes", "layers_extracted",
               "extraction_duration_seconds")
ITEM_FIELDS = ("sample_idx", "activation", "shape", "text_preview", "metadata")
NUMERIC_KINDS = "biufc"


def machine_dirname(machine_id: int) -> str:
    return f"machine-{machine_id:04d}"


def shard_filename(shard_id: int, compressed: bool) -> str:
    return f"shard_{shard_id:04d}.pkl" + (".gz" if compressed else "")


def iso_now() -> str:
    return utc_now().strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------------------- writer

def model_params(model_path: str | Path) -> dict[str, Any]:
    """hidden_size, num_hidden_layers, num_attention_heads, vocab_size from the model's config.json
    (GPT-2 aliases and the vision tower's nested config understood; None where the model has none)."""
    path = Path(model_path) / "config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    aliases = {"hidden_size": ("hidden_size", "n_embd", "d_model"),
               "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
               "num_attention_heads": ("num_attention_heads", "n_head"),
               "vocab_size": ("vocab_size",)}
    scopes = [cfg, cfg.get("vision_config") or {}, cfg.get("text_config") or {}]
    out: dict[str, Any] = {}
    for key, names in aliases.items():
        out[key] = next((s[n] for s in scopes for n in names if isinstance(s.get(n), int)), None)
    return out


def extraction_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The spec's extraction_config block, from a part.json."""
    return {
        "model_name": meta["model"]["name"],
        "model_architecture": meta["model"].get("model_type") or meta["model"]["architecture"],
        "model_params": model_params(meta["model"]["path"]),
        "dataset_name": meta["dataset"]["name"],
        "dataset_config": None,  # local JSONL/image folder: no Hugging Face config name
        "dataset_split": meta["dataset"]["split"],
        "layers_extracted": list(meta["layers"]),
        "max_seq_length": meta["max_seq_length"],
        "batch_size": meta["batch_size"],
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
    """The shard dict for local samples `local` of a part, activations copied out of the memmaps."""
    shard: dict[str, list[dict]] = {}
    for layer in layers:
        tensor = part.tensor(layer_tensor(layer))
        items = []
        for i in local:
            row = part.samples[i]
            act = np.array(tensor[part.sample_slice(i)], dtype=np.float32, order="C")
            items.append({
                "sample_idx": int(row["sample_idx"]),
                "activation": act,
                "shape": tuple(act.shape),
                "text_preview": str(row["text"])[:PREVIEW_CHARS],
                "metadata": {"token_count": int(row["num_tokens"]), "dataset_idx": int(row["sample_idx"]),
                             "machine_id": machine_id, "label": row.get("label"),
                             "label_id": row.get("label_id")},
            })
        shard[f"layer_{layer}"] = items
    return shard


def dump_shard(shard: dict, path: Path, compressed: bool, compresslevel: int) -> None:
    """Pickle one shard; gzip with mtime 0 and no file name so equal inputs give equal bytes."""
    with open(path, "wb") as raw:
        if compressed:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=compresslevel, mtime=0) as fh:
                pickle.dump(shard, fh, protocol=PICKLE_PROTOCOL)
        else:
            pickle.dump(shard, raw, protocol=PICKLE_PROTOCOL)
        raw.flush()
        os.fsync(raw.fileno())


def check_sample_ids(part: Part) -> int:
    """Spec: sample_idx = machine_id * samples_per_machine + local_idx. Holds for our contiguous parts
    of ceil(N/P) samples; checked rather than assumed. Returns samples_per_machine."""
    per_machine = math.ceil(part.meta["n_dataset_samples"] / part.meta["parts"])
    machine_id = part.meta["part"]
    for local, row in enumerate(part.samples):
        if row["sample_idx"] != machine_id * per_machine + local:
            raise FormatError(f"{part.dir}/samples.jsonl: sample_idx {row['sample_idx']} at local index {local} "
                              f"is not machine_id*{per_machine}+local")
    return per_machine


def write_machine(part_dir: str | Path, out_dir: str | Path, *, shard_size_mb: float = 100.0,
                  compression: str = "gzip", compresslevel: int = 1, progress: bool = True) -> dict[str, Any]:
    """Write one extraction part as a complete pickle-shard store (atomic); return its metadata."""
    if compression not in ("gzip", "none"):
        raise FormatError(f"pickle.compression: {compression!r} must be 'gzip' or 'none'")
    part = open_part(part_dir)
    meta, machine_id = part.meta, part.meta["part"]
    layers = list(meta["layers"])
    per_machine = check_sample_ids(part)
    d = part.tensor(layer_tensor(layers[0])).shape[1] if part.meta["n_tokens"] else 0
    compressed = compression == "gzip"
    groups = plan_shards(part, len(layers), d, shard_size_mb * 1e6)
    shards = []
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for shard_id, local in enumerate(tqdm(groups, desc=f"pickle machine {machine_id}", unit="shard",
                                              disable=not progress), start=1):
            name = shard_filename(shard_id, compressed)
            dump_shard(shard_items(part, layers, local, machine_id), tmp / name, compressed, compresslevel)
            ids = [part.samples[i]["sample_idx"] for i in local]
            shards.append({
                "shard_id": shard_id, "filename": name, "size_bytes": (tmp / name).stat().st_size,
                "num_samples": len(local), "layers": layers, "sample_id_range": [ids[0], ids[-1]],
                "compressed": compressed, "checksum": "sha256:" + sha256_file(tmp / name),
                "num_tokens": int(part.offsets[local.stop] - part.offsets[local.start]),
            })
        metadata = {
            "version": VERSION, "created_at": iso_now(),
            "extraction_config": extraction_config(meta),
            "distributed_config": {"machine_id": machine_id, "total_machines": meta["parts"], "multihost": False,
                                   "num_hosts": 1, "mesh_type": "1d", "samples_per_machine": per_machine},
            "shards": shards,
            "statistics": statistics(shards, layers, meta["extraction_duration_seconds"]),
            "actstore": actstore_block(meta, d, compression, compresslevel),
        }
        write_json_atomic(tmp / METADATA, metadata)
    log.info("machine %d: %d samples in %d shards -> %s", machine_id, part.meta["n_samples"], len(shards), out_dir)
    return metadata


def statistics(shards: list[dict], layers: list[int], duration: float) -> dict[str, Any]:
    return {"total_shards": len(shards), "total_samples": sum(s["num_samples"] for s in shards),
            "total_size_bytes": sum(s["size_bytes"] for s in shards), "layers_extracted": layers,
            "extraction_duration_seconds": duration,
            "total_tokens": sum(s["num_tokens"] for s in shards)}


def actstore_block(meta: dict[str, Any], d: int, compression: str, compresslevel: int) -> dict[str, Any]:
    """Optional extension key: what the spec does not say but a reader may want."""
    return {"format": FORMAT, "d_model": d, "dtype": "float32", "modality": meta["modality"],
            "model_kind": meta["model_kind"], "model_path": meta["model"]["path"],
            "n_dataset_samples": meta["n_dataset_samples"], "compression": compression,
            "compresslevel": compresslevel if compression == "gzip" else None,
            "pickle_protocol": PICKLE_PROTOCOL, "sample_idx": "dataset row index"}


def merge_machines(machine_dirs: list[str | Path], out_dir: str | Path) -> dict[str, Any]:
    """Write `out_dir/metadata.json` over per-machine stores: shards referenced in place by relative
    path, shard_id renumbered 1..N in machine order; sample ids checked unique."""
    out_dir = Path(out_dir)
    machines = [(Path(m), load_metadata(m)) for m in machine_dirs]
    machines.sort(key=lambda m: m[1]["distributed_config"]["machine_id"])
    first = machines[0][1]
    shards, seen, duration = [], set(), 0.0
    for mdir, meta in machines:
        for key in ("model_name", "layers_extracted", "max_seq_length"):
            if meta["extraction_config"][key] != first["extraction_config"][key]:
                raise FormatError(f"{mdir / METADATA}: extraction_config.{key} = {meta['extraction_config'][key]!r} "
                                  f"differs from {machines[0][0] / METADATA}")
        machine_id = meta["distributed_config"]["machine_id"]
        for info in meta["shards"]:
            path = mdir / info["filename"]
            if not path.is_file() or path.stat().st_size != info["size_bytes"]:
                raise FormatError(f"{path}: missing or not {info['size_bytes']} bytes as {mdir / METADATA} says")
            lo, hi = info["sample_id_range"]
            ids = set(range(lo, hi + 1))
            if len(ids) != info["num_samples"] or ids & seen:
                raise FormatError(f"{path}: sample ids {lo}..{hi} overlap another shard or disagree with num_samples")
            seen |= ids
            rel = os.path.relpath(path, out_dir).replace(os.sep, "/")
            shards.append({**info, "shard_id": len(shards) + 1, "filename": rel, "machine_id": machine_id})
        duration += meta["statistics"]["extraction_duration_seconds"]
    layers = first["extraction_config"]["layers_extracted"]
    merged = {
        "version": VERSION, "created_at": iso_now(), "extraction_config": first["extraction_config"],
        "distributed_config": {
            "machine_id": None, "total_machines": first["distributed_config"]["total_machines"],
            "multihost": False, "num_hosts": 1, "mesh_type": "1d",
            "samples_per_machine": first["distributed_config"].get("samples_per_machine"),
            "machines": [{"machine_id": meta["distributed_config"]["machine_id"],
                          "dir": os.path.relpath(mdir, out_dir).replace(os.sep, "/"),
                          "metadata_sha256": sha256_file(mdir / METADATA)} for mdir, meta in machines],
        },
        "shards": shards,
        "statistics": statistics(shards, layers, duration),
        "actstore": {**first["actstore"], "merged": True},
    }
    write_json_atomic(out_dir / METADATA, merged)
    return merged


# ------------------------------------------------------------------------------- safe unpickling

def _numeric_dtype(dtype: np.dtype, where: str) -> np.dtype:
    if dtype.kind not in NUMERIC_KINDS or dtype.hasobject or dtype.fields is not None or dtype.subdtype:
        raise pickle.UnpicklingError(f"{where}: dtype {dtype} is not a plain numeric dtype")
    return dtype


def _make_dtype(*args: Any) -> np.dtype:
    return _numeric_dtype(np.dtype(*args), "numpy.dtype")


def _reconstruct(subtype: Any, shape: Any, dtype_code: Any) -> np.ndarray:
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError(f"_reconstruct of {subtype!r}: only numpy.ndarray is admitted")
    from numpy._core.multiarray import _reconstruct as real
    return real(np.ndarray, shape, dtype_code)


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    from numpy._core.numeric import _frombuffer as real
    return real(buf, _numeric_dtype(np.dtype(dtype), "_frombuffer"), shape, order)


# Exactly the globals numpy's own pickles of plain arrays name (protocols 3-5, numpy 1.x and 2.x
# module paths), each wrapped so that only numeric dtypes and plain ndarrays come out.
ALLOWED_GLOBALS = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _make_dtype,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
}
PLAIN_TYPES = (str, int, float, bool, type(None))


class RestrictedUnpickler(pickle.Unpickler):
    """Refuses every global but the numpy array constructors above; never imports anything else."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a shard") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in a shard")


def _check_plain(obj: Any, depth: int = 0) -> None:
    """After loading: only the admitted container/scalar types and numeric arrays remain."""
    if depth > 16:
        raise pickle.UnpicklingError("nesting deeper than 16 levels")
    if isinstance(obj, np.ndarray):
        if type(obj) is not np.ndarray:
            raise pickle.UnpicklingError(f"array subclass {type(obj).__name__}")
        _numeric_dtype(obj.dtype, "array")
    elif type(obj) is dict:
        for key, value in obj.items():
            _check_plain(key, depth + 1)
            _check_plain(value, depth + 1)
    elif type(obj) in (list, tuple):
        for value in obj:
            _check_plain(value, depth + 1)
    elif type(obj) not in PLAIN_TYPES:
        raise pickle.UnpicklingError(f"object of type {type(obj).__name__} is not allowed in a shard")


def safe_loads(data: bytes, compressed: bool) -> Any:
    """Decompress (if gzip) and unpickle with the restricted unpickler; check what came out."""
    # One-shot decompression of the whole member(s) is several times faster than streaming GzipFile.
    raw = gzip.decompress(data) if compressed else data
    obj = RestrictedUnpickler(io.BytesIO(raw)).load()
    _check_plain(obj)
    return obj


# ----------------------------------------------------------------------------------------- reader

def load_metadata(output_dir: str | Path) -> dict[str, Any]:
    """Parse `metadata.json`; FormatError naming the file if it is missing or not a JSON object."""
    path = Path(output_dir) / METADATA
    meta = read_json(path)
    if not isinstance(meta, dict) or not isinstance(meta.get("shards"), list):
        raise FormatError(f"{path}: not a pickle-shard metadata object (no 'shards' list)")
    return meta


def shard_path(output_dir: str | Path, info: dict[str, Any]) -> Path:
    """The shard's path; refuses absolute paths and `..` so metadata cannot point outside the store."""
    name = info.get("filename")
    source = str(Path(output_dir) / METADATA)
    if not isinstance(name, str) or not re.fullmatch(r"shard_\d{4,}\.pkl(\.gz)?", PurePosixPath(name).name):
        raise FormatError(f"{source}: shard filename {name!r} is not a shard_NNNN.pkl[.gz] path")
    return inside(Path(output_dir), name, source)


def read_checked(output_dir: str | Path, info: dict[str, Any]) -> bytes:
    """The shard's bytes, after checking they exist, have size_bytes and match the sha256 checksum."""
    path = shard_path(output_dir, info)
    if not path.is_file():
        raise FormatError(f"{path}: shard missing")
    data = path.read_bytes()
    if len(data) != info.get("size_bytes"):
        raise FormatError(f"{path}: {len(data)} bytes, metadata.json says size_bytes={info.get('size_bytes')}")
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if digest != info.get("checksum"):
        raise FormatError(f"{path}: checksum {digest} != metadata.json checksum {info.get('checksum')}")
    return data


def load_shard(output_dir: str | Path, info: dict[str, Any]) -> dict[str, list[dict]]:
    """Verify then safely unpickle one shard; FormatError naming the shard on any problem."""
    data = read_checked(output_dir, info)
    path = shard_path(output_dir, info)
    try:
        shard = safe_loads(data, bool(info.get("compressed")))
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, MemoryError) as exc:
        raise FormatError(f"{path}: refused to load shard: {exc}") from None
    if not isinstance(shard, dict):
        raise FormatError(f"{path}: shard is a {type(shard).__name__}, not a dict of layers")
    return shard


def iter_activations(output_dir: str | Path, layer_idx: int) -> Iterator[dict[str, Any]]:
    """Every item of `layer_{layer_idx}` in shard order, one verified shard in memory at a time."""
    layer_key = f"layer_{layer_idx}"
    for info in load_metadata(output_dir)["shards"]:
        if layer_idx not in info["layers"]:
            continue
        shard = load_shard(output_dir, info)
        yield from shard.get(layer_key, [])
        del shard


try:  # torch is a dependency of actstore, but keep the module importable without it
    from torch.utils.data import Dataset as _TorchDataset
except ImportError:  # pragma: no cover
    _TorchDataset = object  # type: ignore[misc,assignment]


class ActivationDataset(_TorchDataset):
    """The spec's ActivationDataset, but indexed from metadata.json (no shard is read to build it)
    and loading each shard verified and safely; one shard cached at a time."""

    def __init__(self, output_dir: str | Path, layer_idx: int):
        self.output_dir = Path(output_dir)
        self.layer_idx = layer_idx
        self.layer_key = f"layer_{layer_idx}"
        self.metadata = load_metadata(output_dir)
        self.shards = {s["shard_id"]: s for s in self.metadata["shards"]}
        self.index = [(s["shard_id"], i) for s in self.metadata["shards"] if layer_idx in s["layers"]
                      for i in range(s["num_samples"])]
        self.current_shard_id: int | None = None
        self.current_shard: dict | None = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        shard_id, item_idx = self.index[idx]
        if shard_id != self.current_shard_id:
            self.current_shard = None  # drop the old shard before loading the next
            self.current_shard = load_shard(self.output_dir, self.shards[shard_id])
            self.current_shard_id = shard_id
        item = self.current_shard[self.layer_key][item_idx]
        return {"activation": item["activation"], "sample_idx": item["sample_idx"], "text": item["text_preview"]}


def collate_padded(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """DataLoader collate_fn for variable-length samples: activations zero-padded to the longest,
    plus `lengths` (the default collate needs equal shapes, which unpadded samples do not have)."""
    import torch

    lengths = [item["activation"].shape[0] for item in batch]
    d = batch[0]["activation"].shape[1]
    out = torch.zeros((len(batch), max(lengths), d), dtype=torch.float32)
    for row, item in enumerate(batch):
        out[row, :lengths[row]] = torch.from_numpy(np.asarray(item["activation"]))
    return {"activation": out, "lengths": torch.tensor(lengths),
            "sample_idx": torch.tensor([item["sample_idx"] for item in batch]),
            "text": [item["text"] for item in batch]}


# ------------------------------------------------------------------ detect / inspect / verify / read

def detect(path: str | Path) -> bool:
    """A directory whose metadata.json has the spec's required fields and shard_*.pkl[.gz] entries."""
    try:
        meta = load_metadata(path)
    except FormatError:
        return False
    return all(k in meta for k in REQUIRED) and all(
        isinstance(s, dict) and re.search(r"shard_\d{4,}\.pkl(\.gz)?$", str(s.get("filename", "")))
        for s in meta["shards"])


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary from metadata.json alone (no shard is read)."""
    meta = load_metadata(path)
    ext, stats, cfg = meta.get("actstore", {}), meta["statistics"], meta["extraction_config"]
    shard_bytes = sum(s["size_bytes"] for s in meta["shards"])
    return {
        "format": FORMAT, "version": meta["version"], "model": cfg["model_name"],
        "layers": list(cfg["layers_extracted"]), "n_examples": stats["total_samples"],
        "n_tokens": stats.get("total_tokens"),
        "d_model": ext.get("d_model") or cfg["model_params"].get("hidden_size"),
        "dtype": ext.get("dtype", "float32"), "n_shards": len(meta["shards"]),
        "bytes": shard_bytes + (Path(path) / METADATA).stat().st_size,
        "compressed": sorted({bool(s["compressed"]) for s in meta["shards"]}),
        "machines": meta.get("distributed_config", {}).get("total_machines"),
        "merged": bool(ext.get("merged")),
    }


def _verify_metadata(path: Path, meta: dict[str, Any]) -> list[str]:
    where = path / METADATA
    problems = [f"{where}: missing required field {k!r}" for k in REQUIRED if k not in meta]
    if problems:
        return problems
    try:
        dt.datetime.fromisoformat(str(meta["created_at"]).replace("Z", "+00:00"))
    except ValueError:
        problems.append(f"{where}: created_at {meta['created_at']!r} is not ISO 8601")
    problems += [f"{where}: extraction_config lacks {k!r}" for k in CONFIG_FIELDS if k not in meta["extraction_config"]]
    problems += [f"{where}: statistics lacks {k!r}" for k in STAT_FIELDS if k not in meta["statistics"]]
    for i, info in enumerate(meta["shards"]):
        missing = [k for k in SHARD_FIELDS if k not in info] if isinstance(info, dict) else list(SHARD_FIELDS)
        problems += [f"{where}: shards[{i}] lacks {k!r}" for k in missing]
    return problems


def _verify_totals(path: Path, meta: dict[str, Any]) -> list[str]:
    """Unique shard ids; statistics equal to the sums over shards."""
    where, problems = path / METADATA, []
    ids = [s["shard_id"] for s in meta["shards"]]
    if len(set(ids)) != len(ids):
        problems.append(f"{where}: shard_id values are not unique")
    stats = meta["statistics"]
    for key, want in (("total_shards", len(meta["shards"])),
                      ("total_samples", sum(s["num_samples"] for s in meta["shards"])),
                      ("total_size_bytes", sum(s["size_bytes"] for s in meta["shards"]))):
        if stats[key] != want:
            problems.append(f"{where}: statistics.{key} = {stats[key]} but the shards sum to {want}")
    return problems


def _unlisted_files(path: Path, meta: dict[str, Any]) -> list[str]:
    """Every file is metadata.json, a listed shard, or (merged) a listed machine's metadata.json."""
    machines = meta.get("distributed_config", {}).get("machines") or []
    listed = {METADATA, *(str(s.get("filename")) for s in meta["shards"]),
              *(f"{m.get('dir')}/{METADATA}" for m in machines)}
    return unlisted(path, listed, str(path / METADATA))


def _verify_machines(path: Path, meta: dict[str, Any]) -> list[str]:
    """A merged store records each machine's metadata.json sha256: check them."""
    problems = []
    for m in meta.get("distributed_config", {}).get("machines") or []:
        try:
            mpath = inside(path, m["dir"], str(path / METADATA)) / METADATA
        except FormatError as exc:
            problems.append(str(exc))
            continue
        if problem := file_problem(mpath, {"sha256": m["metadata_sha256"]}, "the merged metadata.json"):
            problems.append(problem)
    return problems


def _verify_shard(path: Path, info: dict[str, Any], seen: set[int]) -> list[str]:
    """One shard: bytes, safe load, and content against its metadata entry."""
    try:
        name = shard_path(path, info)
        shard = load_shard(path, info)
    except FormatError as exc:
        return [str(exc)]
    want_keys = {f"layer_{layer}" for layer in info["layers"]}
    if set(shard) != want_keys:
        return [f"{name}: layer keys {sorted(shard)} != metadata layers {sorted(want_keys)}"]
    problems, ids_by_layer = [], []
    for key, items in shard.items():
        if not isinstance(items, list) or len(items) != info["num_samples"]:
            problems.append(f"{name}: {key} holds {len(items) if isinstance(items, list) else '?'} items, "
                            f"num_samples={info['num_samples']}")
            continue
        for item in items:
            if not isinstance(item, dict) or any(k not in item for k in ITEM_FIELDS):
                problems.append(f"{name}: {key} item lacks one of {ITEM_FIELDS}")
                break
            act = item["activation"]
            if act.dtype != np.float32 or act.ndim != 2 or tuple(item["shape"]) != act.shape:
                problems.append(f"{name}: {key} sample {item['sample_idx']}: activation {act.dtype} {act.shape} "
                                f"vs shape {item['shape']}")
            if not isinstance(item["text_preview"], str) or len(item["text_preview"]) > PREVIEW_CHARS:
                problems.append(f"{name}: {key} sample {item['sample_idx']}: bad text_preview")
        ids_by_layer.append([item.get("sample_idx") for item in items if isinstance(item, dict)])
    if problems:
        return problems
    ids = ids_by_layer[0] if ids_by_layer else []
    lo, hi = info["sample_id_range"]
    if any(other != ids for other in ids_by_layer) or (ids and (min(ids) != lo or max(ids) != hi)):
        problems.append(f"{name}: sample ids {ids[:1]}..{ids[-1:]} disagree across layers or with "
                        f"sample_id_range {info['sample_id_range']}")
    if len(set(ids)) != len(ids) or seen & set(ids):
        problems.append(f"{name}: duplicate sample_idx within the store")
    seen.update(ids)
    return problems


def verify(path: str | Path) -> list[str]:
    """Full integrity check; every problem names its file. Never raises on a bad store."""
    path = Path(path)
    try:
        meta = load_metadata(path)
        problems = _verify_metadata(path, meta)
        if problems:  # required fields missing: nothing further can be trusted
            return problems
        problems = _verify_totals(path, meta)
        seen: set[int] = set()
        for info in tqdm(meta["shards"], desc="verify pickle shards", unit="shard", disable=len(meta["shards"]) < 20):
            problems += _verify_shard(path, info, seen)
        return problems + _verify_machines(path, meta) + _unlisted_files(path, meta)
    except FormatError as exc:  # already names its file
        return [str(exc)]
    except Exception as exc:  # a malformed store must yield a report, not a crash
        return [f"{path / METADATA}: {type(exc).__name__}: {exc}"]


_CACHE: dict[tuple, dict] = {}


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """float32 (d,) activation of one token, or None when the store does not hold that coordinate.
    The last shard read stays cached (keyed on its path, size and mtime)."""
    meta = load_metadata(path)
    for info in meta["shards"]:
        lo, hi = info["sample_id_range"]
        if lo <= sample_idx <= hi and layer_idx in info["layers"]:
            file = shard_path(path, info)
            stat = file.stat()
            key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns, info["checksum"])
            if key not in _CACHE:
                _CACHE.clear()
                _CACHE[key] = load_shard(path, info)
            for item in _CACHE[key][f"layer_{layer_idx}"]:
                if item["sample_idx"] == sample_idx:
                    act = item["activation"]
                    return np.asarray(act[token_idx], dtype=np.float32) if 0 <= token_idx < act.shape[0] else None
    return None
