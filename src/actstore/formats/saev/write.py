"""Writing a saev store: plan its metadata from an extraction, fill its shards, attach labels.

What the format needs from the model and from segmentation masks is handed in by the caller
(workflow/scripts/saev.py, or a test): the model's config.json dict and a PatchLabeler.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from actstore.errors import ConfigError, FormatError
from actstore.formats.extract import PartInfo, layer_tensor
from actstore.formats.saev.layout import (CLS_FAMILIES, DTYPE, FAMILIES, FLAVORS, LABELS, METADATA, PROTOCOL,
                                          SHARDS, SIDECAR, UPSTREAM_FAMILIES, WINDOWS, encode_data,
                                          examples_per_shard, shard_name, shard_sizes, store_name, text_windows,
                                          to_upstream)
from actstore.formats.saev.read import open_store
from actstore.integrity import file_record
from actstore.io_utils import atomic_path, write_json_atomic

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # examples are copied into a shard in ~64 MiB slabs


@dataclass(frozen=True)
class PatchLabeler:
    """How labels.bin is computed from segmentation masks; the caller supplies it (in actstore:
    actstore.patch_labels.image_patch_labels and its REGISTER_LABEL).

    compute(dataset_root, image_rels, model_path, patch_size, settings, patches_per_ex, registers,
    progress=...) returns the (n_images, patches_per_ex) uint8 rows, register columns = register_label.
    """

    compute: Callable[..., np.ndarray]
    register_label: int


@dataclass
class Plan:
    """What to write: spec metadata plus how to fill examples from the extraction.
    flavor upstream: metadata.json in saev's field names, the last shard padded (sparse) to full size."""

    metadata: dict[str, Any]
    windows: np.ndarray | None  # text: (n_examples, 3) sample_idx, token_start, n_valid
    sidecar: dict[str, Any]
    labels: np.ndarray | None = None  # images: (n_examples, patches_per_ex) uint8 -> labels.bin
    flavor: str = "spec"
    pixel_agg: str = "majority"  # upstream's pixel_agg field (saev's default when there are no labels)

    @property
    def tokens_per_ex(self) -> int:
        return self.metadata["patches_per_ex"] + int(self.metadata["cls_token"])

    @property
    def file_metadata(self) -> dict[str, Any]:
        """metadata.json as this flavor writes it."""
        return to_upstream(self.metadata, self.pixel_agg) if self.flavor == "upstream" else self.metadata


def plan_store(extraction, section: dict[str, Any], extract_hash: str | None = None, *,
               model_config: dict[str, Any] | None, labeler: PatchLabeler | None = None,
               progress: bool = False) -> Plan:
    """Spec metadata for an extraction and the `saev` config section. model_config: the model's
    config.json (image stores need it). Patch labels are computed here, so a bad mask fails before
    anything is written."""
    info = extraction.info
    layers = _stored_layers(info, section)
    d_model = int(extraction.parts[0].tensor(layer_tensor(layers[0])).shape[1])
    num_tokens = np.array([row["num_tokens"] for _, _, row in extraction.iter_samples()], dtype=np.int64)
    model_type = info.model.model_type or "unknown"
    sidecar: dict[str, Any] = {"source_extraction": extract_hash, "model_type": model_type}
    description = _description(info, extract_hash, len(num_tokens))
    if info.modality == "image":
        family = FAMILIES.get(model_type, model_type)
        cls_token = family in CLS_FAMILIES
        patches, registers = _image_patches(extraction, num_tokens, cls_token, model_config)
        windows, sidecar["registers"] = None, registers
        labels = _plan_labels(extraction, section, description, labeler,
                              (_patch_size(model_config), patches, registers), progress)
    else:
        if section.get("patch_labels"):
            raise ConfigError("saev.patch_labels: per-patch labels need an image dataset; "
                              f"{info.dataset.path} is text")
        family, cls_token, labels = model_type, False, None
        patches = int(section["tokens_per_window"])
        windows = text_windows(num_tokens, patches)
        description["tokens_per_window"] = patches
        description["max_seq_length"] = info.max_seq_length
    n_examples = int(len(num_tokens) if windows is None else len(windows))
    metadata = {
        "family": family, "ckpt": info.model.name, "layers": layers, "patches_per_ex": patches,
        "cls_token": cls_token, "d_model": d_model, "n_examples": n_examples,
        "patches_per_shard": int(section["patches_per_shard"]), "data": encode_data(description),
        "dataset": str(Path(info.dataset.path).resolve()), "dtype": "float32", "protocol": PROTOCOL,
    }
    if examples_per_shard(metadata["patches_per_shard"], patches + int(cls_token), len(layers)) < 1:
        raise ConfigError(f"saev.patches_per_shard={metadata['patches_per_shard']} is smaller than one example "
                          f"({patches + int(cls_token)} tokens x {len(layers)} layers)")
    pixel_agg = (section.get("patch_labels") or {}).get("pixel_agg", "majority")
    return Plan(metadata, windows, sidecar, labels, _flavor(section, info.modality, family), pixel_agg)


def _flavor(section: dict[str, Any], modality: str, family: str) -> str:
    """saev.flavor (absent = spec); upstream only where saev's Metadata accepts the family."""
    flavor = section.get("flavor") or "spec"
    if flavor not in FLAVORS:
        raise ConfigError(f"saev.flavor = {flavor!r}; use one of {FLAVORS}")
    if flavor == "upstream" and (modality != "image" or family not in UPSTREAM_FAMILIES):
        raise ConfigError(f"saev.flavor: upstream needs an image model of a family saev knows {UPSTREAM_FAMILIES}; "
                          f"this is a {modality} model of family {family!r} (use flavor: spec)")
    return flavor


def _stored_layers(info: PartInfo, section: dict[str, Any]) -> list[int]:
    """saev.layers (default: every extracted layer), each of them extracted."""
    layers = list(section.get("layers") or info.layers)
    missing = [layer for layer in layers if layer_tensor(layer) not in info.tensors]
    if missing:
        raise ConfigError(f"saev.layers: {missing} not extracted; extract.layers = {info.layers}")
    return layers


def _description(info: PartInfo, extract_hash: str | None, n_samples: int) -> dict[str, Any]:
    """The plain dict pickled into `data` (its key order is part of HASH: keep it)."""
    return {"source": "actstore", "extract_hash": extract_hash, "modality": info.modality,
            "dataset": {"path": info.dataset.path, "name": info.dataset.name, "split": info.dataset.split},
            "n_samples": int(n_samples), "model_revision": info.model.revision,
            "torch_dtype": info.model.torch_dtype}


def _image_patches(extraction, num_tokens: np.ndarray, cls_token: bool,
                   model_config: dict[str, Any] | None) -> tuple[int, int]:
    """(patches_per_ex, registers) of an image store: every image must have the same token count."""
    if len(set(num_tokens.tolist())) > 1:
        raise FormatError(f"{extraction.dir}: images have differing token counts {sorted(set(num_tokens))}")
    if model_config is None:
        raise ValueError("an image store needs the model's config.json (model_config)")
    tokens = int(num_tokens[0]) if len(num_tokens) else 0
    registers = int(model_config.get("num_register_tokens") or 0)
    _check_patches(model_config, tokens - int(cls_token) - registers)
    return tokens - int(cls_token), registers


def _plan_labels(extraction, section: dict[str, Any], description: dict[str, Any], labeler: PatchLabeler | None,
                 geometry: tuple[int, int, int], progress: bool) -> np.ndarray | None:
    """labels.bin rows from saev.patch_labels (None when unset); the settings join `data`, so HASH
    changes with them. geometry: patch_size, patches_per_ex, registers."""
    settings = section.get("patch_labels")
    if not settings:
        return None
    if labeler is None:
        raise ValueError("saev.patch_labels is set but no PatchLabeler was given")
    settings = {**settings, "masks": str(Path(settings["masks"]).resolve())}
    if not Path(settings["masks"]).is_dir():
        raise ConfigError(f"saev.patch_labels.masks: {settings['masks']} is not a directory")
    description["patch_labels"] = {**settings, "register_label": labeler.register_label}
    rels = [row["text"] for _, _, row in extraction.iter_samples()]
    patch_size, patches, registers = geometry
    return labeler.compute(extraction.info.dataset.path, rels, extraction.info.model.path, patch_size, settings,
                           patches, registers, progress=progress)


def _patch_size(model_config: dict[str, Any]) -> int:
    return int((model_config.get("vision_config") or model_config)["patch_size"])


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
        take = min(n - done, part.info.n_samples - local)
        rows = slice(int(part.offsets[local]), int(part.offsets[local + take]))
        for li, name in enumerate(layers):
            out[done:done + take, li] = part.tensor(name)[rows].reshape(take, t, -1)
        done += take


def _fill_windows(extraction, layers: list[str], windows: np.ndarray, out: np.ndarray) -> None:
    """out (n, L, T, D) <- the token windows `windows` (n, 3), zero padding past n_valid."""
    t = out.shape[2]
    out[:] = 0
    for part in extraction.parts:
        lo, hi = part.sample_start, part.sample_start + part.info.n_samples
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


def write_store(extraction, section: dict[str, Any], root: str | Path, extract_hash: str | None = None, *,
                model_config: dict[str, Any] | None, labeler: PatchLabeler | None = None,
                progress: bool = True) -> Path:
    """Write the store for an extraction under root/<HASH>/ (built in a temp dir, renamed last).
    model_config and labeler: as plan_store takes them."""
    plan = plan_store(extraction, section, extract_hash, model_config=model_config, labeler=labeler,
                      progress=progress)
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
    """Write metadata, shards (filled slab by slab by `fill(first_example, out)`) and sidecars under
    root/<sha256> (spec) or root/shards/<8 hex> (upstream); every file's size and sha256 go to actstore.json."""
    md = plan.metadata
    final = Path(root) / store_name(plan.file_metadata)
    t, n_layers, d = plan.tokens_per_ex, len(md["layers"]), md["d_model"]
    per_shard = examples_per_shard(md["patches_per_shard"], t, n_layers)
    sizes = shard_sizes(md["n_examples"], per_shard)
    slab = max(1, CHUNK_BYTES // (n_layers * t * d * DTYPE.itemsize))
    with atomic_path(final) as tmp:
        tmp.mkdir()
        shards, files, start = [], {}, 0
        for idx, size in enumerate(tqdm(sizes, desc="saev shards", unit="shard", disable=not progress)):
            path = tmp / shard_name(idx)
            array = np.memmap(path, dtype=DTYPE, mode="w+", shape=(size, n_layers, t, d))
            for lo in range(0, size, slab):
                fill(start + lo, array[lo:lo + slab])
            array.flush()
            del array
            if plan.flavor == "upstream":  # saev maps every shard at full size: pad with a hole, no blocks
                os.truncate(path, per_shard * n_layers * t * d * DTYPE.itemsize)
            shards.append({"name": shard_name(idx), "n_examples": size})
            files[shard_name(idx)] = file_record(path)
            start += size
        if plan.windows is not None:
            np.save(tmp / WINDOWS, plan.windows)
            files[WINDOWS] = file_record(tmp / WINDOWS)
        if plan.labels is not None:
            _write_labels_file(tmp / LABELS, plan.labels, (md["n_examples"], md["patches_per_ex"]))
            files[LABELS] = file_record(tmp / LABELS)
        write_json_atomic(tmp / SHARDS, shards)
        write_json_atomic(tmp / SIDECAR, {**plan.sidecar, "files": files})
        _write_metadata(tmp / METADATA, plan)  # written last: its presence marks a finished store
    log.info("saev store: %d examples in %d shards -> %s", md["n_examples"], len(sizes), final)
    return final


def _write_metadata(path: Path, plan: Plan) -> None:
    """metadata.json: keys sorted (spec, as every actstore JSON), or in saev's field order (upstream,
    as saev writes it)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(plan.file_metadata, indent=2, sort_keys=plan.flavor == "spec") + "\n")


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

