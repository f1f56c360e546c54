"""actstore.casts: the float16 and bfloat16 bits the writers store, without torch, equal numpy's and
torch's own casts bit for bit, on every class of float32 (rounding ties, subnormals, overflow, inf,
NaN payloads), through the C casts (F16C) and through numpy (their stand-in without a C compiler)."""
import os
import platform

import numpy as np
import pytest
import torch

from actstore import casts

SCALE = os.environ.get("ACTSTORE_SCALE_TESTS") == "1"  # `make test-scale`


def _cpu_has_f16c() -> bool:
    try:
        return " f16c" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def tricky_float32_bits() -> np.ndarray:
    """Every sign/exponent/top-mantissa pattern with the low half bits that decide float16 rounding
    (ties, just under and over them), float16-subnormal ties for each exponent, and random patterns."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000, 0xF000,
                    0xFFFF], dtype=np.uint32)
    rng = np.random.default_rng(0)
    ties = []
    for exponent in range(102, 113):  # values that round to float16 subnormals (or to zero)
        drop = 13 + 113 - exponent  # mantissa bits below the last float16 bit: 14..24
        top = rng.integers(0, 1 << max(0, 23 - drop), 512).astype(np.int64) << min(drop, 23)
        for delta in (-1, 0, 1):  # just under, at and over the tie
            mantissa = ((top + ((1 << (drop - 1)) & 0x7FFFFF) + delta) & 0x7FFFFF).astype(np.uint32)
            for sign in (0, 1 << 31):
                ties.append(np.uint32(sign | exponent << 23) | mantissa)
    randoms = rng.integers(0, 1 << 32, 1 << 22, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([(high[:, None] | low[None, :]).ravel(), *ties, randoms])


@pytest.fixture(params=["C", "numpy"])
def cast_path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(casts, "_casts", None)
    elif casts._casts is None:
        pytest.skip("the C casts (actstore._casts) are not built here")
    return request.param


def assert_float16_like_numpy(bits: np.ndarray) -> None:
    x = bits.view(np.float32)
    out = np.empty(x.shape, np.float16)
    overflow = casts.to_float16(x, out)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    mismatch = np.flatnonzero(out.view(np.uint16) != expected.view(np.uint16))
    assert not len(mismatch), [(hex(int(bits[i])), hex(int(out.view(np.uint16)[i])),
                                hex(int(expected.view(np.uint16)[i]))) for i in mismatch[:5]]
    assert overflow == int((np.isinf(expected) & np.isfinite(x)).sum())


def test_float16_bits_equal_numpys_cast(cast_path):
    bits = tricky_float32_bits()
    assert_float16_like_numpy(bits)
    assert_float16_like_numpy(bits[:13])  # shorter than one 8-wide vector: the scalar tail alone


def test_float16_counts_overflow_and_keeps_nan_payloads(cast_path):
    x = np.array([65504.0, 65520.0, -1e6, np.inf, -np.inf, 1.0], np.float32)
    nan = np.array([0x7F800001, 0xFFC12345, 0x7FBFE000], np.uint32).view(np.float32)  # signalling / quiet NaNs
    out = np.empty(9, np.float16)
    assert casts.to_float16(np.concatenate([x, nan]), out) == 2  # 65520 and -1e6; inf was inf already
    with np.errstate(over="ignore"):
        assert out.view(np.uint16).tolist() == np.concatenate([x, nan]).astype(np.float16).view(np.uint16).tolist()


def test_float16_takes_any_layout_and_refuses_a_wrong_target(cast_path):
    x = np.arange(48, dtype=np.float64).reshape(6, 8)[:, ::2]  # float64, not contiguous
    out = np.empty((6, 4), np.float16)
    assert casts.to_float16(x, out) == 0 and (out == x.astype(np.float16)).all()
    with pytest.raises(ValueError, match=r"float32 \(6, 4\) into float16 \(4, 6\)"):
        casts.to_float16(x, np.empty((4, 6), np.float16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_float16_file_holds_the_rows_cast(cast_path, dtype, tmp_path):
    """float16_file: rows of a stored file (after its header), cast as to_float16 casts them (a
    bfloat16 source widened first; NaN payloads and overflows as numpy's), written to a new file in a
    new directories (made in order), then zeros to the buffer's size (a hole: tests/test_zarr.py); the buffer holds the
    file's bytes. Rows with no inf or NaN and rows with them (the C cast leaves those to numpy)."""
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    x[3, 0] = 7e4  # overflows float16
    x.view(np.uint32)[4, :2] = [0x7F8CFC76, 0x7F800000]  # a signalling NaN, +inf
    with np.errstate(over="ignore"):
        stored = {"float32": x, "bfloat16": casts.to_bfloat16_bits(x), "float16": x.astype(np.float16)}[dtype]
    source = tmp_path / "layer.npy"
    source.write_bytes(b"H" * 128 + stored.tobytes())
    wide, out = np.empty((4, 8), np.float32), np.full((4, 8), 7, np.float16)
    fd = os.open(source, os.O_RDONLY)
    try:
        row_file = casts.RowFile(fd, str(source), 128, dtype, 8)
        for first, name in [(0, "plain"), (2, "special")]:
            values = casts.to_float32(stored[first:first + 3], dtype)
            with np.errstate(over="ignore"):
                want = values.astype(np.float16)
            file = tmp_path / name / "c" / "0"
            overflowed = casts.float16_file(row_file, first, 3, wide, out, [str(file.parent.parent), str(file.parent)],
                                            str(file))
            assert overflowed == int(np.isinf(want).sum() - np.isinf(values).sum())
            assert out.view(np.uint16)[:3].tolist() == want.view(np.uint16).tolist() and not out[3].any()
            assert file.read_bytes() == out.tobytes()
        assert overflowed == (0 if dtype == "float16" else 1)
        with pytest.raises(casts.FormatError, match=f"{source}: ends before row 7"):
            casts.float16_file(row_file, 4, 3, wide, out, [str(tmp_path / "d")], str(tmp_path / "d" / "0"))
        with pytest.raises(FileExistsError, match=f"{tmp_path / 'plain' / 'c'}: File exists"):
            casts.float16_file(row_file, 0, 3, wide, out, [str(tmp_path / "new"), str(tmp_path / "plain" / "c")],
                               str(tmp_path / "plain" / "c" / "1"))
        assert (tmp_path / "new").is_dir()  # made before the one that failed
        # An existing file is named alike whether C wrote it or numpy (rows with inf or NaN go through numpy).
        for first in (0, 2):
            with pytest.raises(FileExistsError, match=rf"^\[Errno 17\] {tmp_path / 'plain' / 'c' / '0'}: File exists$"):
                casts.float16_file(row_file, first, 3, wide, out, [], str(tmp_path / "plain" / "c" / "0"))
        # Buffers too small for the rows asked for: refused before anything is read or made.
        for rows, small_wide, small_out in [(5, wide, out), (4, wide[:3], out)]:
            if small_wide is not wide and dtype == "float16":
                continue  # a float16 source lands in out: wide is not used
            with pytest.raises(ValueError, match="values into"):
                casts.float16_file(row_file, 0, rows, small_wide, small_out, [str(tmp_path / "e")],
                                   str(tmp_path / "e" / "0"))
        assert not (tmp_path / "e").exists()
    finally:
        os.close(fd)


def test_f16_file_refuses_counts_past_its_buffers_without_overflowing(tmp_path):
    """The C call's own check (a direct caller's mistake): a count whose byte size overflows is refused, not cast
    past the buffers; and a path that is not UTF-8 is named as Python names it (surrogate escapes)."""
    if casts._casts is None:
        pytest.skip("the C casts (actstore._casts) are not built here")
    source = tmp_path / "src.bin"
    source.write_bytes(bytes(64))
    fd = os.open(source, os.O_RDONLY)
    try:
        wide, out = np.empty(16, np.float32), np.empty(16, np.float16)
        for n in (17, 2**62, 2**63 - 1):
            with pytest.raises(ValueError, match=f"{n} values into 32 float16 bytes"):
                casts._casts.f16_file(fd, str(source), 0, 0, n, wide, out, [], str(tmp_path / "never"))
        odd = os.fsdecode(bytes(tmp_path) + b"/caf\xe9")
        os.mkdir(odd)
        with pytest.raises(FileExistsError) as raised:
            casts._casts.f16_file(fd, str(source), 0, 0, 16, wide, out, [odd], str(tmp_path / "x"))
        assert str(raised.value) == f"[Errno 17] {odd}: File exists"
    finally:
        os.close(fd)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _cpu_has_f16c(),
                    reason="the F16C extension is built for x86 CPUs with F16C only")
def test_the_c_casts_are_built_where_the_cpu_has_f16c():
    """Without them every zarr and 16-bit lmprobe writer casts ~3-15x slower: a build that lost them fails here."""
    assert casts._casts is not None


def test_bfloat16_bits_equal_torchs_cast(cast_path):
    bits = tricky_float32_bits()
    x = bits.view(np.float32)
    expected = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = casts.to_bfloat16_bits(x)
    mismatch = np.flatnonzero(got != expected)
    assert not len(mismatch), [(hex(int(bits[i])), hex(int(got[i])), hex(int(expected[i]))) for i in mismatch[:5]]
    assert np.array_equal(casts.to_bfloat16_bits(x[:13]), expected[:13])  # shorter than a block or a vector
    back = casts.bfloat16_bits_to_float32(got)
    finite = np.isfinite(back)
    assert (back[finite] == torch.from_numpy(got.view(np.int16)).view(torch.bfloat16).float().numpy()[finite]).all()


def test_every_bfloat16_widens_to_torchs_float32_bits_into_any_target():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    expected = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy().view(np.uint32)
    assert np.array_equal(casts.bfloat16_bits_to_float32(bits).view(np.uint32), expected)
    target = np.zeros((300, 300), np.float32)  # a strided window of a larger array, left as it is around it
    casts.bfloat16_bits_to_float32(bits, target[20:276, 30:286])
    assert np.array_equal(target[20:276, 30:286].view(np.uint32), expected)
    assert not target[:20].any() and not target[276:].any() and not target[:, :30].any()
    with pytest.raises(ValueError, match="into float32 \\(255, 256\\)"):
        casts.bfloat16_bits_to_float32(bits, np.empty((255, 256), np.float32))


@pytest.mark.skipif(not SCALE, reason="all 2**32 float32 values, ~2 min: run with make test-scale")
def test_every_float32_casts_like_numpy_and_torch():
    block = 1 << 24
    for start in range(0, 1 << 32, block):
        bits = np.arange(start, start + block, dtype=np.uint64).astype(np.uint32)
        assert_float16_like_numpy(bits)
        expected = torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
        assert (casts.to_bfloat16_bits(bits.view(np.float32)) == expected.view(np.uint16)).all(), hex(start)


def test_float16_file_refuses_rows_before_the_first_and_more_than_4_directories_on_both_paths(cast_path, tmp_path):
    """A negative first row read the bytes before the rows (the .npy header) as values, silently; more
    than 4 directories were refused by the C call alone, made by the numpy path. Both refuse each before
    anything is read or made (review 63)."""
    source = tmp_path / "layer.npy"
    source.write_bytes(b"H" * 128 + np.ones((4, 8), np.float32).tobytes())
    wide, out = np.empty((2, 8), np.float32), np.empty((2, 8), np.float16)
    fd = os.open(source, os.O_RDONLY)
    try:
        row_file = casts.RowFile(fd, str(source), 128, "float32", 8)
        with pytest.raises(ValueError, match="row -1"):
            casts.float16_file(row_file, -1, 2, wide, out, [], str(tmp_path / "neg"))
        dirs = [str(tmp_path / "d")] + [str(tmp_path / "d" / "/".join("x" * i)) for i in range(1, 5)]
        with pytest.raises(ValueError, match="5 directories"):
            casts.float16_file(row_file, 0, 2, wide, out, dirs, dirs[-1] + "/0")
    finally:
        os.close(fd)
    assert not (tmp_path / "neg").exists() and not (tmp_path / "d").exists()
