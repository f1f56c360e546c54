"""SAE training throughput: the sae stage's loop fed from memmapped activations, as a ratio to the same
steps on batches already on the device (the baseline, same run).

Rows: `on device` (batches gathered once, kept on the device, cycled: no input cost at all),
`prefetched` (what train_sae does: shuffled memmap gathers on a background thread, pinned ring + side
stream copy on CUDA) and `inline` (the same gathers and copy in the training thread, as before
prefetching). Data: a float32 .npy of --rows random rows written to a temp dir (page cache warm).
Shapes: `demo` (d 384, 1536 latents, k 32, batch 512) and `gpu` (d 2048, 16384 latents, k 32,
batch 4096: the issue's H100 measurement).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from actstore.sae import Prefetcher, TopKSAE, init_sae, stream_batches, train_steps

OUT = Path(__file__).with_name("out")
SHAPES = {"demo": {"d": 384, "num_basis": 1536, "k": 32, "batch": 512},
          "gpu": {"d": 2048, "num_basis": 16384, "k": 32, "batch": 4096}}


def synthetic_rows(path: Path, rows: int, d: int) -> np.ndarray:
    """A (rows, d) float32 memmap of random activations, written in chunks."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, d))
    rng = np.random.default_rng(0)
    for start in range(0, rows, 65536):
        array[start:start + 65536] = rng.standard_normal((min(65536, rows - start), d), dtype=np.float32)
    array.flush()
    return np.load(path, mmap_mode="r")


def tokens_per_second(batches: Iterator[torch.Tensor], shape: dict, steps: int, device: torch.device) -> float:
    """train_steps on `batches` from a fresh SAE; tokens/s over `steps` after 3 warm-up steps."""
    torch.manual_seed(0)
    sae = TopKSAE(shape["d"], shape["num_basis"], shape["k"])
    init_sae(sae, torch.zeros(shape["d"]), 0)
    sae.to(device)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4)
    cfg = {"aux_k": None, "dead_tokens": 10_000_000, "aux_coef": 1 / 32}
    train_steps(sae, opt, batches, {**cfg, "steps": 3}, progress=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    seen, _ = train_steps(sae, opt, batches, {**cfg, "steps": steps}, progress=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--rows", type=int, default=65536, help="rows of the synthetic activation file")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    args = parser.parse_args()
    device, shape = torch.device(args.device), SHAPES[args.shape]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        arrays = [synthetic_rows(Path(tmp) / "acts.npy", args.rows, shape["d"])]
        rows = [np.arange(args.rows, dtype=np.int64)]

        def source() -> Iterator[torch.Tensor]:
            return stream_batches(arrays, rows, shape["batch"], np.random.default_rng(0))

        resident = [b.to(device) for b in itertools.islice(source(), 8)]
        runs: dict[str, list[float]] = {"on device": [], "prefetched": [], "inline": []}
        for _ in range(args.rounds):
            runs["on device"].append(tokens_per_second(itertools.cycle(resident), shape, args.steps, device))
            with Prefetcher(source(), device) as batches:
                runs["prefetched"].append(tokens_per_second(batches, shape, args.steps, device))
            inline = (b.to(device) for b in source())
            runs["inline"].append(tokens_per_second(inline, shape, args.steps, device))
    base = statistics.median(runs["on device"])
    print(f"device={device} shape={args.shape} {shape} steps={args.steps} rounds={args.rounds} threads={args.threads}")
    print(f"{'loop':12s} {'tokens/s (median)':>18s} {'ratio':>7s}   rounds")
    for name, values in runs.items():
        med = statistics.median(values)
        print(f"{name:12s} {med:18,.0f} {med / base:7.2f}   {', '.join(f'{v:,.0f}' for v in values)}")
    OUT.mkdir(exist_ok=True)
    out = OUT / f"sae-{device.type}-{args.shape}.json"
    out.write_text(json.dumps({"args": vars(args), "tokens_per_s": runs,
                               "ratio_to_on_device": {n: statistics.median(v) / base for n, v in runs.items()}},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
