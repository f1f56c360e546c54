"""Rule zarr_manifest: manifest.json (global index -> shard, per-store checksums) and the stage config."""
from pathlib import Path

from actstore.formats.zarr import write_manifest
from actstore.workflow import stage_rule

run_dir = Path(snakemake.output.manifest).parent
with stage_rule(snakemake, "zarr", run_dir):
    write_manifest(run_dir, list(snakemake.input.shards), snakemake.input.merged[0] if snakemake.input.merged else None)
