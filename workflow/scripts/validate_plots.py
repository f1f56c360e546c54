"""Rule validate_plots: the report's figures from the extraction and the validation report."""
import json
from pathlib import Path

from actstore.workflow import setup_logging

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.formats.extract import open_extraction
from actstore.report import PLOTS, make_plots

report = json.loads(Path(snakemake.input.report).read_text())
extraction = open_extraction(Path(snakemake.input.extract).parent)
make_plots(extraction, report, {name: getattr(snakemake.output, name) for name in PLOTS})
