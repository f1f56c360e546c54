"""Review 63 of the shared integrity and I/O core: what write_json_atomic writes is JSON; a write loop
handed back no progress fails naming its file instead of spinning forever; a streamed JSON number cut by
a block is read whole, and a runaway streamed value refused within the cap; float16_file refuses alike
with the C casts and without."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from actstore.integrity import read_json
from actstore.io_utils import OrderedHashFile, TreeHashFile, stale_temps, write_json_atomic, write_with_hole
from tiny import traced_peak


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), np.float64("nan")])
def test_write_json_atomic_refuses_nan_naming_the_file_and_the_key(tmp_path, value):
    """json.dumps writes NaN and Infinity, which no JSON reader takes (jq, JavaScript, read_json): a
    report holding one was written, and every later read of it failed. Refused before anything is
    written, naming the file and where the value is; the file there before is left as it was."""
    path = tmp_path / "report.json"
    write_json_atomic(path, {"ok": 1})
    with pytest.raises(ValueError) as caught:
        write_json_atomic(path, {"heldout": {"fvu": 0.5, "curve": [1.0, value]}, "n": 3})
    assert str(path) in str(caught.value) and "['heldout']['curve'][1]" in str(caught.value)
    assert read_json(path) == {"ok": 1}
    assert not list(stale_temps(path))


def test_write_json_atomic_writes_finite_floats_names_a_nan_key_and_other_errors_as_json_does(tmp_path):
    path = tmp_path / "ok.json"
    write_json_atomic(path, {"b": [1.5, -0.0, 1e308], "a": None}, indent=None)
    assert path.read_text() == '{"b": [1.5, -0.0, 1e+308], "a": null}\n'
    with pytest.raises(ValueError, match=r"ok.json: value nan at \['a'\]\[nan\], a key, is not a JSON number"):
        write_json_atomic(path, {"a": {float("nan"): 1}})
    assert path.read_text() == '{"b": [1.5, -0.0, 1e+308], "a": null}\n'
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        write_json_atomic(path, {"x": loop})


def writes_nothing(calls: list):
    """os.write or os.pwrite as a file system that takes no byte (returns 0) answers; after 100 calls an
    AssertionError, so that the loop that never gives up fails the test instead of hanging it."""
    def write(fd, data, *rest):
        calls.append(len(data))
        assert len(calls) < 100, "the write loop spun on a write that took nothing"
        return 0
    return write


def test_a_write_with_hole_that_takes_no_byte_is_a_full_disk_as_in_c(tmp_path, monkeypatch):
    """_casts.c's new_file takes a write of 0 bytes for ENOSPC; write_with_hole (the path without the C
    casts) asked again forever."""
    calls: list = []
    monkeypatch.setattr(os, "write", writes_nothing(calls))
    path = tmp_path / "chunk"
    with pytest.raises(OSError) as caught:
        write_with_hole(str(path), bytes(64), 16)
    assert caught.value.errno == 28 and str(path) in str(caught.value)
    assert len(calls) == 1


@pytest.mark.parametrize("kind", [OrderedHashFile, TreeHashFile])
def test_a_positioned_write_that_takes_no_byte_is_a_full_disk(tmp_path, monkeypatch, kind):
    calls: list = []
    path = tmp_path / "acts.bin"
    out = kind(path, 64)
    monkeypatch.setattr(os, "pwrite", writes_nothing(calls))
    with pytest.raises(OSError) as caught:
        out.write(0, bytes(64))
    out.abort()
    assert caught.value.errno == 28 and str(path) in str(caught.value)
    assert len(calls) == 1


def test_a_hashing_writer_on_a_file_that_would_block_fails_instead_of_spinning(tmp_path):
    """An unbuffered non-blocking file's write returns None when it would block: the loop took it for
    no progress and asked again forever, one CPU at 100 % (here a real pipe, full)."""
    code = ("import os\nfrom actstore.io_utils import HashingWriter\n"
            "r, w = os.pipe()\nos.set_blocking(w, False)\n"
            "raw = open(w, 'wb', buffering=0)\n"
            "while raw.write(bytes(65536)) is not None:\n    pass\n"
            "with HashingWriter(raw, 'a full pipe') as out:\n    out.write(b'x')\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("HashingWriter spun on a write that would block")
    assert proc.returncode != 0
    assert "OSError: a full pipe: " in proc.stderr, proc.stderr[-2000:]


def test_read_json_takes_back_what_write_json_atomic_wrote(tmp_path):
    value = {"a": [0.1, 1e-300, 2 ** 62, "é\u2028"], "b": {"c": None, "d": True}}
    write_json_atomic(tmp_path / "x.json", value)
    assert read_json(tmp_path / "x.json") == value == json.loads((tmp_path / "x.json").read_text())


@pytest.mark.parametrize("block", [1, 2, 3, 5, 7, 1 << 20])
def test_a_streamed_number_cut_by_a_block_after_its_point_or_exponent_is_read_whole(tmp_path, monkeypatch, block):
    """A block ending just after a number's "." or "e" (3. | 0) left the window a valid number, 3, followed by
    a character no JSON allows there: a good files listing was called "not valid JSON" (verify: BAD) by
    where its 1 MiB blocks happened to fall."""
    import actstore.integrity as integrity

    value = {"a": 2.5, "files": {"n0": 3.0, "n1": 1.5e-07, "n2": -2e+30, "n3": [0.25, 7E-3]}, "z": 1.0}
    path = tmp_path / "files.json"
    path.write_text(json.dumps(value).replace("e-07", "E-07"))
    monkeypatch.setattr(integrity, "JSON_BLOCK_CHARS", block)
    got = {key: dict(member) if key == "files" else member
           for key, member in integrity.stream_json_object(path, "files")}
    assert got == value


def test_a_streamed_value_past_the_cap_is_refused_before_the_window_doubles_past_it(tmp_path, monkeypatch):
    """The window, refused once it held more than JSON_MAX_BYTES, first read as much again: it reached twice
    the cap, and a tail of NUL bytes a crash left took 5 caps of memory to refuse (the window, the block
    read, its bytes and the two joined; ~5 GiB as shipped). It now never holds more than the cap and a
    character: under 3 caps."""
    import actstore.integrity as integrity

    cap = 4 << 20
    monkeypatch.setattr(integrity, "JSON_MAX_BYTES", cap)
    monkeypatch.setattr(integrity, "JSON_BLOCK_CHARS", 1 << 16)
    path = tmp_path / "job.json"
    with open(path, "wb") as fh:
        fh.write(b'{"files": {"a": "')
        fh.truncate(64 << 20)  # sparse NUL bytes: a string that never ends
    def refused() -> None:
        with pytest.raises(integrity.FormatError, match="runs past"):
            list(integrity.stream_json_members(path, "files"))

    peak = traced_peak(refused)[1]
    assert peak < 3 * cap, peak / cap  # 5 caps before
