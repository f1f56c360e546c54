"""The SAE's data: a held-out split of whole samples, the hook's memmaps, shuffled batch streaming and
a background Prefetcher that makes the next batches (and sends them to the GPU) during the step."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from actstore.errors import ConfigError, FormatError
from actstore.formats.extract import Extraction, Part, PartFile, part_reads, tensor_file


@dataclass
class TokenSplit:
    """Token rows of each part for training and for held-out evaluation (whole samples), increasing
    within each part, in index_dtype: they are held for the whole run."""

    train: list[np.ndarray]
    heldout: list[np.ndarray]
    heldout_samples: list[int]

    @property
    def n_train(self) -> int:
        return sum(len(rows) for rows in self.train)

    @property
    def n_heldout(self) -> int:
        return sum(len(rows) for rows in self.heldout)


def split_tokens(extraction: Extraction, heldout_fraction: float, seed: int) -> TokenSplit:
    """Hold out a seeded random fraction of samples; every token of a sample goes to one side."""
    n = extraction.n_samples
    rng = np.random.default_rng(seed)
    n_held = min(n - 1, max(1, int(round(n * heldout_fraction)))) if n > 1 else 0
    held = np.zeros(n, dtype=bool)
    held[rng.permutation(n)[:n_held]] = True
    train, heldout = [], []
    for part in extraction.parts:
        start = part.sample_start
        counts = np.diff(part.offsets)
        is_held = np.repeat(held[start:start + len(counts)], counts)
        rows = np.arange(int(part.offsets[-1]), dtype=index_dtype(int(part.offsets[-1])))
        train.append(rows[~is_held])
        heldout.append(rows[is_held])
    return TokenSplit(train, heldout, [int(i) for i in np.flatnonzero(held)])


def index_dtype(n: int) -> type:
    """int32 for indices below `n` when they fit, else int64: the split's rows and an epoch's order are
    held for the whole run, 16 B a training token in int64 (16 GB at 1B tokens), 8 in int32."""
    return np.int32 if n <= 2**31 else np.int64


class PartRows:
    """One part's (n_tokens, d) hook tensor, read as float32, asked of the part at each read. A
    StoredTensor held for the whole run kept its memory map, and so a file descriptor, open: an
    extraction of more parts than the limit on open files failed; the part lets its least recently
    used maps go (read.OPEN_MAPS). A part of no samples holds no data file, and is never read.
    Every read is checked finite: one NaN or inf (a float16 capture past its range) in a batch made
    the whole SAE NaN, or a held-out FVU NaN, with no error."""

    def __init__(self, part: Part, hook: str, width: int):
        self.part, self.hook = part, hook
        self.shape = (part.info.n_tokens, width)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        values = self.part.tensor(self.hook)[key]
        if not np.isfinite(values).all():
            self._refuse_non_finite(key, values)
        return values

    def _refuse_non_finite(self, key: Any, values: np.ndarray) -> None:
        """FormatError naming the file, the first token row holding a NaN or inf and its sample."""
        rows = np.atleast_1d(np.arange(len(self))[key])  # the token rows `key` read (one for an int)
        row = int(rows[np.flatnonzero(~np.isfinite(values).reshape(len(rows), -1).all(axis=1))[0]])
        sample = self.part.sample_start + int(np.searchsorted(self.part.offsets, row, side="right")) - 1
        raise FormatError(f"{self.part.dir / tensor_file(self.hook)}: token row {row} (sample {sample}) of "
                          f"{self.hook} holds a non-finite value; an SAE trained or evaluated on it is NaN")


def tensors(extraction: Extraction, hook: str) -> list[PartRows]:
    """The hook's (n_tokens, d) float32 rows of each part (nothing is loaded here)."""
    if hook not in extraction.tensor_names:
        raise ConfigError(f"sae.hook {hook!r} was not captured by the extraction at {extraction.dir}; "
                          f"captured: {extraction.tensor_names} (add it to extract.hooks)")
    holding = next((p for p in extraction.parts if p.info.n_tokens), None)
    if holding is None:  # the extract stage refuses an empty dataset; a hand-made extraction may hold none
        raise ConfigError(f"sae: the extraction at {extraction.dir} holds no token")
    width = holding.tensor(hook).shape[1]  # the same in every part
    return [PartRows(part, hook, width) for part in extraction.parts]


def hook_reads(extraction: Extraction, hook: str, rows: list[np.ndarray] | None = None) -> list[PartFile]:
    """The part files read for `rows` (token rows per part; None: every part's) of `hook`, to be checked
    whole (PartsCheck): every part's offsets.npy (the split reads them all) and the hook's file of each
    part a row is read from. part.json records one digest a file, so a file one row is read from is
    hashed whole; a part no row is read from is not read, nor checked."""
    return [pair for p, part in enumerate(extraction.parts)
            for pair in part_reads(part, [hook] if rows is None or len(rows[p]) else [], samples=False)]


def gather(arrays: list[np.ndarray], rows: list[np.ndarray], picks: np.ndarray) -> np.ndarray:
    """Rows `picks` (indices into the concatenation of `rows`) read from the memmaps, part by part in
    increasing row order so each read walks the file forward. The picks are sorted once and cut at the
    parts' bounds: masking them for every part was O(parts) array passes a batch, half the time of a
    batch of 4,096 from a 2,048-part extraction (37 batches/s, 80 now; the prefetcher set the pace)."""
    starts = np.cumsum([0] + [len(r) for r in rows])
    picks = np.sort(picks)
    cuts = np.searchsorted(picks, starts)
    out = [np.asarray(arrays[p][rows[p][picks[cuts[p]:cuts[p + 1]] - starts[p]]], dtype=np.float32)
           for p in np.flatnonzero(np.diff(cuts))]
    return np.concatenate(out) if out else np.empty((0, arrays[0].shape[1]), np.float32)


def stream_batches(arrays: list[np.ndarray], rows: list[np.ndarray], batch_size: int,
                   rng: np.random.Generator) -> Iterator[torch.Tensor]:
    """Endless shuffled batches: each epoch is a fresh permutation of the training rows."""
    total = sum(len(r) for r in rows)
    if total == 0:
        raise ConfigError("sae: no training tokens (dataset too small for sae.heldout_fraction)")
    while True:
        order = np.arange(total, dtype=index_dtype(total))
        rng.shuffle(order)  # rng.permutation(total)'s order and draws, in half the bytes
        for start in range(0, total - batch_size + 1 if total >= batch_size else 1, batch_size):
            yield torch.from_numpy(gather(arrays, rows, order[start:start + batch_size]))


class Prefetcher:
    """Batches of `source` made on a background thread, `depth` ahead of the training step.

    On CUDA each batch is copied into one of a ring of pinned host buffers and sent to the device on a
    side stream; the step's stream waits on that copy's event, the host never does (no per-step
    synchronisation). Elsewhere the thread only overlaps the memmap gathers with the step (no pinning:
    pinned memory only speeds up copies to a GPU). The batches and their order are those of `source`,
    and it ends where a finite `source` ends.
    """

    def __init__(self, source: Iterator[torch.Tensor], device: torch.device, depth: int = 2):
        self.device, self.cuda = device, device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # A pinned slot is rewritten only after its copy finished: depth queued + 1 in use + 1 being filled.
        self._slots = depth + 2
        self._thread = threading.Thread(target=self._produce, args=(source,), daemon=True, name="sae-prefetch")
        self._thread.start()

    def _produce(self, source: Iterator[torch.Tensor]) -> None:
        try:
            stream = torch.cuda.Stream(self.device) if self.cuda else None
            pinned: list[torch.Tensor | None] = [None] * self._slots
            copied: list[torch.cuda.Event | None] = [None] * self._slots
            for i, batch in enumerate(source):
                item = (batch, None)
                if self.cuda:
                    slot = i % self._slots
                    if copied[slot] is not None:
                        copied[slot].synchronize()  # this (background) thread waits, not the step
                    if pinned[slot] is None or pinned[slot].shape != batch.shape:
                        pinned[slot] = torch.empty(batch.shape, dtype=batch.dtype, pin_memory=True)
                    pinned[slot].copy_(batch)
                    with torch.cuda.stream(stream):
                        on_device = pinned[slot].to(self.device, non_blocking=True)
                        copied[slot] = torch.cuda.Event()
                        copied[slot].record(stream)
                    item = (on_device, copied[slot])
                if not self._put(item):
                    return
            # A finite source's end: without it a consumer waited for the next batch forever.
            self._put((StopIteration(), None))
        except BaseException as exc:  # re-raised in the training thread by __next__
            self._put((exc, None))

    def _put(self, item: tuple[Any, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> torch.Tensor:
        batch, copied = self._get()
        if isinstance(batch, BaseException):  # the end or the source's error: the producer's last item
            self._queue.put_nowait((batch, copied))  # raised again at any later call, which waited forever
            raise batch
        if copied is not None:
            step_stream = torch.cuda.current_stream(self.device)
            step_stream.wait_event(copied)
            batch.record_stream(step_stream)  # allocated on the side stream, used on this one
        return batch

    def _get(self) -> tuple[Any, Any]:
        """The next queued item, or StopIteration once closed: a training loop that closed the Prefetcher
        on an error and then drained it (a finally), or a consumer waiting while another thread closed
        it, waited forever for a batch the stopped producer never makes."""
        while not self._stop.is_set():
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
        raise StopIteration

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def iter_rows(arrays: list[np.ndarray], rows: list[np.ndarray], chunk: int = 8192) -> Iterator[np.ndarray]:
    """The given rows in order, `chunk` at a time (a sample of them: sampled_rows)."""
    for array, part_rows in zip(arrays, rows):
        for start in range(0, len(part_rows), chunk):
            yield np.asarray(array[part_rows[start:start + chunk]], dtype=np.float32)


class Moments(NamedTuple):
    """data_moments' result: the mean (float32, b_dec's start), rows read, variance (summed over the
    columns) and mean square norm (float64)."""

    mean: torch.Tensor
    count: int
    variance: float
    mean_square: float


def data_mean(arrays: list[np.ndarray], rows: list[np.ndarray], limit: int = 65536, seed: int = 0) -> torch.Tensor:
    """Mean of the given rows (b_dec's start), of a seeded uniform sample of `limit` of them when there
    are more: the first `limit` in storage order were one class's tokens in a dataset sorted by label
    (an image folder: ImageNet's first 255 images at 257 tokens each)."""
    return data_moments(arrays, rows, limit, seed).mean


def data_moments(arrays: list[np.ndarray], rows: list[np.ndarray], limit: int = 65536, seed: int = 0) -> Moments:
    """data_mean's mean with the same rows' variance and mean square, read in the same pass."""
    total, squares, count = None, 0.0, 0
    for block in iter_rows(arrays, sampled_rows(rows, limit, seed)):
        wide = block.astype(np.float64)
        s = wide.sum(0)
        total = s if total is None else total + s
        squares += float(np.einsum("ij,ij->", wide, wide))  # no squared copy of the block
        count += len(block)
    mean = total / max(count, 1)
    mean_square = squares / max(count, 1)
    return Moments(torch.from_numpy(mean).float(), count, mean_square - float(mean @ mean), mean_square)


def sampled_rows(rows: list[np.ndarray], limit: int | None, seed: int) -> list[np.ndarray]:
    """`rows` (per part) when they are at most `limit` (None: no limit), else a seeded uniform sample of
    `limit` of them, in storage order within each part (sequential reads)."""
    sizes = np.array([len(part_rows) for part_rows in rows], dtype=np.int64)
    if limit is None or sizes.sum() <= limit:
        return rows
    picked = uniform_picks(int(sizes.sum()), limit, np.random.default_rng(seed))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    cuts = np.searchsorted(picked, starts)  # each part's share of the sorted picks
    return [part_rows[picked[cuts[i]:cuts[i + 1]] - starts[i]] for i, part_rows in enumerate(rows)]


PERMUTED_ROWS = 1 << 24  # numpy's choice of rows below this: 128 MB of int64 at most


def uniform_picks(total: int, limit: int, rng: np.random.Generator) -> np.ndarray:
    """`limit` distinct positions of range(total), sorted: a seeded uniform sample. numpy's choice
    permutes all `total` positions (8 B each) when limit is above total / 50: sae.eval_tokens 10M of
    200M held-out tokens took 1.6 GB beyond the split. It is kept up to PERMUTED_ROWS (the picks the
    demo and the tests were made with) and where the picks are most of the positions (the permutation
    is then at most twice the picks); elsewhere the picks are the distinct values of uniform draws."""
    if total <= PERMUTED_ROWS or limit > total // 2:
        return np.sort(rng.choice(total, size=limit, replace=False))
    return distinct_draws(total, limit, rng)


def distinct_draws(total: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """The first `count` distinct values of a stream of uniform draws from range(total), sorted (a
    uniform sample without replacement), in memory of a few times `count`. Each round draws as many as
    are missing, so never one too many; with count at most total / 2 a draw is new at least half the
    time, and the missing ones halve each round on average."""
    picked = np.empty(0, dtype=np.int64)
    while len(picked) < count:
        picked = np.union1d(picked, rng.integers(total, size=count - len(picked)))
    return picked
