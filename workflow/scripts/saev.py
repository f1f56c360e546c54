"""Rule saev: assemble the saev protocol 2.1 store from the shard jobs' files and point the stage dir at it."""
from functools import partial
from pathlib import Path

from actstore.workflow import record_stage, setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.extract import open_extraction
from actstore.formats.saev import PatchLabeler, finish_store, open_store, plan_store, write_pointer
from actstore.model_config import run_config, trusted
from actstore.patch_labels import REGISTER_LABEL, image_patch_labels

config = snakemake.config
pointer = Path(snakemake.output.pointer)
extract_dir = Path(snakemake.input.index).parent
extraction = open_extraction(extract_dir, config["extract"]["parts"])
# What the format needs from the model and the masks, which it does not read itself (image stores only).
image = extraction.info.modality == "image"
model_config = run_config(config["model"]) if image else None
# The masks go through the model folder's processor, its own code only under model.trust_remote_code.
labels_of = partial(image_patch_labels, trust_remote_code=trusted(config["model"]))
plan = plan_store(extraction, config["saev"], extract_dir.name, model_config=model_config,
                  labeler=PatchLabeler(labels_of, REGISTER_LABEL), progress=True)
# The store sits beside the stage dir {dump_to}/saev/<stage hash>/: {dump_to}/saev/<HASH>/ (saev.flavor spec)
# or {dump_to}/saev/shards/<8 hex>/ (upstream, the directory saev's code requires).
store = finish_store(plan, snakemake.input.jobs, pointer.parent.parent)
open_store(store)  # re-open: every shard present with its exact size
write_pointer(pointer, store)
record_stage(config, "saev", pointer.parent)
