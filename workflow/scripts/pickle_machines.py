"""Rule pickle_machines: write one job's consecutive extraction parts (machines), one after another,
each as a complete pickle-shard store in the stage dir, then the job's record of the parts written."""
from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.pickle import write_machine
from actstore.jobs import write_job_record
from actstore.model_config import model_params, run_config

# The sizes of what ran (a vision-language checkpoint's vision tower with model.tower: vision).
params = model_params(run_config(snakemake.config["model"]))
for part_dir, machine_dir in zip(snakemake.input, snakemake.params.machines):
    write_machine(part_dir, machine_dir, model_params=params,
                  shard_size_mb=snakemake.params.shard_size_mb, compression=snakemake.params.compression,
                  compresslevel=snakemake.params.compresslevel, compressor=snakemake.params.compressor,
                  threads=snakemake.threads)
write_job_record(snakemake.output[0], snakemake.params.jobs, int(snakemake.wildcards.job), (),
                 parts=snakemake.params.parts)
