"""saev review 58: a raw plan whose metadata every reader refuses is refused before its shards are written."""
from __future__ import annotations

import pytest

from actstore.errors import FormatError
from actstore.formats import saev

from test_saev_windows_raw_plan_shards import raw_metadata


@pytest.mark.parametrize("fields, named", [
    ({"layers": [0, 0]}, r"layers \[0, 0\] must be a non-empty list of distinct ints"),
    ({"layers": [True]}, r"layers \[True\] must be a non-empty list of distinct ints"),
    ({"dtype": "float16"}, r"dtype 'float16'; protocol 2.1 fixes 'float32'"),
    ({"cls_token": 1}, r"field 'cls_token' = 1 is not bool"),
    ({"patches_per_ex": 4.0}, r"field 'patches_per_ex' = 4.0 is not int"),
])
def test_a_raw_plan_whose_metadata_no_reader_opens_is_refused_before_writing(tmp_path, fields, named):
    """write_raw_store wrote every shard of a store whose metadata.json every reader then refused (a
    layer listed twice, a bool layer, dtype float16 over float32 bytes, cls_token 1), or failed with a
    TypeError naming nothing (patches_per_ex 4.0). The readers' metadata check runs on the plan first:
    a FormatError naming the field, and no store written."""
    plan = saev.Plan(raw_metadata(tmp_path, **fields), None, {})
    root = tmp_path / "saev"
    with pytest.raises(FormatError, match=rf"saev.Plan.metadata: {named}"):
        saev.write_raw_store(plan, lambda start, out: out.fill(1), root, progress=False)
    assert list(root.iterdir()) == []  # neither the store nor its shards
