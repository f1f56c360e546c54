"""Dry-run time of the whole chain (`snakemake -n`, what a user runs before submitting) at many parts,
against the extraction's own DAG (`--until extract_index`: one job per part) timed in the same run, so
the ratio is what the format, SAE, LUT and validation stages add (#18: goal <= 30 s at 4,096 parts).

The demo config with --parts parts, dump_to in a temp dir (nothing exists, every job is planned); with
--profile, through that profile (profiles/osc needs ACTSTORE_SLURM_ACCOUNT: a placeholder is set when
it is missing). Best of --repeat, each in a fresh process. Snakemake's Slurm plugin runs
`scontrol show config` at start: where Slurm's tools are installed but no controller answers, every
run waits ~9 s more (tests/slurm/cluster.sh up brings the local one up). Writes bench/out/dryrun.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "out"
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def dry_run(configfile: Path, profile: str | None, until: str | None) -> tuple[float, int]:
    """(wall seconds, jobs planned) of one `snakemake -n` in a fresh process."""
    cmd = [SNAKEMAKE, "-n", "--configfile", str(configfile)] + (["--profile", profile] if profile else []) \
        + (["--until", until] if until else [])
    env = {**os.environ, "ACTSTORE_SLURM_ACCOUNT": os.environ.get("ACTSTORE_SLURM_ACCOUNT") or "PAS0000"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit((proc.stdout + proc.stderr)[-4000:])
    return seconds, int(re.search(r"^total\s+(\d+)$", proc.stdout, re.M).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--profile", default="profiles/osc", help="'' for none")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for parts in args.parts:
            config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
            config["dump_to"] = str(Path(tmp) / "dump")
            config["extract"]["parts"] = parts
            configfile = Path(tmp) / f"parts{parts}.yaml"
            configfile.write_text(yaml.safe_dump(config))
            row = {"parts": parts}
            for name, until in (("extraction", "extract_index"), ("chain", None)):
                runs = [dry_run(configfile, args.profile or None, until) for _ in range(args.repeat)]
                row[f"{name}_s"], row[f"{name}_jobs"] = min(s for s, _ in runs), runs[0][1]
            row["ratio"] = row["chain_s"] / row["extraction_s"]
            rows.append(row)
            print(f"{parts:>6} parts: chain {row['chain_jobs']:>6} jobs {row['chain_s']:6.1f} s | extraction alone "
                  f"{row['extraction_jobs']:>6} jobs {row['extraction_s']:6.1f} s | x{row['ratio']:.2f}", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "dryrun.json").write_text(json.dumps({"profile": args.profile, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
