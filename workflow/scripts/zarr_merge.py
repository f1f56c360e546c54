"""Rule zarr_merge: the optional single merged store over every shard (spec Option B), finished from
the zarr_merge_chunks jobs' copies."""
from actstore.formats.zarr import finish_merge
from actstore.workflow import setup_logging

setup_logging(snakemake)
finish_merge(list(snakemake.input.shards), list(snakemake.input.chunks), snakemake.output[0])
