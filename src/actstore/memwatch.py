"""Peak memory a Slurm job's cgroup is charged for and cannot simply drop: anonymous memory plus
dirty file-mapped pages (a memmap written to), sampled from /proc/<pid>/smaps_rollup (Linux;
its smaps where the kernel has no rollup).

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


PROC = Path("/proc")
FIELDS = ("Anonymous", "Private_Dirty", "Shared_Dirty")


def process_memory(pid: int) -> Memory:
    """One sample of process `pid` (zero once it has exited): its smaps_rollup, or where the kernel has
    none (Linux before 4.14, some containers) the same fields of every mapping in its smaps, summed.
    Without smaps_rollup every sample read 0, and a memory bound passed whatever the process held."""
    text = _smaps_text(pid)
    if text is None:
        return Memory()
    fields = dict.fromkeys(FIELDS, 0)
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            fields[name] += int(value.split()[0]) * KIB
    anonymous = fields["Anonymous"]
    dirty = fields["Private_Dirty"] + fields["Shared_Dirty"]
    return Memory(anonymous, max(0, dirty - anonymous))


def _smaps_text(pid: int) -> str | None:
    """/proc/<pid>/smaps_rollup, else /proc/<pid>/smaps; None once the process has exited."""
    for name in ("smaps_rollup", "smaps"):
        try:
            return (PROC / str(pid) / name).read_text()
        except FileNotFoundError:
            continue
        except (ProcessLookupError, PermissionError):
            return None
    return None


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
