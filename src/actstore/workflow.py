"""What the workflow shares: the Snakefile parse's reading of the dataset (rules/common.smk), and
for every rule's script logging to the rule's log file and, when the rule finishes a stage, the
resolved config recorded in its directory (so a stage directory says what made it), with the records
of the metadata files the stage wrote there."""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from actstore.errors import ConfigError

# Only the standard library and actstore.errors at import: every script imports this module before
# setup_logging sends its output to the rule's log, so an import that fails here (numpy, pyarrow or
# isal built for another node's libraries) left the log missing and its traceback in Slurm's output.
# The functions below import what they use.


def setup_logging(snakemake: Any) -> None:
    """Send the job's stdout, stderr (progress bars, warnings, the traceback of an uncaught error) and
    logging to the rule's `log:` file, where a user looks first and whose tail Snakemake shows when the
    job fails. At the file descriptors, not only sys.stderr: native code (a CUDA abort, a C library's
    warning) and subprocesses write to fd 2, and a crash in native code leaves its Python stack there
    (faulthandler). Each script calls it before its other imports, so that one failing is logged too."""
    if snakemake.log:
        sys.stdout.flush()
        sys.stderr.flush()
        with open(snakemake.log[0], "wb") as log:
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
        sys.stdout.reconfigure(line_buffering=True)  # lines in the order written, among stderr's
    faulthandler.enable()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


@contextlib.contextmanager
def stage_rule(snakemake: Any, stage: str, stage_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The script of the rule that completes `stage` (its logging set up first, by setup_logging): the
    config yielded, and on success the stage's resolved config written into `stage_dir` (nothing when
    the body raises). The body sees the main process's facts (parse_memo): a stage it finds by hash
    (verify.write_report's stage_dirs) is in the directory the run named, whatever became of the data since."""
    from actstore import parse_memo

    with parse_memo.main_process_facts():
        yield snakemake.config
    record_stage(snakemake.config, stage, stage_dir)


def record_stage(config: dict[str, Any], stage: str, stage_dir: str | Path) -> None:
    """Write the stage config into `stage_dir`, sealing the files the stage wrote there
    (integrity.sealed_names; `actstore verify` and the validate stage check them against it).
    validate's plots are drawn after its stage config, by their own rule: only its report is sealed.
    The config's hashes are those the main Snakemake process named `stage_dir` by (parse_memo): hashed
    from the data as it is now, a dataset touched during the run (its mtimes: identity stat) would
    record the config of another directory, which `actstore verify` then refuses, and every job
    finishing a stage would list and hash the whole dataset again. The extraction checks its rows
    against the data itself (datasets.check_unchanged)."""
    from actstore import parse_memo
    from actstore.hashing import write_stage_config
    from actstore.integrity import seal

    sealed = seal(Path(stage_dir), stage)
    with parse_memo.main_process_facts():
        write_stage_config(config, stage, Path(stage_dir), sealed=sealed)


def parse_dataset(config: dict[str, Any], main_process: bool) -> dict[str, str]:
    """What a Snakefile parse reads of the dataset, each fact once (rules/common.smk): the dataset
    checked (datasets.check_dataset), every stage's hash (the extract hash's data digest) and the
    Slurm requests that follow the data (resources). In the main process they are remembered for
    its jobs (parse_memo.hand_over); in a job, taken from the main process's file."""
    from actstore import parse_memo, resources
    from actstore.datasets import check_dataset
    from actstore.datasets.source import remember_sources
    from actstore.hashing import stage_hashes

    remember_sources()
    parse_memo.start(main_process)
    check_dataset(config["dataset"])
    resources.extract_scan_mem_mb(config, threads=resources.extract_scan_threads(config))
    resources.extract_part_mem_mb(config)
    return stage_hashes(config)


def check_data_unchanged(config: dict[str, Any], extract_dir: str | Path) -> None:
    """ConfigError unless `extract_dir` is named by the extract stage's hash of the data as it is now.
    The jobs of a run name their outputs by the hash the main Snakemake process computed when it
    started (parse_memo): data changed since then would be extracted under the old data's name."""
    from actstore.hashing import stage_hash

    now = stage_hash(config, "extract")
    if Path(extract_dir).name != now:
        raise ConfigError(f"dataset.path {config['dataset']['path']}: the data changed after Snakemake read it "
                          f"(dataset.identity: the extraction {extract_dir} is named for the data as it was, "
                          f"{now[:12]}... for the data now); run snakemake again")


def git_commit() -> str | None:
    """HEAD of the repository actstore runs from (the zarr store records it), None outside a checkout."""
    from actstore.config import REPO_ROOT

    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
