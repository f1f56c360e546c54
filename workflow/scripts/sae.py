"""Rule train_sae: train (or import) the TopK SAE on sae.hook; write sae.safetensors and report.json."""
from pathlib import Path

import torch

from actstore.config import enabled_stages
from actstore.hashing import write_stage_config
from actstore.lut import check_targets_before_training
from actstore.sae import build_sae
from actstore.workflow import setup_logging

setup_logging(snakemake)
torch.set_num_threads(snakemake.threads)
out_dir = Path(snakemake.output.sae).parent
if "lut" in enabled_stages(snakemake.config):
    check_targets_before_training(snakemake.config, Path(snakemake.input.index).parent)
build_sae(snakemake.config, Path(snakemake.input.index).parent, out_dir)
write_stage_config(snakemake.config, "sae", out_dir)
