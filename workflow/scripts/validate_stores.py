"""Rule validate_stores: every validate share job's fingerprints added up by store and compared, the LUT
and the seals checked, report.json."""
import itertools
from pathlib import Path

from actstore.workflow import setup_logging, stage_rule

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.verify import load_extraction_checks, load_store_checks, write_report

with stage_rule(snakemake, "validate", Path(snakemake.output.stage_config).parent) as config:
    n_coords, entry, reference = load_extraction_checks(snakemake.input.extract)
    files = iter(snakemake.input.stores)  # store by store, each one's shares in order
    stores = {name: load_store_checks(list(itertools.islice(files, shares)))
              for name, shares in snakemake.params.shares.items()}
    write_report(config, n_coords, entry, reference, stores, snakemake.output.report)
