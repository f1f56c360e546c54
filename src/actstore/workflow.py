"""Glue for workflow/scripts: logging to the rule's log file, config access."""
from __future__ import annotations

import logging
import sys
from typing import Any


def setup_logging(snakemake: Any) -> None:
    """Send stderr (progress bars, warnings) and logging to the rule's `log:` file."""
    if snakemake.log:
        sys.stderr = open(snakemake.log[0], "w", buffering=1)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
