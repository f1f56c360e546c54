"""The `actstore` command as a user runs it, on real stores the project's writers build: its output
piped into a reader that stops early, and --threads past what the check can take."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actstore.formats import lmprobe

ACTSTORE = str(Path(sys.executable).with_name("actstore"))


@pytest.fixture(scope="module")
def lmprobe_store(extracted, tmp_path_factory) -> Path:
    _, extract_dir = extracted("bert")
    root = tmp_path_factory.mktemp("cli56") / "lmprobe"
    lmprobe.write_dataset(extract_dir, root, {}, progress=False)
    return root


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """`actstore ARGS | head -0`: stdout a pipe whose reader is gone before the command writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([ACTSTORE, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_reader_that_stops_early_ends_the_command_quietly(lmprobe_store, command):
    """`actstore verify STORE | head` printed a BrokenPipeError traceback and exited 1, verify's "problems
    found", for a clean store. It ends as a command killed by SIGPIPE does: nothing on stderr, 141."""
    proc = run_into_closed_pipe(command, str(lmprobe_store))
    assert (proc.returncode, proc.stderr) == (141, "")


def test_threads_past_the_limit_are_bad_usage_not_a_damaged_store(lmprobe_store):
    """--threads 2**61 and up overflowed the check's window (itertools.islice): a clean store verified
    as "cannot verify (ValueError ...)", exit 1. Past MAX_THREADS it is bad usage, exit 2, naming it."""
    from actstore.cli import MAX_THREADS

    assert subprocess.run([ACTSTORE, "verify", "--threads", str(MAX_THREADS), str(lmprobe_store)],
                          capture_output=True, text=True).returncode == 0
    proc = subprocess.run([ACTSTORE, "verify", "--threads", str(2**61), str(lmprobe_store)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert f"--threads: '{2**61}': a whole number of at least 1 and at most {MAX_THREADS}" in proc.stderr


def test_a_stage_directory_given_through_a_link_must_hold_its_stage_config(lmprobe_store, tmp_path):
    """A link to a run's stage directory (`latest` -> {dump_to}/lmprobe/<hash>) was known by the link's
    name, so taken for no stage's: its missing stage config passed verify, exit 0. Through the link it
    is the problem it is through the directory's own path."""
    stage = tmp_path / "dump" / "lmprobe" / ("ab" * 32)
    shutil.copytree(lmprobe_store, stage)
    (tmp_path / "latest").symlink_to(stage)
    own = subprocess.run([ACTSTORE, "verify", str(stage)], capture_output=True, text=True)
    linked = subprocess.run([ACTSTORE, "verify", str(tmp_path / "latest")], capture_output=True, text=True)
    missing = f"BAD  {stage / 'actstore_config.json'}: missing"
    assert own.returncode == 1 and missing in own.stdout, own.stdout + own.stderr
    assert linked.returncode == 1 and missing in linked.stdout, linked.stdout + linked.stderr
