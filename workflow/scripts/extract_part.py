"""Rule extract_part: run the model over one contiguous slice of the dataset (its rows found from the
dataset's scan)."""
from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.extract import run_part

run_part(snakemake.config, snakemake.params.part, snakemake.output[0], threads=snakemake.threads,
         scan=snakemake.input.scan)
