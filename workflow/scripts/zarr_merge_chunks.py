"""Rule zarr_merge_chunks: one job of the scattered merge, the chunk files of its consecutive shards
copied under their merged names, with their checksums (finished by zarr_merge)."""
from actstore.formats.zarr import copy_chunks
from actstore.workflow import setup_logging

setup_logging(snakemake)
copy_chunks(list(snakemake.params.shards), snakemake.output[0], snakemake.params.jobs, int(snakemake.wildcards.job))
