"""Review 63 of the validate stage (actstore.fingerprints, actstore.verify, actstore.report) and the
`actstore` command."""
from __future__ import annotations

import numpy as np

import tiny
from actstore.formats.extract import synthetic_extraction
from test_extract import write_real_store
from test_fingerprints import add_fingerprints, problems_of, zarr_chunk


def test_an_inf_stored_as_nan_beside_a_nan_of_the_same_row_is_named(tmp_path):
    """Sample 1's first token holds a NaN and a +inf (a float16 overflow beside a NaN); the zarr store holds
    NaN in both places. (A row was hashed by the kind of its product with q, NaN either way: it passed, as
    did a row whose +inf and -inf traded places.)"""
    root = synthetic_extraction(tmp_path / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))
    layer = np.load(root / "part-0000" / "layer_001.npy", mmap_mode="r+")
    offsets = np.load(root / "part-0000" / "offsets.npy")
    layer[offsets[1], [0, 3, 5]] = [np.nan, np.inf, -np.inf]
    layer.flush()
    tiny.rerecord(root / "part-0000", "layer_001.npy")
    store = write_real_store("zarr", root, tmp_path / "zarr")
    assert problems_of("zarr", store, root)[0] == []
    chunk = zarr_chunk(store, 1, 0)
    rows = np.fromfile(chunk, np.float16).reshape(-1, 8)
    for damaged in ([np.nan, np.nan, -np.inf], [np.nan, -np.inf, np.inf]):
        rows[0, [0, 3, 5]] = damaged
        rows.tofile(chunk)
        problems, _ = problems_of("zarr", store, root)
        assert len(problems) == 1 and "(zarr): layer 1, samples 1..1: holds its NaN or inf" in problems[0], problems


def test_the_norm_plot_samples_every_part_however_many_parts_there_are(tmp_path, monkeypatch):
    """More parts than MAX_TOKENS_PER_LAYER tokens (the schema allows 100,000 parts, the plot samples 20,000
    tokens): each part gives at least one token, so every layer's box is drawn. (Each part gave
    20,000 // parts = 0 tokens: every box was empty, the plot blank without a word.)"""
    from actstore import report
    from actstore.formats.extract import open_extraction

    root = synthetic_extraction(tmp_path / "x", 200_000, 3, 8, [1, 2], tokens=(4, 10))
    monkeypatch.setattr(report, "MAX_TOKENS_PER_LAYER", 2)  # fewer than the 3 parts, as 20,000 is than 100,000
    boxes = {}  # a box draws 6 lines (box, 2 whiskers, 2 caps), its median last: NaN where it holds no value
    monkeypatch.setattr(report, "_save", lambda fig, path: boxes.update(
        medians=[float(line.get_ydata()[0]) for line in fig.axes[0].lines[5::6]]))
    report.activation_norms(open_extraction(root), tmp_path / "norms.png")
    assert len(boxes["medians"]) == 2 and np.isfinite(boxes["medians"]).all(), boxes


def test_a_store_whose_metadata_cannot_be_read_is_a_problem_and_the_other_stores_are_still_checked(tmp_path):
    """The pickle store's metadata.json is not JSON: check_format names it as a problem of that store (with what
    verify found), and the full pass goes on to the zarr store beside it. (inspect's FormatError ended validate
    at the first such store: the stores after it, and every store's fingerprint, were never checked.)"""
    from actstore.formats.extract import open_extraction
    from actstore.verify import check_format, sample_coordinates

    root = synthetic_extraction(tmp_path / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))
    extraction = open_extraction(root)
    coords = sample_coordinates(extraction, 8, 0)
    broken = write_real_store("pickle", root, tmp_path / "pickle")
    (broken / "metadata.json").write_text("{not JSON")
    zarr = write_real_store("zarr", root, tmp_path / "zarr")
    rows = np.fromfile(zarr_chunk(zarr, 3, 0), np.float16)
    rows[0] += 1  # one value of sample 3, layer 1 (no sampled coordinate reads it)
    rows.tofile(zarr_chunk(zarr, 3, 0))
    formats = {name: check_format(name, store, extraction, coords) for name, store in
               (("pickle", broken), ("zarr", zarr))}
    add_fingerprints(formats, extraction, 0)
    assert formats["pickle"]["checked"] == 0 and formats["pickle"]["problems"], formats["pickle"]
    assert all(str(broken / "metadata.json") in p for p in formats["pickle"]["problems"]), formats["pickle"]
    assert any("not valid JSON" in p for p in formats["pickle"]["problems"]), formats["pickle"]
    assert formats["zarr"]["checked"] == len(coords)
    assert [p.split(": ")[0] for p in formats["zarr"]["problems"]] == [  # its verify's, then its fingerprint's
        str(zarr_chunk(zarr, 3, 0)), f"{zarr} (zarr)"], formats["zarr"]["problems"]
    assert "layer 1, samples 3..3: holds other vectors" in formats["zarr"]["problems"][1]


def test_a_sample_of_no_token_in_the_offsets_is_named_not_a_numpy_traceback(tmp_path):
    """offsets.npy edited in place (its size unchanged, which is what the open checks) so that sample 1 holds no
    token: the coordinates' draw names the file and the sample. (numpy's `ValueError: high <= 0` ended
    validate, before the extraction's verify named the edit.)"""
    import pytest

    from actstore.errors import FormatError
    from actstore.formats.extract import open_extraction
    from actstore.verify import sample_coordinates

    root = synthetic_extraction(tmp_path / "x", 20_000, 1, 8, [1], tokens=(4, 10))
    offsets = np.load(root / "part-0000" / "offsets.npy", mmap_mode="r+")
    offsets[2] = offsets[1]
    offsets.flush()
    extraction = open_extraction(root)
    with pytest.raises(FormatError, match=rf"^{root / 'part-0000' / 'offsets.npy'}: sample_idx 1 holds no token"):
        sample_coordinates(extraction, extraction.n_samples, 0)


def test_a_clean_store_whose_path_stdout_cannot_encode_verifies_with_exit_0(tmp_path):
    """A store under 日本/ checked where stdout is latin-1 (an HPC login's LANG=en_US.ISO-8859-1, or
    PYTHONIOENCODING): the path is printed with escapes, as on stderr, and the exit code is verify's. (print
    raised UnicodeEncodeError after the check: a traceback and exit 1, "problems found", for a clean store.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = synthetic_extraction(tmp_path / "x", 100_000, 1, 8, [1], tokens=(4, 10))
    store = write_real_store("lmprobe", root, tmp_path / "日本" / "lmprobe")
    actstore = str(Path(sys.executable).with_name("actstore"))
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    done = subprocess.run([actstore, "verify", str(store)], capture_output=True, env=env, timeout=300)
    escaped = str(store).replace("日本", "\\u65e5\\u672c")
    assert (done.returncode, done.stdout.decode("latin-1"), done.stderr) == (0, f"lmprobe store {escaped}: OK\n", b"")


def test_a_lut_whose_metadata_cannot_be_read_is_a_problem_not_the_end_of_validate(tmp_path):
    """The LUT's metadata.json is not JSON: check_lut lists it among the problems (validate then lists every
    store's). (inspect's FormatError ended validate with that one line: every format's problems, found by
    then, unreported.)"""
    from actstore.formats.lut import write_lut
    from actstore.verify import check_lut
    from test_lut_install_hostile_inputs import Tiny, tables_for

    store = write_lut(tmp_path / "lut_stage", tables_for(Tiny()), 4)
    meta = next(store.rglob("metadata.json"))
    meta.write_text("{not JSON")
    report = check_lut(store, tmp_path / "sae")
    assert report["inspect"] == {} and any(str(meta) in p and "not valid JSON" in p for p in report["problems"])
