"""Review of the Zarr reader (formats/zarr/read.py): faults a reader of real stores met, each named."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import zarr as zs
from test_zarr import bert_run, copied_run, synthetic_shard  # noqa: F401 (bert_run: a fixture)


@pytest.mark.parametrize("edit, named", [
    (lambda m: m.update(shards=m["shards"][1:]), r"shards\[0\]: global_index_start=15, expected 0"),
    (lambda m: m["shards"][0].update(num_samples=20), r"shards\[0\]: num_samples=20, but \S*shard-0000\.zarr/"
                                                      r"\.zattrs says 15"),
    (lambda m: m["merged"].update(num_samples=31), r"merged: num_samples=31, but \S*merged/\.zattrs says 30"),
])
def test_a_manifest_whose_entries_leave_a_gap_or_misstate_a_count_is_refused_on_opening(bert_run, tmp_path,  # noqa: F811
                                                                                         edit, named):
    """A run's samples are numbered 0 .. num_samples-1 through its manifest entries. A manifest that
    left a shard out (or overstated a store's samples) opened: an index in the gap was answered from
    the next store at a negative local index, seq_len(i) silently another sample's length, read(i)
    an IndexError about sample -k, and the last store's samples were unreachable."""
    run = copied_run(bert_run, tmp_path, edit)
    with pytest.raises(FormatError, match=rf"{zs.MANIFEST}: {named}"):
        zs.ZarrRun(run, merged="merged" in named)


def edited_store(tmp_path, edit):
    """A synthetic one-layer shard with its consolidated metadata edited by `edit`."""
    store = synthetic_shard(tmp_path, tmp_path / "s.zarr")
    meta = json.loads((store / ".zmetadata").read_text())
    edit(meta["metadata"])
    (store / ".zmetadata").write_text(json.dumps(meta))
    return store


@pytest.mark.parametrize("key, value, named", [
    ("layers", 0, "layers=0, expected a list of distinct block indices"),
    ("layers", [0, 0], r"layers=\[0, 0\], expected a list of distinct block indices"),
    ("num_samples", "two", "num_samples='two', expected a whole number"),
    ("hidden_size", None, "hidden_size=None, expected a whole number"),
    ("T_max", 5.5, "T_max=5.5, expected a whole number"),
])
def test_a_stores_attrs_the_reader_counts_with_are_named_when_wrong(tmp_path, key, value, named):
    """.zattrs' layers, num_samples, hidden_size and T_max were passed to list() and int(): a damaged one
    was a bare TypeError or ValueError (verify: "cannot verify (TypeError: 'int' object is not
    iterable)"), a layer listed twice made its first position unreachable. Each is named."""
    def edit(meta):
        if key == "layers" and isinstance(value, list):  # the array's L axis as long as the list
            meta[f"{zs.ACTS}/.zarray"]["shape"][1] = len(value)
        meta[".zattrs"][key] = value
    store = edited_store(tmp_path, edit)
    with pytest.raises(FormatError, match=rf"{re.escape(str(store))}/\.zattrs: {named}"):
        zs.ZarrStore(store)
    assert any(re.search(named, p) for p in zs.verify(store)), zs.verify(store)


@pytest.mark.parametrize("dtype", ["<f4", "|S4"])
def test_a_seq_len_that_is_not_integers_is_named_on_opening(tmp_path, dtype):
    """seq_len stored as floats (5.0, 3.0) opened and then failed every read with "'float' object
    cannot be interpreted as an integer"; stored as bytes, the store failed to open with numpy's
    UFuncTypeError. Both name the array and its dtype."""
    store = edited_store(tmp_path, lambda meta: meta["arrays/seq_len/.zarray"].update(dtype=dtype))
    (store / "arrays/seq_len/0").write_bytes(np.array([5, 3], dtype).tobytes())
    with pytest.raises(FormatError, match=rf"{re.escape(str(store))}/arrays/seq_len: dtype .*, expected integers"):
        zs.ZarrStore(store)
