"""Writing a saev store: plan its metadata from an extraction, fill its shards, attach labels.

What the format needs from the model and from segmentation masks is handed in by the caller
(workflow/scripts/saev.py, or a test): the model's config.json dict and a PatchLabeler.
"""
from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from tqdm import tqdm

from actstore.errors import ConfigError, FormatError
from actstore.formats.extract import PartFile, PartInfo, PartsCheck, layer_tensor, part_reads
from actstore.formats.saev.layout import (CLS_FAMILIES, DTYPE, FAMILIES, FLAVORS, LABELS, METADATA, PROTOCOL,
                                          SEALED, SHARDS, SIDECAR, UPSTREAM_FAMILIES, WINDOWS, check_metadata,
                                          dropped_tokens, encode_data, examples_per_shard, shard_name, shard_sizes,
                                          store_name, text_windows, to_upstream, window_problem)
from actstore.formats.saev.read import open_store
from actstore.integrity import SEAL_KEY, TREE_HASH_KEY, file_record
from actstore.io_utils import (BEHIND, TreeHashFile, WriteBehind, atomic_path, canonical_sha256, errors_naming,
                               scratch_beside, write_json_atomic)
from actstore.jobs import JOB_RECORD, JobFiles, job_items, read_job_records, write_job_record
from actstore.model_config import config_patches, register_tokens

log = logging.getLogger(__name__)

# A shard writer's slab buffer (it holds BEHIND + 1): examples are filled into one while the ones
# before are written and hashed, so memory does not grow with the data (no dirty memory-mapped pages,
# which a Slurm job's cgroup is charged for).
CHUNK_BYTES = 32 << 20
Fill = Callable[[int, np.ndarray], None]  # fill(first_example, out (n, L, T, D))


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
    kept_tokens: np.ndarray | None = None  # images: the extracted tokens an example holds (None: all)
    flavor: str = "spec"
    pixel_agg: str = "majority"  # upstream's pixel_agg field (saev's default when there are no labels)
    # The extraction's digest (each part's record, its files' sha256 among them): every job record carries
    # it, so a finisher never takes shards of another extraction of the same shape and metadata (another
    # storage dtype; a library caller's extract_hash None). None: a raw plan, filled from anything.
    source: str | None = None

    @property
    def tokens_per_ex(self) -> int:
        return self.metadata["patches_per_ex"] + int(self.metadata["cls_token"])

    @property
    def file_metadata(self) -> dict[str, Any]:
        """metadata.json as this flavor writes it."""
        return to_upstream(self.metadata, self.pixel_agg) if self.flavor == "upstream" else self.metadata

    @property
    def store_name(self) -> str:
        return store_name(self.file_metadata)

    @property
    def example_shape(self) -> tuple[int, int, int]:
        """(L, T, D) of one example."""
        return len(self.metadata["layers"]), self.tokens_per_ex, self.metadata["d_model"]

    @property
    def example_bytes(self) -> int:
        return int(np.prod(self.example_shape)) * DTYPE.itemsize

    @property
    def per_shard(self) -> int:
        return examples_per_shard(self.metadata["patches_per_shard"], self.tokens_per_ex,
                                  len(self.metadata["layers"]))

    @property
    def shard_sizes(self) -> list[int]:
        """Examples in each shard."""
        return shard_sizes(self.metadata["n_examples"], self.per_shard)

    def shard_bytes(self, n_examples: int) -> int:
        """A shard file's size: its examples, or (upstream) always a full shard, since saev maps every
        shard at full size (the tail a hole, no blocks)."""
        return (self.per_shard if self.flavor == "upstream" else n_examples) * self.example_bytes


def plan_store(extraction, section: dict[str, Any], extract_hash: str | None = None, *,
               model_config: dict[str, Any] | None, labeler: PatchLabeler | None = None,
               progress: bool = False, labels: bool = True) -> Plan:
    """Spec metadata for an extraction and the `saev` config section. model_config: the model's
    config.json (image stores need it). Patch labels are computed here, so a bad mask fails before
    anything is written; labels=False leaves them out (a shard job: the same metadata, no masks read)."""
    info = extraction.info
    layers = _stored_layers(info, section)
    d_model = int(extraction.parts[0].tensor(layer_tensor(layers[0])).shape[1])
    num_tokens = np.concatenate([np.diff(part.offsets) for part in extraction.parts]).astype(np.int64)
    model_type = info.model.model_type or "unknown"
    sidecar: dict[str, Any] = {"source_extraction": extract_hash, "model_type": model_type}
    description = _description(info, extract_hash, len(num_tokens))
    if extract_hash is None:
        # Nothing else in `data` names the extraction's bytes: two extractions differing in storage dtype
        # or weights shared a HASH, the second store replacing the first. The workflow passes its stage hash
        # (its stores keep their bytes and HASH); after the other keys, as their order is part of HASH.
        description["extraction_digest"] = _copied_digest(extraction, layers)
    kept_tokens = None
    if info.modality == "image":
        family = FAMILIES.get(model_type, model_type)
        cls_token = family in CLS_FAMILIES
        patches, registers = _image_patches(extraction, num_tokens, cls_token, model_config)
        windows, sidecar["registers"] = None, registers
        if registers and _flavor(section, info.modality, family) == "upstream":
            # saev's own dinov2/dinov3 writers store CLS and the patches, never the registers: its
            # readers and label grids take content token i as patch i.
            dropped = dropped_tokens(cls_token, registers)
            kept_tokens = np.delete(np.arange(patches + int(cls_token)), dropped)
            patches, registers, sidecar["dropped_tokens"] = patches - registers, 0, dropped
        labels = _plan_labels(extraction, section, description, labeler,
                              (model_config, patches, registers), progress, labels)
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
    pixel_agg = (section.get("patch_labels") or {}).get("pixel_agg", "majority")
    plan = Plan(metadata, windows, sidecar, labels, kept_tokens, _flavor(section, info.modality, family), pixel_agg,
                canonical_sha256([part.meta for part in extraction.parts]))
    _check_shape(plan)
    return plan


def _flavor(section: dict[str, Any], modality: str, family: str) -> str:
    """saev.flavor (absent = spec); upstream only where saev's Metadata accepts the family."""
    flavor = section.get("flavor") or "spec"
    if flavor not in FLAVORS:
        raise ConfigError(f"saev.flavor = {flavor!r}; use one of {FLAVORS}")
    if flavor == "upstream" and (modality != "image" or family not in UPSTREAM_FAMILIES):
        raise ConfigError(f"saev.flavor: upstream needs an image model of a family saev knows {UPSTREAM_FAMILIES}; "
                          f"this is a {modality} model of family {family!r} (use flavor: spec)")
    return flavor


def check_options(config: dict[str, Any]) -> None:
    """Parse-time check of saev.layers against extract.layers (ConfigError names the key): the saev
    jobs found a layer not extracted only once the extraction had run."""
    extracted = config["extract"]["layers"]
    missing = [layer for layer in config["saev"].get("layers") or [] if layer not in extracted]
    if missing:
        raise ConfigError(f"saev.layers: {missing} not extracted; extract.layers = {extracted}")


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


def _copied_digest(extraction, layers: list[int]) -> str:
    """sha256 of part.json's records (size, dtype, shape, tree hash) of the files the store copies from
    each part: offsets.npy and the stored layers' tensors. Not part.json whole (Plan.source): its
    created_at and timings differ between two runs of one config, whose stores must share a HASH."""
    names = [layer_tensor(layer) for layer in layers]
    return canonical_sha256([{file: part.meta["files"][file] for _, file in part_reads(part, names, samples=False)}
                             for part in extraction.parts])


def _image_patches(extraction, num_tokens: np.ndarray, cls_token: bool,
                   model_config: dict[str, Any] | None) -> tuple[int, int]:
    """(patches_per_ex, registers) of an image store: every image must have the same token count."""
    if len(set(num_tokens.tolist())) > 1:
        raise FormatError(f"{extraction.dir}: images have differing token counts {sorted(set(num_tokens))}")
    if model_config is None:
        raise ValueError("an image store needs the model's config.json (model_config)")
    tokens = int(num_tokens[0]) if len(num_tokens) else 0
    registers = register_tokens(model_config)
    _check_patches(model_config, tokens - int(cls_token) - registers)
    return tokens - int(cls_token), registers


def _plan_labels(extraction, section: dict[str, Any], description: dict[str, Any], labeler: PatchLabeler | None,
                 geometry: tuple[dict[str, Any], int, int], progress: bool, compute: bool) -> np.ndarray | None:
    """labels.bin rows from saev.patch_labels (None when unset, or when not `compute`); the settings
    join `data` either way, so HASH changes with them. geometry: the model's config.json dict,
    patches_per_ex, registers."""
    settings = section.get("patch_labels")
    if not settings:
        return None
    if labeler is None:
        raise ValueError("saev.patch_labels is set but no PatchLabeler was given")
    settings = {**settings, "masks": str(Path(settings["masks"]).resolve())}
    if not Path(settings["masks"]).is_dir():
        raise ConfigError(f"saev.patch_labels.masks: {settings['masks']} is not a directory")
    model_config, patches, registers = geometry
    patch_size = _patch_size(model_config, extraction.info.model.path)  # checked in the shard jobs too
    description["patch_labels"] = {**settings, "register_label": labeler.register_label}
    if not compute:
        return None
    rels = [row["text"] for _, _, row in extraction.iter_samples()]
    return labeler.compute(extraction.info.dataset.path, rels, extraction.info.model.path, patch_size, settings,
                           patches, registers, progress=progress)


def _patch_size(model_config: dict[str, Any], model_path: str | Path) -> int:
    """The image tower's patch_size from config.json, which only labels.bin needs (a tile of mask
    pixels per patch): a CLIP saved by transformers 4 leaves its vision_config's default out."""
    tower = model_config.get("vision_config") or model_config
    patch_size = tower.get("patch_size")
    if type(patch_size) is not int or patch_size < 1:
        where = "vision_config.patch_size" if tower is not model_config else "patch_size"
        raise ConfigError(f"saev.patch_labels: {Path(model_path) / 'config.json'} {where} = {patch_size!r}; "
                          "labels.bin needs the model's patch size in pixels (add it to config.json)")
    return patch_size


def _check_patches(model_config: dict[str, Any], measured: int) -> None:
    """Patches implied by config.json (image_size/patch_size)^2 vs what the model emitted."""
    expected = config_patches(model_config)
    if expected and expected != measured:
        # dinov2 interpolates position embeddings: its processor may crop smaller than image_size.
        log.warning("config.json implies %d patches per image, the model emitted %d; storing %d",
                    expected, measured, measured)


def _fill_images(extraction, layers: list[str], kept_tokens: np.ndarray | None, start: int, out: np.ndarray) -> None:
    """out (n, L, T, D) <- examples start..start+n (one example = one image: its tokens `kept_tokens`,
    or all of them)."""
    n = len(out)
    done = 0
    while done < n:
        part, local = extraction.locate(start + done)
        take = min(n - done, part.info.n_samples - local)
        rows = slice(int(part.offsets[local]), int(part.offsets[local + take]))
        for li, name in enumerate(layers):
            images = part.tensor(name)[rows].reshape(take, -1, out.shape[3])
            out[done:done + take, li] = images if kept_tokens is None else images[:, kept_tokens]
        done += take


def _fill_windows(extraction, layers: list[str], windows: np.ndarray, out: np.ndarray) -> None:
    """out (n, L, T, D) <- the token windows `windows` (n, 3), zero padding past n_valid. The windows
    are consecutive rows of text_windows, so a part's share is one run of them reading one run of its
    token rows: each layer's rows are copied straight into their places, no gathered temporaries."""
    valid = np.arange(out.shape[2])[None, :] < windows[:, 2:3]
    for li in range(len(layers)):
        out[:, li][~valid] = 0
    samples = windows[:, 0]
    for part in extraction.parts:
        lo = part.sample_start
        a, b = np.searchsorted(samples, [lo, lo + part.info.n_samples])
        if a == b:
            continue
        first = int(part.offsets[samples[a] - lo] + windows[a, 1])
        count = int(windows[a:b, 2].sum())
        if first + count != int(part.offsets[samples[b - 1] - lo] + windows[b - 1, 1] + windows[b - 1, 2]):
            raise ValueError(f"{part.dir}: windows {a}..{b} of this slab are not consecutive")
        for li, name in enumerate(layers):
            out[a:b, li][valid[a:b]] = part.tensor(name)[first:first + count]


@dataclass(frozen=True)
class ExtractionFill:
    """A Fill copying a plan's examples from an extraction, which knows the part files it reads."""

    extraction: Any
    plan: Plan

    @property
    def names(self) -> list[str]:
        return [layer_tensor(layer) for layer in self.plan.metadata["layers"]]

    def __call__(self, start: int, out: np.ndarray) -> None:
        windows = self.plan.windows
        if windows is None:
            _fill_images(self.extraction, self.names, self.plan.kept_tokens, start, out)
        else:
            _fill_windows(self.extraction, self.names, windows[start:start + len(out)], out)

    def reads(self, examples: range) -> list[PartFile]:
        """The files, to be checked whole (PartsCheck), of every part whose first example is one of
        `examples`: a part is checked by the one job that fills its first example, not by each job
        filling some of it (twice the reads where jobs and parts are as many but not aligned). The job
        after reads the rest of it unchecked by itself, but no store is finished unless every job is."""
        windows = self.plan.windows
        reads = []
        for part in self.extraction.parts:
            lo, n = part.sample_start, part.info.n_samples
            first = lo if windows is None else int(np.searchsorted(windows[:, 0], lo))
            holds = n > 0 and (windows is None or (first < len(windows) and windows[first, 0] < lo + n))
            if holds and first in examples:
                reads += part_reads(part, self.names, samples=False)
        return reads


def extraction_fill(extraction, plan: Plan) -> ExtractionFill:
    """fill(first_example, out) copying the plan's examples from the extraction."""
    return ExtractionFill(extraction, plan)


def write_store(extraction, section: dict[str, Any], root: str | Path, extract_hash: str | None = None, *,
                model_config: dict[str, Any] | None, labeler: PatchLabeler | None = None,
                progress: bool = True) -> Path:
    """Write the store for an extraction under root/<HASH>/ (built in a temp dir, renamed last).
    model_config and labeler: as plan_store takes them."""
    plan = plan_store(extraction, section, extract_hash, model_config=model_config, labeler=labeler,
                      progress=progress)
    return write_raw_store(plan, extraction_fill(extraction, plan), root, progress=progress)


def write_raw_store(plan: Plan, fill: Fill, root: str | Path, progress: bool = True) -> Path:
    """Write metadata, shards (filled slab by slab by `fill(first_example, out)`) and sidecars under
    root/<sha256> (spec) or root/shards/<8 hex> (upstream); every file's size and sha256 go to actstore.json.
    One job writing every shard, then finishing the store: what the workflow's shard jobs and its
    finishing job do apart."""
    # Named as atomic_path names the temps of root/<store>-shards, so that the shards a killed run left
    # (as large as the store) are swept here by the next run instead of piling up beside the stores;
    # made beside that name (root/shards/ for upstream), where the sweep looks.
    with scratch_beside(Path(root) / f"{plan.store_name}-shards") as job_dir:
        write_shards(plan, fill, job_dir, 1, 0, progress=progress)
        return finish_store(plan, [job_dir], root)


def write_shards(plan: Plan, fill: Fill, out_dir: str | Path, jobs: int, job: int, progress: bool = False) -> Path:
    """Write job `job` of `jobs`' shards of the plan's store (jobs.job_items) into out_dir, then its
    job record (jobs.write_job_record, with the store's name and the plan's source) last; return the
    record's path. Holds BEHIND + 1 slab buffers of CHUNK_BYTES (at least one example each) whatever the
    data's size."""
    _check_shape(plan)
    out_dir = Path(out_dir)
    shards = job_items(len(plan.shard_sizes), jobs, job)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A rerun into a job dir: its old record goes first, or a rerun killed while rewriting a shard
    # would leave that record vouching for the half-written file (of the recorded size) to finish_store.
    (out_dir / JOB_RECORD).unlink(missing_ok=True)
    sizes = plan.shard_sizes
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    slab = max(1, min(CHUNK_BYTES // plan.example_bytes, max(sizes, default=1)))
    buffers = [np.empty((slab, *plan.example_shape), DTYPE) for _ in range(BEHIND + 1)]
    files = {}
    # The part files an extraction's fill reads, checked against part.json as it reads them, before the
    # job's record is written (a raw fill reads no part)
    examples = range(int(starts[shards.start]), int(starts[shards.stop]))
    reads = fill.reads(examples) if isinstance(fill, ExtractionFill) else []
    with PartsCheck(reads), ThreadPoolExecutor(len(os.sched_getaffinity(0))) as hashers:
        for idx in tqdm(shards, desc="saev shards", unit="shard", disable=not progress):
            path = out_dir / shard_name(idx)
            files[path.name] = _write_shard(path, fill, int(starts[idx]), sizes[idx], buffers,
                                            plan.shard_bytes(sizes[idx]), hashers)
    return write_job_record(out_dir, jobs, job, files.items(), store=plan.store_name, source=plan.source)


def _check_shape(plan: Plan) -> None:
    """ConfigError naming the metadata fields of a plan (write_raw_store takes any) whose examples hold
    no vector, whose shards hold no example (the shard arithmetic divided by zero: a ZeroDivisionError
    naming nothing) or whose example count is negative (a shard planned for a store no reader opens);
    FormatError naming the field of metadata (layout.check_metadata), the labels (labels.bin's uint8
    (n_examples, patches_per_ex)) or the windows (layout.window_problem) the readers refuse."""
    md = plan.metadata
    layers, tokens, d_model = plan.example_shape
    if min(layers, tokens, d_model) < 1 or md["n_examples"] < 0:
        raise ConfigError(f"saev: layers {md['layers']}, {tokens} tokens (patches_per_ex + cls_token), d_model "
                          f"{d_model}, n_examples {md['n_examples']}: an example needs a layer, a token and a "
                          "dimension, n_examples must be >= 0")
    if plan.per_shard < 1:
        raise ConfigError(f"saev.patches_per_shard={md['patches_per_shard']} is smaller than one example "
                          f"({tokens} tokens x {layers} layers)")
    # The readers' own check (a raw plan's metadata is the caller's): a layer listed twice, a bool for
    # an int or a dtype other than float32 wrote every shard of a store that no reader opens.
    check_metadata(plan.file_metadata, Path("saev.Plan.metadata"))
    # Spec §2.1: the absolute path of the dataset root (runs link back to the images through it). Only
    # the writer refuses a relative one: stores saev wrote with one still open.
    if not Path(md["dataset"]).is_absolute():
        raise FormatError(f"saev.Plan.metadata: field 'dataset' = {md['dataset']!r} is not an absolute path; "
                          "protocol 2.1 stores the absolute path of the dataset root")
    # So is its labels.bin: finish_store refused it after every shard was written, naming the store's temp dir.
    if plan.labels is not None:
        _check_labels(np.asarray(plan.labels), (md["n_examples"], md["patches_per_ex"]), "saev.Plan.labels")
    # And its windows.npy, which verify and the readers refused after every shard was written.
    if plan.windows is not None and (problem := window_problem(np.asarray(plan.windows), md["n_examples"], tokens)):
        raise FormatError(f"saev.Plan.windows: {problem}")


def _write_shard(path: Path, fill: Fill, start: int, n: int, buffers: list[np.ndarray], size: int,
                 hashers: Executor) -> dict[str, Any]:
    """Examples start..start+n filled slab by slab into the buffers in turn while the slabs before
    are written and hashed (io_utils.WriteBehind: no second read; each slab's 1 MiB leaves of the
    SHA-256 tree hash by `hashers`, the CPUs this job may use, where one core's plain sha256 bounded a job on a
    fast disk); the file is `size` bytes, the tail past the examples a hole (upstream). Returns its
    {bytes, sha256_tree}."""
    per_example, slab = buffers[0][0].nbytes, len(buffers[0])
    # A new file, never the old one rewritten: a rerun into a job dir finds there the shards that
    # finish_store hard-linked into the finished store, which opening them for writing would change.
    path.unlink(missing_ok=True)
    out = TreeHashFile(path, size, pool=hashers)
    try:
        with errors_naming(path):  # a file-size limit is reported here, naming no file
            os.ftruncate(out.fd, size)
        out.hole(n * per_example, size - n * per_example)
        with WriteBehind(out) as behind:
            for i, lo in enumerate(range(0, n, slab)):
                region = buffers[i % len(buffers)][:min(slab, n - lo)]
                fill(start + lo, region)
                behind.submit(lo * per_example, region)
    except BaseException:
        out.abort()
        path.unlink(missing_ok=True)
        raise
    return {"bytes": size, TREE_HASH_KEY: behind.digest}


def finish_store(plan: Plan, job_dirs: Sequence[str | Path], root: str | Path) -> Path:
    """Assemble the plan's store under root from the shard files its jobs wrote into job_dirs: each
    shard hard-linked in (no copy; the job dirs keep theirs until removed, so a finish that fails can
    run again), its record taken from the job's, not re-hashed; then windows.npy, labels.bin,
    shards.json, actstore.json and metadata.json last, in a temp dir renamed to the store's name."""
    md = plan.metadata
    final = Path(root) / plan.store_name
    shards = _job_shards(plan, [Path(d) for d in job_dirs])
    with atomic_path(final) as tmp:
        tmp.mkdir()
        files = {}
        for name, (job_dir, record) in shards.items():
            os.link(job_dir / name, tmp / name)
            files[name] = record
        if plan.windows is not None:
            with errors_naming(tmp / WINDOWS):
                np.save(tmp / WINDOWS, plan.windows)
            files[WINDOWS] = file_record(tmp / WINDOWS)
        if plan.labels is not None:
            _write_labels_file(tmp / LABELS, plan.labels, (md["n_examples"], md["patches_per_ex"]))
            files[LABELS] = file_record(tmp / LABELS)
        write_json_atomic(tmp / SHARDS, [{"name": shard_name(idx), "n_examples": size}
                                         for idx, size in enumerate(plan.shard_sizes)])
        write_json_atomic(tmp / SIDECAR, {**plan.sidecar, "files": files})
        _write_metadata(tmp / METADATA, plan)  # written last: its presence marks a finished store
    log.info("saev store: %d examples in %d shards from %d jobs -> %s", md["n_examples"], len(shards),
             len(job_dirs), final)
    return final


def _job_shards(plan: Plan, job_dirs: list[Path]) -> JobFiles:
    """Every shard of the plan, in order, from its jobs' records (jobs.read_job_records: each file there
    with its recorded size). FormatError naming the record or file when a job wrote another store's
    shards, or a shard is missing, recorded at the wrong size or not one of the plan's."""
    found = read_job_records(job_dirs)
    for job_dir, extra in zip(job_dirs, found.extras):
        if extra.get("store") != plan.store_name:
            raise FormatError(f"{job_dir / JOB_RECORD}: shards of store {extra.get('store')!r}, not "
                              f"{plan.store_name!r} (a job of another config?)")
        if extra.get("source") != plan.source:
            raise FormatError(f"{job_dir / JOB_RECORD}: shards of extraction {str(extra.get('source'))[:12]}, "
                              f"not {str(plan.source)[:12]}, this finisher's (a job of another extraction?)")
    files = dict(found.files)
    shards = {}
    for idx, n in enumerate(plan.shard_sizes):
        name, size = shard_name(idx), plan.shard_bytes(n)
        if name not in files:
            raise FormatError(f"{name}: no job record lists it (records in {', '.join(map(str, job_dirs))})")
        job_dir, record = shards[name] = files.pop(name)
        if record["bytes"] != size:
            raise FormatError(f"{job_dir / name}: {record['bytes']} bytes, expected {size} "
                              f"(recorded in {job_dir / JOB_RECORD})")
    if files:
        name, (job_dir, _) = next(iter(files.items()))
        raise FormatError(f"{job_dir / name}: not a shard of store {plan.store_name} "
                          f"(listed in {job_dir / JOB_RECORD})")
    return shards


def _write_metadata(path: Path, plan: Plan) -> None:
    """metadata.json: keys sorted (spec, as every actstore JSON), or in saev's field order (upstream,
    as saev writes it)."""
    with atomic_path(path) as tmp, errors_naming(path):
        tmp.write_text(json.dumps(plan.file_metadata, indent=2, sort_keys=plan.flavor == "spec") + "\n")


def write_pointer(pointer: str | Path, store: str | Path) -> None:
    """The rule's declared output: {"store": <store dir relative to the pointer>, "hash": HASH,
    "protocol", "sealed": {name: {bytes, sha256}} of the store's metadata files}. The store sits
    beside the stage directory, outside its stage config's seal: the stage config seals the pointer,
    the pointer the store's metadata (actstore.json records the data files)."""
    pointer, store = Path(pointer), Path(store)
    write_json_atomic(pointer, {"store": os.path.relpath(store, pointer.parent), "hash": store.name,
                                "protocol": PROTOCOL, SEAL_KEY: {name: file_record(store / name)
                                                                 for name in SEALED if (store / name).is_file()}})


def _write_labels_file(path: Path, labels: np.ndarray, shape: tuple[int, int]) -> None:
    """labels.bin: raw C-order uint8 (n_examples, patches_per_ex), written atomically."""
    labels = np.ascontiguousarray(labels)
    _check_labels(labels, shape, str(path))
    with atomic_path(path) as tmp, errors_naming(path):
        tmp.write_bytes(labels.tobytes())


def _check_labels(labels: np.ndarray, shape: tuple[int, int], where: str) -> None:
    if labels.shape != shape or labels.dtype != np.uint8:
        raise FormatError(f"{where}: need uint8 {shape}, got {labels.dtype} {labels.shape}")


def write_labels(path: str | Path, labels: np.ndarray) -> None:
    """Attach per-patch labels (n_examples, patches_per_ex) as labels.bin (uint8) and record its sha256
    in actstore.json. A store a workflow stage points at is sealed by its pointer: labels written
    afterwards are a change `actstore verify <stage dir>` names (the saev stage writes its own labels).
    A store saev wrote has no actstore.json and keeps none: its labels.bin unrecorded, as saev leaves
    it (verify checks its size); a new actstore.json would make verify read the store as ours, whose
    every shard is recorded and whose `data` is a plain dict, and name each of them."""
    store = open_store(path)
    _write_labels_file(store.dir / LABELS, labels, (store.n_examples, store.patches_per_ex))
    if not store.sidecar:
        return
    sidecar = store.sidecar
    sidecar.setdefault("files", {})[LABELS] = file_record(store.dir / LABELS)
    write_json_atomic(store.dir / SIDECAR, sidecar)

