"""A module's weights read by name from a local safetensors checkpoint, opening only the files that
hold them: a vision-language checkpoint's vision tower is a few hundred MB of a checkpoint of tens of
GB (Gemma 3 27B: ~0.4B of its 27B parameters), which from_pretrained would read whole."""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actstore.errors import ConfigError
from actstore.model_identity import named_weights
from actstore.safetensors_io import read_header_json, tensor_sizes

if TYPE_CHECKING:  # the workflow's parse sizes jobs with tensor_bytes, without importing torch
    from torch import nn

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# A .bin checkpoint's, which from_pretrained reads where the folder has no safetensors checkpoint.
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
# Why a module's weights were not found, for every error that says which one.
HOW_READ = ("its weights are read by their own names, all under one prefix, from the folder's *.safetensors; a "
            "checkpoint that renames them inside the module, or one saved as .bin only, cannot be read this way")


def checkpoint_names(folder: Path) -> dict[str, str]:
    """Every tensor name of the folder's safetensors checkpoint -> the file that holds it: the shard
    index's weight_map (no shard opened), else model.safetensors' header; empty for a .bin checkpoint.
    The file config.json's transformers_weights names (a subfolder's too) is that checkpoint where it
    names one, as from_pretrained loads it in place of both: the tower was read, and jobs sized, from a
    model.safetensors the model never ran.
    Either file there but not a regular file (a FIFO) is named: skipping it blamed a missing weight.
    Both there is a ConfigError: save_pretrained in shards over a single-file checkpoint (a fine-tune
    saved where its base was) leaves model.safetensors, which from_pretrained reads first, so a model
    ran the old weights and its vision tower, read by the index, the new. (An index mapping every
    name to model.safetensors itself, as some repositories ship, is one checkpoint.)"""
    if named := named_weights(folder):
        return _names_in(folder, named[0].relative_to(folder).as_posix())
    if (folder / INDEX).exists():
        shards = weight_map(folder, INDEX)
        if (folder / SINGLE).exists() and set(shards.values()) != {SINGLE}:
            raise ConfigError(f"model.path {folder}: holds both {SINGLE} and {INDEX} with its shards, two "
                              f"checkpoints (save_pretrained removes neither when the other is saved over it): "
                              f"from_pretrained would read {SINGLE}; move the stale one out of the folder")
        return shards
    return _names_in(folder, SINGLE) if (folder / SINGLE).exists() else {}


def _names_in(folder: Path, file: str) -> dict[str, str]:
    """Tensor name -> file, of the checkpoint file `file` of the folder: a shard index's weight_map,
    a safetensors file's header; empty for another (a .bin, as for a .bin checkpoint). The header is
    read as bytes: the safetensors library's safe_open imports torch, ~4 s of every Snakefile parse (each
    Slurm job parses it again)."""
    if file.endswith(".index.json"):
        return weight_map(folder, file)
    if not file.endswith(".safetensors"):
        return {}
    try:
        return dict.fromkeys(_header_sizes(_regular(folder, file)), file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path {folder}: {file} cannot be read: {exc}") from None


def weight_map(folder: Path, index: str) -> dict[str, str]:
    """The shard index's weight_map (`index`: INDEX or BIN_INDEX); ConfigError naming the index unless
    it is a JSON object mapping names to file names of the folder itself (a number or list there was a
    TypeError out of sorting or hashing the files; `../x.safetensors` or an absolute path was read from
    outside the folder)."""
    try:
        weight_map = json.loads(_regular(folder, index).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:  # OSError: an index config.json names, not there
        raise ConfigError(f"model.path {folder}: {index} names no weight_map: {exc!r}") from None
    if not isinstance(weight_map, dict):  # a list of pairs read as one (or of "ab": a to b); transformers refuses it
        raise ConfigError(f"model.path {folder}: {index} weight_map is a {type(weight_map).__name__}, not an "
                          "object of tensor names to files")
    for name, file in weight_map.items():
        if not (isinstance(file, str) and _plain_name(file)):
            raise ConfigError(f"model.path {folder}: {index} weight_map gives {name!r} the file {file!r:.80}, "
                              "not a file name of the folder")
    return weight_map


def check_checkpoint_files(folder: Path) -> None:
    """ConfigError naming the file unless every file of the checkpoint from_pretrained reads is a regular
    file of the folder, checked before it reads them: it joins an index's names to the folder as given
    (`../x.safetensors` was read from outside it, where model_identity, which records the folder's own
    files, never saw it change) and blocked forever opening a FIFO. The safetensors checkpoint's, else
    the .bin shards BIN_INDEX names, which from_pretrained reads after both safetensors files and
    BIN_SINGLE: a safetensors download beside the .bin index alone is no error."""
    named = named_weights(folder)  # the index read in place of INDEX, where config.json names one
    index, files = named[0].relative_to(folder).as_posix() if named else INDEX, set(checkpoint_names(folder).values())
    if not files and (folder / BIN_INDEX).exists() and not (folder / BIN_SINGLE).exists():
        index, files = BIN_INDEX, set(weight_map(folder, BIN_INDEX).values())
    for file in sorted(files):
        try:
            _regular(folder, file)
        except OSError as exc:
            raise ConfigError(f"model.path {folder}: {file}, which {index} names, cannot be read "
                              f"({exc.strerror})") from None


def _plain_name(file: str) -> bool:
    """Whether `file` names a file directly in a folder: no folder part, no `..`, no NUL. A link of that
    name is followed, as loading follows it (a Hugging Face cache snapshot links to its blobs)."""
    return file not in ("", ".", "..") and "/" not in file and "\0" not in file


def _regular(folder: Path, file: str) -> Path:
    """`folder / file`, links followed; ConfigError naming it unless it is a regular file: a FIFO
    blocked the open of the parse or of the job forever (safetensors opens without O_NONBLOCK). A
    missing file is the OSError of its stat, which each caller names."""
    path = folder / file
    if not stat.S_ISREG(path.stat().st_mode):
        raise ConfigError(f"model.path {folder}: {file} is not a regular file (a FIFO, device or folder), "
                          "so it is not read")
    return path


def tensor_bytes(folder: Path, names: set[str] | None = None) -> dict[str, int]:
    """Bytes of each tensor of the folder's safetensors files (of `names`, when given), from their
    headers alone (8 bytes of length, then JSON with each tensor's data offsets): no torch, no data read."""
    sizes = {}
    for file in sorted(set(checkpoint_names(folder).values())):
        try:
            sizes.update({name: size for name, size in _header_sizes(_regular(folder, file)).items()
                          if names is None or name in names})
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.path {folder}: {file} has no readable safetensors header "
                              f"({exc!r:.200})") from None
    return sizes


def _header_sizes(path: Path) -> dict[str, int]:
    """Bytes of each tensor `path`'s header gives, read as strictly as the safetensors library that
    loads them reads it (tensor_sizes): a header is whoever published the model's, and a key given
    twice, NaN, or two tensors over the same bytes sized the job past the weights, and a length past
    the file allocated it. ValueError naming the tensor otherwise."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        header, length = read_header_json(handle, size)
    return tensor_sizes(header, size - 8 - length)


@contextmanager
def _opened(folder: Path, file: str) -> Iterator[Any]:
    """safe_open on one file of the checkpoint; a missing, truncated or damaged file (or a tensor its
    header lacks) is a ConfigError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(_regular(folder, file), framework="pt", device="cpu") as handle:
            yield handle
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"model.path {folder}: {file} cannot be read: {exc}") from None


def tied_groups(module: nn.Module) -> list[list[str]]:
    """The module's state-dict names grouped by the tensor they name: a weight shared by two
    submodules (tied) is one tensor, saved once under either name."""
    groups: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def find_prefix(groups: list[list[str]], names: dict[str, str], folder: Path, what: str) -> str:
    """The one prefix under which the checkpoint holds a name of every group. The candidates are where
    the first group sits as a dotted suffix: LLaVA's tower `embeddings.class_embedding` is saved as
    `vision_tower.embeddings.class_embedding` (transformers 5) or under `vision_tower.vision_model.`."""
    candidates = sorted({name[:len(name) - len(key)] for key in groups[0] for name in names
                         if name == key or name.endswith("." + key)})
    missing = {prefix: [group[0] for group in groups if not any(prefix + key in names for key in group)]
               for prefix in candidates}
    complete = [prefix for prefix in candidates if not missing[prefix]]
    if len(complete) > 1:
        raise ConfigError(f"model.path {folder}: the {what}'s weights are in its checkpoint under more than one "
                          f"prefix ({', '.join(map(repr, complete))})")
    if complete:
        return complete[0]
    where = min(candidates, key=lambda prefix: len(missing[prefix]), default=None)  # where most of it is
    first = groups[0][0] if where is None else missing[where][0]
    under = "" if where is None else f" under {where!r}, where its other weights are"
    raise ConfigError(f"model.path {folder}: the {what}'s weight {first!r} is not in its safetensors checkpoint"
                      f"{under}; {HOW_READ}")


def load_weights(module: nn.Module, folder: Path, what: str) -> None:
    """Fill `module`, built with the dtypes wanted, from the checkpoint in `folder`, reading only its own
    tensors (the prefix found from names alone, before any tensor is read) and only the files holding
    them, each cast to its module tensor's dtype as from_pretrained casts; strict: every parameter and
    persistent buffer once (a tied one under either name). `what` names the module in errors."""
    names = checkpoint_names(folder)
    groups = tied_groups(module)
    prefix = find_prefix(groups, names, folder, what)
    dtypes = {name: tensor.dtype for name, tensor in module.state_dict().items()}
    by_file: dict[str, list[tuple[list[str], str]]] = {}
    for group in groups:
        key = next(prefix + name for name in group if prefix + name in names)
        by_file.setdefault(names[key], []).append((group, key))
    tensors = {}
    for file, entries in by_file.items():
        with _opened(folder, file) as handle:
            for group, key in entries:
                tensors.update(dict.fromkeys(group, handle.get_tensor(key).to(dtypes[group[0]])))
    try:
        module.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as exc:  # a shape that is not the module's
        detail = " ".join(str(exc).split())  # torch's message is one line a key
        raise ConfigError(f"model.path {folder}: the {what}'s weights do not fit it: {detail}") from None
