"""Datasets, review 60: a JSON array file's element holding a whole number Python refuses to read
(over 4,300 digits) is named with its element and byte; it was reported as a file that "cannot be
decompressed"."""
from __future__ import annotations

import pytest

from actstore.datasets import scan_dataset
from actstore.errors import ConfigError


@pytest.mark.parametrize("field", ["label", "score"])
def test_a_json_array_elements_huge_number_is_named(field, tmp_path):
    data = tmp_path / "data.json"
    data.write_text('[{"text": "a", "label": 1},\n {"text": "b", "%s": %s}]' % (field, "9" * 5000))
    with pytest.raises(ConfigError, match=r"data\.json: not one JSON array of objects: element 2 \(byte 29\): "
                                          r"cannot be read \(Exceeds the limit"):
        scan_dataset(data)
