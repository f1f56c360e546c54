"""Rule validate_extract: the extraction verified and read once into every store view's fingerprint."""
from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore import parse_memo
from actstore.verify import check_extraction, opened, save_extraction_check

with parse_memo.main_process_facts():  # the stage directories the run named
    extraction, coords = opened(snakemake.config)
    entry, reference = check_extraction(snakemake.config, extraction, coords)
save_extraction_check(snakemake.output[0], len(coords), entry, reference)
