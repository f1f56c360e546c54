"""lmprobe fast path: all last-token vectors of one layer vs a raw read of the same bytes, same run.

Builds a synthetic extraction (random float32 activations, real PartWriter layout) and writes it as
an lmprobe 2.0 dataset with several last-token shards (or uses --dataset DIR), then times, with a
warm page cache and alternating repeats:
  raw      open each last-token shard and readinto() its data bytes into one preallocated buffer
  reader   open_dataset(root).last_tokens(layer): opens the index, parses shard headers, reads
  open_ds  last_tokens(layer) on a dataset opened once (what a training loop pays per layer)
  snippet  the spec's safe_open(framework="pt").get_tensor(key) per shard, then torch.cat
ratio = raw time / method time (speed relative to raw; goal for `reader`: >= 0.5).
"""
from __future__ import annotations

from pathlib import Path


import argparse
import json
import statistics
import tempfile
import time

import numpy as np

from actstore.formats import lmprobe
from actstore.formats.extract import synthetic_extraction

REPO = Path(__file__).resolve().parents[1]


def raw_read(ds: lmprobe.LmprobeDataset, layer: int) -> np.ndarray:
    """The same bytes, read with nothing but open/seek/readinto (offsets taken once, outside timing)."""
    out = np.empty((ds.num_prompts, ds.dim), np.float32)
    view = memoryview(out).cast("B")
    pos = 0
    for path, offset, nbytes in RAW_PLAN:
        with open(path, "rb") as fh:
            fh.seek(offset)
            fh.readinto(view[pos:pos + nbytes])
        pos += nbytes
    return out


def snippet_read(ds: lmprobe.LmprobeDataset, layer: int):
    import torch
    from safetensors import safe_open

    parts = []
    for s in range(ds.last_token_shards):
        with safe_open(str(ds.root / ds.hidden["file_pattern"].format(layer=layer, shard=s)), framework="pt") as f:
            parts.append(f.get_tensor(ds.hidden["key_pattern"].format(layer=layer)))
    return torch.cat(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", help="existing lmprobe dataset (root or stage dir); default: synthetic")
    parser.add_argument("--prompts", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2, help="tokens per synthetic prompt")
    parser.add_argument("--shard-mb", type=float, default=32.0, help="lmprobe.shard_bytes in MiB")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(REPO / "bench" / "out" / "lmprobe.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dataset) if args.dataset else Path(tmp) / "lmprobe"
        if not args.dataset:
            extract_dir = synthetic_extraction(Path(tmp) / "extract", args.prompts * args.tokens * args.dim * 4, 1, args.dim,
                                               [0], tokens=(args.tokens, args.tokens))
            lmprobe.write_dataset(extract_dir, root, {"storage": "pooled", "prompt_ordering": "original", "token_strings": False,
                                                      "shard_bytes": int(args.shard_mb * 2**20)}, progress=False)
        result = run(lmprobe.open_dataset(root), args.repeats)
    result["dataset"] = args.dataset or f"synthetic {args.prompts} prompts x dim {args.dim}"
    print(f"{'method':<8} {'median s':>9} {'GB/s':>7} {'ratio vs raw':>13}")
    for name, row in result["methods"].items():
        print(f"{name:<8} {row['median_s']:>9.4f} {row['gb_per_s']:>7.2f} {row['ratio_vs_raw']:>13.2f}")
    print(f"{result['bytes'] / 2**20:.1f} MiB in {result['last_token_shards']} last-token shards; {result['dataset']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


RAW_PLAN: list[tuple[Path, int, int]] = []


def run(ds: lmprobe.LmprobeDataset, repeats: int) -> dict:
    layer = ds.layers[0]
    RAW_PLAN.clear()
    for s in range(ds.last_token_shards):
        view = ds.hidden_tensor(layer, s)
        RAW_PLAN.append((Path(view.filename), view.offset, view.nbytes))
    if ds.dtype != "float32":
        raise SystemExit("bench needs a float32 dataset (raw bytes = float32 rows)")
    want = raw_read(ds, layer)
    methods = {"raw": lambda: raw_read(ds, layer),
               "reader": lambda: lmprobe.open_dataset(ds.root).last_tokens(layer),
               "open_ds": lambda: ds.last_tokens(layer),
               "snippet": lambda: snippet_read(ds, layer)}
    for name, fn in methods.items():  # warm the page cache and check every method returns the same data
        assert np.array_equal(np.asarray(fn()), want), name
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    nbytes = want.nbytes
    raw = statistics.median(times["raw"])
    return {"bytes": nbytes, "last_token_shards": ds.last_token_shards, "repeats": repeats,
            "methods": {name: {"median_s": statistics.median(t), "times_s": t,
                               "gb_per_s": nbytes / statistics.median(t) / 1e9,
                               "ratio_vs_raw": raw / statistics.median(t)} for name, t in times.items()}}


if __name__ == "__main__":
    main()
