"""Rule extract_index: check every part and summarise the extraction stage."""
from pathlib import Path

from actstore.formats.extract import write_index
from actstore.hashing import write_stage_config
from actstore.workflow import setup_logging

setup_logging(snakemake)
write_index(Path(snakemake.output.index).parent, snakemake.output.index)
write_stage_config(snakemake.config, "extract", Path(snakemake.output.stage_config).parent)
