"""Benchmark the saev shuffled loader against a plain sequential read of the same shard bytes.

Measured in one run, on one store (a synthetic ViT-shaped store by default, or --store):
  sequential   every shard read front to back in 16 MiB reads (the baseline, ratio 1.0)
  ordered      SaevStore.iter_ordered (example order, large reads)
  shuffled     ShuffledActivations, one full epoch (blocks in random order + shuffle buffer)
  saev-gather  saev's access pattern: one pread of one D-float vector at a random coordinate
Warm page cache always; cold too when /proc/sys/vm/drop_caches is writable. Also reports batch
mixing: distinct examples per batch vs. the expectation for a perfectly uniform shuffle.
Writes bench/out/saev.json.
"""
from __future__ import annotations

from pathlib import Path


import argparse
import json
import os
import tempfile
import time

import numpy as np

from actstore.formats import saev
from actstore.saev_loader import ShuffledActivations

OUT = Path(__file__).resolve().parent / "out"


def synthetic_store(root: Path, size_mb: int, d: int, tokens: int, layers: int, shards: int) -> Path:
    """A random-valued ViT-shaped store (CLS + tokens-1 patches) of about size_mb MiB."""
    example_bytes = layers * tokens * d * 4
    n = max(2, size_mb * 2**20 // example_bytes)
    per_shard = -(-n // shards)
    md = {"family": "dinov2", "ckpt": "synthetic", "layers": list(range(layers)), "patches_per_ex": tokens - 1,
          "cls_token": True, "d_model": d, "n_examples": int(n), "patches_per_shard": per_shard * tokens * layers,
          "data": saev.encode_data({"source": "bench"}), "dataset": str(root), "dtype": "float32",
          "protocol": saev.PROTOCOL}
    rng = np.random.default_rng(0)

    def fill(start: int, out: np.ndarray) -> None:
        out[:] = rng.standard_normal(out.shape, dtype=np.float32)
    return saev.write_raw_store(saev.Plan(md, None, {}), fill, root, progress=False)


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sequential(store: saev.SaevStore) -> tuple[int, float]:
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for shard in store.shards:
        with open(store.dir / shard["name"], "rb", buffering=0) as fh:
            while got := fh.readinto(view):
                total += got
    return total // (store.D * 4), time.perf_counter() - t0


def ordered(store: saev.SaevStore) -> tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    for _, block in store.iter_ordered(chunk_examples=max(1, (16 << 20) // store.example_bytes)):
        n += block.shape[0] * block.shape[1] * block.shape[2]
    return n, time.perf_counter() - t0


def shuffled(store: saev.SaevStore, ds: ShuffledActivations, args) -> tuple[int, float, dict]:
    ds.set_epoch(ds.epoch + 1)
    n, examples, t0 = 0, [], time.perf_counter()
    for batch in ds:
        n += batch["act"].shape[0] * (batch["act"].shape[1] if batch["act"].ndim == 3 else 1)
        examples.append(batch["example_idx"])  # counted after the clock stops
    seconds = time.perf_counter() - t0
    distinct = [len(np.unique(ex.numpy())) for ex in examples if len(ex) == args.batch_size]
    # Expected distinct examples among B draws without replacement from N*T equally likely vectors.
    N, T, B = store.n_examples, store.T, args.batch_size
    expected = N * (1 - np.exp(np.sum(np.log1p(-T / (N * T - np.arange(B))))))
    mixing = {"distinct_examples_per_batch": float(np.mean(distinct)), "uniform_expectation": float(expected),
              "block_examples": ds.block_examples, "n_examples": N}
    return n, seconds, mixing


def gather(store: saev.SaevStore, n: int) -> tuple[int, float]:
    rng = np.random.default_rng(1)
    ex, tok = rng.integers(store.n_examples, size=n), rng.integers(store.T, size=n)
    fds = {i: os.open(store.dir / s["name"], os.O_RDONLY) for i, s in enumerate(store.shards)}
    t0 = time.perf_counter()
    for e, t in zip(ex.tolist(), tok.tolist()):
        shard, offset = divmod(e, store.examples_per_shard)
        os.pread(fds[shard], store.D * 4, (offset * store.L * store.T + t) * store.D * 4)
    seconds = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return n, seconds


def run(store: saev.SaevStore, args, cache: str) -> list[dict]:
    """Interleaved rounds: every reader once per round, so each round's ratios share the machine's
    state of the moment (this VM's sequential baseline alone swings 2x between runs); the report is
    the median over rounds. Warm: one untimed pass of each reader first (page cache, loader buffers)."""
    ds = ShuffledActivations(store.dir, batch_size=args.batch_size, seed=0, buffer_blocks=args.buffer_blocks,
                             block_bytes=args.block_mb << 20, fill_threads=args.fill_threads)
    readers = {"sequential": lambda: sequential(store), "ordered": lambda: ordered(store),
               "shuffled": lambda: shuffled(store, ds, args), "saev-gather": lambda: gather(store, args.gather)}
    if cache == "cold" and not drop_caches():
        return []
    if cache == "warm":
        for fn in readers.values():
            fn()
    rounds: dict[str, list[tuple]] = {name: [] for name in readers}
    for _ in range(args.repeat if cache == "warm" else args.cold_repeat):
        for name, fn in readers.items():
            if cache == "cold":
                drop_caches()
            rounds[name].append(fn())
    base = [out[0] / out[1] for out in rounds["sequential"]]
    rows = []
    for name, outs in rounds.items():
        speeds = [out[0] / out[1] for out in outs]
        ratios = [v / b for v, b in zip(speeds, base)]
        rows.append({"cache": cache, "reader": name, "vectors": outs[0][0], "vectors_per_s": float(np.median(speeds)),
                     "ratio_to_sequential": float(np.median(ratios)), "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "rounds": len(outs),
                     **({"mixing": outs[-1][2]} if len(outs[-1]) > 2 else {})})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="an existing saev store / stage dir (default: build a synthetic one)")
    parser.add_argument("--size-mb", type=int, default=2048, help="synthetic store size (MiB)")
    parser.add_argument("--d", type=int, default=1024, help="synthetic d_model")
    parser.add_argument("--tokens", type=int, default=257, help="synthetic tokens per example (CLS + patches)")
    parser.add_argument("--layers", type=int, default=1, help="synthetic stored layers")
    parser.add_argument("--shards", type=int, default=4, help="synthetic shard count")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--block-mb", type=int, default=4, help="loader block size (MiB)")
    parser.add_argument("--buffer-blocks", type=int, default=32, help="loader shuffle buffer (blocks)")
    parser.add_argument("--fill-threads", type=int, default=2, help="loader threads reading + scattering blocks")
    parser.add_argument("--gather", type=int, default=20000, help="vectors for the saev-gather pattern")
    parser.add_argument("--repeat", type=int, default=7, help="warm rounds (median reported)")
    parser.add_argument("--cold-repeat", type=int, default=2, help="cold rounds (median reported)")
    parser.add_argument("--cold", action="store_true",
                        help="also time with a cold page cache (drops the machine-wide cache: needs root)")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        store = saev.open_store(args.store or synthetic_store(Path(tmp), args.size_mb, args.d, args.tokens,
                                                              args.layers, args.shards))
        size = sum(store.shard_bytes(i) for i in range(len(store.shards)))
        rows = run(store, args, "warm") + (run(store, args, "cold") if args.cold else [])
    print(f"store: {store.n_examples} examples x {store.L} layers x {store.T} tokens x d={store.D}, "
          f"{size / 2**20:.0f} MiB in {len(store.shards)} shards")
    print(f"{'cache':6} {'reader':12} {'vectors/s':>12} {'ratio':>7} {'min-max':>11}  mixing")
    for r in rows:
        mix = r.get("mixing")
        extra = (f"{mix['distinct_examples_per_batch']:.0f} distinct examples/batch (uniform: "
                 f"{mix['uniform_expectation']:.0f})") if mix else ""
        spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        print(f"{r['cache']:6} {r['reader']:12} {r['vectors_per_s']:12,.0f} {r['ratio_to_sequential']:7.3f} {spread:>11}  {extra}")
    if not any(r["cache"] == "cold" for r in rows):
        print("cold: not measured (pass --cold; needs a writable /proc/sys/vm/drop_caches)")
    (OUT / "saev.json").write_text(json.dumps({"args": vars(args), "bytes": size, "rows": rows}, indent=2))
    print(f"wrote {OUT / 'saev.json'}")


if __name__ == "__main__":
    main()
