"""Rule validate_stores: verify every store and compare random coordinates with the extraction."""
from pathlib import Path

from actstore.workflow import setup_logging, stage_rule

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.verify import validate_all

with stage_rule(snakemake, "validate", Path(snakemake.output.stage_config).parent) as config:
    validate_all(config, snakemake.output.report)
