"""Shuffled training loader for saev stores: large contiguous reads, a shuffle buffer, torch batches.

saev's own shuffled reader gathers single 4 KiB vectors at large strides (~3.6K vectors/s on OSC
scratch). This one reads *blocks* (a run of whole examples inside one shard, all tokens, one pread
per block when every layer is wanted) in a seeded random order, pours `buffer_blocks` blocks into a
buffer, permutes the buffer and yields batches from it; the buffer refills as it drains. So disk reads
stay large and sequential while each batch mixes many examples from all over the dataset.
A reader thread preads the next block while the current one is scattered, so the two copies overlap.

Each epoch every kept vector is yielded exactly once: blocks partition the examples, torch
DataLoader workers take disjoint slices of the block permutation, and the last partial batch is
yielded (unless drop_last). Text padding (past n_valid in windows.npy) is never yielded.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
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

    def __getstate__(self) -> dict:
        """Sent to DataLoader workers without the buffers: each process makes its own."""
        return {k: v for k, v in self.__dict__.items() if k != "_pool"}

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

    def _read_block(self, store: SaevStore, fds: dict[int, int], block: np.ndarray,
                    scratch: np.ndarray) -> np.ndarray:
        """Read one block into the reused (cache-hot) `scratch` with large preads."""
        shard, lo, k = (int(x) for x in block)
        if shard not in fds:
            fds[shard] = os.open(store.dir / store.shards[shard]["name"], os.O_RDONLY)
        data = scratch[:k]
        if self.layer_idx == list(range(store.L)):  # the whole block: one contiguous read
            _pread_into(fds[shard], data, lo * store.example_bytes)
        else:  # selected layers only: one read of T contiguous vectors per (example, layer)
            layer_bytes = store.T * store.D * DTYPE.itemsize
            for e in range(k):
                for j, li in enumerate(self.layer_idx):
                    _pread_into(fds[shard], data[e, j], (lo + e) * store.example_bytes + li * layer_bytes)
        return data

    @staticmethod
    def _scatter(data: np.ndarray, mask: np.ndarray, rows: np.ndarray, acts: np.ndarray) -> None:
        """Scatter a block's kept vectors (mask order) to their shuffled rows of `acts` in one numpy
        copy, straight from the read buffer; dropped ones (CLS off, padding, label filter) go to the
        junk row acts[-1]."""
        dest = np.full(mask.shape, len(acts) - 1, dtype=np.int64)
        dest[mask] = rows
        acts[dest] = data.transpose(0, 2, 1, 3)  # (k, T, nl, D) view of the (k, nl, T, D) block

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        store = SaevStore(self.path)  # per worker: its own file descriptors
        info = get_worker_info()
        rng = np.random.default_rng([self.seed, self.epoch, 0 if info is None else info.id + 1])
        nl, squeeze = len(self.layer_idx), len(self.layers) == 1
        # Two read buffers: a reader thread fills one (pread releases the GIL) while this thread
        # scatters the other, so the disk/page-cache copy and the shuffle copy overlap.
        scratch = [np.empty((self.block_examples, nl, store.T, store.D), dtype=DTYPE) for _ in range(2)]
        reader = ThreadPoolExecutor(max_workers=1)
        cap = self.buffer_blocks * self.block_examples * store.T + self.batch_size + 1
        pool = self.__dict__.setdefault("_pool", [])  # kept across epochs, per process
        if pool and pool[0].shape != (cap, nl, store.D):
            pool.clear()
        fds: dict[int, int] = {}
        carry: tuple[np.ndarray, ...] | None = None
        try:
            blocks = self.my_blocks()
            for start in range(0, len(blocks), self.buffer_blocks):
                group = blocks[start:start + self.buffer_blocks]
                firsts = [int(store.starts[b[0]] + b[1]) for b in group]
                masks = [self.token_mask(store, f, int(b[2])) for f, b in zip(firsts, group)]
                c = 0 if carry is None else len(carry[1])
                n = c + sum(int(m.sum()) for m in masks)
                # The shuffle: item i of this buffer (carry first, then blocks in order) -> row perm[i].
                perm = rng.permutation(n)
                acts = None  # drop our view of the last buffer so it can be recycled
                acts = _buffer(pool, (cap, nl, store.D))[:n + 1]  # + a junk row for dropped tokens
                exs, toks = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
                if carry is not None:
                    acts[perm[:c]], exs[perm[:c]], toks[perm[:c]] = carry
                    carry = None
                i = c
                pending = reader.submit(self._read_block, store, fds, group[0], scratch[0])
                for b, (first, block, mask) in enumerate(zip(firsts, group, masks)):
                    data = pending.result()
                    if b + 1 < len(group):
                        pending = reader.submit(self._read_block, store, fds, group[b + 1], scratch[(b + 1) % 2])
                    ex, tok = np.nonzero(mask)
                    rows = perm[i:i + len(ex)]
                    self._scatter(data, mask, rows, acts)
                    exs[rows], toks[rows] = ex + first, tok
                    i += len(ex)
                n_full = n // self.batch_size * self.batch_size
                for lo in range(0, n_full, self.batch_size):
                    yield _batch(acts[lo:lo + self.batch_size], exs[lo:lo + self.batch_size],
                                 toks[lo:lo + self.batch_size], squeeze)
                # The carry stays a view of this buffer (which is then not recycled until it is copied).
                carry = (acts[n_full:n], exs[n_full:], toks[n_full:]) if n_full < n else None
            if carry is not None and not self.drop_last:
                yield _batch(*(x.copy() for x in carry), squeeze)
        finally:
            reader.shutdown(wait=True)
            for fd in fds.values():
                os.close(fd)


def _buffer(pool: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """A buffer no yielded batch still uses (recycled: fresh memory costs a page fault per 4 KiB,
    which is most of the time of a large read), else a new one. Batches are views of a buffer and
    keep it referenced, so a batch the consumer still holds is never overwritten."""
    for array in pool:
        # References: the pool list, this loop variable, getrefcount's argument.
        if sys.getrefcount(array) == 3:
            return array
    if len(pool) >= POOL_SIZE:
        pool.pop(0)  # still in use by the consumer: forget it, it is freed with its last batch
    pool.append(np.empty(shape, dtype=DTYPE))
    return pool[-1]


POOL_SIZE = 2


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill a C-contiguous array from fd at offset, resuming after short reads."""
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError(f"short read at byte {offset + done} of a saev shard")
        done += got


def _batch(acts: np.ndarray, exs: np.ndarray, toks: np.ndarray, squeeze: bool) -> dict[str, torch.Tensor]:
    """Batch tensors sharing the buffer's memory (no copy); a fresh buffer is made per refill."""
    a = torch.from_numpy(acts)
    return {"act": a[:, 0] if squeeze else a, "example_idx": torch.from_numpy(exs), "token_idx": torch.from_numpy(toks)}
