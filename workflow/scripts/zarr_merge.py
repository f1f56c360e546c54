"""Rule zarr_merge: the optional single merged store over every shard (spec Option B), finished from
the zarr_merge_chunks jobs' copies once the shard jobs' records show every shard written. The rule
declares the store's .zmetadata (no directory(), whose marker file Snakemake writes into the store)."""
from pathlib import Path

from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.zarr import finish_merge
from actstore.io_utils import discard
from actstore.jobs import check_job_parts

store = Path(snakemake.output.zmetadata).parent
# On a rerun Snakemake deleted the declared .zmetadata alone: the rest of the earlier store goes first,
# so that a failure or a kill from here on leaves no store under its name that looks whole
discard(store)
check_job_parts(list(snakemake.input.records), len(snakemake.params.shards))
finish_merge(list(snakemake.params.shards), list(snakemake.input.chunks), store)
