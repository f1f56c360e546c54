"""Rule pickle_merge: one metadata.json over every machine's shards (referenced in place, not copied)."""
from pathlib import Path

from actstore.formats.pickle import merge_machines
from actstore.workflow import stage_rule

with stage_rule(snakemake, "pickle", Path(snakemake.output.stage_config).parent):
    merge_machines(list(snakemake.input), Path(snakemake.output.metadata).parent)
