"""Rule pickle_merge: one metadata.json over every machine's shards (referenced in place, not copied),
once the jobs' records show every machine written."""
from pathlib import Path

from actstore.formats.pickle import merge_machines
from actstore.jobs import check_job_parts
from actstore.workflow import stage_rule

with stage_rule(snakemake, "pickle", Path(snakemake.output.stage_config).parent):
    check_job_parts(list(snakemake.input), len(snakemake.params.machines))
    merge_machines(list(snakemake.params.machines), Path(snakemake.output.metadata).parent)
