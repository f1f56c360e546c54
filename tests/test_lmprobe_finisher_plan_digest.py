"""lmprobe's finishing job links only the files of jobs that planned what it plans: a job record carries
the plan's digest (resolved options and the extraction's part records); the finisher checked names and
sizes only, so files a float16 job wrote were indexed as float32 (library use: the workflow's jobs
share one config)."""
from __future__ import annotations

import pytest

from actstore.errors import FormatError
from actstore.formats import lmprobe
from test_lmprobe import SMALL, scattered, tree


def test_jobs_written_for_other_options_are_refused_by_name(extracted, tmp_path):
    _, extract_dir = extracted("gpt2")
    asked = {"storage": "pooled", "dtype": "float32", **SMALL}
    out = tmp_path / "dataset"
    job_dirs = scattered(extract_dir, out, {**asked, "dtype": "float16"}, 2)
    before = tree(tmp_path / "scatter")
    with pytest.raises(FormatError, match=r"job-0000/job.json: written for other lmprobe options or another "
                                          r"extraction \(plan [0-9a-f]{12}, this finisher's [0-9a-f]{12}\)"):
        lmprobe.finish_dataset(extract_dir, job_dirs, out, asked)
    assert not out.exists() and tree(tmp_path / "scatter") == before
    lmprobe.finish_dataset(extract_dir, job_dirs, out, {**asked, "dtype": "float16"})
    assert lmprobe.verify(out) == []


def test_jobs_of_another_extraction_are_refused(extracted, tmp_path):
    _, extract_dir = extracted("gpt2")
    _, other_dir = extracted("gpt2", extract={"max_seq_length": 20})
    options = {"storage": "pooled", **SMALL}
    out = tmp_path / "dataset"
    job_dirs = scattered(other_dir, out, options, 2)
    with pytest.raises(FormatError, match="job-0000/job.json: written for other lmprobe options or another"):
        lmprobe.finish_dataset(extract_dir, job_dirs, out, options)
    assert not out.exists()
