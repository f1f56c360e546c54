"""Rule extract_scan: one pass over the dataset (row count, labels, where JSONL or tar rows start) that
every part's job reads, so each reads only its own rows; its files scanned at once on the rule's threads.
First the data is checked to be what the stage's hash was computed from when Snakemake started."""
from pathlib import Path

from actstore.workflow import check_data_unchanged, setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.datasets import configured_scan, write_scan
from actstore.formats.lmprobe import check_dataset_labels

check_data_unchanged(snakemake.config, Path(snakemake.output[0]).parent)
if snakemake.config["extract"]["hooks"]:  # here, on a CPU: a misspelt one stopped each part's job after its GPU wait
    from actstore.extract import check_hooks  # torch and the model's skeleton, for a config naming hooks alone

    check_hooks(snakemake.config)
scan = configured_scan(snakemake.config, progress=True, workers=snakemake.threads)
check_dataset_labels(snakemake.config, scan.labels)
write_scan(scan, snakemake.output[0])
