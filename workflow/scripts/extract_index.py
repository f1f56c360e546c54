"""Rule extract_index: check every part and summarise the extraction stage."""
from pathlib import Path

from actstore.formats.extract import write_index
from actstore.workflow import stage_rule

with stage_rule(snakemake, "extract", Path(snakemake.output.stage_config).parent):
    write_index(Path(snakemake.output.index).parent, snakemake.output.index)
