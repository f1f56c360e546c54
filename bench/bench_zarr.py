"""Benchmark the Zarr activation logger's (sample, layer) reads and its shard writers.

Measured in one run, on one synthetic extraction (random float32, varied lengths) written as shards:
  raw         np.memmap of a flat float16 (N, L, T_max, H) file holding the same bytes; [i, l, :n] copied
              (the baseline, ratio 1.0)
  fast        ZarrRun.read: validated .zarray, then os.preadv of the chunk files (actstore's reader)
  zarr        zarr-python 3: open_consolidated(...)["arrays/activations"][i, l, :n] (fewer queries)
Each for k random (sample, random layer) queries, latency timed inside the reading process, with 0, 2
and 4 DataLoader workers (raw and fast). Write throughput of write_shard with 1 and 2 writer processes
(2 parts either way). Warm page cache. Writes bench/out/zarr.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from actstore.formats import zarr as zs
from actstore.formats.extract import open_part, part_dirname, synthetic_extraction

OUT = Path(__file__).resolve().parent / "out"


def write_runs(parts: list[Path], run: Path, writers: int) -> float:
    """Seconds to write every part as a shard with `writers` processes."""
    shutil.rmtree(run, ignore_errors=True)
    jobs = [(p, run / "shards" / zs.shard_name(k)) for k, p in enumerate(parts)]
    t0 = time.perf_counter()
    with mp.get_context("fork").Pool(writers) as pool:
        pool.starmap(_write, jobs)
    elapsed = time.perf_counter() - t0
    zs.write_manifest(run, [dst for _, dst in jobs])
    return elapsed


def _write(src: Path, dst: Path) -> None:
    zs.write_shard(src, dst, progress=False)


class Timed(torch.utils.data.Dataset):
    """Returns (tensor, seconds spent reading) so latency is measured where the read happens."""

    def __init__(self, kind: str, run: Path, raw: Path, shape: tuple, seq_len: np.ndarray, layers: list[int]):
        self.kind, self.run, self.raw, self.shape, self.seq_len = kind, run, raw, shape, seq_len
        self.layers, self._reader = layers, None

    def _open(self):
        if self._reader is None:  # opened lazily, i.e. inside each worker
            if self.kind == "fast":
                self._reader = zs.ZarrRun(self.run)
            elif self.kind == "raw":
                self._reader = np.memmap(self.raw, dtype=np.float16, mode="r", shape=self.shape)
            else:
                import zarr
                self._reader = [zarr.open_consolidated(str(self.run / e["path"]), mode="r")["arrays/activations"]
                                for e in json.loads((self.run / zs.MANIFEST).read_text())["shards"]]
        return self._reader

    def __len__(self) -> int:
        return self.shape[0] * self.shape[1]

    def __getitem__(self, key):
        i, layer = key
        reader = self._open()
        t0 = time.perf_counter()
        if self.kind == "fast":
            x = reader.read(i, layer)
        elif self.kind == "raw":
            x = np.array(reader[i, self.layers.index(layer), : self.seq_len[i]])
        else:
            half = self.shape[0] // 2  # two equal parts
            x = reader[i // half][i % half, self.layers.index(layer), : self.seq_len[i]]
        return torch.from_numpy(x), time.perf_counter() - t0


def measure(ds: Timed, keys: list, workers: int) -> dict:
    loader = torch.utils.data.DataLoader(ds, sampler=keys, batch_size=None, num_workers=workers,
                                         multiprocessing_context="fork" if workers else None)
    lat, t0 = [], time.perf_counter()
    for _, dt in loader:
        lat.append(dt)
    wall = time.perf_counter() - t0
    us = np.array(lat) * 1e6
    return {"mean_us": float(us.mean()), "p50_us": float(np.percentile(us, 50)),
            "p95_us": float(np.percentile(us, 95)), "queries_per_s": len(keys) / wall, "k": len(keys)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1000, help="samples (two equal parts)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--t-max", type=int, default=128)
    ap.add_argument("-k", type=int, default=10_000, help="random (sample, layer) queries per measurement")
    ap.add_argument("--zarr-k", type=int, default=1000, help="queries through zarr-python (slow)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zarr-bench-", dir=args.workdir))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> None:
    mean_tokens = (args.t_max // 8 + args.t_max) / 2  # samples of t_max/8 .. t_max tokens
    extract = synthetic_extraction(work / "extract", int(args.samples * mean_tokens * args.layers * args.hidden * 4), 2,
                                   args.hidden, list(range(args.layers)), tokens=(max(1, args.t_max // 8), args.t_max))
    parts = [extract / part_dirname(p) for p in (0, 1)]
    run_dir = work / "zarr"
    act_bytes = sum(open_part(p).info.n_samples for p in parts) * args.layers * args.t_max * args.hidden * 2
    writes = {}
    for w in (1, 2):
        seconds = write_runs(parts, run_dir, w)
        writes[w] = {"seconds": seconds, "MB_per_s": act_bytes / seconds / 1e6}
    reader = zs.ZarrRun(run_dir)
    shape = (reader.n_samples, args.layers, args.t_max, args.hidden)
    raw = work / "raw.f16"
    flat = np.memmap(raw, dtype=np.float16, mode="w+", shape=shape)
    for i in range(reader.n_samples):  # the same bytes, laid out flat
        for layer in range(args.layers):
            flat[i, layer, : reader.seq_len(i)] = reader.read(i, layer)
    flat.flush()
    seq_len = np.array([reader.seq_len(i) for i in range(reader.n_samples)])
    rng = np.random.default_rng(0)
    keys = [(int(i), int(l)) for i, l in zip(rng.integers(0, shape[0], args.k), rng.integers(0, args.layers, args.k))]
    layers = list(range(args.layers))
    results = []
    for workers in args.workers:
        for kind in ("raw", "fast"):
            ds = Timed(kind, run_dir, raw, shape, seq_len, layers)
            measure(ds, keys[:500], workers)  # warm page cache and worker start-up
            results.append({"reader": kind, "workers": workers, **measure(ds, keys, workers)})
    ds = Timed("zarr", run_dir, raw, shape, seq_len, layers)
    results.append({"reader": "zarr-python", "workers": 0, **measure(ds, keys[: args.zarr_k], 0)})
    base = {r["workers"]: r for r in results if r["reader"] == "raw"}
    print(f"store: N={shape[0]} L={shape[1]} T_max={shape[2]} H={shape[3]} float16, "
          f"mean seq_len {seq_len.mean():.0f}, chunk {args.t_max}x{args.hidden}")
    print(f"{'reader':<12}{'workers':>8}{'mean us':>10}{'p50 us':>10}{'p95 us':>10}{'p50/raw':>9}{'q/s':>10}")
    for r in results:
        r["p50_ratio_vs_raw"] = r["p50_us"] / base.get(r["workers"], base[args.workers[0]])["p50_us"]
        print(f"{r['reader']:<12}{r['workers']:>8}{r['mean_us']:>10.1f}{r['p50_us']:>10.1f}{r['p95_us']:>10.1f}"
              f"{r['p50_ratio_vs_raw']:>9.2f}{r['queries_per_s']:>10.0f}")
    for w, v in writes.items():
        print(f"write_shard, {w} writer process(es), 2 parts: {v['seconds']:.2f} s, {v['MB_per_s']:.0f} MB/s "
              f"(x{v['MB_per_s'] / writes[1]['MB_per_s']:.2f} vs 1)")
    OUT.mkdir(exist_ok=True)
    doc = {"shape": list(shape), "mean_seq_len": float(seq_len.mean()), "reads": results,
           "writes": {str(w): v for w, v in writes.items()}}
    (OUT / "zarr.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT / 'zarr.json'}")


if __name__ == "__main__":
    main()
