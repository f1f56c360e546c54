"""Rule zarr_merge: the optional single merged store over every shard (spec Option B)."""
from actstore.formats.zarr import merge_stores
from actstore.workflow import setup_logging

setup_logging(snakemake)
merge_stores(list(snakemake.input), snakemake.output[0])
