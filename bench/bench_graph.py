"""Would a CUDA graph feed the ViT faster than the eager forward? The main thread's time a batch, and the bits.

On the H100 the ViT rows' main thread took ~29 ms a batch where the bare forward's GPU work is 9-10
ms (session 44), and each aten op cost it 30-40 us of CPU beside the decoding workers, the writer
threads and the hashing pool. A CUDA graph replays a batch's ~180 kernels with one launch, so the
thread's per-op cost (and every GIL hand-off around an op) leaves the batch loop; image batches all
have one shape but the last, so a graph captured once fits the part. This bench asks what that is
worth before run_part takes it: bench_extract's vit-b14 model (bf16 on CUDA, random weights), the
block outputs of --layers captured by the product's hooks (extract.capture), --batches batches of
random pixels already on the device (no decoding, no writes), two ways, in --repeat rounds:
  eager: model(pixel_values=x) each batch, as run_part does
  graph: the same forward captured once in a CUDA graph (bench_extract's GraphedModel, which
         --graph-forward runs in run_part), each batch copied into its static input and replayed,
         the capture hooks then called with the outputs the graph wrote
each alone and beside --busy threads hashing 1 MiB blocks in a loop (a part's hashing pool: sha256
releases the GIL for each block and takes it back between). Per way, best of the rounds: wall ms a
batch (device synchronised at the end), the ms a batch the main thread took to queue them (before
that synchronise) and its CPU ms a batch; and whether the graph's captured outputs equal the eager
forward's bit for bit on the same inputs (run_part's parts must not change).
Without CUDA only the eager rows run (a graph needs a GPU).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_extract import GraphedModel, build_model  # noqa: E402

from actstore.extract.capture import capture  # noqa: E402
from actstore.models import load_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def hash_loop(stop: threading.Event) -> None:
    block = os.urandom(1 << 20)
    while not stop.is_set():
        hashlib.sha256(block).digest()


def timed(forward: Callable[[torch.Tensor], Any], inputs: list[torch.Tensor], batches: int, busy: int, cuda: bool) -> dict[str, float]:
    stop = threading.Event()
    helpers = [threading.Thread(target=hash_loop, args=(stop,), daemon=True) for _ in range(busy)]
    for helper in helpers:
        helper.start()
    if cuda:
        torch.cuda.synchronize()
    cpu, started = time.thread_time(), time.perf_counter()
    for i in range(batches):
        forward(inputs[i % len(inputs)])
    queued = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    ended, cpu = time.perf_counter(), time.thread_time() - cpu
    stop.set()
    for helper in helpers:
        helper.join()
    return {"wall_ms": (ended - started) / batches * 1e3, "queue_ms": (queued - started) / batches * 1e3,
            "cpu_ms": cpu / batches * 1e3}


def same_bits(model: torch.nn.Module, captured: dict, graphed: GraphedModel, inputs: list[torch.Tensor]) -> bool:
    """The graph's outputs, as its replayed hooks hand them to `captured`, against the eager forward's,
    input by input (cleared in between: a hook not replayed leaves its name missing)."""
    for pixels in inputs:
        model(pixel_values=pixels)
        eager = {name: tensor.clone() for name, tensor in captured.items()}
        captured.clear()
        graphed(pixels)
        if captured.keys() != eager.keys() or any(not torch.equal(captured[name], t) for name, t in eager.items()):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=32)
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 2], help="as bench_extract's ViT row")
    parser.add_argument("--busy", type=int, default=2, help="hashing threads in the busy rows")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(OUT / "graph.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(build_model("vit-b14", Path(tmp), device), "bfloat16" if cuda else "float32", str(device))
    dtype = next(loaded.model.parameters()).dtype
    generator = torch.Generator(device="cpu").manual_seed(0)
    inputs = [torch.randn(args.batch_size, 3, 224, 224, generator=generator).to(device, dtype) for _ in range(4)]
    rows: dict[str, list[dict[str, float]]] = {}
    result: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "batch_size": args.batch_size,
                    "batches": args.batches, "layers": args.layers}
    with capture(loaded, args.layers, []) as captured, torch.inference_mode():
        ways: dict[str, Callable[[torch.Tensor], Any]] = {"eager": lambda pixels: loaded.model(pixel_values=pixels)}
        if cuda:
            graphed = GraphedModel(loaded.model)
            graphed(inputs[0])  # seen: the next call of this shape captures its graph
            ways["graph"] = graphed
            result["graph_equals_eager"] = same_bits(loaded.model, captured, graphed, inputs)
        for _ in range(args.repeat):
            for name, forward in ways.items():
                for busy in (0, args.busy):
                    rows.setdefault(f"{name}, {busy} busy threads", []).append(
                        timed(forward, inputs, args.batches, busy, cuda))
    result["rows"] = {name: {key: min(r[key] for r in runs) for key in runs[0]} for name, runs in rows.items()}
    print(f"{result['device']}: {args.batches} batches of {args.batch_size}, layers {args.layers}, best of {args.repeat}"
          + (f"; graph outputs equal eager bit for bit: {result['graph_equals_eager']}" if cuda else
             "; no CUDA: eager only"))
    print("| way | wall ms a batch | queued ms a batch | main thread CPU ms a batch |\n|---|---:|---:|---:|")
    for name, row in result["rows"].items():
        print(f"| {name} | {row['wall_ms']:.2f} | {row['queue_ms']:.2f} | {row['cpu_ms']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
