"""The saev sharded activation protocol 2.1 (/work/shared/specs/saev-protocol.md), to the byte.

Store layout (`<dump_to>/saev/<HASH>/`, HASH = full sha256 of the canonical metadata.json):
  metadata.json    the spec's 12 fields, nothing else (so HASH depends on spec fields only)
  shards.json      [{"name": "acts000000.bin", "n_examples": S, "bytes": ..., "sha256": ...}, ...]
                   ("bytes"/"sha256": optional keys, a backward-compatible minor addition)
  acts%06d.bin     raw C-order float32 (S, L, T, D), no header
  labels.bin       optional per-patch labels: raw C-order uint8 (n_examples, patches_per_ex), no CLS
                   column (saev's layout); written from segmentation masks (saev.patch_labels, see
                   actstore.patch_labels) or attached later with write_labels()
  windows.npy      text stores only (optional extension): int64 (n_examples, 3) rows
                   (sample_idx, token_start, n_valid): example e = tokens token_start..+n_valid of
                   dataset row sample_idx; tokens n_valid..T-1 are zero padding
  actstore.json    optional extension: sizes and sha256 of windows.npy / labels.bin, the source
                   extraction, registers; not part of HASH
Text models: each sample's tokens are cut into windows of T = tokens_per_window tokens that never
cross samples; a sample's last, shorter window is zero-padded (n_valid in windows.npy says where).
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from tqdm import tqdm

from actstore.errors import ConfigError, FormatError
from actstore.integrity import dir_bytes, file_problem, file_record, inside, read_json, unlisted
from actstore.io_utils import atomic_path, canonical_json, write_json_atomic

log = logging.getLogger(__name__)

PROTOCOL = "2.1"
METADATA = "metadata.json"
SHARDS = "shards.json"
LABELS = "labels.bin"
WINDOWS = "windows.npy"
SIDECAR = "actstore.json"
POINTER = "saev.json"
DTYPE = np.dtype("<f4")
METADATA_FIELDS = {
    "family": str, "ckpt": str, "layers": list, "patches_per_ex": int, "cls_token": bool,
    "d_model": int, "n_examples": int, "patches_per_shard": int, "data": str, "dataset": str,
    "dtype": str, "protocol": str,
}
# model_type -> spec family; text models keep their model_type (a documented extension).
FAMILIES = {"dinov2": "dinov2", "dinov2_with_registers": "dinov2", "clip": "clip",
            "clip_vision_model": "clip", "siglip": "siglip", "siglip_vision_model": "siglip"}
CLS_FAMILIES = ("dinov2", "clip")
CHUNK_BYTES = 64 << 20  # examples are copied into a shard in ~64 MiB slabs


def shard_name(idx: int) -> str:
    return f"acts{idx:06d}.bin"


def metadata_hash(metadata: dict[str, Any]) -> str:
    """The store's directory name: full sha256 hex of the canonical metadata JSON (spec §1)."""
    return hashlib.sha256(canonical_json(metadata).encode("utf-8")).hexdigest()


def examples_per_shard(patches_per_shard: int, tokens_per_ex: int, n_layers: int) -> int:
    """Spec §3: floor(patches_per_shard / (tokens_per_ex * len(layers)))."""
    return patches_per_shard // (tokens_per_ex * n_layers)


def encode_data(description: dict[str, Any]) -> str:
    """Spec §2.1 `data`: base64 of a pickle. A dict of plain values, protocol 4, so it is
    deterministic and readable by decode_data without unpickling any class."""
    return base64.b64encode(pickle.dumps(description, protocol=4)).decode("utf8")


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every global: only dicts, lists, strings and numbers come back."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from metadata.json data")


def decode_data(data: str) -> Any:
    """Decode the `data` field safely (never executes code); raises FormatError if it needs classes."""
    try:
        return _PlainUnpickler(io.BytesIO(base64.b64decode(data))).load()
    except Exception as exc:
        raise FormatError(f"metadata.json data: not a plain pickled description ({exc})") from None


# --------------------------------------------------------------------------------------------- writer

@dataclass
class Plan:
    """What to write: spec metadata plus how to fill examples from the extraction."""

    metadata: dict[str, Any]
    windows: np.ndarray | None  # text: (n_examples, 3) sample_idx, token_start, n_valid
    sidecar: dict[str, Any]
    labels: np.ndarray | None = None  # images: (n_examples, patches_per_ex) uint8 -> labels.bin

    @property
    def tokens_per_ex(self) -> int:
        return self.metadata["patches_per_ex"] + int(self.metadata["cls_token"])


def text_windows(num_tokens: np.ndarray, window: int) -> np.ndarray:
    """(n_windows, 3) sample_idx, token_start, n_valid: windows never cross samples, last one short."""
    n_win = -(-num_tokens // window)
    sample = np.repeat(np.arange(len(num_tokens), dtype=np.int64), n_win)
    first = np.repeat(np.cumsum(n_win) - n_win, n_win)
    start = (np.arange(len(sample), dtype=np.int64) - first) * window
    valid = np.minimum(window, num_tokens[sample] - start)
    return np.stack([sample, start, valid], axis=1).astype(np.int64)


def plan_store(extraction, section: dict[str, Any], extract_hash: str | None = None,
               progress: bool = False) -> Plan:
    """Spec metadata for an extraction and the `saev` config section (patch labels computed here, so a
    bad mask fails before anything is written)."""
    from actstore.formats.parts import layer_tensor
    from actstore.models import read_model_config

    meta = extraction.meta
    layers = list(section.get("layers") or meta["layers"])
    missing = [layer for layer in layers if layer_tensor(layer) not in meta["tensors"]]
    if missing:
        raise ConfigError(f"saev.layers: {missing} not extracted; extract.layers = {meta['layers']}")
    d_model = int(extraction.parts[0].tensor(layer_tensor(layers[0])).shape[1])
    num_tokens = np.array([row["num_tokens"] for _, _, row in extraction.iter_samples()], dtype=np.int64)
    model_type = meta["model"]["model_type"] or "unknown"
    sidecar: dict[str, Any] = {"source_extraction": extract_hash, "model_type": model_type}
    description = {"source": "actstore", "extract_hash": extract_hash, "modality": meta["modality"],
                   "dataset": {k: meta["dataset"].get(k) for k in ("path", "name", "split")},
                   "n_samples": int(len(num_tokens)), "model_revision": meta["model"]["revision"],
                   "torch_dtype": meta["model"]["torch_dtype"]}
    if meta["modality"] == "image":
        family = FAMILIES.get(model_type, model_type)
        if len(set(num_tokens.tolist())) > 1:
            raise FormatError(f"{extraction.dir}: images have differing token counts {sorted(set(num_tokens))}")
        tokens = int(num_tokens[0]) if len(num_tokens) else 0
        cls_token = family in CLS_FAMILIES
        model_config = read_model_config(Path(meta["model"]["path"]))
        registers = _registers(model_config)
        _check_patches(model_config, tokens - int(cls_token) - registers)
        patches, windows = tokens - int(cls_token), None
        sidecar["registers"] = registers
        labels = _plan_labels(extraction, section, description, _patch_size(model_config), patches, registers,
                              progress)
    else:
        if section.get("patch_labels"):
            raise ConfigError("saev.patch_labels: per-patch labels need an image dataset; "
                              f"{meta['dataset']['path']} is text")
        labels = None
        family, cls_token = model_type, False
        patches = int(section["tokens_per_window"])
        windows = text_windows(num_tokens, patches)
        description["tokens_per_window"] = patches
        description["max_seq_length"] = meta["max_seq_length"]
    n_examples = int(len(num_tokens) if windows is None else len(windows))
    metadata = {
        "family": family, "ckpt": meta["model"]["name"], "layers": layers, "patches_per_ex": patches,
        "cls_token": cls_token, "d_model": d_model, "n_examples": n_examples,
        "patches_per_shard": int(section["patches_per_shard"]), "data": encode_data(description),
        "dataset": str(Path(meta["dataset"]["path"]).resolve()), "dtype": "float32", "protocol": PROTOCOL,
    }
    if examples_per_shard(metadata["patches_per_shard"], patches + int(cls_token), len(layers)) < 1:
        raise ConfigError(f"saev.patches_per_shard={metadata['patches_per_shard']} is smaller than one example "
                          f"({patches + int(cls_token)} tokens x {len(layers)} layers)")
    return Plan(metadata, windows, sidecar, labels)


def _plan_labels(extraction, section: dict[str, Any], description: dict[str, Any], patch_size: int,
                 patches: int, registers: int, progress: bool) -> np.ndarray | None:
    """labels.bin rows from saev.patch_labels (None when unset); the settings join `data`, so HASH
    changes with them."""
    from actstore.patch_labels import REGISTER_LABEL, image_patch_labels

    settings = section.get("patch_labels")
    if not settings:
        return None
    settings = {**settings, "masks": str(Path(settings["masks"]).resolve())}
    if not Path(settings["masks"]).is_dir():
        raise ConfigError(f"saev.patch_labels.masks: {settings['masks']} is not a directory")
    description["patch_labels"] = {**settings, "register_label": REGISTER_LABEL}
    meta = extraction.meta
    rels = [row["text"] for _, _, row in extraction.iter_samples()]
    return image_patch_labels(meta["dataset"]["path"], rels, meta["model"]["path"], patch_size, settings,
                              patches, registers, progress=progress)


def _patch_size(model_config: dict[str, Any]) -> int:
    return int((model_config.get("vision_config") or model_config)["patch_size"])


def _registers(model_config: dict[str, Any]) -> int:
    return int(model_config.get("num_register_tokens") or 0)


def _check_patches(model_config: dict[str, Any], measured: int) -> None:
    """Patches implied by config.json (image_size/patch_size)^2 vs what the model emitted."""
    cfg = model_config.get("vision_config") or model_config
    if isinstance(cfg.get("image_size"), int) and isinstance(cfg.get("patch_size"), int):
        expected = (cfg["image_size"] // cfg["patch_size"]) ** 2
        if expected != measured:
            # dinov2 interpolates position embeddings: its processor may crop smaller than image_size.
            log.warning("config.json implies %d patches per image, the model emitted %d; storing %d",
                        expected, measured, measured)


def _fill_images(extraction, layers: list[str], start: int, out: np.ndarray) -> None:
    """out (n, L, T, D) <- examples start..start+n (one example = one image)."""
    n, _, t, _ = out.shape
    done = 0
    while done < n:
        part, local = extraction.locate(start + done)
        take = min(n - done, part.meta["n_samples"] - local)
        rows = slice(int(part.offsets[local]), int(part.offsets[local + take]))
        for li, name in enumerate(layers):
            out[done:done + take, li] = part.tensor(name)[rows].reshape(take, t, -1)
        done += take


def _fill_windows(extraction, layers: list[str], windows: np.ndarray, out: np.ndarray) -> None:
    """out (n, L, T, D) <- the token windows `windows` (n, 3), zero padding past n_valid."""
    t = out.shape[2]
    out[:] = 0
    for part in extraction.parts:
        lo, hi = part.sample_start, part.sample_start + part.meta["n_samples"]
        sel = np.nonzero((windows[:, 0] >= lo) & (windows[:, 0] < hi))[0]
        if not len(sel):
            continue
        w = windows[sel]
        rows = part.offsets[w[:, 0] - lo][:, None] + w[:, 1:2] + np.arange(t)[None, :]
        valid = np.arange(t)[None, :] < w[:, 2:3]
        for li, name in enumerate(layers):
            tensor = part.tensor(name)
            block = out[sel, li]
            block[valid] = tensor[rows[valid]]
            out[sel, li] = block


def shard_sizes(n_examples: int, per_shard: int) -> list[int]:
    """Examples in each shard: per_shard each, the last one smaller."""
    full, rest = divmod(n_examples, per_shard)
    return [per_shard] * full + ([rest] if rest else [])


def write_store(extraction, section: dict[str, Any], root: str | Path, extract_hash: str | None = None,
                progress: bool = True) -> Path:
    """Write the store for an extraction under root/<HASH>/ (built in a temp dir, renamed last)."""
    from actstore.formats.parts import layer_tensor

    plan = plan_store(extraction, section, extract_hash, progress=progress)
    names = [layer_tensor(layer) for layer in plan.metadata["layers"]]
    windows = plan.windows

    def fill(start: int, out: np.ndarray) -> None:
        if windows is None:
            _fill_images(extraction, names, start, out)
        else:
            _fill_windows(extraction, names, windows[start:start + len(out)], out)
    return write_raw_store(plan, fill, root, progress=progress)


def write_raw_store(plan: Plan, fill: Callable[[int, np.ndarray], None], root: str | Path,
                    progress: bool = True) -> Path:
    """Write metadata, shards (filled slab by slab by `fill(first_example, out)`) and sidecars."""
    md = plan.metadata
    final = Path(root) / metadata_hash(md)
    t, n_layers, d = plan.tokens_per_ex, len(md["layers"]), md["d_model"]
    sizes = shard_sizes(md["n_examples"], examples_per_shard(md["patches_per_shard"], t, n_layers))
    slab = max(1, CHUNK_BYTES // (n_layers * t * d * DTYPE.itemsize))
    with atomic_path(final) as tmp:
        tmp.mkdir()
        shards, start = [], 0
        for idx, size in enumerate(tqdm(sizes, desc="saev shards", unit="shard", disable=not progress)):
            path = tmp / shard_name(idx)
            array = np.memmap(path, dtype=DTYPE, mode="w+", shape=(size, n_layers, t, d))
            for lo in range(0, size, slab):
                fill(start + lo, array[lo:lo + slab])
            array.flush()
            del array
            shards.append({"name": shard_name(idx), "n_examples": size, **file_record(path)})
            start += size
        files = {}
        if plan.windows is not None:
            np.save(tmp / WINDOWS, plan.windows)
            files[WINDOWS] = file_record(tmp / WINDOWS)
        if plan.labels is not None:
            _write_labels_file(tmp / LABELS, plan.labels, (md["n_examples"], md["patches_per_ex"]))
            files[LABELS] = file_record(tmp / LABELS)
        write_json_atomic(tmp / SHARDS, shards)
        write_json_atomic(tmp / SIDECAR, {**plan.sidecar, "files": files})
        write_json_atomic(tmp / METADATA, md)  # written last: its presence marks a finished store
    log.info("saev store: %d examples in %d shards -> %s", md["n_examples"], len(sizes), final)
    return final


def write_pointer(pointer: str | Path, store: str | Path) -> None:
    """The rule's declared output: {"store": <store dir relative to the pointer>, "hash": HASH}."""
    pointer, store = Path(pointer), Path(store)
    write_json_atomic(pointer, {"store": os.path.relpath(store, pointer.parent), "hash": store.name,
                                "protocol": PROTOCOL})


def _write_labels_file(path: Path, labels: np.ndarray, shape: tuple[int, int]) -> None:
    """labels.bin: raw C-order uint8 (n_examples, patches_per_ex), written atomically."""
    labels = np.ascontiguousarray(labels)
    if labels.shape != shape or labels.dtype != np.uint8:
        raise FormatError(f"{path}: need uint8 {shape}, got {labels.dtype} {labels.shape}")
    with atomic_path(path) as tmp:
        tmp.write_bytes(labels.tobytes())


def write_labels(path: str | Path, labels: np.ndarray) -> None:
    """Attach per-patch labels (n_examples, patches_per_ex) as labels.bin (uint8) and record its sha256."""
    store = open_store(path)
    _write_labels_file(store.dir / LABELS, labels, (store.n_examples, store.patches_per_ex))
    sidecar = store.sidecar
    sidecar.setdefault("files", {})[LABELS] = file_record(store.dir / LABELS)
    write_json_atomic(store.dir / SIDECAR, sidecar)


# --------------------------------------------------------------------------------------------- reader

def resolve(path: str | Path) -> Path:
    """The store directory from itself, a stage dir holding saev.json, or saev.json itself."""
    path = Path(path)
    if path.is_dir() and (path / METADATA).is_file():
        return path
    pointer = path / POINTER if path.is_dir() else path
    if pointer.name == POINTER and pointer.is_file():
        try:
            target = json.loads(pointer.read_text())["store"]
        except (ValueError, KeyError, TypeError):
            raise FormatError(f"{pointer}: not a saev pointer (needs a 'store' key)") from None
        # The store is the stage dir's sibling named by its HASH, and nothing else.
        if not isinstance(target, str) or not re.fullmatch(r"\.\./[0-9a-f]{64}", target):
            raise FormatError(f"{pointer}: store {target!r} is not '../<metadata sha256>'")
        return (pointer.parent / target).resolve()
    raise FormatError(f"{path}: neither a saev store (no {METADATA}) nor a stage dir with {POINTER}")


def check_metadata(md: Any, where: Path) -> None:
    """Every spec field present with its type; raise FormatError naming the field."""
    if not isinstance(md, dict):
        raise FormatError(f"{where}: top level must be an object")
    for name, kind in METADATA_FIELDS.items():
        if name not in md:
            raise FormatError(f"{where}: field {name!r} missing")
        value = md[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise FormatError(f"{where}: field {name!r} = {value!r} is not {kind.__name__}")
    if md["dtype"] != "float32":
        raise FormatError(f"{where}: dtype {md['dtype']!r}; protocol {PROTOCOL} fixes 'float32'")
    if not md["layers"] or not all(isinstance(x, int) for x in md["layers"]):
        raise FormatError(f"{where}: layers {md['layers']!r} must be a non-empty int list")
    for name in ("patches_per_ex", "d_model", "patches_per_shard"):
        if md[name] < 1:
            raise FormatError(f"{where}: {name} = {md[name]} must be >= 1")


class SaevStore:
    """An opened store: spec §4 addressing, per-shard memmaps, ordered iteration."""

    def __init__(self, path: str | Path, check_sizes: bool = True):
        self.dir = resolve(path)
        self.metadata = read_json(self.dir / METADATA)
        check_metadata(self.metadata, self.dir / METADATA)
        if str(self.metadata["protocol"]).split(".")[0] != PROTOCOL.split(".")[0]:
            warnings.warn(f"{self.dir / METADATA}: protocol {self.metadata['protocol']} has a different major "
                          f"version than this reader's {PROTOCOL}; the layout may have changed", stacklevel=2)
        self.shards = read_json(self.dir / SHARDS)
        self._check_shards_json()
        sidecar = self.dir / SIDECAR
        self.sidecar = read_json(sidecar) if sidecar.is_file() else {}
        self.starts = np.concatenate([[0], np.cumsum([s["n_examples"] for s in self.shards])]).astype(np.int64)
        self._maps: dict[int, np.memmap] = {}
        self._windows: np.ndarray | None | bool = False  # False: not looked for yet
        if check_sizes:
            problems = self.size_problems()
            if problems:
                raise FormatError("; ".join(problems))

    # spec §4.1 names
    @property
    def layers(self) -> list[int]:
        return self.metadata["layers"]

    @property
    def L(self) -> int:
        return len(self.layers)

    @property
    def patches_per_ex(self) -> int:
        return self.metadata["patches_per_ex"]

    @property
    def T(self) -> int:
        return self.patches_per_ex + int(self.metadata["cls_token"])

    @property
    def D(self) -> int:
        return self.metadata["d_model"]

    @property
    def n_examples(self) -> int:
        return self.metadata["n_examples"]

    @property
    def examples_per_shard(self) -> int:
        return examples_per_shard(self.metadata["patches_per_shard"], self.T, self.L)

    @property
    def example_bytes(self) -> int:
        return self.L * self.T * self.D * DTYPE.itemsize

    def _check_shards_json(self) -> None:
        where = self.dir / SHARDS
        if not isinstance(self.shards, list) or not self.shards and self.n_examples:
            raise FormatError(f"{where}: must be a non-empty array of shard objects")
        per = self.examples_per_shard
        for i, shard in enumerate(self.shards):
            if not isinstance(shard, dict) or shard.get("name") != shard_name(i):
                raise FormatError(f"{where}: entry {i} must be named {shard_name(i)!r}, got {shard!r:.80}")
            n = shard.get("n_examples")
            if not isinstance(n, int) or n < 1 or n > per or (i < len(self.shards) - 1 and n != per):
                raise FormatError(f"{where}: {shard_name(i)} n_examples={n!r}; expected {per} "
                                  f"(only the last shard may be smaller)")
        total = sum(s["n_examples"] for s in self.shards)
        if total != self.n_examples:
            raise FormatError(f"{where}: shards hold {total} examples, metadata.json n_examples={self.n_examples}")

    def shard_bytes(self, idx: int) -> int:
        return self.shards[idx]["n_examples"] * self.example_bytes

    def size_problems(self) -> list[str]:
        """Every shard present with exactly n_examples * L * T * D * 4 bytes (checked before any read)."""
        problems = []
        for i, shard in enumerate(self.shards):
            path = self.dir / shard["name"]
            if not path.is_file():
                problems.append(f"{path}: missing shard")
            elif path.stat().st_size != self.shard_bytes(i):
                problems.append(f"{path}: {path.stat().st_size} bytes, expected {self.shard_bytes(i)} "
                                f"({shard['n_examples']} x {self.L} x {self.T} x {self.D} float32)")
        return problems

    def layer_index(self, layer: int) -> int:
        """Spec §4.2 step 2: a layer not stored is an error naming the stored layers."""
        if layer not in self.layers:
            raise FormatError(f"{self.dir}: layer {layer} not stored; stored layers are {self.layers}")
        return self.layers.index(layer)

    def locate(self, example: int, layer: int, token: int) -> tuple[Path, int]:
        """Spec §4.2: (shard file, byte offset) of vector [example, layer value, token]."""
        if not 0 <= example < self.n_examples:
            raise IndexError(f"example {example} out of range [0, {self.n_examples})")
        if not 0 <= token < self.T:
            raise IndexError(f"token {token} out of range [0, {self.T})")
        s = self.examples_per_shard
        shard_idx, ex_in_shard = divmod(example, s)
        offset_in_vectors = ex_in_shard * self.L * self.T + self.layer_index(layer) * self.T + token
        return self.dir / shard_name(shard_idx), offset_in_vectors * self.D * DTYPE.itemsize

    def vector(self, example: int, layer: int, token: int) -> np.ndarray:
        """One (D,) vector by seek + read at the spec's byte offset."""
        path, offset = self.locate(example, layer, token)
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = os.pread(fd, self.D * DTYPE.itemsize, offset)
        finally:
            os.close(fd)
        return np.frombuffer(raw, dtype=DTYPE).astype(np.float32)

    def memmap(self, shard_idx: int) -> np.memmap:
        """Read-only (S, L, T, D) memmap of one shard (random access for visualisation)."""
        if shard_idx not in self._maps:
            self._maps[shard_idx] = np.memmap(self.dir / shard_name(shard_idx), dtype=DTYPE, mode="r",
                                              shape=(self.shards[shard_idx]["n_examples"], self.L, self.T, self.D))
        return self._maps[shard_idx]

    def example(self, example: int) -> np.ndarray:
        """(L, T, D) view of one example through the shard memmap."""
        shard_idx, ex_in_shard = divmod(example, self.examples_per_shard)
        return self.memmap(shard_idx)[ex_in_shard]

    def iter_ordered(self, chunk_examples: int = 1024, progress: bool = False) -> Iterator[tuple[int, np.ndarray]]:
        """(first example, (n, L, T, D) array) in example order, one large sequential read each."""
        for idx, shard in enumerate(tqdm(self.shards, desc="saev read", disable=not progress)):
            path = self.dir / shard["name"]
            with open(path, "rb", buffering=0) as fh:
                for lo in range(0, shard["n_examples"], chunk_examples):
                    n = min(chunk_examples, shard["n_examples"] - lo)
                    out = np.empty((n, self.L, self.T, self.D), dtype=DTYPE)
                    fh.seek(lo * self.example_bytes)
                    fh.readinto(memoryview(out).cast("B"))
                    yield int(self.starts[idx]) + lo, out

    @property
    def windows(self) -> np.ndarray | None:
        """Text stores: (n_examples, 3) sample_idx, token_start, n_valid; None for images."""
        if self._windows is False:  # looked up once: the loader asks for every block
            path = self.dir / WINDOWS
            self._windows = np.load(path, allow_pickle=False) if path.is_file() else None
        return self._windows

    def labels(self) -> np.ndarray | None:
        """labels.bin as a read-only uint8 (n_examples, patches_per_ex) memmap, or None."""
        path = self.dir / LABELS
        if not path.is_file():
            return None
        want = self.n_examples * self.patches_per_ex
        if path.stat().st_size != want:
            raise FormatError(f"{path}: {path.stat().st_size} bytes, expected {want} (uint8 n_examples x patches_per_ex)")
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(self.n_examples, self.patches_per_ex))

    def find(self, sample_idx: int, token_idx: int) -> tuple[int, int] | None:
        """(example, token) holding token `token_idx` of dataset row `sample_idx`, or None."""
        windows = self.windows
        if windows is None:
            ok = 0 <= sample_idx < self.n_examples and 0 <= token_idx < self.T
            return (sample_idx, token_idx) if ok else None
        lo, hi = np.searchsorted(windows[:, 0], [sample_idx, sample_idx + 1])
        for ex in range(lo, hi):
            _, start, valid = windows[ex]
            if start <= token_idx < start + valid:
                return int(ex), int(token_idx - start)
        return None


def open_store(path: str | Path) -> SaevStore:
    """Open a store (or a stage dir / saev.json pointing at one); checks every shard's size first."""
    return SaevStore(path)


# ------------------------------------------------------------------------ CLI / validate interface

def detect(path: str | Path) -> bool:
    """Does `path` hold a saev store (or point at one)?"""
    try:
        store_dir = resolve(path)
    except FormatError:
        return False
    return (store_dir / METADATA).is_file() and (store_dir / SHARDS).is_file()


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary of a store for `actstore inspect`."""
    store = SaevStore(path, check_sizes=False)
    md = store.metadata
    windows = store.windows
    return {
        "format": "saev", "protocol": md["protocol"], "path": str(store.dir), "hash": store.dir.name,
        "model": md["ckpt"], "family": md["family"], "layers": md["layers"], "n_examples": md["n_examples"],
        "n_tokens": int(windows[:, 2].sum()) if windows is not None else md["n_examples"] * store.T,
        "d_model": md["d_model"], "dtype": md["dtype"], "n_shards": len(store.shards),
        "bytes": dir_bytes(store.dir), "patches_per_ex": md["patches_per_ex"], "cls_token": md["cls_token"],
        "tokens_per_ex": store.T, "examples_per_shard": store.examples_per_shard,
        "patches_per_shard": md["patches_per_shard"], "dataset": md["dataset"],
        "has_labels": (store.dir / LABELS).is_file(), "text_windows": windows is not None,
    }


def verify(path: str | Path) -> list[str]:
    """Full integrity check; a list of problems each naming its file (empty = clean). Never raises."""
    try:
        store = SaevStore(path, check_sizes=False)
    except (FormatError, OSError) as exc:
        return [str(exc)]
    problems = []
    if store.dir.name != metadata_hash(store.metadata):
        problems.append(f"{store.dir / METADATA}: sha256 {metadata_hash(store.metadata)} does not match "
                        f"the directory name {store.dir.name} (config drift)")
    try:
        decode_data(store.metadata["data"])
    except FormatError as exc:
        problems.append(f"{store.dir / METADATA}: {exc}")
    problems += store.size_problems()
    for shard in store.shards:
        path_ = store.dir / shard["name"]
        if "sha256" not in shard:
            problems.append(f"{store.dir / SHARDS}: {shard['name']} has no sha256")
        elif path_.is_file() and path_.stat().st_size == store.shard_bytes(store.shards.index(shard)):
            if problem := file_problem(path_, {"sha256": shard["sha256"]}, SHARDS):
                problems.append(problem)
    problems += _verify_sidecar_files(store)
    sidecar_files = store.sidecar.get("files", {}) if isinstance(store.sidecar, dict) else {}
    listed = {METADATA, SHARDS, SIDECAR, *(s["name"] for s in store.shards), *sidecar_files}
    return problems + unlisted(store.dir, listed, f"{SHARDS} or {SIDECAR}")


def _verify_sidecar_files(store: SaevStore) -> list[str]:
    problems = []
    files = store.sidecar.get("files", {}) if isinstance(store.sidecar, dict) else {}
    for name, info in files.items():
        try:
            problem = file_problem(inside(store.dir, name, str(store.dir / SIDECAR)), info, SIDECAR)
        except FormatError as exc:
            problem = str(exc)
        if problem:
            problems.append(problem)
    if (store.dir / LABELS).is_file() and LABELS not in files:
        problems.append(f"{store.dir / LABELS}: no sha256 recorded in {SIDECAR}")
    if store.metadata["family"] not in FAMILIES.values() and WINDOWS not in files:
        problems.append(f"{store.dir / WINDOWS}: text store without a recorded windows.npy")
    if WINDOWS in files and not problems:
        try:
            w = store.windows
            if w.shape != (store.n_examples, 3) or (w[:, 2] < 1).any() or (w[:, 2] > store.T).any():
                problems.append(f"{store.dir / WINDOWS}: shape {w.shape} or n_valid out of [1, {store.T}]")
        except (ValueError, OSError) as exc:
            problems.append(f"{store.dir / WINDOWS}: unreadable ({exc})")
    return problems


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """(d,) float32 activation of dataset row sample_idx, block layer_idx, token token_idx, or None."""
    store = open_store(path)
    if layer_idx not in store.layers:
        return None
    where = store.find(sample_idx, token_idx)
    if where is None:
        return None
    return store.vector(where[0], layer_idx, where[1])
