"""Rule lmprobe_tensors: one scatter job's contiguous range of the lmprobe dataset's tensor files."""
from pathlib import Path

from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats import lmprobe

lmprobe.write_job(Path(snakemake.input.index).parent, snakemake.output[0], snakemake.config["lmprobe"],
                  jobs=snakemake.params.jobs, job=int(snakemake.wildcards.job), threads=snakemake.threads)
