"""Dry-run time of the whole chain (`snakemake -n`, what a user runs before submitting) at many parts,
against the extraction's own DAG (`--until extract_index`: one job per part) timed in the same run, so
the ratio is what the format, SAE, LUT and validation stages add (#18: goal <= 30 s at 4,096 parts).

The demo config with --parts parts, dump_to in a temp dir (nothing exists, every job is planned); with
--profile, through that profile (profiles/osc needs ACTSTORE_SLURM_ACCOUNT: a placeholder is set when
it is missing). Best of --repeat, each in a fresh process. Snakemake's Slurm plugin runs
`scontrol show config` at start: where Slurm's tools are installed but no controller answers, every
run waits ~9 s more (tests/slurm/cluster.sh up brings the local one up). Writes bench/out/dryrun.json.

--job-parse N: instead, the parse every cluster job makes of the Snakefile (one extraction part's job
planned as Slurm's jobstep starts it, `--mode subprocess -n`; wall seconds and peak memory) for an
image folder of N empty .JPEG files in 1,000 class folders (a tiny seeded ViT, `dataset.identity:
stat`): reading the data itself, and taking the main process's facts from the file it hands its jobs
(actstore/parse_memo.py, written here as rules/common.smk's parse and onstart write it), against the
same job's parse with a one-row JSONL file (the parse without data) in the same run. Writes
bench/out/job_parse.json.
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


# What rules/common.smk's parse learns of the data, handed over as the main process's onstart does.
MAIN_PARSE = """
import json, sys
from actstore import parse_memo, workflow
workflow.parse_dataset(json.loads(sys.argv[1]), main_process=True)
print(parse_memo.hand_over(sys.argv[2]))
"""


def job_parse(configfile: Path, handed: str | None) -> tuple[float, float]:
    """(wall seconds, peak MB) of one extraction part's job parsing the Snakefile, in a fresh process."""
    cmd = ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
           "--configfile", str(configfile), "--target-jobs", "extract_part:part=0000", "--allowed-rules",
           "extract_part", "--cores", "1", "--force", "--nolock", "--no-hooks", "--mode", "subprocess", "-n"]
    env = {k: v for k, v in os.environ.items() if k != "ACTSTORE_PARSE_MEMO"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**env, **({"ACTSTORE_PARSE_MEMO": handed} if handed else {})},
                          capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if proc.returncode != 0 or (handed and "as the main process read it" not in proc.stderr):
        raise SystemExit((proc.stdout + proc.stderr)[-4000:])
    return seconds, int(proc.stderr.strip().splitlines()[-1]) / 1000


def measure_job_parse(tmp: Path, images: int, repeat: int) -> dict:
    import torch
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    vit = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                    image_size=32, patch_size=8)
    ViTModel(vit).save_pretrained(tmp / "vit")
    for i in range(images):
        folder = tmp / "images" / f"n{i % 1000:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"n{i % 1000:08d}_{i:07d}.JPEG").touch()
    (tmp / "one.jsonl").write_text('{"text": "a"}\n')
    row = {"images": images}
    for name, data in (("no_data", tmp / "one.jsonl"), ("images", tmp / "images")):
        config = {"dump_to": str(tmp / "dump"), "model": {"path": str(tmp / "vit")},
                  "dataset": {"path": str(data), "identity": "stat"},
                  "extract": {"layers": [0, 1], "parts": 8}, "sae": {"enabled": False}}
        configfile = tmp / f"{name}.yaml"
        configfile.write_text(yaml.safe_dump(config))
        resolved = subprocess.run([sys.executable, "-c", "import json, sys, yaml; from actstore.config import "
                                   "validate_config; print(json.dumps(validate_config(yaml.safe_load(open(sys.argv[1])))))",
                                   str(configfile)], capture_output=True, text=True, check=True).stdout
        handed = subprocess.run([sys.executable, "-c", MAIN_PARSE, resolved, str(tmp / "handed")],
                                capture_output=True, text=True, check=True).stdout.strip()
        for mode, memo in (("read", None), ("handed", handed)):
            runs = [job_parse(configfile, memo) for _ in range(repeat)]
            row[f"{name}_{mode}_s"], row[f"{name}_{mode}_mb"] = min(s for s, _ in runs), max(m for _, m in runs)
    for mode in ("read", "handed"):
        row[f"images_{mode}_over_no_data"] = row[f"images_{mode}_s"] / row["no_data_read_s"]
    print(json.dumps(row, indent=2))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--profile", default="profiles/osc", help="'' for none")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--job-parse", type=int, metavar="N", help="measure a job's parse with N images instead")
    args = parser.parse_args()
    if args.job_parse:
        with tempfile.TemporaryDirectory() as tmp:
            row = measure_job_parse(Path(tmp), args.job_parse, args.repeat)
        OUT.mkdir(exist_ok=True)
        (OUT / "job_parse.json").write_text(json.dumps(row, indent=2) + "\n")
        return
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
