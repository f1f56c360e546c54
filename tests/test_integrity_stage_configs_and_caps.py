"""Integrity review 57: the shared integrity layer and stage bookkeeping, each fault on real stores."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from actstore.errors import FormatError
from actstore.integrity import STAGE_CONFIG_FILE


def extract_stage(extracted, tmp_path: Path) -> Path:
    """A copy of a tiny extraction in its workflow stage directory, its stage config recorded."""
    from actstore.hashing import stage_dir
    from actstore.workflow import record_stage

    config, out = extracted("bert")
    config = {**config, "dump_to": str(tmp_path / "dump")}
    directory = stage_dir(config, "extract")
    shutil.copytree(out, directory)
    record_stage(config, "extract", directory)
    return directory


def test_a_stage_directory_opened_through_a_link_still_needs_its_stage_config(extracted, tmp_path):
    """`latest` -> {dump_to}/extract/<hash>: known by the link's name, the stage directory's missing
    stage config passed open_extraction(verify=True) (and stage_problems of a store below the link),
    while the directory given by its own path was refused."""
    from actstore.formats.extract import open_extraction
    from actstore.hashing import stage_problems

    directory = extract_stage(extracted, tmp_path)
    latest = tmp_path / "latest"
    latest.symlink_to(directory)
    assert open_extraction(latest, verify=True).n_samples > 0
    (directory / STAGE_CONFIG_FILE).unlink()
    missing = f"{directory / STAGE_CONFIG_FILE}: missing (the workflow writes one in every stage directory)"
    with pytest.raises(FormatError, match="actstore_config.json: missing"):
        open_extraction(latest, verify=True)
    assert stage_problems(latest / "part-0000") == [missing]


def test_a_streamed_record_with_a_value_running_past_the_cap_is_refused_before_it_is_held(tmp_path, monkeypatch):
    """A job record (streamed, jobs.read_job_records) cut short by a crash and left with a sparse tail
    of NUL bytes: no JSON error is final before the end, so the window grew to hold the whole file
    (a 400 MB record of 8 disk blocks took 800 MB) before naming the bad character at byte 38. A value
    past JSON_MAX_BYTES (patched small here, 1 GiB as shipped) is refused as the window reaches it."""
    from actstore import integrity
    from actstore.jobs import read_job_records, write_job_record

    monkeypatch.setattr(integrity, "JSON_MAX_BYTES", 1 << 20)
    (tmp_path / "a.bin").write_bytes(b"abc")
    record = write_job_record(tmp_path, 1, 0, [("a.bin", integrity.file_record(tmp_path / "a.bin"))])
    assert list(read_job_records([tmp_path]).files) == ["a.bin"]
    text = record.read_bytes()
    cut = text.index(b'"sha256"')
    with open(record, "r+b") as fh:
        fh.truncate(cut)
        fh.truncate(64 << 20)  # the tail a crash leaves: NUL bytes, sparse on disk
    entry = text.index(b'{"bytes"')  # the value cut: a.bin's record
    with pytest.raises(FormatError, match=f"job.json: not valid JSON \\(a value at character {entry} runs past"):
        read_job_records([tmp_path])


@pytest.mark.parametrize("given", [".", "part-0000"])
def test_a_foreign_stage_config_is_named_when_the_stage_is_given_from_inside_it(extracted, tmp_path, monkeypatch,
                                                                                given):
    """`cd {dump_to}/extract/<hash> && actstore verify .` (or a store below it): "." has no name, so a
    stage config of another stage directory (another batch_size, hash and seal consistent) passed,
    where the same directory given by its path was named."""
    import json

    from actstore.hashing import stage_problems
    from actstore.io_utils import canonical_sha256

    directory = extract_stage(extracted, tmp_path)
    path = directory / STAGE_CONFIG_FILE
    record = json.loads(path.read_text())
    record["config"]["extract"]["batch_size"] += 1
    record["hash"] = canonical_sha256({k: v for k, v in record.items() if k not in ("hash", "sealed")})
    path.write_text(json.dumps(record))
    foreign = f"the config of stage directory {record['hash']}, found in {directory.name}"
    assert stage_problems(directory) == [f"{path}: {foreign}"]
    monkeypatch.chdir(directory)
    assert stage_problems(given) == [f"{STAGE_CONFIG_FILE}: {foreign}"]


@pytest.mark.parametrize("number", ["1e999", "-1e999", "2.5e400"])
def test_a_number_past_the_largest_float_is_refused_as_infinity_is(tmp_path, number):
    """JSON's grammar takes 1e999, which Python reads as inf: a pickle store's metadata.json with
    `extraction_duration_seconds: 1e999` passed verify where `Infinity` there was named. Refused by
    the whole-file and the streamed reader alike, naming the file."""
    from actstore.integrity import read_json, stream_json_object

    path = tmp_path / "metadata.json"
    path.write_text(f'{{"files": {{"a": {{"bytes": 1, "seconds": {number}}}}}, "seconds": 0.5}}')
    why = f"not valid JSON \\({number} is past the largest float"
    with pytest.raises(FormatError, match=f"metadata.json: {why}"):
        read_json(path)
    with pytest.raises(FormatError, match=f"metadata.json: {why}"):
        [(key, dict(value) if key == "files" else value) for key, value in stream_json_object(path, "files")]
