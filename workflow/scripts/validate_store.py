"""Rule validate_store: one format's store verified, read at the sampled coordinates and in full."""
from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore import parse_memo
from actstore.verify import check_store, opened, save_store_check

with parse_memo.main_process_facts():  # the stage directories the run named
    extraction, coords = opened(snakemake.config)
    entry, passes = check_store(snakemake.config, snakemake.wildcards.store, extraction, coords)
save_store_check(snakemake.output[0], entry, passes)
