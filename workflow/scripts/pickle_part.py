"""Rule pickle_part: write one extraction part (machine) as a complete pickle-shard store."""
from actstore.formats.extract import open_part
from actstore.formats.pickle import write_machine
from actstore.model_config import model_params, read_model_config
from actstore.workflow import setup_logging

setup_logging(snakemake)
# The model the part was extracted with (its resolved folder, as part.json records it).
model_path = open_part(snakemake.input[0]).info.model.path
write_machine(snakemake.input[0], snakemake.output[0], model_params=model_params(read_model_config(model_path)),
              shard_size_mb=snakemake.params.shard_size_mb, compression=snakemake.params.compression,
              compresslevel=snakemake.params.compresslevel, compressor=snakemake.params.compressor,
              threads=snakemake.threads)
