"""Rule train_sae: train (or import) the TopK SAE on sae.hook; write sae.safetensors, saelens/ and report.json."""
from pathlib import Path

from actstore.workflow import setup_logging, stage_rule

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

import torch

from actstore.config import enabled_stages
from actstore.lut import check_targets_before_training
from actstore.sae import build_sae

out_dir = Path(snakemake.output.sae).parent
extract_dir = Path(snakemake.input.index).parent
with stage_rule(snakemake, "sae", out_dir) as config:
    torch.set_num_threads(snakemake.threads)
    if "lut" in enabled_stages(config):
        check_targets_before_training(config, extract_dir)
    build_sae(config, extract_dir, out_dir)
