"""Rule pickle_merge: one metadata.json over every machine's shards (referenced in place, not copied)."""
from pathlib import Path

from actstore.formats.pickle import merge_machines
from actstore.hashing import write_stage_config
from actstore.workflow import setup_logging

setup_logging(snakemake)
merge_machines(list(snakemake.input), Path(snakemake.output.metadata).parent)
write_stage_config(snakemake.config, "pickle", Path(snakemake.output.stage_config).parent)
