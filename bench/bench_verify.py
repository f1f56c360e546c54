"""Time `actstore verify` of a saev store against hashing its shards one after another, same run.

Builds a synthetic ViT-shaped saev store (bench_saev's, random values) of --size-mb in --shards
shards, or takes --store, then alternates in rounds: the baseline (sha256 of each shard in turn, what
verify did before it checked files at once) and `saev.verify` with each of --threads checks at once
(integrity.problems_of). Warm page cache: what is measured is the hashing, not the disk. Best and
median seconds per row; the ratio is the baseline's best over the row's best (a speed-up).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_saev import OUT, synthetic_store  # noqa: E402

from actstore import integrity  # noqa: E402
from actstore.formats import saev  # noqa: E402
from actstore.io_utils import sha256_file  # noqa: E402


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="an existing saev store (default: build a synthetic one)")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, integrity.CHECK_THREADS])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.store) if args.store else synthetic_store(Path(tmp), args.size_mb, 1024, 257, 1, args.shards)
        store = saev.open_store(path)
        files = [store.dir / shard["name"] for shard in store.shards]
        n_bytes = sum(f.stat().st_size for f in files)
        rows: dict[str, list[float]] = {"sha256, one shard after another": []}
        rows.update({f"verify, {n} at once": [] for n in args.threads})
        for _ in range(args.repeat):
            rows["sha256, one shard after another"].append(seconds(lambda: [sha256_file(f) for f in files]))
            for n in args.threads:
                problems: list[str] = []
                with integrity.check_threads(n):
                    rows[f"verify, {n} at once"].append(seconds(lambda: problems.extend(saev.verify(path))))
                assert not problems, problems
    base = min(rows["sha256, one shard after another"])
    print(f"{n_bytes / 1e9:.2f} GB in {len(files)} shards, best of {args.repeat}\n"
          f"{'row':34s} {'best s':>8s} {'median s':>9s} {'GB/s':>6s} {'speed-up':>8s}")
    for name, times in rows.items():
        print(f"{name:34s} {min(times):8.3f} {statistics.median(times):9.3f} {n_bytes / 1e9 / min(times):6.2f} "
              f"{base / min(times):8.2f}")
    OUT.mkdir(exist_ok=True)
    (OUT / "verify.json").write_text(json.dumps({"args": vars(args), "bytes": n_bytes, "seconds": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
