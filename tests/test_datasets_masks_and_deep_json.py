"""Review 57: dataset readers and patch labels."""
from __future__ import annotations

import numpy as np
import pytest

from actstore.errors import ConfigError
from actstore.patch_labels import read_mask


@pytest.mark.parametrize("name, stored", [("bool.png", lambda ids: ids.astype(bool)),
                                          ("big-endian.tif", lambda ids: ids.astype(">u2"))])
def test_a_boolean_or_big_endian_16_bit_mask_is_read(name, stored, tmp_path):
    """A mask saved from a numpy bool array (PIL writes a 1-bit PNG, mode "1") and a big-endian
    16-bit TIFF (mode "I;16B") are one channel of class ids: both were refused as "need one
    channel of class ids"; now read as the same ids an 8-bit mask holds."""
    from PIL import Image

    ids = np.zeros((4, 6), np.uint8)
    ids[1:3, 2:5] = 1
    Image.fromarray(stored(ids)).save(tmp_path / name)
    assert Image.open(tmp_path / name).mode in ("1", "I;16B")
    mask = read_mask(tmp_path / name, (6, 4))
    assert mask.dtype == np.uint8 and mask.tolist() == ids.tolist()


DEEP = "[" * 5000 + "]" * 5000  # json recurses once a level: past ~1000 a RecursionError naming nothing


@pytest.mark.parametrize("name, text, where", [
    ("rows.jsonl", '{"text": "a"}\n{"text": "b", "tree": %s}\n' % DEEP, r"rows\.jsonl:2"),
    ("rows.json", '[{"text": "a"}, {"text": "b", "tree": %s}]' % DEEP, r"rows\.json: element 2")])
def test_a_json_row_nested_too_deeply_is_named(name, text, where, tmp_path):
    """A row holding lists nested thousands deep (a parse tree, a damaged line) crashed the scan with
    a bare RecursionError; now a ConfigError naming the line or element."""
    from actstore.datasets import scan_dataset

    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=rf"{where}: not valid JSON \(nested too deeply to parse\)"):
        scan_dataset(tmp_path / name)


def test_a_webdataset_json_member_nested_too_deeply_is_named(tmp_path):
    """dataset.keep_fields json: a member nested thousands deep crashed the scan with a bare
    RecursionError; now a ConfigError naming the shard, the sample and the member."""
    import io
    import tarfile

    from PIL import Image

    from actstore.datasets import scan_dataset

    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    with tarfile.open(tmp_path / "shard-00000.tar", "w") as tar:
        for name, data in (("k0.png", png.getvalue()), ("k0.json", DEEP.encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ConfigError, match=r"shard-00000\.tar: sample 'k0' .*its 'json' member is not JSON "
                                          r"\(nested too deeply to parse\)"):
        scan_dataset(tmp_path / "shard-00000.tar", keep_fields=["json"])


def test_a_json_array_nested_too_deeply_is_estimated(tmp_path):
    """The resource estimate (every Snakemake parse) counts the elements whole before one nested too
    deeply to parse, which crashed every parse with a bare RecursionError; the scan names it."""
    from actstore.datasets.jsonl import size_estimate

    path = tmp_path / "rows.json"
    path.write_text('[{"text": "a"}, {"text": "b"}, {"text": "c", "tree": %s}]' % DEEP)
    assert size_estimate((path,), arrays=True) == (2, path.stat().st_size)
