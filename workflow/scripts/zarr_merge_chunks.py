"""Rule zarr_merge_chunks: one job of the scattered merge, the chunk files of its consecutive shards
hard-linked under their merged names, with their checksums (finished by zarr_merge)."""
from actstore.formats.zarr import link_chunks
from actstore.workflow import setup_logging

setup_logging(snakemake)
link_chunks(list(snakemake.params.shards), snakemake.output[0], snakemake.params.jobs, int(snakemake.wildcards.job))
