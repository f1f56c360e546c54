"""Rule pickle_merge: one metadata.json over every machine's shards (referenced in place, not copied),
once the jobs' records show every machine written."""
from pathlib import Path

from actstore.workflow import setup_logging, stage_rule

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.pickle import merge_machines
from actstore.jobs import check_job_parts

with stage_rule(snakemake, "pickle", Path(snakemake.output.stage_config).parent):
    check_job_parts(list(snakemake.input), len(snakemake.params.machines))
    merge_machines(list(snakemake.params.machines), Path(snakemake.output.metadata).parent)
