"""Shuffled training loader for saev stores: large contiguous reads, a shuffle buffer, torch batches.

saev's own shuffled reader gathers single 4 KiB vectors at large strides (~3.6K vectors/s on OSC
scratch). This one reads *blocks* (a run of whole examples inside one shard, all tokens, one pread
per block when every layer is wanted) in a seeded random order, pours `buffer_blocks` blocks into a
buffer, permutes the buffer and yields batches from it. So disk reads stay large and sequential while
each batch mixes many examples from all over the dataset.
`fill_threads` threads each pread a block into a small scratch array that stays in cache, then
scatter its vectors to their shuffled rows with streaming stores (the `_scatter` C extension; numpy's
fancy assignment when it was not built); the next buffer fills while the current one's batches are
consumed. Designs measured on the way: bench/README.md `## saev`.

Each epoch every kept vector is yielded exactly once: blocks partition the examples, torch
DataLoader workers take disjoint slices of the block permutation, and the last partial batch is
yielded (unless drop_last). Text padding (past n_valid in windows.npy) is never yielded.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from queue import SimpleQueue
from threading import Lock
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from actstore.errors import ConfigError, FormatError
from actstore.formats.saev import DTYPE, SaevStore

try:
    from actstore import _scatter
except ImportError:  # built without a C compiler (setup.py: optional): numpy's scatter, same results
    _scatter = None


class ShuffledActivations(IterableDataset):
    """IterableDataset of {"act": (B, [n_layers,] D) float32, "example_idx": (B,), "token_idx": (B,)}.

    layers: layer values to return (default all stored); one layer gives act (B, D), several give
    (B, n_layers, D) with the same token at each layer. include_cls: yield CLS vectors (ViT stores).
    keep_labels: keep only patches whose labels.bin value is in this set (CLS has no label).
    fill_threads: threads reading and scattering blocks into the buffer (per DataLoader worker).
    """

    def __init__(self, path: str | Path, layers: Iterable[int] | None = None, batch_size: int = 4096,
                 seed: int = 0, block_examples: int | None = None, buffer_blocks: int = 32,
                 include_cls: bool = True, keep_labels: Iterable[int] | None = None, drop_last: bool = False,
                 block_bytes: int = 4 << 20, fill_threads: int = 2):
        self.path = Path(path)
        store = SaevStore(self.path)
        self.layers = list(layers) if layers is not None else list(store.layers)
        self.layer_idx = [store.layer_index(layer) for layer in self.layers]
        if batch_size < 1 or buffer_blocks < 1:
            raise ConfigError(f"batch_size={batch_size} and buffer_blocks={buffer_blocks} must be >= 1")
        self.batch_size, self.seed, self.buffer_blocks, self.drop_last = batch_size, seed, buffer_blocks, drop_last
        self.include_cls = include_cls
        if fill_threads < 1:
            raise ConfigError(f"fill_threads={fill_threads} must be >= 1")
        self.fill_threads = fill_threads
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

    def token_mask(self, store: SaevStore, labels: np.ndarray | None, first: int, n: int) -> np.ndarray:
        """(n, T) bool: which tokens of examples first..first+n are yielded (labels: the store's)."""
        mask = np.ones((n, store.T), dtype=bool)
        cls = int(store.metadata["cls_token"])
        if cls and not self.include_cls:
            mask[:, 0] = False
        if store.windows is not None:
            mask &= np.arange(store.T)[None, :] < store.windows[first:first + n, 2:3]
        if self.keep_labels is not None:
            mask[:, cls:] &= np.isin(labels[first:first + n], self.keep_labels)
        return mask

    def my_blocks(self) -> np.ndarray:
        """This worker's blocks for this epoch: a disjoint slice of one seeded permutation."""
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.blocks))
        info = get_worker_info()
        if info is not None:
            order = order[info.id::info.num_workers]
        return self.blocks[order]

    def _fill_block(self, store: SaevStore, shards: "_ShardFiles", block: np.ndarray, first: int, mask: np.ndarray,
                    rows: np.ndarray, out: tuple[np.ndarray, np.ndarray, np.ndarray], scratch: SimpleQueue) -> None:
        """Read one block into a cache-resident scratch array, then scatter its kept vectors (mask
        order) to their shuffled `rows` of the buffer. Runs on a fill thread: blocks own disjoint rows,
        and pread and the scatter run without the GIL, so blocks fill in parallel."""
        acts, exs, toks = out
        shard, lo, k = (int(x) for x in block)
        buf = scratch.get()
        try:
            data = buf[:k]
            if self.layer_idx == list(range(store.L)):  # the whole block: one large read
                shards.read(shard, lo * store.example_bytes, data)
            else:  # selected layers only: one read of T contiguous vectors per (example, layer)
                layer_bytes = store.T * store.D * DTYPE.itemsize
                for e in range(k):
                    for j, layer in enumerate(self.layer_idx):
                        shards.read(shard, (lo + e) * store.example_bytes + layer * layer_bytes, data[e, j])
            if mask.all():
                dest = rows.reshape(mask.shape)
            else:  # dropped vectors (CLS off, padding, label filter) go to the junk row acts[-1]
                dest = np.full(mask.shape, len(acts) - 1, dtype=np.int64)
                dest[mask] = rows
            _scatter_rows(acts, dest, data)
        finally:
            scratch.put(buf)
        ex, tok = np.nonzero(mask)
        exs[rows], toks[rows] = ex + first, tok

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        store = SaevStore(self.path)  # per worker: its own file descriptors
        info = get_worker_info()
        rng = np.random.default_rng([self.seed, self.epoch, 0 if info is None else info.id + 1])
        nl, squeeze, size = len(self.layer_idx), len(self.layers) == 1, self.batch_size
        cap = self.buffer_blocks * self.block_examples * store.T + size + 1
        pool = self.__dict__.setdefault("_pool", [])  # kept across epochs, per process
        if pool and pool[0].shape != (cap, nl, store.D):
            pool.clear()
        labels = store.labels() if self.keep_labels is not None else None
        shards = _ShardFiles(store)
        fill = ThreadPoolExecutor(max_workers=self.fill_threads)
        scratch: SimpleQueue = SimpleQueue()  # one read buffer per fill thread, reused: it stays in cache
        for _ in range(self.fill_threads):
            scratch.put(np.empty((self.block_examples, nl, store.T, store.D), dtype=DTYPE))

        def start(group: np.ndarray, n_carry: int) -> _Fill:
            """Plan one buffer (n_carry leftover rows of the last one first, then the blocks in order:
            item i goes to row perm[i]) and start filling it; the carry is placed once it is known."""
            firsts = [int(store.starts[b[0]] + b[1]) for b in group]
            masks = [self.token_mask(store, labels, f, int(b[2])) for f, b in zip(firsts, group)]
            counts = np.array([int(m.sum()) for m in masks], dtype=np.int64)
            ends = n_carry + np.cumsum(counts)
            n = int(ends[-1])
            perm = rng.permutation(n)
            buf = _Fill(_buffer(pool, (cap, nl, store.D))[:n + 1],  # + a junk row for dropped tokens
                        np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), perm, [])
            buf.jobs = [fill.submit(self._fill_block, store, shards, block, first, mask, perm[end - count:end],
                                    buf.arrays(), scratch)
                        for block, first, mask, count, end in zip(group, firsts, masks, counts, ends)]
            return buf

        try:
            blocks = self.my_blocks()
            groups = [blocks[lo:lo + self.buffer_blocks] for lo in range(0, len(blocks), self.buffer_blocks)]
            nxt = start(groups[0], 0) if groups else None
            for g in range(len(groups)):
                # Pipelined: the next buffer fills while this one is waited for and its batches yielded,
                # so the fill threads never idle at a buffer boundary (hence POOL_SIZE = 3).
                cur, nxt = nxt, None
                n, n_full = len(cur.perm), len(cur.perm) // size * size
                if g + 1 < len(groups):
                    nxt = start(groups[g + 1], n - n_full)
                for job in cur.jobs:
                    job.result()
                cur.jobs = []
                tail = (cur.acts[n_full:n], cur.exs[n_full:], cur.toks[n_full:])
                if nxt is not None and n_full < n:  # the leftover rows join the next buffer
                    nxt.jobs.append(fill.submit(_place, nxt.arrays(), nxt.perm[:n - n_full], tail))
                for lo in range(0, n_full, size):
                    yield _batch(cur.acts[lo:lo + size], cur.exs[lo:lo + size], cur.toks[lo:lo + size], squeeze)
                if nxt is None and n_full < n and not self.drop_last:
                    yield _batch(*tail, squeeze)
                del cur, tail  # drop our references so the buffer can be recycled
        finally:
            fill.shutdown(wait=True, cancel_futures=True)
            shards.close()


@dataclass
class _Fill:
    """One shuffle buffer being filled: rows, their example/token indices, the permutation, the jobs."""
    acts: np.ndarray
    exs: np.ndarray
    toks: np.ndarray
    perm: np.ndarray
    jobs: list[Future]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.acts, self.exs, self.toks


class _ShardFiles:
    """Shard file descriptors, opened on first use and shared by the fill threads."""

    def __init__(self, store: SaevStore):
        self.store, self.lock = store, Lock()
        self.fds: dict[int, int] = {}

    def read(self, shard: int, offset: int, out: np.ndarray) -> None:
        """Fill a C-contiguous array from a shard at offset, resuming after short reads."""
        with self.lock:
            if shard not in self.fds:
                self.fds[shard] = os.open(self.store.dir / self.store.shards[shard]["name"], os.O_RDONLY)
            fd = self.fds[shard]
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise FormatError(f"{self.store.dir / self.store.shards[shard]['name']}: ends at byte "
                                  f"{offset + done}, shards.json says {self.store.shard_bytes(shard)}; "
                                  "was it truncated or purged?")
            done += got

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _scatter_rows(acts: np.ndarray, dest: np.ndarray, block: np.ndarray) -> None:
    """acts[dest] = block.transpose(0, 2, 1, 3) for a (k, n_layers, T, D) block and (k, T) destination
    rows: with streaming stores when the C extension was built (the scatter is the loader's whole cost,
    and they make it 2.7x faster), else numpy's fancy assignment."""
    if _scatter is None:
        acts[dest] = block.transpose(0, 2, 1, 3)
        return
    k, n_layers, n_tok, d = block.shape
    if not (acts.flags.c_contiguous and dest.flags.c_contiguous and dest.dtype == np.int64
            and block.strides[3] == block.itemsize == acts.itemsize and dest.shape == (k, n_tok)
            and acts.shape[1:] == (n_layers, d)):
        raise ValueError(f"scatter: unsupported layout acts {acts.shape} dest {dest.shape} block {block.shape}")
    _scatter.scatter(acts.ctypes.data, len(acts), acts.strides[0], block.ctypes.data, k, n_layers, n_tok,
                     block.strides[0], block.strides[1], block.strides[2], d * block.itemsize, dest.ctypes.data)


def _place(out: tuple[np.ndarray, ...], rows: np.ndarray, carry: tuple[np.ndarray, ...]) -> None:
    """The last buffer's leftover vectors (fewer than a batch) go to their rows of this one."""
    for dest, src in zip(out, carry):
        dest[rows] = src


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


POOL_SIZE = 3


def _batch(acts: np.ndarray, exs: np.ndarray, toks: np.ndarray, squeeze: bool) -> dict[str, torch.Tensor]:
    """Batch tensors sharing the buffer's memory (no copy); their reference keeps the buffer from
    being recycled while the consumer holds them (_buffer)."""
    a = torch.from_numpy(acts)
    return {"act": a[:, 0] if squeeze else a, "example_idx": torch.from_numpy(exs), "token_idx": torch.from_numpy(toks)}
