"""Review 62 of the shared integrity module, the job records, the `actstore` command and config loading:
numbers read from a record bound what is computed and printed from them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actstore import cli
from actstore.errors import FormatError
from actstore.integrity import SEAL_KEY, STAGE_CONFIG_FILE, file_record
from actstore.io_utils import canonical_sha256
from actstore.jobs import JOB_RECORD, read_job_records, write_job_record


def job_dirs_claiming(root: Path, jobs: int, count: int) -> list[Path]:
    """`count` job dirs, each with one file and the record the real writer leaves, each claiming job i of `jobs`."""
    dirs = []
    for job in range(count):
        job_dir = root / f"job-{job:04d}"
        job_dir.mkdir(parents=True)
        (job_dir / f"{job}.bin").write_bytes(b"x")
        write_job_record(job_dir, jobs, job, [(f"{job}.bin", file_record(job_dir / f"{job}.bin"))])
        dirs.append(job_dir)
    return dirs


def test_records_of_a_huge_job_count_name_a_few_missing_jobs_not_every_one(tmp_path):
    """A record's `jobs` (one damaged digit: 2 -> 2000000) made the finisher build a set of every job
    number and print each missing one: megabytes of message, and memory without bound for a larger count."""
    dirs = job_dirs_claiming(tmp_path, 2_000_000, 2)
    with pytest.raises(FormatError, match=r"records of 2000000 jobs, none of job 2, 3, .*\.\.\.") as caught:
        read_job_records(dirs)
    assert len(str(caught.value)) < 1000
    assert str(dirs[0] / JOB_RECORD) in str(caught.value)


def exit_code(argv: list[str]) -> int:
    """What `actstore ARGV` exits with (the command leaves by sys.exit for an unknown path)."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("stage", ["sae", "zarr"])
def test_a_file_where_a_stage_directory_goes_is_not_a_directory_exit_2(tmp_path, capsys, command, stage):
    """A file named as a stage directory ({dump_to}/sae/<64 hex>) was taken for one: verify exited 1,
    naming an actstore_config.json "missing" under a file, as though a directory had lost it."""
    path = tmp_path / "results" / stage / ("a" * 64)
    path.parent.mkdir(parents=True)
    path.write_text("not a store\n")
    assert exit_code([command, str(path)]) == 2
    out, err = capsys.readouterr()
    assert f"{path}: not a directory" in err
    assert "BAD" not in out


def test_a_name_from_a_seal_cannot_forge_lines_of_verify_output(tmp_path, capsys):
    """A name from metadata went to the terminal as it was: a newline in it printed a line of the
    name's own ("sae stage ...: OK") among verify's, and an escape sequence drove the terminal."""
    payload = {"stage": "sae", "config": {}, "upstream": {}}
    stage_dir = tmp_path / "results" / "sae" / canonical_sha256(payload)
    stage_dir.mkdir(parents=True)
    forged = "gone.bin\nsae stage elsewhere: OK\x1b[2K"
    seal = {forged: {"bytes": 1, "sha256": "0" * 64}}
    (stage_dir / STAGE_CONFIG_FILE).write_text(json.dumps({**payload, "hash": canonical_sha256(payload),
                                                           SEAL_KEY: seal}))
    assert exit_code(["verify", str(stage_dir)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.startswith("BAD  ") for line in lines] == [True] * (len(lines) - 1) + [False]
    assert lines[-1].endswith(f"{len(lines) - 1} problem(s)")
    assert "gone.bin\\nsae stage elsewhere: OK\\x1b[2K" in lines[0] and "\x1b" not in lines[0]


def test_an_undecodable_file_name_is_printed_escaped_not_a_traceback(tmp_path):
    """A file name of bytes that are not UTF-8 (os.scandir gives them as lone surrogates) crashed verify
    with a UnicodeEncodeError where stdout is strict UTF-8 (an en_US.UTF-8 locale), printing no problem."""
    payload = {"stage": "sae", "config": {}, "upstream": {}}
    stage_dir = tmp_path / "results" / "sae" / canonical_sha256(payload)
    stage_dir.mkdir(parents=True)
    (stage_dir / STAGE_CONFIG_FILE).write_text(json.dumps({**payload, "hash": canonical_sha256(payload),
                                                           SEAL_KEY: {}}))
    os.close(os.open(os.fsencode(stage_dir) + b"/bad\xff.bin", os.O_CREAT | os.O_WRONLY))
    done = subprocess.run([sys.executable, "-m", "actstore.cli", "verify", str(stage_dir)], capture_output=True,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"}, timeout=120)
    assert done.returncode == 1, done.stderr.decode(errors="replace")
    assert f"BAD  {stage_dir}/bad\\udcff.bin: not sealed by".encode() in done.stdout
