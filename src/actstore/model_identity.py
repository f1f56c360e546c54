"""Which model files an extraction read, and whether its model folder still holds them.

Stage hashes name a model by its path (model.path, model.revision), so weights saved over a folder (a
fine-tune written where its base was) would leave the old extraction standing under the new
weights' name: Snakemake would find it and run nothing. Each part records the size and mtime of
the folder's model files it loaded (part.json model_files; the parts of one extraction must agree),
extract_index adds their sha256 to extract.json, and each Snakefile parse compares a finished
extraction's record with the folder: a file whose size or mtime moved is hashed again, so a copy
that kept the bytes passes and new bytes stop the run, naming the file.
"""
from __future__ import annotations

import json
import logging
import posixpath
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from actstore.errors import ConfigError
from actstore.integrity import is_sha256, read_json, unique_keys, whole_number
from actstore.io_utils import sha256_file

# What loading a model, its tokenizer or image processor can read: weights, configs and tokenizer
# files, the chat template (chat_template.jinja: a chat dataset's tokens), remote code. Other files
# in the folder (a README, images) change nothing extracted.
MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".json", ".model",
                  ".txt", ".tiktoken", ".spm", ".codes", ".jinja", ".py")
# transformers' folder of named chat templates (utils.hub.CHAT_TEMPLATE_DIR): a tokenizer or processor
# loads each of its *.jinja files, and default.jinja there is the template a chat is rendered with.
CHAT_TEMPLATES = "additional_chat_templates"
# Files Hugging Face's Trainer writes beside the weights that no loading reads (an evaluation run
# adding eval_results.json would otherwise stop every later run).
TRAINER_FILES = frozenset({"trainer_state.json", "training_args.bin", "all_results.json", "train_results.json",
                           "eval_results.json", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth"})
# Read by from_pretrained, but only generate() uses it: an edited sampling setting changes no activation.
UNUSED_FILES = TRAINER_FILES | {"generation_config.json"}
# config.json's key naming the weights file from_pretrained reads in place of model.safetensors (transformers
# 4.5x: a file anywhere in the folder, or a shard index whose weight_map names the shards).
WEIGHTS_KEY = "transformers_weights"
MODEL_FILES_KEY = "model_files"  # the key of part.json and extract.json
PART_FIELDS = ("bytes", "mtime_ns")  # a file's entry in part.json; extract.json's adds its sha256
INDEX_FIELDS = (*PART_FIELDS, "sha256")
log = logging.getLogger(__name__)


def model_files(folder: Path) -> dict[str, dict[str, int]]:
    """The folder's top-level model files (MODEL_SUFFIXES; links followed, as loading follows them:
    a Hugging Face cache snapshot links to its blobs) and its CHAT_TEMPLATES, by their path in the
    folder, with their size and mtime."""
    files = {}
    listed = [*folder.iterdir(), *(folder / CHAT_TEMPLATES).glob("*.jinja"), *named_weights(folder)]
    for path in sorted(set(listed)):
        if path.suffix.lower() in MODEL_SUFFIXES and path.name not in UNUSED_FILES and path.is_file():
            stat = path.stat()
            files[path.relative_to(folder).as_posix()] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return files


def named_weights(folder: Path) -> list[Path]:
    """The weights config.json's WEIGHTS_KEY names, wherever in the folder (a subfolder is not listed
    otherwise), and the shards of a shard index it names. A name that is not a relative path inside the
    folder names nothing: from_pretrained refuses it, and no file outside the folder is stat'ed."""
    name = _json_key(folder / "config.json", WEIGHTS_KEY)
    if not inside_folder(name):
        return []
    named = folder / name
    weight_map = _json_key(named, "weight_map") if named.name.endswith(".index.json") else None
    shards = ({shard for shard in weight_map.values() if inside_folder(shard)} if isinstance(weight_map, dict)
              else set())
    return [named, *(folder / shard for shard in sorted(shards))]


def _json_key(path: Path, key: str) -> Any:
    """`key` of the JSON object in model folder file `path`, read as transformers reads it (a Mamba 2
    config.json's Infinity: integrity.read_json's FormatError stopped its extraction before the load);
    None where the file or the key is not there."""
    return read_model_json(path).get(key) if path.is_file() else None


def read_model_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a model folder (config.json, tokenizer_config.json...); ConfigError naming
    it when it is not JSON, gives a key twice (transformers would take the last, and which was meant is
    unknown) or is not an object. NaN and Infinity are taken, unlike integrity.read_json: transformers
    writes them (Mamba 2's and Falcon-H1's config.json: "time_step_limit": [0.0, Infinity])."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a key given twice
        raise ConfigError(f"model.path: {path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise ConfigError(f"model.path: {path} is not valid JSON (nested too deeply to parse)") from None
    if not isinstance(content, dict):
        raise ConfigError(f"model.path: {path} holds a JSON {type(content).__name__}, not an object")
    return content


def inside_folder(name: Any) -> bool:
    """Whether `name` is a relative path that stays inside its folder (no `..` out of it)."""
    return isinstance(name, str) and bool(name) and not posixpath.isabs(name) and not posixpath.normpath(
        name).startswith("..")


def hashed_model_files(folder: Path, loaded: dict[str, dict[str, int]], threads: int = 4) -> dict[str, dict]:
    """`loaded` (what the parts recorded) with each file's sha256, hashed from the folder; ConfigError
    if the folder no longer holds what the parts loaded."""
    if moved := moved_files(loaded, now := model_files(folder)):
        raise ConfigError(f"model.path {folder}: {_change(moved[0], loaded, now, hashed=False)} since the "
                          f"extraction's parts loaded it (their part.json {MODEL_FILES_KEY}), so the folder may no "
                          f"longer hold the weights they ran; extract them again")
    with ThreadPoolExecutor(threads) as pool:
        digests = dict(zip(loaded, pool.map(lambda name: sha256_file(folder / name), loaded)))
    if moved := moved_files(loaded, now := model_files(folder)):
        raise ConfigError(f"model.path {folder}: {_change(moved[0], loaded, now, hashed=False)} while it was hashed; "
                          f"run again")
    return {name: stat | {"sha256": digests[name]} for name, stat in loaded.items()}


def check_model_unchanged(folder: Path, extract_dir: Path) -> None:
    """ConfigError naming the file if the finished extraction in `extract_dir` (its extract.json)
    read other model files than `folder` holds now. Nothing to compare (no finished extraction, one
    of a release that recorded no files, or no folder here) is no error."""
    index = extract_dir / "extract.json"
    recorded = _recorded(index) if index.is_file() else None
    if not recorded or not folder.is_dir():
        return
    # An extraction of a release that counted generation_config.json (UNUSED_FILES) compares without it.
    recorded = {name: entry for name, entry in recorded.items() if Path(name).name not in UNUSED_FILES}
    now = model_files(folder)
    if changed := [name for name in moved_files(recorded, now) if not _same_bytes(folder, name, recorded, now)]:
        raise ConfigError(
            f"model.path {folder}: {_change(changed[0], recorded, now, hashed=True)} since the extraction "
            f"{extract_dir} read it ({index} {MODEL_FILES_KEY}), so its activations are of the old weights. The "
            f"stage hashes name a model by its path: save new weights to a new folder or give model.revision a "
            f"new value, or move {extract_dir} away to extract the new weights under the same name")


def well_formed(files: Any, fields: tuple[str, ...]) -> bool:
    """A model_files record: a map of file names to entries of those fields (PART_FIELDS or
    INDEX_FIELDS), sizes and mtimes whole numbers, a sha256 as hashlib's hexdigest spells it (what
    the parse compares a file's digest with)."""
    return isinstance(files, dict) and all(isinstance(entry, dict) and all(
        is_sha256(entry.get(field)) if field == "sha256"
        else whole_number(entry.get(field)) for field in fields) for entry in files.values())


def _recorded(index: Path) -> dict[str, dict] | None:
    index_data = read_json(index)
    recorded = index_data.get(MODEL_FILES_KEY) if isinstance(index_data, dict) else None
    if recorded is not None and not well_formed(recorded, INDEX_FIELDS):
        raise ConfigError(f"{index}: {MODEL_FILES_KEY} is not a map of files to their bytes, mtime_ns and sha256")
    return recorded


def moved_files(recorded: dict[str, Any], now: dict[str, dict[str, int]]) -> list[str]:
    """The files gone, new, or of another size or mtime in `now` than in `recorded` (sorted names)."""
    return [name for name in sorted(set(recorded) | set(now)) if name not in now or name not in recorded
            or (now[name]["bytes"], now[name]["mtime_ns"]) != (recorded[name]["bytes"], recorded[name]["mtime_ns"])]


def _same_bytes(folder: Path, name: str, recorded: dict[str, Any], now: dict[str, dict[str, int]]) -> bool:
    """A file whose mtime alone moved (a copy, a touch) holds the bytes recorded; said in the log, as
    every parse hashes it again until its mtime is the recorded one."""
    same = (name in now and name in recorded and now[name]["bytes"] == recorded[name]["bytes"]
            and sha256_file(folder / name) == recorded[name]["sha256"])
    if same:
        seconds, nanoseconds = divmod(recorded[name]["mtime_ns"], 10**9)  # exactly: a float has no 19 digits
        log.warning("%s: its mtime moved since the extraction read it, its bytes did not (hashed again at each "
                    "run; `touch -d @%d.%09d %s` gives it back its recorded mtime)", folder / name, seconds,
                    nanoseconds, shlex.quote(str(folder / name)))
    return same


def _change(name: str, recorded: dict[str, Any], now: dict[str, dict[str, int]], hashed: bool) -> str:
    """How a moved file changed; one of the recorded size whose mtime alone moved has other bytes only
    where `hashed` compared them (the parts record no sha256: a touch, a scratch purge's refresh or a
    copy without its times looks the same as new weights of the same size)."""
    if name not in now:
        return f"{name} is gone"
    if name not in recorded:
        return f"{name} is new (if no loading reads it, a file of your own, move it out of the folder)"
    if hashed or now[name]["bytes"] != recorded[name]["bytes"]:
        return f"{name} has other bytes"
    return (f"{name} was written again or touched (its size is the same, its mtime moved, and the parts "
            f"recorded no sha256 to tell its bytes from new weights)")
