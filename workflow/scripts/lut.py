"""Rule build_lut: write lut/ (metadata.json + one .lut.safetensors per target) and report.json."""
from pathlib import Path

import torch

from actstore.hashing import write_stage_config
from actstore.lut import build_lut
from actstore.workflow import setup_logging

setup_logging(snakemake)
torch.set_num_threads(snakemake.threads)
out_dir = Path(snakemake.output.report).parent
build_lut(snakemake.config, Path(snakemake.input.index).parent, Path(snakemake.input.sae).parent, out_dir)
write_stage_config(snakemake.config, "lut", out_dir)
