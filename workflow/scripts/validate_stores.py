"""Rule validate_stores: every validate job's fingerprints compared, the LUT and the seals checked, report.json."""
from pathlib import Path

from actstore.workflow import setup_logging, stage_rule

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.verify import load_extraction_check, load_store_check, write_report

with stage_rule(snakemake, "validate", Path(snakemake.output.stage_config).parent) as config:
    n_coords, entry, reference = load_extraction_check(snakemake.input.extract)
    stores = {name: load_store_check(path) for name, path in zip(snakemake.params.stores, snakemake.input.stores)}
    write_report(config, n_coords, entry, reference, stores, snakemake.output.report)
