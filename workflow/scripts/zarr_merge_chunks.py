"""Rule zarr_merge_chunks: one job of the scattered merge, the chunk files of its consecutive shards
hard-linked under their merged names, with their checksums (finished by zarr_merge)."""
from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.zarr import link_chunks

link_chunks(list(snakemake.params.shards), snakemake.output[0], snakemake.params.jobs, int(snakemake.wildcards.job))
