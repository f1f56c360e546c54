"""Rule validate_stores: verify every store and compare random coordinates with the extraction."""
from pathlib import Path

from actstore.hashing import write_stage_config
from actstore.verify import validate_all
from actstore.workflow import setup_logging

setup_logging(snakemake)
validate_all(snakemake.config, snakemake.output.report)
write_stage_config(snakemake.config, "validate", Path(snakemake.output.stage_config).parent)
