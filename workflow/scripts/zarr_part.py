"""Rule zarr_part: write one extraction part as a self-contained Zarr v2 shard store."""
import logging
import subprocess

from actstore.config import REPO_ROOT
from actstore.formats.zarr import write_shard
from actstore.workflow import setup_logging


def git_commit() -> str | None:
    """HEAD of the repository actstore runs from (recorded in the store's attrs), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


setup_logging(snakemake)
entry = write_shard(snakemake.input[0], snakemake.output[0], snakemake.params.t_chunk, git_commit=git_commit())
logging.getLogger("zarr_part").info("%s: %d samples, %d bytes", entry["path"], entry["num_samples"], entry["bytes"])
