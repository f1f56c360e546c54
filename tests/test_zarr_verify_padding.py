"""Zarr verify (formats/zarr/check.py) and the padding past a sample's seq_len: any zarr client reads
the whole T_max row, so a chunk file past the sample's tokens is data to it, and must be zeros."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from actstore.formats import zarr as zs
from actstore.formats.zarr.layout import FILES_JSON, acts_chunk_key, files_json_text
from actstore.integrity import file_record
from test_zarr import bert_run, copied_run  # noqa: F401 (bert_run: a fixture)


def record_files(run: Path, store: Path, written: dict[str, bytes]) -> None:
    """Write `written` (name -> bytes) into `store` and record them in its files.json and the manifest, as
    whoever damaged (or, for zeros, wrote an older) store would: every checksum agrees."""
    files = json.loads((store / FILES_JSON).read_text())["files"]
    for key, data in written.items():
        (store / key).parent.mkdir(parents=True, exist_ok=True)
        (store / key).write_bytes(data)
        files[key] = file_record(store / key)
    (store / FILES_JSON).write_text(files_json_text(files))
    manifest = json.loads((run / zs.MANIFEST).read_text())
    entry = next(e for e in manifest["shards"] if run / e["path"] == store)
    entry.update(files_sha256=hashlib.sha256((store / FILES_JSON).read_bytes()).hexdigest(), n_files=len(files) + 1,
                 bytes=sum(f["bytes"] for f in files.values()) + (store / FILES_JSON).stat().st_size)
    (run / zs.MANIFEST).write_text(json.dumps(manifest))


def chunks_past_tokens(reader: zs.ZarrStore) -> list[tuple[int, int, int]]:
    """(sample, layer position, chunk) of every activations chunk past its sample's seq_len chunks."""
    counts = reader.chunk_counts()
    return [(i, l, c) for i in range(reader.n_samples) for l in range(len(reader.layers))
            for c in range(int(counts[i]), reader.n_chunks)]


def test_a_non_zero_chunk_past_seq_len_fails_verify(bert_run, tmp_path):  # noqa: F811
    """The writer writes no file for a chunk past a sample's tokens (zarr reads it as the fill value 0).
    One put there with non-zero bytes and recorded passed verify: actstore's reader never reads it,
    but a plain zarr client gets it as the sample's padding, which code padding to T_max takes as data."""
    import zarr
    run = copied_run(bert_run, tmp_path, lambda m: None)
    store = run / "shards" / zs.shard_name(0)
    reader = zs.ZarrStore(store)
    i, l, c = chunks_past_tokens(reader)[0]
    key = acts_chunk_key(i, l, c)
    record_files(run, store, {key: np.full(reader.chunk_bytes // 2, 7, "<f2").tobytes()})
    padding = zarr.open_consolidated(str(store), mode="r")["arrays/activations"][i, l, c * reader.t_chunk:]
    assert (padding == 7).any()  # the damage at hand: a zarr client reads it past seq_len
    expected = f"{store / key}: an activations chunk past its sample's seq_len"
    for path in (run, store):
        assert any(p.startswith(expected) for p in zs.verify(path)), zs.verify(path)


def test_an_older_store_with_zero_files_past_seq_len_verifies(bert_run, tmp_path):  # noqa: F811
    """Stores written before 2026-11-26 have a zero-filled file for every chunk, recorded: they verify."""
    run = copied_run(bert_run, tmp_path, lambda m: None)
    store = run / "shards" / zs.shard_name(0)
    reader = zs.ZarrStore(store)
    zeros = bytes(reader.chunk_bytes)
    record_files(run, store, {acts_chunk_key(*key): zeros for key in chunks_past_tokens(reader)})
    assert chunks_past_tokens(reader)
    assert zs.verify(run) == [] and zs.verify(store) == []


def test_an_activations_fill_value_other_than_zero_fails_verify(bert_run, tmp_path):  # noqa: F811
    """The chunks past a sample's tokens have no file, so a zarr client reads them as the .zarray's
    fill_value. A store whose fill_value was 1.0 (.zarray and .zmetadata alike, recorded) passed verify;
    a zarr client read 1.0 as every sample's padding."""
    import zarr
    run = copied_run(bert_run, tmp_path, lambda m: None)
    store = run / "shards" / zs.shard_name(0)
    consolidated = json.loads((store / ".zmetadata").read_text())
    zarray = consolidated["metadata"][f"{zs.ACTS}/.zarray"]
    zarray["fill_value"] = 1.0
    record_files(run, store, {".zmetadata": json.dumps(consolidated).encode(),
                              f"{zs.ACTS}/.zarray": json.dumps(zarray).encode()})
    reader = zs.ZarrStore(store)
    i, l, c = chunks_past_tokens(reader)[0]
    assert (zarr.open_consolidated(str(store), mode="r")["arrays/activations"][i, l, c * reader.t_chunk:] == 1).all()
    expected = f"{store / zs.ACTS}/.zarray: fill_value=1.0, expected 0"
    for path in (run, store):
        assert any(p.startswith(expected) for p in zs.verify(path)), zs.verify(path)
