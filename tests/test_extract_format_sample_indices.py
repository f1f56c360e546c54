"""Review: the extraction intermediate's sample and token indices, the offsets a PartWriter takes, and
what verify and inspect make of a part.json record that is not one the readers can use."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats.extract import (PartWriter, inspect, open_extraction, open_part, read_vector,
                                      synthetic_extraction, verify, write_index)


@pytest.fixture(scope="module")
def extraction(tmp_path_factory) -> Path:
    return synthetic_extraction(tmp_path_factory.mktemp("review62") / "extract", 8_000, 2, 8, [0, 1], tokens=(3, 6))


def _edited_part(extraction: Path, out: Path, edit) -> Path:
    """A copy of part 0 with its part.json edited by `edit(meta)`."""
    part = out / "part-0000"
    part.mkdir(parents=True)
    for file in (extraction / "part-0000").iterdir():
        (part / file.name).write_bytes(file.read_bytes())
    meta = json.loads((part / "part.json").read_text())
    edit(meta)
    (part / "part.json").write_text(json.dumps(meta))
    return part


def test_a_negative_local_sample_is_counted_from_the_end(extraction):
    """Part.activations(name, -1) sliced offsets[-1]:offsets[0], an empty array: the last sample read
    as one of no tokens, without an error (samples[-1] gave the last sample's row)."""
    part = open_part(extraction / "part-0000")
    last = part.info.n_samples - 1
    assert part.activations("layer_0", -1).shape[0] == part.offsets[-1] - part.offsets[-2] > 0
    np.testing.assert_array_equal(part.activations("layer_0", -1), part.activations("layer_0", last))
    np.testing.assert_array_equal(part.token_ids(-1), part.token_ids(last))
    assert part.samples[-1] == part.samples[last]


def test_a_local_sample_past_the_part_is_named(extraction):
    part = open_part(extraction / "part-0000")
    for local in (part.info.n_samples, -part.info.n_samples - 1):
        with pytest.raises(IndexError, match=f"{part.dir}.*sample {local} of {part.info.n_samples}"):
            part.activations("layer_0", local)


@pytest.mark.parametrize("coordinate", [(True, 0, 0), (0, 0, True), (1.0, 0, 0), (0, 1.0, 0), (0, 0, 1.5)])
def test_read_vector_refuses_an_index_that_is_no_integer(extraction, coordinate):
    """Token True read rows[True]: the sample's every token under a new axis, (1, tokens, d), as the
    vector; sample True was row 1; a float failed with a bare numpy error naming no store."""
    with pytest.raises(TypeError, match=f"{extraction}.* is not an integer"):
        read_vector(extraction, *coordinate)
    assert read_vector(extraction, np.int64(1), np.int64(1), np.int64(0)).shape == (8,)


def test_extraction_locate_refuses_a_bool(extraction):
    with pytest.raises(TypeError, match="sample_idx True is not an integer"):
        open_extraction(extraction).locate(True)


@pytest.mark.parametrize("offsets", [[2, 5], [0, 5, 3], [0, 1.5, 3]])
def test_offsets_that_do_not_run_up_from_0_in_whole_tokens_are_refused_before_anything_is_written(
        tmp_path, offsets):
    """Offsets from 2 made a file of rows 0..5 whose rows 0..2 no sample fills, refused only at finish
    ("152 of 168 bytes written"); offsets going down failed a write as ending past the file; 1.5
    tokens was cut to 1 without an error."""
    samples = [{"sample_idx": i} for i in range(len(offsets) - 1)]
    with pytest.raises(ValueError, match=r"offsets .* must be whole numbers of tokens from 0, never going down"):
        PartWriter(tmp_path / "part", samples, np.array(offsets))
    assert not (tmp_path / "part").exists()


def test_verify_names_a_data_file_whose_record_has_no_shape(extraction, tmp_path):
    """A part.json record of token_ids.npy without its shape passed verify, and every read of the
    token ids was then refused."""
    part = _edited_part(extraction, tmp_path, lambda meta: meta["files"]["token_ids.npy"].pop("shape"))
    with pytest.raises(FormatError, match="token_ids.npy"):
        open_part(part).token_ids(0)
    assert [problem for problem in verify(part) if "token_ids.npy" in problem and "shape None" in problem]


def test_inspect_names_a_layer_record_that_is_not_tokens_by_width(extraction, tmp_path):
    """A layer file recorded as 1-D (its header matching) crashed inspect with a bare IndexError."""
    def flatten(meta):
        record = meta["files"]["layer_000.npy"]
        record["shape"] = [record["shape"][0] * record["shape"][1]]
    part = _edited_part(extraction, tmp_path, flatten)
    with pytest.raises(FormatError, match="part-0000/layer_000.npy"):
        inspect(part)


def test_inspect_reads_the_width_and_dtype_of_the_stored_tensor(extraction):
    summary = inspect(extraction)
    assert (summary["d_model"], summary["dtype"]) == (8, "float32")


def test_a_part_json_linking_outside_its_part_is_refused(extraction, tmp_path):
    """open_part looked offsets.npy and every data file up inside the part, but read a part.json that was
    a link to a file elsewhere (open_extraction, read_vector and inspect read such parts)."""
    part = _edited_part(extraction, tmp_path / "store", lambda meta: None)
    outside = tmp_path / "elsewhere.json"
    (part / "part.json").rename(outside)
    (part / "part.json").symlink_to(outside)
    with pytest.raises(FormatError, match="'part.json' leads outside"):
        open_part(part)


def test_an_index_over_overlapping_parts_names_the_line(extraction, tmp_path):
    """write_index refused parts whose samples.jsonl rows repeat a sample_idx naming only the extraction
    directory: which of thousands of parts, and which line, was left to a search."""
    root = tmp_path / "extract"
    root.mkdir()
    for part in ("part-0000", "part-0001"):
        (root / part).mkdir()
        for file in (extraction / part).iterdir():
            (root / part / file.name).write_bytes(file.read_bytes())
    samples = root / "part-0001" / "samples.jsonl"
    first = json.loads(samples.read_text().splitlines()[0])["sample_idx"]
    samples.write_text(samples.read_text().replace(f'"sample_idx": {first},', f'"sample_idx": {first - 1},', 1))
    with pytest.raises(FormatError, match=f"part-0001/samples.jsonl: line 1 says sample_idx {first - 1}, where "
                                          f"it is row {first}"):
        write_index(root, root / "extract.json")
