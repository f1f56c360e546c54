"""Rule validate_stores: verify every store and compare random coordinates with the extraction."""
from pathlib import Path

from actstore.verify import validate_all
from actstore.workflow import stage_rule

with stage_rule(snakemake, "validate", Path(snakemake.output.stage_config).parent) as config:
    validate_all(config, snakemake.output.report)
