"""The job record every scattered writer leaves (actstore.jobs): written once, read and checked by
one reader that names the record or file at fault and reads no file's bytes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from actstore.errors import FormatError
from actstore.integrity import file_record
from actstore.jobs import JOB_RECORD, check_job_parts, read_job_records, write_job_record


def write_jobs(root: Path, contents: list[dict[str, bytes]]) -> list[Path]:
    """One job dir per dict of {rel path: bytes}, each with its record (an `extra` key `n`)."""
    dirs = []
    for job, files in enumerate(contents):
        job_dir = root / f"job-{job:04d}"
        for rel, data in files.items():
            (job_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (job_dir / rel).write_bytes(data)
        job_dir.mkdir(parents=True, exist_ok=True)
        write_job_record(job_dir, len(contents), job, [(rel, file_record(job_dir / rel)) for rel in files], n=job)
        dirs.append(job_dir)
    return dirs


def edit_record(job_dir: Path, **changes) -> None:
    record = json.loads((job_dir / JOB_RECORD).read_text())
    (job_dir / JOB_RECORD).write_text(json.dumps({**record, **changes}))


@pytest.fixture
def dirs(tmp_path):
    return write_jobs(tmp_path, [{"a.bin": b"aa", "sub/b.bin": b"bbb"}, {}, {"c.bin": b"c"}])


def test_records_read_back_in_job_order_with_their_extras(dirs):
    found = read_job_records(dirs)
    assert found.extras == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert list(found.files) == ["a.bin", "sub/b.bin", "c.bin"]
    job_dir, record = found.files["sub/b.bin"]
    assert job_dir == dirs[0] and record == file_record(dirs[0] / "sub" / "b.bin")


def test_recorded_sha256_stands_no_file_is_read(dirs, monkeypatch):
    """The jobs hashed their bytes as they wrote them: the reader only stats the files."""
    (dirs[2] / "c.bin").write_bytes(b"x")  # same size, other bytes
    monkeypatch.setattr("builtins.open", lambda *a, **k: pytest.fail(f"opened {a[0]}"))
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"read {self}"))
    assert read_job_records(dirs).files["c.bin"][0] == dirs[2]


@pytest.mark.parametrize("name, match", [
    ("../x", r"job-0002/job\.json: '\.\./x' is not a relative path inside .*job-0002"),
    ("/etc/passwd", r"job-0002/job\.json: '/etc/passwd' is not a relative path inside"),
    ("sub/../../x", r"job-0002/job\.json: 'sub/\.\./\.\./x' is not a relative path inside"),
])
def test_names_outside_the_job_dir_are_refused_naming_the_record(dirs, name, match):
    (dirs[2].parent / "x").write_bytes(b"c")
    edit_record(dirs[2], files={name: {"bytes": 1, "sha256": "0" * 64}})
    with pytest.raises(FormatError, match=match):
        read_job_records(dirs)


def test_a_name_leading_out_through_a_link_is_refused(dirs, tmp_path):
    (tmp_path / "outside.bin").write_bytes(b"c")
    (dirs[2] / "link").symlink_to(tmp_path)
    edit_record(dirs[2], files={"link/outside.bin": {"bytes": 1, "sha256": "0" * 64}})
    with pytest.raises(FormatError, match=r"job-0002/job\.json: 'link/outside\.bin' leads outside"):
        read_job_records(dirs)


def test_missing_job_is_named(dirs):
    with pytest.raises(FormatError, match=r"job-0002/job\.json: records of 3 jobs, none of job 1$"):
        read_job_records([dirs[0], dirs[2]])


def test_job_recorded_twice_is_named(dirs):
    (dirs[1] / JOB_RECORD).write_bytes((dirs[0] / JOB_RECORD).read_bytes())
    with pytest.raises(FormatError, match=r"job-0001/job\.json: the record of job 0 of 3, as is .*job-0000/job\.json"):
        read_job_records(dirs)


def test_job_of_another_run_or_out_of_order_is_named(dirs, tmp_path):
    other = write_jobs(tmp_path / "other", [{}, {}])
    with pytest.raises(FormatError, match=r"other/job-0001/job\.json: the record of job 1 of 2, given as job 1 of 3"):
        read_job_records([dirs[0], other[1], dirs[2]])
    with pytest.raises(FormatError, match=r"job-0002/job\.json: the record of job 2 of 3, given as job 0 of 3"):
        read_job_records(dirs[::-1])


def test_file_listed_by_two_jobs_is_named(dirs):
    (dirs[1] / "sub").mkdir()
    (dirs[1] / "sub" / "b.bin").write_bytes(b"bbb")
    edit_record(dirs[1], files={"sub/b.bin": file_record(dirs[1] / "sub" / "b.bin")})
    with pytest.raises(FormatError, match=r"job-0001/job\.json: sub/b\.bin also listed in .*job-0000/job\.json"):
        read_job_records(dirs)


def test_truncated_or_missing_file_is_named_with_its_record(dirs):
    (dirs[0] / "sub" / "b.bin").write_bytes(b"b")
    with pytest.raises(FormatError, match=r"job-0000/sub/b\.bin: 1 bytes, .*job-0000/job\.json says 3"):
        read_job_records(dirs)
    (dirs[0] / "sub" / "b.bin").unlink()
    with pytest.raises(FormatError, match=r"job-0000/sub/b\.bin: missing \(listed in .*job-0000/job\.json\)"):
        read_job_records(dirs)


@pytest.mark.parametrize("text, match", [
    (None, r"job-0001/job\.json: missing"),
    ("{", r"job-0001/job\.json: not valid JSON"),
    ("[]", r"job-0001/job\.json: not a job record"),
    ('{"jobs": 3, "job": "1", "files": {}}', r"job-0001/job\.json: not a job record"),
    ('{"jobs": 3, "job": 1, "files": {"a": {"bytes": 1}}}', r"job-0001/job\.json: no bytes and sha256 .* 'a'"),
])
def test_bad_record_is_named(dirs, text, match):
    record = dirs[1] / JOB_RECORD
    record.unlink() if text is None else record.write_text(text)
    with pytest.raises(FormatError, match=match):
        read_job_records(dirs)


def part_records(root: Path, parts: list[list[int]]) -> list[Path]:
    """The records pickle_machines / zarr_shards leave: no files of their own, the parts they wrote."""
    dirs = []
    for job, written in enumerate(parts):
        write_job_record(root / f"job-{job:04d}", len(parts), job, (), parts=written)
        dirs.append(root / f"job-{job:04d}")
    return dirs


def test_part_records_covering_every_part_in_order_pass(tmp_path):
    check_job_parts(part_records(tmp_path, [[0, 1], [2], []]), 3)


@pytest.mark.parametrize("parts, n_parts, match", [
    ([[0, 1], [3]], 4, r"job-0001/job\.json: the jobs wrote parts \[0, 1, 3\] of 4, none of part 2"),
    ([[0], [1]], 3, r"the jobs wrote parts \[0, 1\] of 3, none of part 2"),
    ([[1], [0]], 2, r"the jobs wrote parts \[1, 0\] of 2$"),
])
def test_part_records_missing_or_out_of_order_are_named(tmp_path, parts, n_parts, match):
    with pytest.raises(FormatError, match=match):
        check_job_parts(part_records(tmp_path, parts), n_parts)


def test_part_record_of_another_run_is_named(tmp_path):
    dirs = part_records(tmp_path / "a", [[0], [1]])
    other = part_records(tmp_path / "b", [[0], [1], [2]])
    with pytest.raises(FormatError, match=r"b/job-0001/job\.json: the record of job 1 of 3, given as job 1 of 2"):
        check_job_parts([dirs[0], other[1]], 2)


@pytest.mark.parametrize("parts", [1, None, "01", [0, True], [0, 1.0]])
def test_part_record_whose_parts_are_not_part_numbers_is_named(tmp_path, parts):
    """A record's parts not a list of ints: a TypeError traceback (1, None), or true and 1.0 taken as
    part 1 (they compare equal to it); the record is named instead."""
    dirs = part_records(tmp_path, [[0], parts])
    with pytest.raises(FormatError, match=r"job-0001/job\.json: parts .* is not a list of part numbers"):
        check_job_parts(dirs, 2)
