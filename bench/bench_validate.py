"""Time validate's full pass (actstore.fingerprints: every vector of every store against the
extraction) against reading and hashing the same files, same run.

Builds (in a temporary folder) a synthetic extraction (--mb MB of float32 activations, 2 parts, layers
1/3/5, d = --dim, samples of 64-512 tokens) and the saev, pickle (no compression), zarr and lmprobe
(full sequence) stores its real writers make of it. Then, page cache warm, in rounds: the baselines
(`cat` of every extraction and store file to /dev/null: the raw sequential read; sha256 of each file
one after another: verify on one core) and fingerprint_problems with each of --threads passes at once.
Best and median seconds per row; the ratio is the row's best over sha256's best (< 1: faster than
hashing). Writes bench/out/validate.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_verify import seconds  # noqa: E402

from actstore import integrity  # noqa: E402
from actstore.fingerprints import fingerprint_problems  # noqa: E402
from actstore.formats import format_module  # noqa: E402
from actstore.formats.extract import open_extraction, synthetic_extraction  # noqa: E402
from actstore.io_utils import sha256_file  # noqa: E402
from actstore.verify import reference_dtype  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
PARAMS = {"hidden_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 16, "vocab_size": 30522}


def write_stores(root: Path, out: Path) -> dict[str, Path]:
    """Every format's store of the extraction at `root`, by the real writers, with their defaults."""
    from actstore.formats import lmprobe, pickle, saev, zarr
    from actstore.formats.lmprobe.write import DEFAULTS

    parts = sorted(root.glob("part-*"))
    machines = [out / "pickle" / pickle.machine_dirname(p) for p in range(len(parts))]
    for part, machine in zip(parts, machines):
        pickle.write_machine(part, machine, compression="none", model_params=PARAMS, progress=False)
    pickle.merge_machines(machines, out / "pickle")
    shards = [out / "zarr" / "shards" / zarr.shard_name(p) for p in range(len(parts))]
    for part, shard in zip(parts, shards):
        zarr.write_shard(part, shard, progress=False)
    zarr.write_manifest(out / "zarr", shards)
    lmprobe.write_dataset(root, out / "lmprobe", {**DEFAULTS, "token_strings": False}, progress=False)
    store = saev.write_store(open_extraction(root), {"patches_per_shard": 2_400_000, "tokens_per_window": 32},
                             out / "saev", model_config=None, progress=False)
    return {"saev": store, "pickle": out / "pickle", "zarr": out / "zarr", "lmprobe": out / "lmprobe"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=512, help="MB of float32 activations in the extraction")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, integrity.CHECK_THREADS])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = synthetic_extraction(Path(tmp) / "extract", args.mb * 10**6, 2, args.dim, [1, 3, 5])
        stores = write_stores(root, Path(tmp))
        extraction = open_extraction(root)
        dtypes = {name: (store, format_module(name).inspect(store).get("dtype", "float32"))
                  for name, store in stores.items()}
        files = [*sorted(root.glob("part-*/*.npy")),
                 *sorted(p for store in stores.values() for p in store.rglob("*") if p.is_file())]
        n_bytes = sum(f.stat().st_size for f in files)
        rows: dict[str, list[float]] = {"cat, every file (raw read)": [], "sha256, one file after another": []}
        rows.update({f"full pass, {n} at once": [] for n in args.threads})
        for _ in range(args.repeat):
            rows["cat, every file (raw read)"].append(seconds(
                lambda: subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)))
            rows["sha256, one file after another"].append(seconds(lambda: [sha256_file(f) for f in files]))
            for n in args.threads:
                with integrity.check_threads(n):
                    found = {}
                    rows[f"full pass, {n} at once"].append(seconds(
                        lambda: found.update(fingerprint_problems(dtypes, extraction, 0, reference_dtype))))
                assert all(not result["problems"] for result in found.values()), found
    sha = min(rows["sha256, one file after another"])
    report = {"bytes": n_bytes, "mb": args.mb, "dim": args.dim,
              "rows": {name: {"best_s": min(t), "median_s": statistics.median(t), "gb_per_s": n_bytes / min(t) / 1e9,
                              "ratio_to_sha256": min(t) / sha} for name, t in rows.items()}}
    OUT.mkdir(exist_ok=True)
    (OUT / "validate.json").write_text(json.dumps(report, indent=1))
    print(f"{n_bytes / 1e9:.2f} GB in the extraction and its four stores\n")
    print("| row | best s | median s | GB/s | x sha256 |\n|---|---:|---:|---:|---:|")
    for name, row in report["rows"].items():
        print(f"| {name} | {row['best_s']:.2f} | {row['median_s']:.2f} | {row['gb_per_s']:.2f} | "
              f"{row['ratio_to_sha256']:.2f} |")


if __name__ == "__main__":
    main()
