"""How fast can this disk take an extraction's bytes? Four ways of writing --gb GB, in rounds.

bench_extract's disk bound is one file written front to back in 64 MiB blocks through the page cache,
the disk started on each block (sync_file_range) and one fsync at the end: what the part writer
does for one file. An extraction writes one file per stored layer, each from its own thread, so this
bench also writes --streams files at once, and writes each way again with O_DIRECT (the bytes go
from the caller's page-aligned buffer to the device, no page-cache copy, no dirty pages): whether a
writer could go faster than that bound on this disk. Rows: buffered or direct x 1 or --streams
streams, the same total bytes, fsync'd; best and median GB/s (1 GB = 1e9 B) over --repeat rounds,
the ways interleaved within each round. The files go in --dir (default: the system's temp dir,
where bench_extract writes).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from actstore.io_utils import start_writeback

OUT = Path(__file__).resolve().parent / "out"
BLOCK = 64 << 20  # bytes per write, as bench_extract.write_bandwidth


def write_file(path: Path, block: mmap.mmap, n_blocks: int, direct: bool) -> None:
    """n_blocks writes of `block` front to back, then fsync."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        for i in range(n_blocks):
            os.pwrite(fd, block, i * BLOCK)
            if not direct:
                start_writeback(fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rate(directory: Path, block: mmap.mmap, n_bytes: int, streams: int, direct: bool) -> float:
    """GB/s of `streams` threads writing about n_bytes in all, a file each; the files are deleted after."""
    per_stream = max(1, n_bytes // BLOCK // streams)
    paths = [directory / f"disk-{i}.bin" for i in range(streams)]
    threads = [threading.Thread(target=write_file, args=(path, block, per_stream, direct)) for path in paths]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    written = sum(path.stat().st_size for path in paths)
    for path in paths:
        path.unlink()
    os.sync()  # the deletes' own work stays out of the next row
    if written != per_stream * streams * BLOCK:
        raise SystemExit(f"{directory}: {written} bytes written, expected {per_stream * streams * BLOCK}")
    return written / elapsed / 1e9


def direct_supported(directory: Path) -> bool:
    try:
        fd = os.open(directory / "disk-probe.bin", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    (directory / "disk-probe.bin").unlink()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=4.0, help="GB each row writes (1 GB = 1e9 B)")
    parser.add_argument("--streams", type=int, default=4, help="files written at once in the multi-stream rows")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="the disk under test")
    parser.add_argument("--out", default=str(OUT / "disk.json"))
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="bench-disk-", dir=args.dir))
    block = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    block[:] = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    ways = [(direct, streams) for direct in (False, True) for streams in (1, args.streams)]
    if not direct_supported(directory):
        print(f"{directory}: this file system refuses O_DIRECT; buffered rows only", file=sys.stderr)
        ways = [way for way in ways if not way[0]]
    n_bytes = int(args.gb * 1e9)
    rates: dict[str, list[float]] = {f"{'direct' if d else 'buffered'}, {s} stream{'s' * (s > 1)}": [] for d, s in ways}
    try:
        for _ in range(args.repeat):
            for (direct, streams), name in zip(ways, rates):
                rates[name].append(write_rate(directory, block, n_bytes, streams, direct))
    finally:
        directory.rmdir()
    result = {"dir": args.dir, "gb": args.gb, "rows": {name: {"best_gb_s": max(r), "median_gb_s": statistics.median(r),
                                                              "rounds_gb_s": [round(x, 3) for x in r]}
                                                       for name, r in rates.items()}}
    print(f"{args.gb:.1f} GB a row in {args.dir}, {args.repeat} rounds")
    print("| way | best GB/s | median GB/s |\n|---|---:|---:|")
    for name, row in result["rows"].items():
        print(f"| {name} | {row['best_gb_s']:.2f} | {row['median_gb_s']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
