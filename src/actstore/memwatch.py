"""Peak memory a Slurm job's cgroup is charged for and cannot simply drop: anonymous memory plus
dirty file-mapped pages (a memmap written to), sampled from /proc/<pid>/smaps_rollup (Linux).

Clean mapped pages (a part's .npy read through np.memmap) are left out: the kernel reclaims them
under pressure, as it does the page cache behind plain reads."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

KIB = 1024


@dataclass
class Memory:
    """Bytes of anonymous memory and of dirty file-mapped pages."""

    anonymous: int = 0
    dirty_mapped: int = 0

    @property
    def total(self) -> int:
        return self.anonymous + self.dirty_mapped


def process_memory(pid: int) -> Memory:
    """One sample of process `pid` (zero once it has exited)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return Memory()
    fields = {}
    for line in text.splitlines()[1:]:
        name, _, value = line.partition(":")
        fields[name] = int(value.split()[0]) * KIB if value.strip() else 0
    anonymous = fields.get("Anonymous", 0)
    dirty = fields.get("Private_Dirty", 0) + fields.get("Shared_Dirty", 0)
    return Memory(anonymous, max(0, dirty - anonymous))


MEMINFO = Path("/proc/meminfo")


def machine_available_gb() -> float | None:
    """The machine's MemAvailable in GB (/proc/meminfo; None without it). The benchmarks record it: on a
    machine short of memory (session 46's VM, with 11 GB of stale files in /dev/shm) every new
    page-cache page costs a reclaim, which moved writer and test times by up to 1.5x."""
    try:
        text = MEMINFO.read_text()
    except FileNotFoundError:
        return None
    # Kernels before 3.14 (and some sandboxes) list no MemAvailable: StopIteration escaped the bench.
    kib = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("MemAvailable:")), None)
    return None if kib is None else round(kib * KIB / 1e9, 1)


class PeakMemory:
    """Samples the summed memory of `pids` every `interval` s in a thread, from `with` to its end;
    `peak` holds the sample with the largest total (anonymous + dirty mapped)."""

    def __init__(self, pids: Iterable[int], interval: float = 0.02):
        self.pids, self.interval = list(pids), interval
        self.peak = Memory()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        samples = [process_memory(pid) for pid in self.pids]
        now = Memory(sum(s.anonymous for s in samples), sum(s.dirty_mapped for s in samples))
        if now.total > self.peak.total:
            self.peak = now

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):  # woken at the block's end, not after a whole interval
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # what the block held at its end, taken after the thread's last sample
