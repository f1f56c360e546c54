"""Extraction throughput vs a bare forward pass over the same batches, in the same run.

ratio = extraction wall time / bare forward wall time (both include model load, tokenization and
batching; extraction adds hooks, device->host copies, the token-packed writes, fsync and sha256).
Goal: ratio <= 1.15.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from actstore.config import load_config
from actstore.extract import length_batches, preflight, run_part, text_batch, tokenize
from actstore.models import load_model

REPO = Path(__file__).resolve().parents[1]


def bare_forward(config: dict) -> tuple[float, int]:
    started = time.perf_counter()
    model_path, dataset = preflight(config)
    loaded = load_model(model_path, config["model"]["torch_dtype"], config["extract"]["device"])
    ids = tokenize(loaded, dataset.samples, config["extract"]["max_seq_length"])
    with torch.inference_mode():
        for batch in length_batches([len(x) for x in ids], config["extract"]["batch_size"]):
            loaded.model(**text_batch(loaded, [ids[i] for i in batch]))
    return time.perf_counter() - started, sum(len(x) for x in ids)


def extraction(config: dict, out: Path) -> tuple[float, int]:
    started = time.perf_counter()
    meta = run_part(config, 0, out, progress=False)
    return time.perf_counter() - started, meta["n_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configfile", default=str(REPO / "config" / "config.yaml"))
    parser.add_argument("--limit", type=int, default=600, help="dataset rows to run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "out" / "extract.json"))
    args = parser.parse_args()
    config = load_config(args.configfile)
    config["dataset"]["path"] = str(REPO / config["dataset"]["path"])
    config["dataset"]["limit"] = args.limit
    config["extract"]["parts"] = 1
    bare_times, extract_times = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            bare_s, tokens = bare_forward(config)
            extract_s, stored = extraction(config, Path(tmp) / f"part-{repeat}")
            assert stored == tokens
            bare_times.append(bare_s)
            extract_times.append(extract_s)
    result = {
        "model": config["model"]["path"], "rows": args.limit, "tokens": tokens,
        "layers": config["extract"]["layers"], "hooks": config["extract"]["hooks"],
        "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
        "bare_forward_s": min(bare_times), "extract_s": min(extract_times),
        "bare_tokens_per_s": tokens / min(bare_times), "extract_tokens_per_s": tokens / min(extract_times),
        "ratio": min(extract_times) / min(bare_times),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        print(f"{key:22s} {value:.3f}" if isinstance(value, float) else f"{key:22s} {value}")


if __name__ == "__main__":
    main()
