"""Rule pickle_part: write one extraction part (machine) as a complete pickle-shard store."""
from actstore.formats.pickle_shards import write_machine
from actstore.workflow import setup_logging

setup_logging(snakemake)
write_machine(snakemake.input[0], snakemake.output[0], shard_size_mb=snakemake.params.shard_size_mb,
              compression=snakemake.params.compression, compresslevel=snakemake.params.compresslevel)
