"""Rule build_lut: write lut/ (metadata.json + one .lut.safetensors per target) and report.json."""
from pathlib import Path

import torch

from actstore.lut import build_lut
from actstore.workflow import stage_rule

out_dir = Path(snakemake.output.report).parent
with stage_rule(snakemake, "lut", out_dir) as config:
    torch.set_num_threads(snakemake.threads)
    build_lut(config, Path(snakemake.input.index).parent, Path(snakemake.input.sae).parent, out_dir)
