"""Rule zarr_merge: the optional single merged store over every shard (spec Option B), finished from
the zarr_merge_chunks jobs' copies once the shard jobs' records show every shard written."""
from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.zarr import finish_merge
from actstore.jobs import check_job_parts

check_job_parts(list(snakemake.input.records), len(snakemake.params.shards))
finish_merge(list(snakemake.params.shards), list(snakemake.input.chunks), snakemake.output[0])
