"""Rule extract_index: check every part and summarise the extraction stage, with the model files the
parts loaded hashed (later parses compare them with the model folder)."""
from pathlib import Path

from actstore.workflow import setup_logging, stage_rule

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.extract import write_index
from actstore.model_config import resolve_model_path

with stage_rule(snakemake, "extract", Path(snakemake.output.stage_config).parent):
    write_index(Path(snakemake.output.index).parent, snakemake.output.index,
                resolve_model_path(snakemake.config["model"]["path"]))
