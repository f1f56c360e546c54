"""Rule zarr_shards: write one job's consecutive extraction parts, one after another, each as a
self-contained Zarr v2 shard store in shards/, then the job's record of the parts written."""
import logging

from actstore.workflow import git_commit, setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.zarr import write_shard
from actstore.jobs import write_job_record

commit = git_commit()
for part_dir, shard in zip(snakemake.input, snakemake.params.shards):
    entry = write_shard(part_dir, shard, snakemake.params.t_chunk, git_commit=commit, threads=snakemake.threads)
    logging.getLogger("zarr_shards").info("%s: %d samples, %d bytes", entry["path"], entry["num_samples"], entry["bytes"])
write_job_record(snakemake.output[0], snakemake.params.jobs, int(snakemake.wildcards.job), (),
                 parts=snakemake.params.parts)
