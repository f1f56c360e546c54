"""Rule zarr_manifest: manifest.json (global index -> shard, per-store checksums) and the stage config,
once the shard jobs' records show every shard written."""
from pathlib import Path

from actstore.formats.zarr import write_manifest
from actstore.jobs import check_job_parts
from actstore.workflow import stage_rule

run_dir = Path(snakemake.output.manifest).parent
with stage_rule(snakemake, "zarr", run_dir):
    check_job_parts(list(snakemake.input.records), len(snakemake.params.shards))
    write_manifest(run_dir, list(snakemake.params.shards), snakemake.input.merged[0] if snakemake.input.merged else None)
