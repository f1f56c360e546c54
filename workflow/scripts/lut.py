"""Rule build_lut: write lut/ (metadata.json + one .lut.safetensors per target) and report.json."""
from pathlib import Path

from actstore.workflow import setup_logging, stage_rule

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

import torch

from actstore.lut import build_lut

out_dir = Path(snakemake.output.report).parent
with stage_rule(snakemake, "lut", out_dir) as config:
    torch.set_num_threads(snakemake.threads)
    build_lut(config, Path(snakemake.input.index).parent, Path(snakemake.input.sae).parent, out_dir)
