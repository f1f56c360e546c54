"""Time the LUT runtime against the dense matmul it replaces, same batch, same run.

Rows: dense x @ W (the baseline), lookup alone (Step B given precomputed TopK codes), encode + lookup
(Steps A + B), and encode + lookup + compensation at a budget. Every time is also a ratio to dense.
Uses a real LUT directory when given (--lut, e.g. results/lut/<hash>), else random tables of the demo's
shape (MiniLM: input 384, output 384, 1536 latents, k 32).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from actstore.lut import LutEncoder, LutLinear

OUT = Path(__file__).with_name("out")


def best_of(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def tables_for(args) -> tuple[dict[str, torch.Tensor], int, torch.Tensor]:
    if args.lut:
        from actstore.formats.lut import open_lut
        store = open_lut(args.lut)
        target = next(iter(store.layers))
        tables = store.load(target)
        w = torch.randn(store.layers[target]["input_dim"], store.layers[target]["output_dim"])
        return tables, store.k_active, w
    g = torch.Generator().manual_seed(0)
    d_in, d_out, n, k = args.d_in, args.d_out, args.num_basis, args.k
    w = torch.randn(d_in, d_out, generator=g) / d_in ** 0.5
    dec = torch.nn.functional.normalize(torch.randn(n, d_in, generator=g), dim=1)
    tables = {"encoder_weight": dec.clone(), "encoder_bias": torch.zeros(n), "decoder_weight": dec,
              "decoder_bias": torch.zeros(d_in), "precomputed_products": dec @ w, "bias_product": torch.zeros(d_out)}
    return {key: v.half() for key, v in tables.items()}, k, w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lut", help="a lut stage directory (or its lut/); default: random demo-shaped tables")
    parser.add_argument("--tokens", type=int, default=2048, help="batch of tokens (rows of x)")
    parser.add_argument("--d-in", type=int, default=384)
    parser.add_argument("--d-out", type=int, default=384)
    parser.add_argument("--num-basis", type=int, default=1536)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--budget", type=int, default=32, help="compensation budget for the last row")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tables, k, w = tables_for(args)
    linear = torch.nn.Linear(w.shape[0], w.shape[1], bias=False)
    with torch.no_grad():
        linear.weight.copy_(w.T)
    lut = LutLinear(LutEncoder(tables, k, torch.float32), tables, linear, 0)
    x = torch.randn(args.tokens, w.shape[0])
    with torch.inference_mode():
        values, indices = lut.encoder(x.clone())
        rows = {"dense x @ W": best_of(lambda: x @ w, args.repeat),
                "lookup only (Step B)": best_of(lambda: lut.lookup(values, indices), args.repeat),
                "encode only (Step A)": best_of(lambda: lut.encoder(x.clone()), args.repeat),
                "encode + lookup (A + B)": best_of(lambda: lut(x.clone()), args.repeat)}
        lut.set_budget(args.budget)
        rows[f"A + B + compensation {args.budget}"] = best_of(lambda: lut(x.clone()), args.repeat)
    dense = rows["dense x @ W"]
    print(f"tokens={args.tokens} d_in={w.shape[0]} d_out={w.shape[1]} num_basis={tables['encoder_weight'].shape[0]} "
          f"k={k} threads={args.threads}")
    print(f"{'step':36s} {'ms':>9s} {'x dense':>9s}")
    for name, t in rows.items():
        verdict = "" if name.startswith("dense") else ("  slower than dense" if t > dense else "  faster than dense")
        print(f"{name:36s} {t * 1e3:9.3f} {t / dense:9.2f}{verdict}")
    OUT.mkdir(exist_ok=True)
    result = {"args": vars(args), "seconds": rows, "ratio_to_dense": {n: t / dense for n, t in rows.items()}}
    (OUT / "lut.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT / 'lut.json'}")


if __name__ == "__main__":
    main()
