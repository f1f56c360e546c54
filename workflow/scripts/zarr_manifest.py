"""Rule zarr_manifest: manifest.json (global index -> shard, per-store checksums) and the stage config."""
from pathlib import Path

from actstore.formats.zarr import write_manifest
from actstore.hashing import write_stage_config
from actstore.workflow import setup_logging

setup_logging(snakemake)
run_dir = Path(snakemake.output.manifest).parent
write_manifest(run_dir, list(snakemake.input.shards), snakemake.input.merged[0] if snakemake.input.merged else None)
write_stage_config(snakemake.config, "zarr", run_dir)
