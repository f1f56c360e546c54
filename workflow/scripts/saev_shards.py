"""Rule saev_shards: write one job's contiguous range of the saev store's shards, and its job record."""
from pathlib import Path

from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.extract import open_extraction
from actstore.formats.saev import PatchLabeler, extraction_fill, plan_store, write_shards
from actstore.model_config import run_config
from actstore.patch_labels import REGISTER_LABEL, image_patch_labels

config = snakemake.config
# The extraction's hash is its directory's name, the main process's: hashed again here, from the data as it
# is now, a dataset touched during the run gave the store another source (and identity: content read it all).
extract_dir = Path(snakemake.input.index).parent
extraction = open_extraction(extract_dir, config["extract"]["parts"])
image = extraction.info.modality == "image"
model_config = run_config(config["model"]) if image else None
# The store's metadata (its name goes into the job record) without computing labels.bin: the finishing job does.
plan = plan_store(extraction, config["saev"], extract_dir.name, model_config=model_config,
                  labeler=PatchLabeler(image_patch_labels, REGISTER_LABEL), labels=False)
write_shards(plan, extraction_fill(extraction, plan), snakemake.output[0], snakemake.params.jobs, snakemake.params.job,
             progress=True)
