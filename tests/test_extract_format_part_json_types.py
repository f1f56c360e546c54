"""Review: the extraction intermediate's part directories past part 9999, synthetic samples as large
as the value pool, part.json fields of the wrong type, and read_vector's token bounds."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import actstore.formats.extract.write as extract_write
from actstore.errors import FormatError
from actstore.formats.extract import (PartWriter, inspect, open_extraction, open_part, read_vector,
                                      synthetic_extraction, verify, write_index, write_part)
from actstore.formats.extract.write import index_of
from tiny import traced_peak


@pytest.fixture
def extraction(tmp_path) -> Path:
    return synthetic_extraction(tmp_path / "extract", 4_000, 1, 8, [0], tokens=(3, 5))


def _edit_part_json(extract_dir: Path, edit) -> None:
    """Change part-0000's part.json as a writer that made it so would have written it."""
    path = extract_dir / "part-0000" / "part.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def test_verify_looks_at_part_directories_past_part_9999(extraction):
    """part_dirname gives part 10000 five digits, which the four-digit pattern verify listed parts by
    never matched: a damaged file in part-10000 on passed verify, and no such part was named unlisted."""
    shutil.copytree(extraction / "part-0000", extraction / "part-10000")
    layer = extraction / "part-10000" / "layer_000.npy"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))
    problems = verify(extraction)
    assert any("part-10000: not listed in extract.json" in p for p in problems)
    assert any("part-10000/layer_000.npy: sha256_tree differs" in p for p in problems)


def test_synthetic_extraction_of_samples_as_large_as_its_value_pool(tmp_path, monkeypatch):
    """A sample of tokens * dim values took its rows from a random start below pool size - tokens * dim:
    none when that is 0 or less (numpy's bare "high <= 0": 2,048 tokens of width 8,192 at the real size)."""
    monkeypatch.setattr(extract_write, "SYNTHETIC_POOL", 64)
    root = synthetic_extraction(tmp_path / "extract", 1_000, 2, 8, [0, 1], tokens=(8, 8))
    extraction = open_extraction(root, verify=True)
    assert extraction.n_samples > 1 and extraction.activations("layer_1", 0).shape == (8, 8)


@pytest.mark.parametrize("field, value, named", [
    ("layers", [], "'layers'"),
    ("versions", ["torch 2.5"], "'versions'"),
    ("versions", {"torch": 2.5}, "'versions'"),
    ("created_at", 1700000000, "'created_at'"),
    ("model.path", 7, "'model.path'"),
    ("model.name", None, "'model.name'"),
    ("dataset.split", ["train"], "'dataset.split'"),
])
def test_part_json_fields_the_formats_use_are_refused_when_of_the_wrong_type(extraction, field, value, named):
    """layers [] made inspect and every format writer (layers[0]) raise a bare IndexError; versions not a
    map, lmprobe's provenance an AttributeError; a model path not a string, its tokenizer load a
    TypeError; a name of another type went into a format's metadata as it was. Each opened and verified
    clean; now each is a FormatError naming part.json and the field."""
    def edit(meta):
        key, _, sub = field.partition(".")
        if sub:
            meta[key][sub] = value
        else:
            meta[key] = value
    _edit_part_json(extraction, edit)
    with pytest.raises(FormatError, match=named):
        open_part(extraction / "part-0000")
    assert any(named in p and "part.json" in p for p in verify(extraction / "part-0000"))


def test_inspect_counts_a_null_float16_overflow_count_as_none(extraction):
    """part.json's float16_overflow_count may be null (the contract takes it): inspect raised int()'s
    TypeError on it."""
    _edit_part_json(extraction, lambda meta: meta.update(float16_overflow_count=None))
    write_index(extraction, extraction / "extract.json")
    assert verify(extraction) == []
    assert inspect(extraction)["float16_overflow_count"] == 0


def test_read_vector_of_a_negative_token_is_none(extraction):
    """Token -1 is no token of the sample: read_vector gave the last token's vector, where every
    other format's read_vector says the store holds no such coordinate."""
    assert read_vector(extraction, 0, 0, 0) is not None
    assert read_vector(extraction, 0, 0, -1) is None


def _one_token_samples(root: Path, n: int) -> Path:
    """An extraction of `n` one-token samples in one part, each file written in one call (fast at any n)."""
    samples = [{"sample_idx": i, "text": "", "label": None, "label_id": None, "num_tokens": 1, "metadata": {}}
               for i in range(n)]
    with write_part(root / "part-0000") as tmp:
        writer = PartWriter(tmp, samples, np.arange(n + 1))
        writer.add_tokens("layer_000.npy", 1, "float32")
        writer.write("layer_000.npy", 0, np.zeros(n, np.float32), n_samples=n)
        writer.finish(extract_write._synthetic_meta(root, 0, 1, range(n), n, [0], 1))
    return root


def test_indexing_an_extraction_holds_no_list_of_every_sample_idx(tmp_path):
    """index_of (write_index, and verify's comparison with extract.json) listed every sample_idx to
    compare it with range(n): ~70 bytes a sample, GBs for an extraction of 10^7 samples. Its peak now
    does not grow with the samples (their line index, 8 bytes a row, is built before it is measured)."""
    peaks = []
    for n in (2_000, 20_000):
        extraction = open_extraction(_one_token_samples(tmp_path / str(n), n))
        assert len(extraction.parts[0].samples) == n
        peaks.append(traced_peak(lambda: index_of(extraction))[1])
    assert peaks[1] - peaks[0] < 18_000 * 8  # under 8 bytes a further sample
