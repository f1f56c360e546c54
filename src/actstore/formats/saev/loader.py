"""Shuffled training loader for saev stores: batches mixed like a uniform shuffle, read at disk speed.

saev's own shuffled reader gathers single 4 KiB vectors at large strides (~3.6K vectors/s on OSC
scratch). A batch mixes as well as a uniform shuffle only when its vectors come from as many examples
as a uniform draw would hit (~1,770 of 2,040 for a 4,096 batch on the bench store), so reading whole
examples into a bounded buffer cannot do it: the buffer would have to hold most of the store. This
loader is two-level instead. Level one: the store is cut into small *blocks* (by default a run of
~32 KiB of tokens inside one example, every wanted layer) and the blocks of the whole store are
taken in one seeded random order, `buffer_blocks` at a time into a shuffle buffer (`buffer_bytes`,
256 MiB by default: 8,192 blocks from all over the store). Level two: the buffer is permuted and
yielded as batches, so a batch of B vectors draws from thousands of blocks of different examples.
Mixing relative to a uniform shuffle is about H/B, H = M(1 - exp(-B/M)) the blocks a batch hits, M
the blocks in the buffer: more memory or smaller blocks mix better (bench/README.md `## saev`).

`fill_threads` threads run one C call per few MiB of blocks (the `_scatter` extension, without the
GIL): pread each block into a small scratch array that stays in cache, then scatter its vectors to
their shuffled rows with streaming stores (numpy reads and fancy assignment when it was not built).
The next buffer fills while the current one's batches are consumed. Where a block's vectors go is
planned from the seed alone, so the batches are identical whatever the thread count.

Each epoch every kept vector is yielded exactly once: blocks partition the (example, token) pairs,
torch DataLoader workers take disjoint slices of the block permutation, and the last partial batch is
yielded (unless drop_last). Text padding (past n_valid in windows.npy) is never yielded.

Memory per process (DataLoader worker): 3 buffers of buffer_blocks blocks (at most the blocks it reads)
and one batch (row = one token, every wanted layer), 16 bytes of indices per buffered vector, one block
of scratch per fill thread, and the epoch's block order (8 bytes per block).
"""
from __future__ import annotations

import errno
import os
import resource
import sys
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from queue import SimpleQueue
from threading import Lock
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from actstore.errors import ConfigError, FormatError
from actstore.formats.saev.layout import DTYPE, LABELS, groups_and_ranks
from actstore.formats.saev.read import SaevStore
from actstore.integrity import memory_budget, open_files_budget, whole_number
from actstore.io_utils import pread_into

try:
    from actstore import _scatter
except ImportError:  # built without a C compiler (setup.py: optional): numpy reads + scatter, same results
    _scatter = None

FILL_JOB_BYTES = 4 << 20  # blocks per C call: few enough calls that Python's share is small


class ShuffledActivations(IterableDataset):
    """IterableDataset of {"act": (B, [n_layers,] D) float32, "example_idx": (B,), "token_idx": (B,)}.

    layers: layer values to return (default all stored); one layer gives act (B, D), several give
    (B, n_layers, D) with the same token at each layer. include_cls: yield CLS vectors (ViT stores).
    keep_labels: keep only patches whose labels.bin value is in this set. CLS has no label: include_cls
    alone keeps it (with the default True, every example's CLS comes with the kept patches).
    block_bytes: store bytes per block (every stored layer); below one example a block is a run of
    tokens of one example, else whole examples (block_examples sets their number directly; a block never
    holds more than a shard).
    buffer_blocks: blocks per shuffle buffer; by default as many as fit in buffer_bytes (the memory
    of one buffer: the loader keeps three).
    fill_threads: threads reading and scattering blocks into the buffer (per DataLoader worker).
    rank, world_size: this process's share under data-parallel training (DDP: torch.distributed's
    get_rank() and get_world_size()): the ranks, and each rank's DataLoader workers, read disjoint
    slices of one seeded block order, together every block once an epoch. Ranks may get different
    batch counts (blocks keep different numbers of vectors): train for a set number of steps.
    Batches (and any slice of one) are views of a shuffle buffer and keep all of it: .clone() what you keep.
    """

    def __init__(self, path: str | Path, layers: Iterable[int] | None = None, batch_size: int = 4096,
                 seed: int = 0, block_examples: int | None = None, buffer_blocks: int | None = None,
                 include_cls: bool = True, keep_labels: Iterable[int] | None = None, drop_last: bool = False,
                 block_bytes: int = 32 << 10, fill_threads: int = 2, buffer_bytes: int = 256 << 20,
                 rank: int = 0, world_size: int = 1):
        store = SaevStore(path)
        # Resolved once: each __iter__ (each DataLoader worker) reopens this store, even after the working
        # directory changed (a relative path named another store, or none) or a saev.json was re-pointed.
        self.path = store.dir
        # The blocks, layer offsets and buffer sizes below are planned from this store's layout.
        self._layout = (store.file_metadata, store.shards)
        if layers is not None and not isinstance(layers, Iterable):
            raise ConfigError(f"layers={layers!r} must be a list of stored layers {list(store.layers)}, or None")
        self.layers = list(layers) if layers is not None else list(store.layers)
        self.layer_idx = [store.layer_index(layer) for layer in self.layers]
        counts = (batch_size, fill_threads, block_bytes, buffer_bytes, 1 if buffer_blocks is None else buffer_blocks,
                  1 if block_examples is None else block_examples)
        if not all(whole_number(count, least=1) for count in counts):  # buffer_blocks=0 was taken for the default
            raise ConfigError(f"batch_size={batch_size}, fill_threads={fill_threads}, block_bytes={block_bytes}, "
                              f"buffer_bytes={buffer_bytes}, buffer_blocks={buffer_blocks} and block_examples="
                              f"{block_examples} must be whole numbers >= 1")  # a float failed deep in range()
        if not self.layers:
            raise ConfigError(f"{store.dir}: layers=[] asks for no layer; pass None for every stored one "
                              f"{list(store.layers)}")
        if len(set(self.layers)) != len(self.layers):  # each batch held the layer twice, as two layers
            raise ConfigError(f"{store.dir}: layers={self.layers} names a layer twice")
        if not (isinstance(include_cls, bool) and isinstance(drop_last, bool)):  # "no" was taken for True
            raise ConfigError(f"include_cls={include_cls!r} and drop_last={drop_last!r} must be True or False")
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        self.include_cls, self.fill_threads = include_cls, fill_threads
        if not whole_number(seed):  # numpy's seeding refuses it naming nothing, at the first batch
            raise ConfigError(f"seed={seed!r} must be a whole number >= 0")
        if not (whole_number(world_size, least=1) and whole_number(rank) and rank < world_size):
            raise ConfigError(f"rank={rank!r} and world_size={world_size!r} must be whole numbers, 0 <= rank < "
                              "world_size")
        self.rank, self.world_size = rank, world_size
        self.keep_labels = None if keep_labels is None else _label_values(keep_labels)
        self._labels_path(store)  # refused now, not at the first epoch, where the store has no labels.bin
        # Sizes count every stored layer, so choosing fewer layers changes which tokens a block holds
        # and a buffer's block count not at all (the batches are the same, narrower); memory only shrinks.
        token_bytes = store.L * store.D * DTYPE.itemsize
        if block_examples is None and block_bytes < store.example_bytes:  # runs of tokens inside one example
            self.block_examples = 1
            self.chunks_per_example = -(-store.T // max(1, block_bytes // token_bytes))
        else:  # a block never crosses a shard: one asked larger is the largest shard (the same blocks),
            # so its scratch and buffers are not sized by what was asked (petabytes for block_bytes=1 << 50)
            largest = max([1] + [shard["n_examples"] for shard in store.shards])
            self.block_examples = min(block_examples or block_bytes // store.example_bytes, largest)
            self.chunks_per_example = 1
        self.runs = self._runs(store, block_bytes)
        self.block_vectors = self.block_examples * -(-store.T // self.chunks_per_example)  # at most
        self.buffer_blocks = buffer_blocks or max(1, buffer_bytes // (self.block_vectors * token_bytes))
        # In shared memory: DataLoader workers started before set_epoch (persistent_workers) still see
        # it, instead of replaying their first epoch's order every epoch.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def n_blocks(self) -> int:
        return len(self.runs) * self.chunks_per_example

    def __getstate__(self) -> dict:
        """Sent to DataLoader workers without the buffers: each process makes its own."""
        return {k: v for k, v in self.__dict__.items() if k != "_pool"}

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """A new epoch gets a new (still seeded) order, in this process and its DataLoader workers."""
        if not whole_number(epoch):  # -1 failed in numpy at the first batch, 2.7 was taken for epoch 2
            raise ConfigError(f"epoch={epoch!r} must be a whole number >= 0")
        self._epoch.fill_(epoch)

    def _reopened(self) -> SaevStore:
        """The store again, refused when the files at its path now describe another one (a store written
        over it): blocks planned from the old layout yielded part of a larger store as a whole epoch, and
        failed on a smaller one with a bare IndexError."""
        store = SaevStore(self.path)
        if (store.file_metadata, store.shards) != self._layout:
            raise FormatError(f"{store.dir}: changed since this loader was made (its metadata.json or "
                              "shards.json differ); make a new ShuffledActivations for the store there now")
        return store

    def _runs(self, store: SaevStore, block_bytes: int) -> np.ndarray:
        """(n_runs, 2) first example, n examples: runs of block_examples inside one shard, a partition
        of every example. Block b is token chunk b % chunks_per_example of run b // chunks_per_example.
        The index is sized by the store's example count, so it is checked against memory first."""
        n = np.array([shard["n_examples"] for shard in store.shards], dtype=np.int64)
        runs_per_shard = -(-n // self.block_examples)
        n_runs = int(runs_per_shard.sum())
        need = n_runs * 16 + n_runs * self.chunks_per_example * 16  # runs, then an epoch's order + a slice
        if need > memory_budget():
            raise ConfigError(f"{store.dir}: {n_runs * self.chunks_per_example:,} blocks of {block_bytes} bytes "
                              f"({int(n.sum()):,} examples): the loader's block index would need "
                              f"{need / 1e9:.1f} GB, over a quarter of this machine's memory; pass a larger "
                              f"block_bytes (or block_examples)")
        shard, nth = groups_and_ranks(runs_per_shard)
        lo = nth * self.block_examples
        first = np.asarray(store.starts, dtype=np.int64)[shard] + lo
        return np.stack([first, np.minimum(self.block_examples, n[shard] - lo)], axis=1).reshape(-1, 2)

    def my_blocks(self, epoch: int) -> np.ndarray:
        """This rank's and worker's block ids for `epoch`: a disjoint slice of one seeded permutation. The
        rank's share is cut first, so it does not depend on how many DataLoader workers the rank runs (ranks
        of different worker counts read some blocks twice and others never)."""
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return order[self.rank::self.world_size][worker::workers]

    def _stream(self, info: Any) -> int:
        """This rank's and worker's own shuffle stream: ranks with one stream would permute their
        (disjoint) buffers alike, the n-th row of every rank's batch drawn from the same buffer slot.
        Rank 0 keeps the streams a single process always had (0 alone, worker i: i + 1)."""
        slots = 1 if info is None else info.num_workers + 1
        return self.rank * slots + (0 if info is None else info.id + 1)

    def _plan(self, store: SaevStore, labels: Path | None, ids: np.ndarray, n_carry: int,
              rng: np.random.Generator, acts: np.ndarray) -> tuple[_Fill, _Blocks]:
        """Where every vector of blocks `ids` goes: vector i in (block, example, token) order to row
        rows[i] of the buffer (-1: not kept: CLS off, padding, label filter), after the n_carry rows
        left over from the last buffer; the example/token index of every row is filled in here."""
        run, chunk = np.divmod(ids, self.chunks_per_example)
        first, n_ex = self.runs[run, 0], self.runs[run, 1]
        tok_lo = chunk * store.T // self.chunks_per_example
        n_tok = (chunk + 1) * store.T // self.chunks_per_example - tok_lo
        counts = n_ex * n_tok
        block, within = groups_and_ranks(counts)
        ex = first[block] + within // n_tok[block]
        tok = tok_lo[block] + within % n_tok[block]
        keep = self._kept(store, labels, ex, tok)
        n = n_carry + int(keep.sum())
        perm = rng.permutation(n)
        rows = np.full(len(ex), -1, dtype=np.int64)
        rows[keep] = perm[n_carry:]
        buf = _Fill(acts[:n], np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), perm, [])
        buf.exs[perm[n_carry:]], buf.toks[perm[n_carry:]] = ex[keep], tok[keep]
        shard = np.searchsorted(store.starts, first, side="right") - 1
        offsets = (first - store.starts[shard]) * store.example_bytes + tok_lo * store.D * DTYPE.itemsize
        return buf, _Blocks(shard, offsets, n_ex, n_tok, rows, np.cumsum(counts) - counts)

    def _kept(self, store: SaevStore, labels: Path | None, ex: np.ndarray, tok: np.ndarray) -> np.ndarray:
        """Which of the (example, token) pairs are yielded (labels: the store's labels.bin)."""
        keep = np.ones(len(ex), dtype=bool)
        cls = int(store.metadata["cls_token"])
        if cls and not self.include_cls:
            keep &= tok != 0
        if store.windows is not None:
            keep &= tok < store.windows[ex, 2]
        if self.keep_labels is not None:
            patch = tok >= cls
            examples, row = np.unique(ex[patch], return_inverse=True)
            values = _label_rows(labels, examples, store.patches_per_ex)[row, tok[patch] - cls]
            keep[patch] &= np.isin(values, self.keep_labels)
        return keep

    def _labels_path(self, store: SaevStore) -> Path | None:
        """labels.bin when keep_labels filters by it, its size checked as each epoch begins (SaevStore.labels)."""
        if self.keep_labels is None:
            return None
        if store.labels() is None:  # also as each epoch begins: a store written over this one since
            raise ConfigError(f"{store.dir}: keep_labels given but the store has no labels.bin")
        return store.dir / LABELS

    def _fill(self, store: SaevStore, shards: "_ShardFiles", acts: np.ndarray, blocks: "_Blocks",
              scratch: SimpleQueue) -> None:
        """Read blocks and scatter their kept vectors to their rows of acts. Runs on a fill thread:
        blocks own disjoint rows, and the C call runs without the GIL, so jobs fill in parallel."""
        buf = scratch.get()
        try:
            if _scatter is None:  # each read holds its shard open
                self._fill_numpy(store, shards, acts, blocks, buf)
                return
            with shards.opened(blocks.shard) as fds:
                layer_off = np.array(self.layer_idx, dtype=np.int64) * store.T * store.D * DTYPE.itemsize
                short = _scatter.fill(acts.ctypes.data, len(acts), acts.strides[0], buf.ctypes.data, buf.nbytes,
                                      len(fds), fds.ctypes.data, blocks.offsets.ctypes.data, blocks.n_ex.ctypes.data,
                                      blocks.n_tok.ctypes.data, store.example_bytes, len(layer_off),
                                      layer_off.ctypes.data, store.D * DTYPE.itemsize, blocks.rows.ctypes.data)
                if short is not None:  # (block, where the read started, errno: 0 when the file ended first)
                    block, offset, error = short
                    raise shards.failed(int(blocks.shard[block]), offset, error)
        finally:
            scratch.put(buf)

    def _fill_numpy(self, store: SaevStore, shards: "_ShardFiles", acts: np.ndarray, blocks: "_Blocks",
                    buf: np.ndarray) -> None:
        """The same as _scatter.fill, one block at a time (no C compiler at install)."""
        layer_bytes = store.T * store.D * DTYPE.itemsize
        for i, (shard, offset, ne, nt, lo) in enumerate(zip(*(a.tolist() for a in (
                blocks.shard, blocks.offsets, blocks.n_ex, blocks.n_tok, blocks.first_row)))):
            data = buf.reshape(-1)[:ne * len(self.layer_idx) * nt * store.D].reshape(ne, -1, nt, store.D)
            for e in range(ne):
                for j, layer in enumerate(self.layer_idx):
                    shards.read(shard, offset + e * store.example_bytes + layer * layer_bytes, data[e, j])
            rows = blocks.rows[lo:lo + ne * nt]
            acts[rows[rows >= 0]] = data.transpose(0, 2, 1, 3).reshape(ne * nt, -1, store.D)[rows >= 0]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        store = self._reopened()  # per worker: its own file descriptors
        info, epoch = get_worker_info(), self.epoch  # read once: set_epoch may run meanwhile
        rng = np.random.default_rng([self.seed, epoch, self._stream(info)])
        nl, squeeze, size = len(self.layer_idx), len(self.layers) == 1, self.batch_size
        blocks = self.my_blocks(epoch)
        # Sized by the blocks this process reads: a buffer_blocks (or buffer_bytes) past the whole
        # store, asking to shuffle it all at once, or a batch_size past it (the rows a buffer keeps for
        # the last one's leftovers), must not allocate buffers of that size.
        shape = (min(self.buffer_blocks * self.block_vectors + size, len(blocks) * self.block_vectors), nl, store.D)
        pool = self.__dict__.setdefault("_pool", [])  # kept across epochs, per process
        if pool and pool[0].shape != shape:
            pool.clear()
        labels = self._labels_path(store)
        shards = _ShardFiles(store)
        fill = ThreadPoolExecutor(max_workers=self.fill_threads)
        scratch: SimpleQueue = SimpleQueue()  # one read buffer per fill thread, reused: it stays in cache
        for _ in range(self.fill_threads):
            scratch.put(np.empty((self.block_vectors, nl, store.D), dtype=DTYPE))
        # A job holds its blocks' shards open while it reads: the fill threads' jobs together stay
        # within the open-file budget however many shards the store has.
        per_job = max(1, min(FILL_JOB_BYTES // (self.block_vectors * nl * store.D * DTYPE.itemsize),
                             shards.budget // self.fill_threads))

        def start(ids: np.ndarray, n_carry: int) -> _Fill:
            """Plan one buffer and start filling it; the carry is placed once it is known."""
            buf, blocks = self._plan(store, labels, ids, n_carry, rng, _buffer(pool, shape))
            buf.jobs = [fill.submit(self._fill, store, shards, buf.acts, blocks.slice(lo, lo + per_job), scratch)
                        for lo in range(0, len(ids), per_job)]
            return buf

        try:
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


def _label_rows(path: Path, examples: np.ndarray, width: int) -> np.ndarray:
    """labels.bin's rows of `examples` (sorted, unique), read, never mapped: a file cut short during
    the epoch is named (reading a map of it killed the process with SIGBUS). Runs of consecutive
    examples are read at once: a buffer's blocks are whole runs or token chunks of single examples."""
    out = np.empty((len(examples), width), dtype=np.uint8)
    if not len(examples):  # a buffer of CLS tokens only
        return out
    breaks = (np.flatnonzero(np.diff(examples) != 1) + 1).tolist()
    fd = os.open(path, os.O_RDONLY)
    try:
        for lo, hi in zip([0, *breaks], [*breaks, len(examples)]):
            offset = int(examples[lo]) * width
            if pread_into(fd, out[lo:hi], offset) < out[lo:hi].nbytes:
                raise FormatError(f"{path}: ends at byte {os.fstat(fd).st_size}, before byte "
                                  f"{offset + out[lo:hi].nbytes} of the labels read; was it truncated or purged?")
    finally:
        os.close(fd)
    return out


def _label_values(keep_labels: Iterable[int]) -> np.ndarray:
    """keep_labels as the uint8 values labels.bin holds. Any other value is refused: numpy would keep
    label 1 for 1.5, or fail on 300 or a bare 1 without naming keep_labels."""
    values = sorted(set(keep_labels)) if isinstance(keep_labels, Iterable) else None
    if values is None or not all(isinstance(v, (int, np.integer)) and 0 <= v <= 255 for v in values):
        raise ConfigError(f"keep_labels={keep_labels!r} must be labels.bin values: ints in [0, 255]")
    return np.array(values, dtype=np.uint8)


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


@dataclass
class _Blocks:
    """Blocks to read (int64 arrays): shard, byte offset of the first vector, examples, tokens; and
    the destination row of each of their vectors (block i's from first_row[i])."""
    shard: np.ndarray
    offsets: np.ndarray
    n_ex: np.ndarray
    n_tok: np.ndarray
    rows: np.ndarray
    first_row: np.ndarray

    def slice(self, lo: int, hi: int) -> "_Blocks":
        """Blocks lo..hi with their own rows (contiguous, in the order the fill walks them)."""
        hi = min(hi, len(self.shard))
        start = int(self.first_row[lo])
        end = int(self.first_row[hi]) if hi < len(self.shard) else len(self.rows)
        return _Blocks(self.shard[lo:hi], self.offsets[lo:hi], self.n_ex[lo:hi], self.n_tok[lo:hi],
                       self.rows[start:end], self.first_row[lo:hi] - start)


class _ShardFiles:
    """Shard file descriptors shared by the fill threads, opened on first use. A buffer's blocks come
    from anywhere in the store, so a process would soon hold every shard open, past the open-file limit
    on a store of thousands of shards: past `budget` the least recently used shard no job is reading
    is closed, and opened again when a later block needs it."""

    def __init__(self, store: SaevStore):
        self.store, self.lock = store, Lock()
        self.fds: OrderedDict[int, int] = OrderedDict()  # least recently used first
        self.readers: Counter[int] = Counter()  # jobs reading each shard now: never closed under them
        self.budget = open_files_budget()

    def path(self, shard: int) -> Path:
        return self.store.dir / self.store.shards[shard]["name"]

    @contextmanager
    def opened(self, shards: np.ndarray) -> Iterator[np.ndarray]:
        """The file descriptor of each of `shards` (int64, as _scatter.fill takes them), kept open
        until the block ends."""
        used, which = np.unique(shards, return_inverse=True)
        held: list[int] = []
        try:
            with self.lock:
                for shard in used.tolist():
                    self._open(shard)
                    self.readers[shard] += 1
                    held.append(shard)
                fds = np.array([self.fds[shard] for shard in held], dtype=np.int64)[which]
            yield fds
        finally:
            with self.lock:
                self.readers.subtract(held)
                self._close_past_budget()

    def _open(self, shard: int) -> None:
        """Open `shard` unless it is (then it is the most recently used); the caller holds the lock."""
        if shard not in self.fds:
            self._close_past_budget()
            try:
                self.fds[shard] = os.open(self.path(shard), os.O_RDONLY)
            except OSError as exc:
                raise self.not_opened(shard, exc) from exc
        self.fds.move_to_end(shard)

    def _close_past_budget(self) -> None:
        """Close the least recently used shards no job is reading, down to `budget` open."""
        while len(self.fds) > self.budget:
            idle = next((shard for shard in self.fds if not self.readers[shard]), None)
            if idle is None:  # every open shard is being read: the jobs hold at most the budget
                return
            os.close(self.fds.pop(idle))

    def not_opened(self, shard: int, exc: OSError) -> OSError:
        """The error for a shard that would not open. At the open-file limit (the loader keeps about
        `budget` shards open, a quarter of it, at least 16: the rest of the process holds the others) the
        message says what to change."""
        message = f"{self.path(shard)}: cannot open it ({exc.strerror})"
        if exc.errno == errno.EMFILE:
            message += (f": this process has {len(self.fds)} of the store's {len(self.store.shards)} shards open, "
                        f"at its open-file limit of {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}: raise it "
                        "(ulimit -n, up to the hard limit `ulimit -Hn`) or write the store in fewer, larger "
                        "shards (saev.patches_per_shard)")
        return OSError(exc.errno, message)

    def failed(self, shard: int, offset: int, error: int) -> Exception:
        """The error for a read of `shard` at `offset` that failed (errno `error`) or found the file
        ended (0), naming the file (and its size now: it was checked when the epoch began)."""
        path = self.path(shard)
        if error:
            return OSError(error, f"{path}: {os.strerror(error)} (reading at byte {offset})")
        ends = os.fstat(self.fds[shard]).st_size if shard in self.fds else os.stat(path).st_size
        return FormatError(f"{path}: ends at byte {ends}, shards.json says {self.store.shard_bytes(shard)}; was it "
                           "truncated or purged?")

    def read(self, shard: int, offset: int, out: np.ndarray) -> None:
        """Fill a C-contiguous array from a shard at offset, resuming after short reads."""
        with self.opened(np.array([shard])) as fds:
            try:
                done = pread_into(int(fds[0]), out, offset)
            except OSError as exc:
                raise self.failed(shard, offset, exc.errno) from exc
            if done < out.nbytes:
                raise self.failed(shard, offset + done, 0)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _place(out: tuple[np.ndarray, ...], rows: np.ndarray, carry: tuple[np.ndarray, ...]) -> None:
    """The last buffer's leftover vectors (fewer than a batch) go to their rows of this one."""
    for dest, src in zip(out, carry):
        dest[rows] = src


def _references_when_free() -> int:
    """What sys.getrefcount says of a pool's buffer that nothing else holds, asked as _buffer asks it:
    interpreters count their own temporary references differently (CPython 3.14 borrows references
    that 3.11 counted), so the count is measured, not assumed."""
    pool = [np.empty(0, dtype=DTYPE)]
    return sys.getrefcount(pool[0])


FREE_REFERENCES = _references_when_free()


def _buffer(pool: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """A buffer no yielded batch still uses (recycled: fresh memory costs a page fault per 4 KiB,
    which is most of the time of a large read), else a new one. Batches are views of a buffer and
    keep it referenced, so a batch the consumer still holds is never overwritten."""
    for i in range(len(pool)):
        if sys.getrefcount(pool[i]) == FREE_REFERENCES:
            return pool[i]
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
