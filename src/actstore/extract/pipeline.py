"""The write pipeline: captured tensors leave the device through a ring of staging buffers while
the model runs the next batch, and writer threads put them in the part's files.

    forward (batch b+1)  ──►  pack on the device  ──►  staging slot (pinned; side stream on CUDA)
                                                           │  bounded: `buffers` slots in flight
                                 writer threads  ◄─────────┘  (one owner per file, hashed as written)

A slow disk blocks `submit` on a free slot, so it slows the GPU instead of filling memory. The same
pipeline runs on CPU (plain buffers, synchronous copies).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actstore.formats.extract import PartWriter

ALIGN = 64  # byte alignment of each file's region in a staging slot (any dtype view is legal)
POLL_S = 0.1  # how often a blocked submit looks for a failed writer (never hangs on a dead thread)
# A writer thread waits for its slot's copies asleep (cudaEventBlockingSync). A default event's wait
# spins a CPU until the copies are done, which is through the forward of the batch: a core per
# writer thread taken from the image-decoding workers and the main thread, which an image part is
# short of (torchrec measured a spinning wait slowing a thread beside it by 28 %; vLLM made its copy
# events blocking for the same reason); on the H100 a ViT part with them spinning took 1.49 s, asleep 1.36.


@dataclass
class BatchRows:
    """Where a batch's samples go: batch position j is local sample local_idx[j], whose tokens are
    packed rows token_start[j]:token_start[j] + n_tokens[j] of every token tensor."""

    local_idx: np.ndarray
    n_tokens: np.ndarray
    token_start: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.token_start = np.concatenate([[0], np.cumsum(self.n_tokens)[:-1]]).astype(np.int64)


@dataclass
class _Region:
    start: int        # byte offset in the slot
    unit_bytes: int   # bytes per token row (token files) or per sample row (row files)
    per_token: bool


@dataclass
class _Slot:
    buffer: torch.Tensor | None = None  # flat uint8 host buffer (pinned on CUDA)
    event: Any = None                   # CUDA event: the device->host copies are done
    rows: BatchRows | None = None
    regions: dict[str, _Region] = field(default_factory=dict)
    pending: int = 0


class WritePipeline:
    """Context manager: `submit` each batch's packed tensors; leaving the block waits for every
    write (raising the first writer error, naming the file) or, on an exception, abandons them."""

    def __init__(self, writer: PartWriter, device: torch.device, buffers: int, writer_threads: int):
        """writer_threads: at most this many (never more than the part has files)."""
        self.writer = writer
        self.max_threads = writer_threads
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(buffers):
            self.free.put(_Slot())
        self.lock = threading.Lock()
        self.error: tuple[str, BaseException] | None = None
        self.owned: list[list[str]] = []
        self.inboxes: list[queue.Queue] = []
        self.threads: list[threading.Thread] = []
        self.staging_wait = 0.0  # seconds submit waited for a free slot: the writers were behind
        self.busy: list[float] = []  # seconds each writer thread spent writing and hashing

    def __enter__(self) -> WritePipeline:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            with self.lock:
                self.error = self.error or ("", exc)
        for inbox in self.inboxes:
            inbox.put(None)
        for thread in self.threads:
            thread.join()
        if self.error is not None:
            # Only once every writer thread has stopped: abort closes the descriptors they write to
            # (which the kernel may hand to another file) and the hashing threads they use.
            self.writer.abort()
        if exc_type is None:
            self._raise_writer_error()

    def _raise_writer_error(self) -> None:
        """The first writer error, naming its file (the part is aborted when the threads are joined)."""
        if self.error is not None:
            path, exc = self.error
            raise OSError(f"{path}: writing the extraction failed: {exc}") from exc

    def submit(self, rows: BatchRows, token_tensors: dict[str, torch.Tensor],
               row_tensors: dict[str, torch.Tensor]) -> None:
        """Queue one batch: token_tensors (n_tokens, ...) packed in batch order, row_tensors
        (batch, ...) one row per sample; any device, already in the file's dtype."""
        if not self.writer.sinks:
            self._declare(token_tensors, row_tensors)
        slot = self._free_slot()
        slot.rows = rows
        tensors = {**token_tensors, **row_tensors}
        slot.regions, size = {}, 0
        for file, tensor in tensors.items():
            per_token = file in token_tensors
            unit_bytes = tensor[0].nbytes if len(tensor) else 0
            slot.regions[file] = _Region(size, unit_bytes, per_token)
            size += -(-tensor.nbytes // ALIGN) * ALIGN
        if slot.buffer is None or slot.buffer.numel() < size:
            slot.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
        self._copy_to_host(slot, tensors)
        slot.pending = len(self.inboxes)
        for inbox in self.inboxes:
            inbox.put(slot)

    def _declare(self, token_tensors: dict[str, torch.Tensor], row_tensors: dict[str, torch.Tensor]) -> None:
        """Create each file from the first batch's shapes; hand files to writer threads, largest first."""
        for file, tensor in token_tensors.items():
            self.writer.add_tokens(file, tensor.shape[1] if tensor.dim() == 2 else None, dtype_name(tensor.dtype))
        for file, tensor in row_tensors.items():
            self.writer.add_rows(file, tensor.shape[1], dtype_name(tensor.dtype))
        by_size = sorted({**token_tensors, **row_tensors}.items(), key=lambda kv: (-kv[1][0].nbytes, kv[0]))
        n_threads = min(self.max_threads, len(by_size))
        self.owned = [[file for file, _ in by_size[i::n_threads]] for i in range(n_threads)]
        self.inboxes = [queue.Queue() for _ in range(n_threads)]
        self.busy = [0.0] * n_threads
        self.threads = [threading.Thread(target=self._write_loop, args=(i,), daemon=True, name=f"part-writer-{i}")
                        for i in range(n_threads)]
        for thread in self.threads:
            thread.start()

    def _free_slot(self) -> _Slot:
        asked = time.perf_counter()
        while True:
            self._raise_writer_error()
            try:
                slot = self.free.get(timeout=POLL_S)
            except queue.Empty:
                continue
            self.staging_wait += time.perf_counter() - asked
            return slot

    def _copy_to_host(self, slot: _Slot, tensors: dict[str, torch.Tensor]) -> None:
        def copy_all() -> None:
            for file, tensor in tensors.items():
                start = slot.regions[file].start
                dst = slot.buffer[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
                dst.copy_(tensor, non_blocking=self.cuda)
                if tensor.is_cuda:
                    tensor.record_stream(self.copy_stream)  # keep it alive until the copy ran

        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.copy_stream):
                copy_all()
                slot.event = torch.cuda.Event(blocking=True)
                slot.event.record(self.copy_stream)
        else:
            copy_all()

    def _write_loop(self, thread_idx: int) -> None:
        inbox = self.inboxes[thread_idx]
        while (slot := inbox.get()) is not None:
            file = ""
            try:
                if self.error is None:
                    if slot.event is not None:
                        slot.event.synchronize()
                    started, host = time.perf_counter(), slot.buffer.numpy()
                    for file in self.owned[thread_idx]:
                        self._write_file(file, slot, host)
                    self.busy[thread_idx] += time.perf_counter() - started
            except BaseException as exc:  # reported by the main thread, naming the file
                with self.lock:
                    self.error = self.error or (str(self.writer.file_path(file)), exc)
            finally:
                self._release(slot)

    def _write_file(self, file: str, slot: _Slot, host: np.ndarray) -> None:
        """The batch's rows of `file` in ascending sample order, one write per run of samples that
        follow each other both in the file and in the slot (a whole batch of images is one run)."""
        region, rows = slot.regions[file], slot.rows
        order = np.argsort(rows.local_idx, kind="stable")
        local = rows.local_idx[order]
        if region.per_token:
            first, count = rows.token_start[order], rows.n_tokens[order]
        else:
            first, count = order, np.ones_like(order)
        breaks = np.flatnonzero((np.diff(local) != 1) | (first[1:] != first[:-1] + count[:-1])) + 1
        for run in np.split(np.arange(len(order)), breaks):
            start = region.start + int(first[run[0]]) * region.unit_bytes
            stop = start + int(count[run].sum()) * region.unit_bytes
            self.writer.write(file, int(local[run[0]]), host[start:stop], len(run))

    def _release(self, slot: _Slot) -> None:
        with self.lock:
            slot.pending -= 1
            done = slot.pending == 0
        if done:
            self.free.put(slot)


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> the name part.json records (float32, bfloat16, int64, ...)."""
    return str(dtype).removeprefix("torch.")
