"""Per-stage hashes: every stage writes under {dump_to}/{stage}/{hash}/.

hash = sha256 of the canonical JSON of exactly the resolved config sections the stage reads plus
its upstream stages' hashes, so identical configs reuse outputs and divergent ones never collide.
"""
from __future__ import annotations

import functools
import glob
from pathlib import Path
from typing import Any

from actstore.config import config_schema, enabled_stages
from actstore.formats import FORMAT_STAGES
from actstore.formats.saev.layout import POINTER as SAEV_POINTER
from actstore.errors import ActstoreError
from actstore.integrity import (SEAL_KEY, STAGE_CONFIG_FILE, is_sha256, read_json, resolved,
                                stage_config_problems)
from actstore.io_utils import canonical_sha256, sha256_file, write_json_atomic
from actstore.model_config import run_dtype, storage_dtype
from actstore.parse_memo import remembered

STAGES = ("extract", *FORMAT_STAGES, "sae", "lut", "validate")
# Config sections each stage reads: its own, and for extraction also the model and dataset.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    stage: ("model", "dataset", "extract") if stage == "extract" else (stage,) for stage in STAGES}
# dataset keys of earlier releases: a config with only these, on a JSONL file or an image folder,
# hashes its dataset by path as those releases did (see dataset_identity).
LEGACY_DATASET_KEYS = {"path", "name", "split", "limit"}
# Keys that change how a stage runs, never what it writes (tested byte for byte): not hashed.
EXECUTION_KEYS: dict[str, tuple[str, ...]] = {"model": ("trust_remote_code",),
                                              "extract": ("num_workers", "buffers", "writer_threads"),
                                              "saev": ("jobs",), "lmprobe": ("jobs",),
                                              "zarr": ("jobs", "merge_jobs", "threads"), "pickle": ("threads", "jobs"),
                                              "validate": ("jobs",)}
# Keys with no schema default (so configs made before them keep their hash) given as what leaving
# them out means: hashed as left out, or writing out the documented value would rewrite the stage.
ABSENT_MEANS: dict[str, dict[str, Any]] = {"saev": {"flavor": "spec"}, "lut": {"runtime": "lookup"}}


def upstream_stages(config: dict[str, Any], stage: str) -> list[str]:
    """Stages whose outputs `stage` reads (only enabled ones for the validation stage)."""
    if stage == "extract":
        return []
    if stage in FORMAT_STAGES or stage == "sae":
        return ["extract"]
    if stage == "lut":
        return ["extract", "sae"]
    if stage == "validate":
        return [s for s in enabled_stages(config) if s != "validate"]
    raise KeyError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")


def stage_payload(config: dict[str, Any], stage: str) -> dict[str, Any]:
    """The exact resolved config a stage depends on, with its upstream hashes."""
    return stage_payloads(config)[stage]


def stage_payloads(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every stage's payload, upstream stages first so that each hash is computed once: the data
    files are listed (and stat'ed or hashed) once, not once per stage that depends on them."""
    payloads: dict[str, dict[str, Any]] = {}
    hashes: dict[str, str] = {}
    for stage in STAGES:  # in dependency order
        payloads[stage] = {
            "stage": stage,
            "config": {section: hashed_section(config, section) for section in STAGE_SECTIONS[stage]},
            "upstream": {up: hashes[up] for up in upstream_stages(config, stage)},
        }
        hashes[stage] = canonical_sha256(payloads[stage])
    return payloads


def stage_hashes(config: dict[str, Any]) -> dict[str, str]:
    """Every stage's hash (see stage_payloads)."""
    return {stage: canonical_sha256(payload) for stage, payload in stage_payloads(config).items()}


def hashed_section(config: dict[str, Any], section: str) -> Any:
    """A config section as hashed: execution-only keys dropped, and keys given as what their absence
    means (ABSENT_MEANS); extract.storage_dtype resolved, and dropped when float32 (all earlier
    releases stored), so extractions made before it keep their hash
    (extract.token_logprobs likewise when true, extract.image_pipeline when cpu); lmprobe.dtype auto
    resolved to the storage dtype; likewise pickle.compressor when zlib (or when nothing is
    compressed, when pickle.compresslevel hashes as its default); a whole number in a number-typed
    key as an int (see _integral_numbers_as_ints)."""
    values = config[section]
    if not isinstance(values, dict):
        return values
    absent = ABSENT_MEANS.get(section, {}).items()
    values = {k: v for k, v in values.items() if k not in EXECUTION_KEYS.get(section, ()) and (k, v) not in absent}
    values = _integral_numbers_as_ints(section, values)
    if section == "dataset":
        values |= dataset_identity(values)
    if section == "pickle" and (values.get("compressor") == "zlib" or values.get("compression") == "none"):
        values.pop("compressor", None)
    if section == "pickle" and values.get("compression") == "none" and "compresslevel" in values:
        # the store records no level (compresslevel null): every level is the default's store and hash
        values["compresslevel"] = config_schema()["properties"]["pickle"]["properties"]["compresslevel"]["default"]
    if section == "extract" and values.get("token_logprobs") is True:  # every earlier release kept them
        values.pop("token_logprobs")
    if section == "extract" and values.get("image_pipeline") == "cpu":  # every earlier release decoded so
        values.pop("image_pipeline")
    if section == "model" and values.get("torch_dtype") == "auto":  # the same run as the dtype it names
        values["torch_dtype"] = run_dtype(values)
    if section == "extract" and "storage_dtype" in values:
        values.pop("storage_dtype")
        if (stored := storage_dtype(config)) != "float32":
            values["storage_dtype"] = stored
    if section == "lmprobe" and values.get("dtype") == "auto":  # the same dataset as the dtype it names
        values["dtype"] = storage_dtype(config)
    return values


def _integral_numbers_as_ints(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each whole float of a key the schema types number (pickle.shard_size_mb: 100.0,
    sae.lr: 1.0) made an int: YAML reads 100.0 as a float and 100 as an int, the stage runs the same
    on both, and canonical JSON would hash them apart. Towards the int, as the schema's defaults spell
    a whole number (shard_size_mb: 100), so a config leaving the key unset keeps its hash. Integer keys
    hold ints already (config._default_filling_validator refuses 2.0)."""
    numbers = {key for key, schema in config_schema()["properties"][section].get("properties", {}).items()
               if "number" in _schema_types(schema)}
    return {key: int(value) if key in numbers and isinstance(value, float) and value.is_integer() else value
            for key, value in values.items()}


def _schema_types(schema: dict[str, Any]) -> list[str]:
    types = schema.get("type", [])
    return [types] if isinstance(types, str) else types


def dataset_identity(section: dict[str, Any]) -> dict[str, str]:
    """What the hash adds for the data itself (dataset.identity): `stat` = the sizes and mtimes of the
    files read, `content` = their sha256, `path` = nothing (only the config's path). Unset: `path`
    for a config of earlier releases (a JSONL file or image folder, no new key), so its hash is
    unchanged, and `stat` for everything else, so editing the data re-extracts. Once per Snakefile
    parse: a job's parse takes the main process's (parse_memo)."""
    return remembered("dataset identity", section, lambda: _identity(section))


def _identity(section: dict[str, Any]) -> dict[str, str]:
    mode = section.get("identity") or ("path" if _legacy_dataset(section) else "stat")
    if mode == "path":
        return {}
    return {f"data_{mode}": _data_digest(section, mode)}


def _legacy_dataset(section: dict[str, Any]) -> bool:
    """A config earlier releases read: no new key, and a JSONL file (not a compressed one, which
    they did not read) or an image folder without a metadata file (which they did not read), or
    data not at hand: results are found by hash where the data is not."""
    from actstore.datasets.source import COMPRESSED_SUFFIXES

    path = Path(section["path"])
    if set(section) - LEGACY_DATASET_KEYS or glob.has_magic(section["path"]):
        return False
    if path.suffix.lower() in COMPRESSED_SUFFIXES:
        return False
    return not path.exists() or _auto_format(str(path)) == ("image_folder" if path.is_dir() else "jsonl")


@functools.lru_cache(maxsize=16)
def _auto_format(path: str) -> str:
    """The format `auto` reads `path` as, an image folder with a metadata file apart (cached: listing
    a large image folder once per parse is enough)."""
    from actstore.datasets import resolve_source

    source = resolve_source(path)
    return "image_folder with metadata" if source.metadata else source.format


def _data_digest(section: dict[str, Any], mode: str) -> str:
    """sha256 over each data file's name relative to the root and its (size, mtime_ns) or sha256."""
    from actstore.datasets import identity_files, resolve_source

    source = resolve_source(section["path"], section.get("format", "auto"), section.get("split", "train"))
    listing = []
    for path in identity_files(source):
        stat = path.stat()
        facts = [_file_sha256(str(path), stat.st_size, stat.st_mtime_ns)] if mode == "content" else \
            [stat.st_size, stat.st_mtime_ns]
        listing.append([source.name(path), *facts])
    return canonical_sha256(listing)


@functools.lru_cache(maxsize=4096)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, cached while its size and mtime stay (Snakemake hashes a config once per rule)."""
    return sha256_file(path)


def stage_hash(config: dict[str, Any], stage: str) -> str:
    """Full sha256 hex of the stage's canonical payload."""
    return stage_hashes(config)[stage]


def stage_dir(config: dict[str, Any], stage: str) -> Path:
    """{dump_to}/{stage}/{hash}/ for a resolved config."""
    return stage_dirs(config)[stage]


def stage_dirs(config: dict[str, Any]) -> dict[str, Path]:
    """{dump_to}/{stage}/{hash}/ of every stage, the hashes computed together (see stage_payloads)."""
    return {stage: Path(config["dump_to"]) / stage / digest for stage, digest in stage_hashes(config).items()}


def is_stage_dir(directory: Path) -> bool:
    """Whether `directory` is where the workflow puts a stage, {dump_to}/{stage}/{64 hex}/, and so
    must hold its stage config. saev's stores beside its stage directories are named by a hash too:
    a saev stage directory is the one holding the pointer (saev.json), or its stage config when the
    pointer is gone (a store holds none)."""
    directory = directory.absolute()
    return (is_sha256(directory.name) and directory.parent.name in STAGES
            and (directory.parent.name != "saev" or (directory / SAEV_POINTER).exists()
                 or (directory / STAGE_CONFIG_FILE).exists()))


def stage_problems(path: str | Path) -> list[str]:
    """The problems of the stage config of the workflow stage directory holding the store at `path`
    (the path itself, or its parent: lmprobe's dataset/, lut/, a pickle machine); a workflow stage
    directory must hold one (is_stage_dir), of its folder's stage (_foreign_stage). What `actstore verify`
    and the readers' verify=True add to a format's own checks. Either directory given as a link (`latest`
    -> {dump_to}/lmprobe/<hash>, opened as `latest` or `latest/dataset`) is followed: known by the link's
    name, a stage directory's missing or foreign stage config passed a reader's verify=True."""
    path = followed(Path(path))
    problems = []
    for directory in dict.fromkeys([path, followed(path.parent)]):
        try:
            problems += stage_config_problems(directory, required=is_stage_dir(directory)) or \
                _foreign_stage(directory)
        except ActstoreError as exc:  # a stage config too broken to read: the problem names it
            problems.append(str(exc))
    return problems


def _foreign_stage(directory: Path) -> list[str]:
    """A stage directory holding the stage config of another stage than its folder's: copied or moved
    under another stage's folder ({dump_to}/lut/<the sae hash>/, a pickle store at saev/<its hash>/), it
    kept its name, so the check of its hash against its name passed it. Called on a stage config
    integrity.stage_config_problems passed (or a directory holding none)."""
    path = directory / STAGE_CONFIG_FILE
    if not is_stage_dir(directory) or not path.is_file():
        return []
    stage, folder = read_json(path)["stage"], directory.absolute().parent.name
    return [] if stage == folder else [f"{path}: the config of stage {stage!r}, found in {folder}/ (copied or "
                                       f"moved from {stage}/: its store is not a {folder} stage's)"]


def followed(path: Path) -> Path:
    """`path`, or where it leads when it is a link (is_stage_dir knows a stage directory by its name: a
    stage directory given through one, `latest` -> {dump_to}/zarr/<hash>, was taken for no stage's)."""
    return (resolved(path) or path) if path.is_symlink() else path  # a loop of links: the format names it


def write_stage_config(config: dict[str, Any], stage: str, out_dir: str | Path | None = None, *,
                       sealed: dict[str, dict[str, Any]]) -> Path:
    """Record the resolved config a stage directory was made from (atomic, idempotent), with the
    records of the metadata files it seals (integrity.seal), outside the hashed payload."""
    target = Path(out_dir) if out_dir is not None else stage_dir(config, stage)
    path = target / STAGE_CONFIG_FILE
    payload = stage_payload(config, stage)
    write_json_atomic(path, {**payload, "hash": canonical_sha256(payload), SEAL_KEY: sealed})
    return path
