"""Where a bench run's threads spent their time, from a py-spy raw profile of it.

    py-spy record -r 100 --idle --native --threads --format raw -o run.spy.txt -- python3 bench/bench_extract.py ...
    python3 bench/spy_summary.py run.spy.txt

`gpu_suite.sh` records one for the rows named in SPY. Each sample is given to the thread's role by
the Python frames it holds (ROLES: the main thread in extraction's batch loop or the bare forward's,
a part writer, the hashing pool, the loader's pinning thread, a writer job's buffer workers, other
pools), and within the main thread's loops to a phase: the frame right below the loop (the forward's
module call, packing, the submit to the staging ring, the next inputs); within a buffer worker (a zarr
shard job's chunk files), the innermost line of actstore's own code, quoted from src/ (the step of a
chunk: its read, cast, directory, write or sha256). For each role and phase: its share of the role's
samples and its most frequent innermost frames, which say whether the thread ran (a kernel launch,
sha256, a copy) or waited, and on what: `pthread_cond_timedwait` under an interpreter or extension
frame is a wait for the GIL; `sem_clockwait` / `do_futex_wait` a Python lock or queue; the CUDA
driver's frames a device sync. Samples are taken at the sampler's rate whether a thread runs or
waits (--idle), so shares are of wall time.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

ROLES = {  # a Python frame's function -> the role of the thread it runs on, the first found in this order
    "extract_batches": "main: extraction batches",
    "bare_forward": "main: bare forward",
    "run_part": "main: extraction, before and after its batches",
    "WritePipeline._write_loop": "part writer",
    "_leaf_digests": "hashing pool",
    "_pin_memory_loop": "loader pinning",
    "BufferWorkers._loop": "buffer workers (a writer job's files)",
    "_worker": "thread pools (idle, or not hashing)",
    "TMonitor.run": "progress bars' monitor",
}
MAIN = ("extract_batches", "bare_forward", "run_part")
BY_LINE = ("BufferWorkers._loop",)  # roles whose phase is the innermost line of actstore's code
SRC = Path(__file__).resolve().parent.parent / "src"
FRAME = re.compile(r"^(?P<name>.+?) \((?P<where>[^()]*)\)$")


def frames_of(line: str) -> tuple[list[tuple[str, str]], int]:
    """(function, file:line or library) of each frame of a raw line, outermost first, and its samples."""
    stack, _, count = line.rstrip("\n").rpartition(" ")
    frames = []
    for text in stack.split(";")[1:]:  # the first is the thread's name
        match = FRAME.match(text)
        frames.append((match["name"], match["where"]) if match else (text, ""))
    return frames, int(count)


def role_and_phase(frames: list[tuple[str, str]]) -> tuple[str, str]:
    names = [name for name, _ in frames]
    for function, role in ROLES.items():
        if function in names:
            i = names.index(function)
            if function in BY_LINE:
                return role, innermost_line(frames[i + 1:])
            return role, names[i + 1] if function in MAIN and i + 1 < len(names) else ""
    return "other", ""


def innermost_line(frames: list[tuple[str, str]]) -> str:
    """The innermost frame in actstore's code, as `file:line: the line` (its text from src/ when there)."""
    ours = [where for _, where in frames if where.startswith("actstore/")]
    if not ours:
        return ""
    file, _, line = ours[-1].rpartition(":")
    source = SRC / file
    text = source.read_text(encoding="utf-8").splitlines()[int(line) - 1].strip() if source.is_file() else ""
    return f"{ours[-1]}: {text}" if text else ours[-1]


def leaf(frames: list[tuple[str, str]]) -> str:
    """The innermost frame with a name (a native frame may be an address), with its caller."""
    named = [f"{name} ({where})" for name, where in frames if not name.startswith("0x")]
    return " <- ".join(reversed(named[-2:]))


def summary(path: Path, top: int) -> str:
    samples: dict[str, Counter] = defaultdict(Counter)  # role -> phase -> samples
    leaves: dict[tuple[str, str], Counter] = defaultdict(Counter)
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            frames, count = frames_of(line)
            role, phase = role_and_phase(frames)
            samples[role][phase] += count
            leaves[role, phase][leaf(frames)] += count
    lines = []
    for role, phases in sorted(samples.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(phases.values())
        lines.append(f"{role}: {total} samples")
        for phase, n in phases.most_common():
            lines.append(f"  {n / total:6.1%}  {phase or '(all)'}")
            for where, m in leaves[role, phase].most_common(top):
                lines.append(f"           {m / n:6.1%}  {where}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="py-spy record --format raw output")
    parser.add_argument("--top", type=int, default=4, help="innermost frames shown per role and phase")
    args = parser.parse_args()
    print(summary(args.profile, args.top))


if __name__ == "__main__":
    main()
