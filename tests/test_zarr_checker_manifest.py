"""The Zarr checker (formats/zarr/check.py) and manifest reading on real runs: a chunk recorded at the
wrong size, and a manifest that is a bare JSON string."""
from __future__ import annotations

import hashlib
import json

import pytest

from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.zarr.layout import FILES_JSON, acts_chunk_key, files_json_text
from actstore.integrity import file_record
from test_zarr import bert_run, copied_run  # noqa: F401 (bert_run: a fixture)


def test_a_chunk_recorded_at_the_wrong_size_fails_verify(bert_run, tmp_path):  # noqa: F811
    """A chunk cut short before meta/files.json was written (its record, and the manifest's, agree with
    the short file) passed verify, run and store alike; then every read of its sample failed."""
    run = copied_run(bert_run, tmp_path, lambda m: None)
    store = run / "shards" / zs.shard_name(0)
    chunk = store / acts_chunk_key(0, 0, 0)
    chunk.write_bytes(chunk.read_bytes()[:100])
    files = json.loads((store / FILES_JSON).read_text())["files"]
    files[acts_chunk_key(0, 0, 0)] = file_record(chunk)
    (store / FILES_JSON).write_text(files_json_text(files))
    manifest = json.loads((run / zs.MANIFEST).read_text())
    manifest["shards"][0].update(files_sha256=hashlib.sha256((store / FILES_JSON).read_bytes()).hexdigest(),
                                 bytes=sum(f["bytes"] for f in files.values()) + (store / FILES_JSON).stat().st_size)
    (run / zs.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="100 bytes, expected 512"):
        zs.open_zarr(run).read(0, 0)  # the damage at hand: the reader refuses the chunk
    expected = f"{chunk}: {FILES_JSON} records 100 bytes, an activations chunk holds 512"
    for path in (run, store):
        assert any(p.startswith(expected) for p in zs.verify(path)), zs.verify(path)


def test_a_manifest_that_is_its_format_name_alone_is_named(bert_run, tmp_path):  # noqa: F811
    """A manifest.json holding only the JSON string "actstore-zarr-activation-logger" passed the format
    check (the string was taken as its own format) and opening, inspect included, raised a bare
    AttributeError ('str' object has no attribute 'get')."""
    run = copied_run(bert_run, tmp_path, lambda m: None)
    (run / zs.MANIFEST).write_text(json.dumps(zs.FORMAT_NAME))
    for open_run in (zs.open_zarr, zs.inspect, lambda r: zs.open_zarr(r, merged=True)):
        with pytest.raises(FormatError, match=f"{run / zs.MANIFEST}: not a JSON object"):
            open_run(run)


def test_a_store_entry_leading_outside_the_run_is_one_problem_among_the_others(bert_run, tmp_path):  # noqa: F811
    """A manifest entry whose path leads outside the run raised out of verify's loop: the whole run was
    one "cannot verify", and every other store's problems (here a flipped chunk byte) went unsaid."""
    run = copied_run(bert_run, tmp_path, lambda m: m["shards"][1].update(path="../elsewhere"))
    chunk = run / "shards" / zs.shard_name(0) / acts_chunk_key(0, 0, 0)
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    chunk.write_bytes(raw)
    problems = zs.verify(run)
    assert any("'../elsewhere'" in p for p in problems), problems
    assert any(p.startswith(f"{chunk}: ") and "sha256" in p for p in problems), problems
    assert not any("cannot verify" in p for p in problems), problems
