"""Follow-ups on the extraction intermediate: a part of an unknown format version, PartWriter's offsets
and non-C-order arrays, and the top-k files' widths against each other and logits_topk."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats.extract import (PartWriter, open_part, synthetic_extraction, tensor_file, verify, write_index,
                                      write_part)


def test_a_part_of_an_unknown_format_version_is_refused_naming_it(tmp_path):
    """open_part checked the format name only: a part of version 3 was read as version 2."""
    root = synthetic_extraction(tmp_path / "extract", 2_000, 1, 8, [0], tokens=(3, 5))
    part_json = root / "part-0000" / "part.json"
    for version in (3, "2", None):
        part_json.write_text(json.dumps({**json.loads(part_json.read_text()), "version": version}))
        with pytest.raises(FormatError, match=rf"part-0000/part.json: version {version!r} of actstore-part"):
            open_part(root / "part-0000")


def test_offsets_of_another_length_than_the_samples_are_refused_before_anything_is_written(tmp_path):
    """Two samples with offsets for one failed finish with a bare IndexError."""
    samples = [{"sample_idx": 0}, {"sample_idx": 1}]
    with pytest.raises(ValueError, match=r"offsets of shape \[2\] for 2 samples, expected \[3\]"):
        PartWriter(tmp_path / "part", samples, np.array([0, 2]))
    assert not (tmp_path / "part").exists()


def test_a_transposed_array_is_written_in_the_order_the_file_holds_it(tmp_path):
    """A transposed (Fortran-order) array failed with a bare TypeError from the buffer protocol."""
    root = synthetic_extraction(tmp_path / "extract", 2_000, 1, 8, [0], tokens=(3, 5))
    source = open_part(root / "part-0000")
    rows = [source.tensor("layer_0")[source.sample_slice(i)] for i in range(source.info.n_samples)]
    with write_part(tmp_path / "again") as tmp:
        writer = PartWriter(tmp, list(source.samples), source.offsets)
        writer.add_tokens(tensor_file("layer_0"), 8, "float32")
        for local, values in enumerate(rows):
            writer.write(tensor_file("layer_0"), local, np.asfortranarray(values))
        writer.finish({key: value for key, value in source.meta.items() if key != "files"})
    again = open_part(tmp_path / "again")
    again.verify()
    np.testing.assert_array_equal(again.tensor("layer_0")[:], np.concatenate(rows))


def _with_topk(root: Path, widths: tuple[int, int], logits_topk: int | None) -> Path:
    """`root`'s one part written again with top-k files of `widths` (values, indices), part.json saying
    `logits_topk`, and its extract.json rebuilt."""
    source = open_part(root / "part-0000")
    samples, offsets = list(source.samples), source.offsets
    rows = [source.tensor("layer_0")[source.sample_slice(i)] for i in range(len(samples))]
    meta = {key: value for key, value in source.meta.items() if key != "files"}
    shutil.rmtree(root / "part-0000")
    with write_part(root / "part-0000") as tmp:
        writer = PartWriter(tmp, samples, offsets)
        writer.add_tokens(tensor_file("layer_0"), 8, "float32")
        writer.add_rows("topk_values.npy", widths[0], "float32")
        writer.add_rows("topk_indices.npy", widths[1], "int64")
        for local, values in enumerate(rows):
            writer.write(tensor_file("layer_0"), local, values)
            writer.write("topk_values.npy", local, np.arange(widths[0], dtype=np.float32))
            writer.write("topk_indices.npy", local, np.arange(widths[1], dtype=np.int64))
        writer.finish({**meta, "logits_topk": logits_topk})
    write_index(root, root / "extract.json")
    return root


@pytest.mark.parametrize("widths, logits_topk", [((4, 3), 4), ((4, 4), 5), ((4, 4), None)])
def test_top_k_files_of_two_widths_or_another_k_than_the_parts_fail_verify(tmp_path, widths, logits_topk):
    """Each top-k file's header was checked against its own part.json record only: values of 4 and
    indices of 3 a sample, or widths other than logits_topk, passed verify."""
    root = _with_topk(synthetic_extraction(tmp_path / "extract", 2_000, 1, 8, [0], tokens=(3, 5)),
                      widths, logits_topk)
    problems = verify(root)
    assert len(problems) == 1 and f"logits_topk {logits_topk} give" in problems[0], problems


def test_top_k_files_of_the_parts_k_verify(tmp_path):
    root = _with_topk(synthetic_extraction(tmp_path / "extract", 2_000, 1, 8, [0], tokens=(3, 5)), (4, 4), 4)
    assert verify(root) == []
