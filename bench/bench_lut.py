"""Time the LUT runtime against the dense matmuls it replaces, same inputs, same run.

For each token count: dense x @ W of every target (the baseline), Step B alone (the fused lookup of
every target at once given the TopK codes), Step A + B (one shared encoding, then every target's
lookup), and A + B + online compensation at two budgets: what the runtime runs on the device (on CUDA
its Triton Step B where triton is installed; at up to 8 tokens it and the Triton ReLU + top-k only in
the graph rows, lut_runtime.DECODE_ROWS). On CUDA also
dense, Step B and A + B each captured in one CUDA graph (the kernels without Python and launch
overhead, as a decode loop run through a graph pays), and in graphs the parts of A + B: Step A's
encoder GEMV with its bias, its ReLU + torch.topk and the Triton ReLU + top-k
(lut_kernels.topk_relu_triton) alone, and Step B by embedding_bag (the CPU's op, which the Triton
kernel replaced; each result is compared with the runtime's first). Every time is
also a ratio to dense. First `lut.runtime: auto`'s own calibration runs
(actstore.lut_runtime.calibrate, budget 0): its table and crossover are printed, and each token
count's block says which path the calibrated auto takes there.

Shapes: `demo` = MiniLM layer-3 q/k/v (input 384, three outputs of 384, 1536 latents, k 32, float16
tables); `llama8b-mlp` = Llama-3-8B gate + up (input 4096, two outputs of 14336, 16384 latents, k 32,
bfloat16 tables). Tables are random (the speed does not depend on their values) unless --lut names a
real lut directory (its first target). CPU: wall clock, best and median of --repeat. CUDA: CUDA events,
best and median of --repeat after a warm-up call.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable

import torch

from actstore.lut_runtime import (LutEncoder, LutLinear, calibrate, call_seconds, embedding_bag_rows, weighted_rows)

OUT = Path(__file__).with_name("out")
SHAPES = {"demo": {"d_in": 384, "outs": [384] * 3, "num_basis": 1536, "k": 32, "stored": torch.float16},
          "llama8b-mlp": {"d_in": 4096, "outs": [14336] * 2, "num_basis": 16384, "k": 32, "stored": torch.bfloat16}}


def timed(fn: Callable[[], object], repeat: int, device: torch.device) -> tuple[float, float]:
    """(best, median) seconds of fn over `repeat` runs after a warm-up (the runtime's own timer)."""
    times = call_seconds(fn, device, repeat)
    return min(times), statistics.median(times)


def graph_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured into one CUDA graph (after warm-up calls on a side stream, as torch.cuda.graph
    requires); returns its replay: the same kernels without the per-call Python and launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def random_luts(shape: dict, dtype: torch.dtype, device: torch.device) -> list[LutLinear]:
    """LutLinears sharing one encoder, from random unit-norm decoder rows and random target weights."""
    torch.manual_seed(0)
    d_in, n = shape["d_in"], shape["num_basis"]
    # Built on the device: the llama8b-mlp products are 2 x 1.9 TFLOP.
    dec = torch.nn.functional.normalize(torch.randn(n, d_in, device=device), dim=1)
    base = {"encoder_weight": dec, "encoder_bias": torch.zeros(n, device=device), "decoder_weight": dec,
            "decoder_bias": torch.zeros(d_in, device=device)}
    stored = {key: v.to(shape["stored"]) for key, v in base.items()}
    encoder = LutEncoder(stored, shape["k"], dtype)
    luts = []
    for out in shape["outs"]:
        linear = torch.nn.Linear(d_in, out, bias=False, device=device)
        torch.nn.init.normal_(linear.weight, std=d_in ** -0.5)
        tables = {**stored, "precomputed_products": (dec @ linear.weight.detach().T).to(shape["stored"]),
                  "bias_product": torch.zeros(out, dtype=shape["stored"], device=device)}
        luts.append(LutLinear(encoder, tables, linear))
    return luts


def real_luts(path: str, dtype: torch.dtype, device: torch.device) -> list[LutLinear]:
    """Every target of a lut directory, one shared encoder, random stand-ins for the original W."""
    from actstore.formats.lut import open_lut

    store = open_lut(path)
    first = store.load(next(iter(store.layers)))
    encoder = LutEncoder(first, store.k_active, dtype).to(device)
    luts = []
    for target, entry in store.layers.items():
        linear = torch.nn.Linear(entry["input_dim"], entry["output_dim"], bias=False)
        luts.append(LutLinear(encoder, store.load(target), linear).to(device))
    return luts


def measure(luts: list[LutLinear], tokens: int, budgets: list[int], args, device: torch.device) -> dict:
    """Seconds (best, median) of each row for one token count, all targets together."""
    dtype = luts[0].precomputed_products.dtype
    x = torch.randn(tokens, luts[0].in_features, device=device, dtype=dtype)

    def forward_all() -> None:
        fresh = x.clone()  # a new tensor: the shared encoder's cache must not skip Step A
        for lut in luts:
            lut(fresh)

    rows = {}
    with torch.inference_mode():
        for lut in luts:
            lut.set_budget(0)
        values, indices = luts[0].encoder(x)
        # The baseline: each target's own matmul, as the model runs its nn.Linear layers.
        weights = [lut.w_target.contiguous() for lut in luts]
        rows["dense"] = timed(lambda: [x @ w for w in weights], args.repeat, device)
        rows["lookup (B)"] = timed(lambda: luts[0].encoder.lookup(values, indices), args.repeat, device)
        rows["encode + lookup (A+B)"] = timed(forward_all, args.repeat, device)
        if device.type == "cuda":  # what a decode loop captured in a CUDA graph pays: the kernels alone
            for name, fn in (("dense, CUDA graph", lambda: [x @ w for w in weights]),
                             ("lookup (B), CUDA graph", lambda: luts[0].encoder.lookup(values, indices)),
                             ("A+B, CUDA graph", forward_all)):
                try:
                    rows[name] = timed(graph_replay(fn), args.repeat, device)
                except RuntimeError as exc:  # an op that cannot be captured: say which, keep the other rows
                    print(f"{name}: not captured ({exc})")
            rows |= part_rows(luts[0].encoder, x, values, indices, args.repeat, device)
        for budget in budgets:
            for lut in luts:
                lut.set_budget(budget)
            rows[f"A+B+comp {budget}"] = timed(forward_all, args.repeat, device)
        for lut in luts:
            lut.set_budget(0)
    return rows


def part_rows(encoder: LutEncoder, x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
              repeat: int, device: torch.device) -> dict:
    """The parts of the runtime's A + B, each in a CUDA graph: Step A's encoder GEMV with its bias, and
    its ReLU + top-k both ways (torch's ops and the Triton kernels, which the encoder runs depending on
    the token count and on a graph capture), and Step B by embedding_bag, the op the runtime's Triton kernel
    replaced. Each alternative's result is first compared with the runtime's (printed), so a wrong
    kernel is seen before its time is read."""
    from actstore.lut_kernels import topk_relu_triton

    weight, bias, k, table = encoder.encoder_weight, encoder.encoder_bias, encoder.k_active, encoder.products
    pre = (x @ weight.T).add_(bias)
    lookup, reference = weighted_rows(values, indices, table), embedding_bag_rows(values, indices, table)
    scale = reference.float().abs().max().item() or 1.0
    print(f"runtime B vs embedding_bag: max |difference| / max |lookup| "
          f"{(lookup.float() - reference.float()).abs().max().item() / scale:.2e}, "
          f"{(lookup == reference).float().mean().item():.4f} of values bit-equal")
    expect = pre.relu().topk(k)[0]
    print(f"Triton top-k: values equal torch.topk's {torch.equal(topk_relu_triton(pre, k)[0], expect)}")
    parts = {"A: encoder GEMV + bias, graph": lambda: (x @ weight.T).add_(bias),
             "A: ReLU + torch.topk, graph": lambda: torch.topk(pre.relu(), k),
             "A: Triton ReLU + top-k, graph": lambda: topk_relu_triton(pre, k),
             "B embedding_bag, graph": lambda: embedding_bag_rows(values, indices, table)}
    return {name: timed(graph_replay(fn), repeat, device) for name, fn in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--lut", help="a lut stage directory (or its lut/) instead of random tables")
    parser.add_argument("--tokens", default="1,8,64,512,2048", help="comma-separated token counts")
    parser.add_argument("--budgets", default="32,128", help="two compensation budgets")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="the model's dtype (tables held in it): default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    luts = real_luts(args.lut, dtype, device) if args.lut else random_luts(SHAPES[args.shape], dtype, device)
    budgets = [int(b) for b in args.budgets.split(",")]
    enc = luts[0].encoder
    print(f"device={device} shape={args.lut or args.shape} d_in={luts[0].in_features} "
          f"outs={[lut.out_features for lut in luts]} num_basis={enc.encoder_weight.shape[0]} k={enc.k_active} "
          f"dtype={dtype} threads={args.threads} repeat={args.repeat}")
    calibration = calibrate(luts)
    crossover = calibration["crossover_tokens"]
    print(f"auto's calibration (budget 0, {calibration['seconds']:.2f} s): crossover {crossover} tokens\n"
          f"{'tokens':>8s} {'lookup ms':>10s} {'dense ms':>10s}")
    for row in calibration["rows"]:
        print(f"{row['tokens']:8d} {row['lookup_ms']:10.3f} {row['dense_ms']:10.3f}")
    results = {}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        rows = measure(luts, tokens, budgets, args, device)
        dense = rows["dense"][0]
        auto = "lookup" if tokens <= crossover else "dense"
        print(f"\ntokens={tokens}  (auto runs {auto})\n{'row':24s} {'best ms':>10s} {'median ms':>10s} {'x dense':>8s}")
        for name, (best, median) in rows.items():
            print(f"{name:24s} {best * 1e3:10.3f} {median * 1e3:10.3f} {best / dense:8.2f}")
        results[tokens] = {"seconds_best_median": rows, "ratio_to_dense_best": {n: b / dense for n, (b, _) in rows.items()},
                           "auto_path": auto}
    OUT.mkdir(exist_ok=True)
    out = OUT / f"lut-{device.type}-{args.shape if not args.lut else 'lut'}.json"
    out.write_text(json.dumps({"args": vars(args), "calibration": calibration, "results": results}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
