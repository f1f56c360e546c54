"""Rule validate_extract: one share of the extraction's parts verified and read once into every store
view's fingerprint (share 0: at the sampled coordinates too)."""
from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore import parse_memo
from actstore.resources import validate_jobs
from actstore.verify import check_extraction, opened, save_extraction_check

share = (int(snakemake.wildcards.share), validate_jobs(snakemake.config, "extract"))
with parse_memo.main_process_facts():  # the stage directories the run named
    extraction, coords = opened(snakemake.config)
    entry, reference = check_extraction(snakemake.config, extraction, coords, share)
save_extraction_check(snakemake.output[0], len(coords), entry, reference)
