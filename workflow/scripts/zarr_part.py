"""Rule zarr_part: write one extraction part as a self-contained Zarr v2 shard store."""
import logging

from actstore.formats.zarr import write_shard
from actstore.workflow import git_commit, setup_logging

setup_logging(snakemake)
entry = write_shard(snakemake.input[0], snakemake.output[0], snakemake.params.t_chunk, git_commit=git_commit())
logging.getLogger("zarr_part").info("%s: %d samples, %d bytes", entry["path"], entry["num_samples"], entry["bytes"])
