"""Review 66, second adversarial review of the session's changes (91c204b..4048706): the faults found, each
on a real store the writers made, changed only as the test says, with every checksum kept consistent."""
from __future__ import annotations

import json

import numpy as np

from actstore.formats import zarr as zs
from test_spec_audit_lmprobe_zarr import STORE, copied_run, need, problems_naming, rerecord
from test_zarr import bert_run  # noqa: F401 (a fixture: two shards of 15 bert samples, merged)


def test_verify_names_a_sample_key_array_of_numbers_instead_of_crashing(bert_run, tmp_path):  # noqa: F811
    """Spec, Sample identity: `sample_key` is (N,) fixed-length bytes. A store whose arrays/sample_key holds
    int64 (its .zarray, .zmetadata and chunk rewritten, files.json and the manifest re-recorded) made the
    new prompts.jsonl check call .decode() on a number: verify's answer for the whole run was one line,
    "cannot verify (AttributeError: 'numpy.int64' object has no attribute 'decode')", every other
    store's problems dropped and the array not named."""
    run = copied_run(bert_run, tmp_path)
    store = run / STORE
    zarray_path, consolidated_path = store / "arrays/sample_key/.zarray", store / ".zmetadata"
    zarray = json.loads(zarray_path.read_text())
    need(zarray["dtype"] == "|S64" and zarray["shape"] == [15], "sample_key is |S64, 15 samples, one chunk")
    zarray["dtype"] = "<i8"
    zarray_path.write_text(json.dumps(zarray))
    consolidated = json.loads(consolidated_path.read_text())
    consolidated["metadata"]["arrays/sample_key/.zarray"] = zarray
    consolidated_path.write_text(json.dumps(consolidated))
    (store / "arrays/sample_key/0").write_bytes(np.arange(zarray["chunks"][0], dtype="<i8").tobytes())
    rerecord(run, ["arrays/sample_key/.zarray", ".zmetadata", "arrays/sample_key/0"])
    problems = zs.verify(run)
    assert not problems_naming(problems, "cannot verify"), problems
    assert problems_naming(problems, "arrays/sample_key", "int64"), problems
