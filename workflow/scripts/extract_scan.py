"""Rule extract_scan: one pass over the dataset (row count, labels, where JSONL or tar rows start) that
every part's job reads, so each reads only its own rows; its files scanned at once on the rule's threads."""
from actstore.datasets import configured_scan, write_scan
from actstore.workflow import setup_logging

setup_logging(snakemake)
write_scan(configured_scan(snakemake.config, progress=True, workers=snakemake.threads), snakemake.output[0])
