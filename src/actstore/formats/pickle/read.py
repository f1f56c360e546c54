"""Reading a pickle-shard store: metadata, verified shard loading, iteration, a torch Dataset.

Loading never trusts a shard: size and sha256 are checked against metadata.json first, then the
bytes go through the restricted unpickler (unpickler.py).
"""
from __future__ import annotations

import hashlib
import operator
import pickle  # absolute import: the standard library, not this package
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

import numpy as np

from actstore.errors import FormatError
from actstore.formats.pickle.layout import CHECKSUM_PREFIX, METADATA, is_shard_name, layer_key
from actstore.formats.pickle.unpickler import safe_loads
from actstore.integrity import inside, is_integer, read_json, read_sized, refuse, share_places, whole_number

# What a hostile or broken shard can raise from decompression or the restricted unpickler. numpy's
# ndarray.__setstate__ raises SystemError or RuntimeError on a dtype that a BUILD state altered after
# numpy.dtype() admitted it (flags saying it holds objects), which no unpickler hook can see first.
LOAD_ERRORS = (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, AttributeError, IndexError,
               KeyError, MemoryError, RuntimeError, SystemError)


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
    if not isinstance(name, str) or not is_shard_name(PurePosixPath(name).name):
        raise FormatError(f"{source}: shard filename {name!r} is not a shard_NNNN.pkl[.gz] path")
    return inside(Path(output_dir), name, source)


def read_checked(output_dir: str | Path, info: dict[str, Any]) -> bytes:
    """The shard's bytes, after checking they exist, have size_bytes and match the sha256 checksum."""
    path = shard_path(output_dir, info)
    if not whole_number(size := info.get("size_bytes")):
        raise FormatError(f"{path}: {METADATA} size_bytes={size!r:.40} is not a whole number")
    data = read_sized(path, size, f"{METADATA} size_bytes")
    digest = CHECKSUM_PREFIX + hashlib.sha256(data).hexdigest()
    if digest != info.get("checksum"):
        raise FormatError(f"{path}: checksum {digest} != metadata.json checksum {info.get('checksum')}")
    return data


def load_shard(output_dir: str | Path, info: dict[str, Any],
               take: Callable[[int], None] | None = None) -> dict[str, list[dict]]:
    """Verify then safely unpickle one shard; FormatError naming the shard on any problem. `take`: the
    share of a ByteBudget its decompressed bytes are charged to (safe_loads)."""
    data = read_checked(output_dir, info)
    path = shard_path(output_dir, info)
    try:
        shard = safe_loads(data, bool(info.get("compressed")), take)
    except LOAD_ERRORS as exc:
        # a MemoryError (a length no shard has, allocated before its bytes are read) says nothing itself
        raise FormatError(f"{path}: refused to load shard: {str(exc) or type(exc).__name__}") from None
    if not isinstance(shard, dict):
        raise FormatError(f"{path}: shard is a {type(shard).__name__}, not a dict of layers")
    return shard


def _layer_items(output_dir: str | Path, meta: dict[str, Any], info: dict[str, Any],
                 shard: dict[str, list[dict]], layer_idx: int) -> list[dict]:
    """The items of a layer the shard's metadata entry lists, checked as verify checks them (check's
    _verify_items): FormatError naming the shard unless they are a list of its num_samples, each with
    the spec's fields and a (tokens, d_model) float32 activation. The checksum only proves these are the
    bytes the writer wrote: a layer it left out was skipped in silence, a short list served too few
    samples, an item without text_preview was a bare KeyError, a 1-D activation served as a sample."""
    from actstore.formats.pickle.check import layer_item_problems  # check imports this module

    key = layer_key(layer_idx)
    items = shard.get(key)
    refuse(layer_item_problems(shard_path(output_dir, info), key, items, info["num_samples"], meta))
    return items


def stored_metadata(output_dir: str | Path, *layers: int) -> dict[str, Any]:
    """metadata.json, checked (check.checked_metadata), of a store that extracted every one of `layers`:
    the spec's loaders skip the shards without one, so a layer never extracted (or "15" for 15) gave no
    items and no error, as if the store were empty."""
    from actstore.formats.pickle.check import checked_metadata  # check imports this module

    meta = checked_metadata(output_dir)
    stored = meta["extraction_config"]["layers_extracted"]
    for layer_idx in layers:
        # False == 0 and 2.0 == 2 passed `in`, then no shard held "layer_False": an intact shard was named damaged
        if not is_integer(layer_idx) or layer_idx not in stored:
            raise FormatError(f"{output_dir}: layer {layer_idx!r} not stored; layers are {stored}")
    return meta


def iter_activations(output_dir: str | Path, layer_idx: int, *,
                     share: tuple[int, int] = (0, 1)) -> Iterator[dict[str, Any]]:
    """Every item of `layer_{layer_idx}` in shard order, one verified shard in memory at a time. share
    (k, n): only the shards at places k, k + n, k + 2n, ... of metadata.json's list (integrity.in_share's
    pick, a validate share job's), the others never loaded."""
    for _, items in iter_layer_items(output_dir, [layer_idx], share=share):
        yield from items
        del items  # let go before the next shard loads


def iter_layer_items(output_dir: str | Path, layers: list[int], *,
                     share: tuple[int, int] = (0, 1)) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(layer, its items) of each of `layers` a shard holds, shard by shard in shard order (share: as
    iter_activations'), each verified shard loaded once for all of them and let go before the next: a
    pass over every layer through iter_activations inflated each shard once a layer."""
    first, every = share_places(share)
    meta = stored_metadata(output_dir, *layers)
    for info in meta["shards"][first::every]:
        if held := [layer for layer in layers if layer in info["layers"]]:
            shard = load_shard(output_dir, info)
            for layer in held:
                yield layer, _layer_items(output_dir, meta, info, shard, layer)
            del shard


def item_tokens(item: dict[str, Any]) -> int:
    """The sample's real tokens: its metadata.token_count where given (checked by then to be at most its
    rows), as the rows past it in the spec's padded store hold padding, not tokens; else its rows (the
    spec's `metadata` is optional: an item without it is read as one whose metadata is null)."""
    metadata = item.get("metadata")
    rows = item["activation"].shape[0]
    return metadata.get("token_count", rows) if isinstance(metadata, dict) else rows



class SampleIndex(Sequence):
    """The spec's index, [(shard_id, item_idx), ...] over the shards given, held as one count per
    shard: a tuple per sample held ~96 MB per million samples (a GB at 10M, and any memory a
    metadata.json's num_samples asked for), before a shard was read. A sequence like that list
    (negative indices too, IndexError past the end, which ends a plain `for` over the dataset)."""

    def __init__(self, shards: list[dict[str, Any]]) -> None:
        self.shard_ids = [s["shard_id"] for s in shards]
        self.ends = list(accumulate(s["num_samples"] for s in shards))  # one past each shard's last sample

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, idx: int) -> tuple[int, int]:
        if isinstance(idx, bool):  # operator.index(True) is 1: sample 1 was served for True
            raise TypeError(f"sample index {idx!r} is a bool, not an integer")
        n, idx = len(self), operator.index(idx)
        if not -n <= idx < n:
            raise IndexError(f"sample index {idx} out of range for {n} samples")
        idx %= n
        pos = bisect_right(self.ends, idx)  # the first shard ending past idx (skips shards of 0 samples)
        return self.shard_ids[pos], idx - (self.ends[pos - 1] if pos else 0)


class ActivationDataset:
    """The spec's ActivationDataset, but indexed from metadata.json (no shard is read to build it)
    and loading each shard verified and safely; one shard cached at a time. Not a subclass of torch's
    Dataset (a DataLoader needs only __len__ and __getitem__): importing this package, as the pickle
    writer jobs do, does not import torch (~2 s, ~150 MB)."""

    def __init__(self, output_dir: str | Path, layer_idx: int) -> None:
        self.output_dir = Path(output_dir)
        self.layer_idx = layer_idx
        self.layer_key = layer_key(layer_idx)
        self.metadata = stored_metadata(output_dir, layer_idx)
        self.shards = shards_by_id(self.output_dir, self.metadata["shards"])
        self.index = SampleIndex([s for s in self.metadata["shards"] if layer_idx in s["layers"]])
        self.current_shard_id: int | None = None
        self.current_shard: dict | None = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        shard_id, item_idx = self.index[idx]
        if shard_id != self.current_shard_id:
            # drop the old shard before loading the next, and its id: a load that fails must not leave
            # the old id naming no shard
            self.current_shard, self.current_shard_id = None, None
            info = self.shards[shard_id]
            shard = load_shard(self.output_dir, info)
            # the index assumed num_samples items, and each is served as one
            _layer_items(self.output_dir, self.metadata, info, shard, self.layer_idx)
            self.current_shard, self.current_shard_id = shard, shard_id
        item = self.current_shard[self.layer_key][item_idx]
        return {"activation": item["activation"], "sample_idx": item["sample_idx"], "text": item["text_preview"]}


def shards_by_id(output_dir: Path, shards: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The shard entries by shard_id; FormatError naming metadata.json when one repeats (machines'
    lists concatenated without renumbering): the index finds shards by id, so the second shard 1
    would be served for the first's items too."""
    by_id: dict[int, dict[str, Any]] = {}
    for info in shards:
        if info["shard_id"] in by_id:
            raise FormatError(f"{output_dir / METADATA}: shard_id {info['shard_id']} is listed twice "
                              f"({by_id[info['shard_id']]['filename']} and {info['filename']})")
        by_id[info["shard_id"]] = info
    return by_id


def collate_padded(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """DataLoader collate_fn for variable-length samples: activations zero-padded to the longest,
    plus `lengths` (the default collate needs equal shapes, which unpadded samples do not have)."""
    import torch

    if not batch:  # no sample gives the width (torch's default_collate([]) fails too, an IndexError)
        raise ValueError("collate_padded: an empty batch has no activation width to pad to")
    lengths = [item["activation"].shape[0] for item in batch]
    d = batch[0]["activation"].shape[1]
    out = torch.zeros((len(batch), max(lengths), d), dtype=torch.float32)
    for row, item in enumerate(batch):
        out[row, :lengths[row]] = torch.from_numpy(np.asarray(item["activation"]))
    return {"activation": out, "lengths": torch.tensor(lengths),
            "sample_idx": torch.tensor([item["sample_idx"] for item in batch]),
            "text": [item["text"] for item in batch]}
