"""Benchmark the saev shuffled loader: speed against a plain sequential read of the same shard bytes,
batch mixing against a uniform shuffle, and (--sae) what the mixing does to a TopK SAE trained on it.

Measured in one run, on one store (a synthetic ViT-shaped store by default, or --store):
  sequential    every shard read front to back in 16 MiB reads (the baseline, ratio 1.0)
  ordered       SaevStore.iter_ordered (example order, large reads)
  shuffled-tN   ShuffledActivations with its defaults and N fill threads, one full epoch
  old-loader    the same class configured as the loader before issue 21 (4 MiB blocks of whole
                examples, a 32-block buffer, 2 fill threads)
  saev-gather   saev's access pattern: one pread of one D-float vector at a random coordinate
Warm page cache always; cold too when /proc/sys/vm/drop_caches is writable. Mixing: distinct examples
per batch divided by the expectation for a perfectly uniform shuffle of the store.
--sae: a structured synthetic store (examples sorted by class, as an ImageFolder store is; tokens
are sparse sums of their example's dictionary atoms); a TopK SAE (actstore.sae) trained for the
same steps from the same seed on batches of the loader, of the old loader and of a perfectly
shuffled in-memory copy; held-out FVU on examples generated apart.
Writes bench/out/saev.json (bench/out/saev_sae_seed<N>.json with --sae).
"""
from __future__ import annotations

from pathlib import Path


import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

from actstore import sae as sae_lib
from actstore.formats import saev
from actstore.formats.saev.loader import ShuffledActivations

OUT = Path(__file__).resolve().parent / "out"
# The loader before issue 21, as the bench configured it: blocks of whole examples (4 MiB: 3 ViT-L
# examples), 32 blocks a buffer, 2 fill threads.
OLD_LOADER = {"block_bytes": 4 << 20, "buffer_blocks": 32, "fill_threads": 2}


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


def uniform_distinct(n: int, tokens: int, batch: int) -> float:
    """Expected distinct examples among `batch` draws without replacement from n*tokens vectors."""
    return float(n * (1 - np.exp(np.sum(np.log1p(-tokens / (n * tokens - np.arange(batch)))))))


def shuffled(store: saev.SaevStore, ds: ShuffledActivations, args) -> tuple[int, float, dict]:
    ds.set_epoch(ds.epoch + 1)
    n, examples, t0 = 0, [], time.perf_counter()
    for batch in ds:
        n += batch["act"].shape[0] * (batch["act"].shape[1] if batch["act"].ndim == 3 else 1)
        examples.append(batch["example_idx"])  # counted after the clock stops
    seconds = time.perf_counter() - t0
    distinct = [len(np.unique(ex.numpy())) for ex in examples if len(ex) == args.batch_size]
    expected = uniform_distinct(store.n_examples, store.T, args.batch_size)
    mixing = {"distinct_examples_per_batch": float(np.mean(distinct)), "uniform_expectation": expected,
              "ratio_to_uniform": float(np.mean(distinct)) / expected, "block_examples": ds.block_examples,
              "chunks_per_example": ds.chunks_per_example, "buffer_blocks": ds.buffer_blocks,
              "n_examples": store.n_examples}
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


def structured_examples(rng: np.random.Generator, classes: np.ndarray, atoms: np.ndarray, class_atoms: np.ndarray,
                        tokens: int) -> np.ndarray:
    """(n, tokens, d) float32: each example keeps 32 atoms of its class's set and an offset of its own;
    each token adds 8 of the example's atoms with positive weights, plus a little noise."""
    n, d = len(classes), atoms.shape[1]
    mine = np.stack([rng.choice(class_atoms[c], 32, replace=False) for c in classes])  # (n, 32)
    pick = np.take_along_axis(np.repeat(mine[:, None], tokens, 1), rng.integers(0, 32, (n, tokens, 8)), 2)
    weights = np.abs(rng.standard_normal((n, tokens, 8))).astype(np.float32) * 2
    x = np.einsum("ntk,ntkd->ntd", weights, atoms[pick]) + 0.5 * rng.standard_normal((n, 1, d)).astype(np.float32)
    return (x + 0.05 * rng.standard_normal(x.shape).astype(np.float32)).astype(np.float32)


def sae_store(root: Path, args) -> tuple[Path, np.ndarray]:
    """The structured store (examples sorted by class) and held-out examples of the same classes."""
    rng = np.random.default_rng(args.sae_seed)
    d, n, tokens, n_classes = args.sae_d, args.sae_examples, args.tokens, 32
    atoms = rng.standard_normal((2048, d)).astype(np.float32)
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    class_atoms = np.stack([rng.choice(len(atoms), 128, replace=False) for _ in range(n_classes)])
    classes = np.sort(rng.integers(0, n_classes, n))
    md = {"family": "dinov2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": tokens - 1, "cls_token": True,
          "d_model": d, "n_examples": n, "patches_per_shard": -(-n // 4) * tokens, "dtype": "float32",
          "data": saev.encode_data({"source": "bench-sae"}), "dataset": str(root), "protocol": saev.PROTOCOL}

    def fill(start: int, out: np.ndarray) -> None:
        out[:, 0] = structured_examples(rng, classes[start:start + len(out)], atoms, class_atoms, tokens)
    store = saev.write_raw_store(saev.Plan(md, None, {}), fill, root, progress=False)
    held = structured_examples(rng, rng.integers(0, n_classes, args.sae_examples // 8), atoms, class_atoms, tokens)
    return store, held.reshape(-1, d)


def train_fvu(batches, steps: int, mean: torch.Tensor, held: np.ndarray, args) -> float:
    """A TopK SAE (actstore.sae: Gao et al.'s recipe, AuxK included) trained for `steps` batches from
    a fixed seed; its FVU on the held-out vectors."""
    torch.manual_seed(args.sae_seed)
    model = sae_lib.TopKSAE(args.sae_d, args.sae_latents, args.sae_k)
    sae_lib.init_sae(model, mean, seed=args.sae_seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.sae_lr, eps=6.25e-10)
    last_fired, seen = torch.zeros(args.sae_latents, dtype=torch.long), 0
    for _, x in zip(range(steps), batches):
        pre = model.pre_acts(x)
        values, indices = torch.topk(pre, args.sae_k, dim=-1)
        x_hat = model.decode_dense(values, indices)
        loss = (x_hat - x).pow(2).sum(-1).mean() / (x - x.mean(0)).pow(2).sum(-1).mean()
        seen += len(x)
        last_fired[indices[values > 0].unique()] = seen
        loss = loss + sae_lib.auxk_loss(model, x, x_hat, pre, (seen - last_fired) >= 200_000, args.sae_latents // 2) / 32
        opt.zero_grad(set_to_none=True)
        loss.backward()
        model.remove_parallel_grad()
        opt.step()
        model.normalize_decoder()
    return sae_lib.evaluate(model, [held], [np.arange(len(held))])["fvu"]


def loader_batches(ds: ShuffledActivations):
    """Endless batches, a new epoch each pass (batches are copied: training keeps nothing of them)."""
    for epoch in range(10**9):
        ds.set_epoch(epoch)
        for batch in ds:
            yield batch["act"].clone()


def memory_batches(data: np.ndarray, batch_size: int, seed: int):
    """The baseline: a perfectly uniform shuffle of the whole store, held in memory."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(data))
        for lo in range(0, len(order) - batch_size + 1, batch_size):
            yield torch.from_numpy(data[order[lo:lo + batch_size]])


def sae_proof(args) -> dict:
    """Held-out FVU of the same SAE trained on each batch source; the loaders' blocks and buffer are
    scaled to this store as they are to the default bench store (8-token blocks, a buffer of 1/8 of
    the store; the old loader: 3-example blocks, a 32-block buffer)."""
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        store_dir, held = sae_store(Path(tmp), args)
        store = saev.open_store(store_dir)
        data = np.concatenate([np.fromfile(store.dir / s["name"], dtype=np.float32) for s in store.shards])
        data = data.reshape(-1, args.sae_d)
        steps = args.sae_epochs * (len(data) // args.batch_size)
        mean = torch.from_numpy(data.mean(0, dtype=np.float64).astype(np.float32))
        vec = args.sae_d * 4
        configs = {"loader (defaults scaled)": {"block_bytes": 8 * vec, "buffer_bytes": len(data) * vec // 8},
                   "old loader (scaled)": {"block_examples": 3, "buffer_blocks": 32}}

        def loader(cfg: dict) -> ShuffledActivations:
            return ShuffledActivations(store.dir, batch_size=args.batch_size, drop_last=True, seed=args.sae_seed, **cfg)
        sources = {"in-memory uniform shuffle (baseline)": lambda: memory_batches(data, args.batch_size, args.sae_seed),
                   **{name: (lambda cfg=cfg: loader_batches(loader(cfg))) for name, cfg in configs.items()}}
        out = {"steps": steps, "vectors": len(data), "heldout_vectors": len(held), "fvu": {}, "mixing": {}}
        for name, make in sources.items():
            out["fvu"][name] = train_fvu(make(), steps, mean, held, args)
            print(f"{name:40} held-out FVU {out['fvu'][name]:.4f}", flush=True)
        for name, cfg in configs.items():
            distinct = [len(np.unique(b["example_idx"].numpy())) for b in loader(cfg)]
            out["mixing"][name] = float(np.mean(distinct)) / uniform_distinct(store.n_examples, store.T, args.batch_size)
    return out

def run(store: saev.SaevStore, args, cache: str) -> list[dict]:
    """Interleaved rounds: every reader once per round, so each round's ratios share the machine's
    state of the moment (this VM's sequential baseline alone swings 2x between runs); the report is
    the median over rounds. Warm: one untimed pass of each reader first (page cache, loader buffers)."""
    loaders = {f"shuffled-t{n}": ShuffledActivations(store.dir, batch_size=args.batch_size, seed=0, fill_threads=n,
                                                     block_bytes=args.block_kb << 10, buffer_bytes=args.buffer_mb << 20)
               for n in args.fill_threads}
    loaders["old-loader"] = ShuffledActivations(store.dir, batch_size=args.batch_size, seed=0, **OLD_LOADER)
    readers = {"sequential": lambda: sequential(store), "ordered": lambda: ordered(store),
               **{name: (lambda ds=ds: shuffled(store, ds, args)) for name, ds in loaders.items()},
               "saev-gather": lambda: gather(store, args.gather)}
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
    parser.add_argument("--block-kb", type=int, default=32, help="loader block size (KiB)")
    parser.add_argument("--buffer-mb", type=int, default=256, help="loader shuffle buffer (MiB)")
    parser.add_argument("--fill-threads", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="fill thread counts to time (one loader each)")
    parser.add_argument("--gather", type=int, default=20000, help="vectors for the saev-gather pattern")
    parser.add_argument("--repeat", type=int, default=7, help="warm rounds (median reported)")
    parser.add_argument("--cold-repeat", type=int, default=2, help="cold rounds (median reported)")
    parser.add_argument("--cold", action="store_true",
                        help="also time with a cold page cache (drops the machine-wide cache: needs root)")
    parser.add_argument("--sae", action="store_true", help="instead: the SAE proof (held-out FVU per batch source)")
    parser.add_argument("--sae-examples", type=int, default=2048, help="--sae: examples in the structured store")
    parser.add_argument("--sae-d", type=int, default=128, help="--sae: d_model")
    parser.add_argument("--sae-latents", type=int, default=512, help="--sae: SAE latents")
    parser.add_argument("--sae-k", type=int, default=16, help="--sae: active latents (TopK)")
    parser.add_argument("--sae-lr", type=float, default=1e-3, help="--sae: Adam learning rate")
    parser.add_argument("--sae-epochs", type=int, default=4, help="--sae: epochs of the store (sets the steps)")
    parser.add_argument("--sae-seed", type=int, default=0,
                        help="--sae: one seed for the store's data, the SAE's init and every batch order")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    if args.sae:
        result = sae_proof(args)
        base = result["fvu"]["in-memory uniform shuffle (baseline)"]
        for name, fvu in result["fvu"].items():
            mix = result["mixing"].get(name)
            print(f"{name:40} FVU {fvu:.4f}  {fvu / base - 1:+.2%} vs baseline"
                  + (f"  mixing {mix:.3f} of uniform" if mix is not None else ""))
        (OUT / f"saev_sae_seed{args.sae_seed}.json").write_text(json.dumps({"args": vars(args), **result}, indent=2))
        return
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
        extra = (f"{mix['ratio_to_uniform']:.3f} of uniform ({mix['distinct_examples_per_batch']:.0f} distinct "
                 f"examples/batch, uniform {mix['uniform_expectation']:.0f})") if mix else ""
        spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        print(f"{r['cache']:6} {r['reader']:12} {r['vectors_per_s']:12,.0f} {r['ratio_to_sequential']:7.3f} {spread:>11}  {extra}")
    if not any(r["cache"] == "cold" for r in rows):
        print("cold: not measured (pass --cold; needs a writable /proc/sys/vm/drop_caches)")
    (OUT / "saev.json").write_text(json.dumps({"args": vars(args), "bytes": size, "rows": rows}, indent=2))
    print(f"wrote {OUT / 'saev.json'}")


if __name__ == "__main__":
    main()
