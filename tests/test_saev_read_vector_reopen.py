"""saev review 58: read_vector (validation's random access) reopened the store on every call."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import saev
from actstore.formats.saev import check, read
from actstore.formats.saev.layout import SHARDS, shard_name

from test_saev import synthetic_store


def _reads_counted(monkeypatch, store_dir, coords) -> tuple[int, int]:
    """(os.stat calls, stores opened) while read_vector reads `coords`, each checked against the vector
    a freshly opened store gives."""
    counts = {"stat": 0, "open": 0}
    real_stat, real_init = os.stat, read.SaevStore.__init__

    def stat(*args, **kwargs):
        counts["stat"] += 1
        return real_stat(*args, **kwargs)

    def init(self, *args, **kwargs):
        counts["open"] += 1
        real_init(self, *args, **kwargs)
    want = [saev.open_store(store_dir).vector(e, 0, t) for e, t in coords]
    check.read_vector(store_dir, 0, 0, 0)  # the first read opens the store
    with monkeypatch.context() as patch:
        patch.setattr(os, "stat", stat)
        patch.setattr(read.SaevStore, "__init__", init)
        got = [check.read_vector(store_dir, e, 0, t) for e, t in coords]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    return counts["stat"], counts["open"]


def test_repeated_reads_do_not_stat_every_shard(tmp_path, monkeypatch):
    """Each call opened the store again, which stats every shard: validation's reads of a few thousand
    coordinates cost (coordinates x shards) stats, tens of millions on 10,000 shards. The opened store
    is now kept while its metadata files are unchanged: a read stats as many files on 40 shards as on 4."""
    coords = [(e % 4, t) for e, t in zip(range(12), [0, 1, 2] * 4)]
    few = synthetic_store(tmp_path / "few", n=4, tokens=3, d=4, per_shard=1)
    many = synthetic_store(tmp_path / "many", n=40, tokens=3, d=4, per_shard=1)
    stats_few, opens_few = _reads_counted(monkeypatch, few, coords)
    stats_many, opens_many = _reads_counted(monkeypatch, many, coords)
    assert opens_few == opens_many == 0
    assert stats_many == stats_few


def test_a_store_damaged_between_reads_is_still_refused(tmp_path):
    """A kept store must not hide damage done after it was opened, which opening it again named: the
    shard read is checked on each call (grown, missing), and a metadata file rewritten opens it again."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=3, d=4, per_shard=2)
    assert check.read_vector(store_dir, 0, 0, 1) is not None
    shard = store_dir / shard_name(1)
    with open(shard, "ab") as grown:
        grown.write(bytes(16))
    with pytest.raises(FormatError, match=rf"{shard}: \d+ bytes, expected"):
        check.read_vector(store_dir, 2, 0, 1)
    shard.unlink()
    with pytest.raises(FormatError, match=rf"{shard}: missing shard"):
        check.read_vector(store_dir, 2, 0, 1)
    shards_json = store_dir / SHARDS
    shards_json.write_text(json.dumps(json.loads(shards_json.read_text())[:1]))
    with pytest.raises(FormatError, match=rf"{shards_json}: shards hold 2 examples"):
        check.read_vector(store_dir, 0, 0, 1)
