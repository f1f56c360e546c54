"""Shuffled training loader for saev stores: large contiguous reads, a shuffle buffer, torch batches.

saev's own shuffled reader gathers single 4 KiB vectors at large strides (~3.6K vectors/s on OSC
scratch). This one reads *blocks* (a run of whole examples inside one shard, all tokens, one pread
per block when every layer is wanted) in a seeded random order, pours `buffer_blocks` blocks into a
buffer, permutes the buffer and yields batches from it; the buffer refills as it drains. So disk reads
stay large and sequential while each batch mixes many examples from all over the dataset.

Each epoch every kept vector is yielded exactly once: blocks partition the examples, torch
DataLoader workers take disjoint slices of the block permutation, and the last partial batch is
yielded (unless drop_last). Text padding (past n_valid in windows.npy) is never yielded.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from actstore.errors import ConfigError
from actstore.formats.saev import DTYPE, SaevStore


class ShuffledActivations(IterableDataset):
    """IterableDataset of {"act": (B, [n_layers,] D) float32, "example_idx": (B,), "token_idx": (B,)}.

    layers: layer values to return (default all stored); one layer gives act (B, D), several give
    (B, n_layers, D) with the same token at each layer. include_cls: yield CLS vectors (ViT stores).
    keep_labels: keep only patches whose labels.bin value is in this set (CLS has no label).
    """

    def __init__(self, path: str | Path, layers: Iterable[int] | None = None, batch_size: int = 4096,
                 seed: int = 0, block_examples: int | None = None, buffer_blocks: int = 32,
                 include_cls: bool = True, keep_labels: Iterable[int] | None = None, drop_last: bool = False,
                 block_bytes: int = 4 << 20):
        self.path = Path(path)
        store = SaevStore(self.path)
        self.layers = list(layers) if layers is not None else list(store.layers)
        self.layer_idx = [store.layer_index(layer) for layer in self.layers]
        if batch_size < 1 or buffer_blocks < 1:
            raise ConfigError(f"batch_size={batch_size} and buffer_blocks={buffer_blocks} must be >= 1")
        self.batch_size, self.seed, self.buffer_blocks, self.drop_last = batch_size, seed, buffer_blocks, drop_last
        self.include_cls = include_cls
        self.keep_labels = None if keep_labels is None else np.array(sorted(set(keep_labels)), dtype=np.uint8)
        if self.keep_labels is not None and store.labels() is None:
            raise ConfigError(f"{store.dir}: keep_labels given but the store has no labels.bin")
        # Default block: ~block_bytes of contiguous shard bytes (>= 1 example).
        self.block_examples = block_examples or max(1, block_bytes // store.example_bytes)
        self.blocks = self._blocks(store)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """A new epoch gets a new (still seeded) order."""
        self.epoch = epoch

    def _blocks(self, store: SaevStore) -> np.ndarray:
        """(n_blocks, 3) shard, first example in shard, n examples: a partition of every example."""
        out = []
        for idx, shard in enumerate(store.shards):
            for lo in range(0, shard["n_examples"], self.block_examples):
                out.append((idx, lo, min(self.block_examples, shard["n_examples"] - lo)))
        return np.array(out, dtype=np.int64).reshape(-1, 3)

    def token_mask(self, store: SaevStore, first: int, n: int) -> np.ndarray:
        """(n, T) bool: which tokens of examples first..first+n are yielded."""
        mask = np.ones((n, store.T), dtype=bool)
        cls = int(store.metadata["cls_token"])
        if cls and not self.include_cls:
            mask[:, 0] = False
        if store.windows is not None:
            mask &= np.arange(store.T)[None, :] < store.windows[first:first + n, 2:3]
        if self.keep_labels is not None:
            mask[:, cls:] &= np.isin(store.labels()[first:first + n], self.keep_labels)
        return mask

    def my_blocks(self) -> np.ndarray:
        """This worker's blocks for this epoch: a disjoint slice of one seeded permutation."""
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.blocks))
        info = get_worker_info()
        if info is not None:
            order = order[info.id::info.num_workers]
        return self.blocks[order]

    def _fill(self, store: SaevStore, fds: dict[int, int], block: np.ndarray, buf: tuple[np.ndarray, ...],
              n: int, scratch: np.ndarray) -> int:
        """Append the kept vectors of one block to the buffer at row n; return the new row count.

        One layer, nothing filtered: pread straight into the buffer (one read per example, T*D floats
        contiguous on disk). Otherwise: one pread of the whole block into `scratch`, then one copy of
        the kept tokens."""
        shard, lo, k = (int(x) for x in block)
        if shard not in fds:
            fds[shard] = os.open(store.dir / store.shards[shard]["name"], os.O_RDONLY)
        first = int(store.starts[shard]) + lo
        base = lo * store.example_bytes
        mask = self.token_mask(store, first, k)
        acts, exs, toks = buf
        if len(self.layer_idx) == 1 and mask.all():
            layer_bytes = store.T * store.D * DTYPE.itemsize
            for e in range(k):
                rows = slice(n + e * store.T, n + (e + 1) * store.T)
                _pread_into(fds[shard], acts[rows], base + e * store.example_bytes + self.layer_idx[0] * layer_bytes)
            exs[n:n + k * store.T] = np.repeat(np.arange(first, first + k), store.T)
            toks[n:n + k * store.T] = np.tile(np.arange(store.T), k)
            return n + k * store.T
        data = scratch[:k]
        _pread_into(fds[shard], data, base)
        ex, tok = np.nonzero(mask)
        m = len(ex)
        acts[n:n + m] = data[ex[:, None], np.asarray(self.layer_idx)[None, :], tok[:, None]]
        exs[n:n + m], toks[n:n + m] = ex + first, tok
        return n + m

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        store = SaevStore(self.path)  # per worker: its own file descriptors
        info = get_worker_info()
        rng = np.random.default_rng([self.seed, self.epoch, 0 if info is None else info.id + 1])
        cap = self.buffer_blocks * self.block_examples * store.T + self.batch_size  # + room for the carry
        buf = (np.empty((cap, len(self.layer_idx), store.D), dtype=DTYPE),
               np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64))
        scratch = np.empty((self.block_examples, store.L, store.T, store.D), dtype=DTYPE)
        squeeze = len(self.layers) == 1
        fds: dict[int, int] = {}
        n = 0
        try:
            blocks = self.my_blocks()
            for start in range(0, len(blocks), self.buffer_blocks):
                for block in blocks[start:start + self.buffer_blocks]:
                    n = self._fill(store, fds, block, buf, n, scratch)
                perm = rng.permutation(n)
                n_full = n // self.batch_size * self.batch_size
                for lo in range(0, n_full, self.batch_size):
                    yield _batch(buf, perm[lo:lo + self.batch_size], squeeze)
                rest = np.sort(perm[n_full:])  # the carry (< batch_size) moves to the front
                for array in buf:
                    array[:len(rest)] = array[rest]
                n = len(rest)
            if n and not self.drop_last:
                yield _batch(buf, rng.permutation(n), squeeze)
        finally:
            for fd in fds.values():
                os.close(fd)


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError(f"short read at byte {offset + done} of a saev shard")
        done += got


def _batch(buf: tuple[np.ndarray, ...], idx: np.ndarray, squeeze: bool) -> dict[str, torch.Tensor]:
    """Gather one batch out of the buffer (a fresh array the consumer owns)."""
    acts = torch.from_numpy(np.take(buf[0], idx, axis=0))
    return {"act": acts[:, 0] if squeeze else acts, "example_idx": torch.from_numpy(buf[1][idx]),
            "token_idx": torch.from_numpy(buf[2][idx])}
