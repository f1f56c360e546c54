"""Rule zarr_manifest: manifest.json (global index -> shard, per-store checksums) and the stage config,
once the shard jobs' records show every shard written."""
from pathlib import Path

from actstore.workflow import setup_logging, stage_rule

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.zarr import write_manifest
from actstore.jobs import check_job_parts

run_dir = Path(snakemake.output.manifest).parent
# zarr.merged: the input is the merged store's declared file (.zmetadata), the store its directory
merged = Path(snakemake.input.merged[0]).parent if snakemake.input.merged else None
with stage_rule(snakemake, "zarr", run_dir):
    check_job_parts(list(snakemake.input.records), len(snakemake.params.shards))
    write_manifest(run_dir, list(snakemake.params.shards), merged)
