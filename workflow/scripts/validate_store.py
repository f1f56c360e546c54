"""Rule validate_store: one share of one format's store verified and read in full (share 0: at the sampled
coordinates too)."""
from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore import parse_memo
from actstore.resources import validate_jobs
from actstore.verify import check_store, opened, save_store_check

store = snakemake.wildcards.store
share = (int(snakemake.wildcards.share), validate_jobs(snakemake.config, store))
with parse_memo.main_process_facts():  # the stage directories the run named
    extraction, coords = opened(snakemake.config)
    entry, passes = check_store(snakemake.config, store, extraction, coords, share)
save_store_check(snakemake.output[0], entry, passes)
