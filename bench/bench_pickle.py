"""Benchmark pickle-shard loading on real activations against a raw read of the same float32 bytes.

Takes the first --mb MB of samples (all extracted layers) of one extraction part (default: the demo's
results/extract/*/part-0000), writes them as one shard per variant and measures, warm page cache,
best of --repeat:
  raw float32      np.fromfile of the same activation bytes in one flat file (baseline, ratio 1.0)
  sha256 only      hashing the uncompressed shard file (the check done before every unpickle)
  pkl plain        pickle.load of the uncompressed shard, no checks (the spec's loader)
  pkl safe         actstore load_shard: size + sha256 + restricted unpickler
  gz-C-N safe/plain  the same for gzip shards of compressor C (isal, zlib) at level N, plus write
                   speed and compression ratio
Activation MB/s counts the raw float32 bytes delivered (1 MB = 1e6 bytes). Writes bench/out/pickle.json.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import pickle
import tempfile
import time
from pathlib import Path

import numpy as np

from actstore.formats import pickle as ps
from actstore.formats.extract import open_part

OUT = Path(__file__).resolve().parent / "out"


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def pick_samples(part, n_layers: int, d: int, mb: float) -> range:
    sizes = np.diff(part.offsets) * n_layers * d * 4
    n = int(np.searchsorted(np.cumsum(sizes), mb * 1e6)) + 1
    return range(min(n, len(sizes)))


def write_variant(shard: dict, path: Path, compressed: bool, level: int, compressor: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    ps.dump_shard(shard, path, compressed, level, compressor)
    seconds = time.perf_counter() - t0
    data = path.read_bytes()
    info = {"filename": path.name, "size_bytes": len(data), "compressed": compressed,
            "checksum": "sha256:" + hashlib.sha256(data).hexdigest()}
    return info, seconds


def plain_load(path: Path, compressed: bool) -> dict:
    with (gzip.open(path, "rb") if compressed else open(path, "rb")) as fh:
        return pickle.load(fh)  # our own freshly written file: trusted, as in the spec's loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", help="an extraction part dir (default: results/extract/*/part-0000)")
    parser.add_argument("--mb", type=float, default=64, help="raw float32 MB of activations in the shard")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 3, 6, 9],
                        help="gzip levels to measure (each compressor at those it has: isal 1-3, zlib 1-9)")
    parser.add_argument("--compressors", nargs="+", default=["isal", "zlib"], choices=sorted(ps.LEVELS))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    part_dir = args.part or sorted(glob.glob("results/extract/*/part-0000"))[0]
    part = open_part(part_dir)
    layers = part.meta["layers"]
    d = part.tensor(f"layer_{layers[0]}").shape[1]
    local = pick_samples(part, len(layers), d, args.mb)
    shard = ps.shard_items(part, layers, local, part.meta["part"])
    raw_bytes = sum(it["activation"].nbytes for items in shard.values() for it in items)
    OUT.mkdir(exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        tmp = Path(tmp)
        flat = tmp / "raw.f32"
        with open(flat, "wb") as fh:
            for items in shard.values():
                for it in items:
                    fh.write(it["activation"].tobytes())
        rows.append({"reader": "raw float32", "seconds": best(lambda: np.fromfile(flat, np.float32), args.repeat)})
        variants = [("pkl", False, 0, "zlib")] + [(f"gz-{c}-{lvl}", True, lvl, c) for c in args.compressors
                                                  for lvl in args.levels if lvl in ps.LEVELS[c]]
        for name, compressed, level, compressor in variants:
            (tmp / name).mkdir()
            path = tmp / name / ps.shard_filename(1, compressed)
            info, write_s = write_variant(shard, path, compressed, level, compressor)
            if not compressed:
                rows.append({"reader": "sha256 only", "seconds": best(lambda: hashlib.sha256(path.read_bytes()),
                                                                      args.repeat)})
            extra = {"file_bytes": info["size_bytes"], "compression_ratio": raw_bytes / info["size_bytes"],
                     "write_mb_s": raw_bytes / 1e6 / write_s}
            rows.append({"reader": f"{name} plain", "seconds": best(lambda: plain_load(path, compressed),
                                                                    args.repeat), **extra})
            rows.append({"reader": f"{name} safe", "seconds": best(lambda: ps.load_shard(path.parent, info),
                                                                   args.repeat),
                         **extra})
    base = raw_bytes / rows[0]["seconds"]
    for row in rows:
        row["activation_mb_s"] = raw_bytes / 1e6 / row["seconds"]
        row["ratio_to_raw"] = raw_bytes / row["seconds"] / base
    print(f"{part_dir}: {len(local)} samples x {len(layers)} layers x d={d}, {raw_bytes / 1e6:.1f} MB float32")
    print(f"{'reader':14} {'act MB/s':>9} {'ratio':>6} {'file MB':>8} {'compr':>6} {'write MB/s':>10}")
    for r in rows:
        file_mb = f"{r['file_bytes'] / 1e6:8.1f}" if "file_bytes" in r else " " * 8
        comp = f"{r['compression_ratio']:6.3f}" if "compression_ratio" in r else " " * 6
        wr = f"{r['write_mb_s']:10.1f}" if "write_mb_s" in r else ""
        print(f"{r['reader']:14} {r['activation_mb_s']:9.1f} {r['ratio_to_raw']:6.3f} {file_mb} {comp} {wr}")
    (OUT / "pickle.json").write_text(json.dumps({"args": vars(args), "part": str(part_dir), "samples": len(local),
                                                 "raw_bytes": raw_bytes, "rows": rows}, indent=2))
    print(f"wrote {OUT / 'pickle.json'}")


if __name__ == "__main__":
    main()
