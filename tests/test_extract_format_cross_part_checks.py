"""Review: the extraction intermediate's parts checked against each other and against what lies
outside them (whole model records, offsets.npy through a link), and hooks on modules named layer_*."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats.extract import (PartWriter, open_extraction, open_part, synthetic_extraction, tensor_file, verify,
                                      write_index, write_part)


@pytest.fixture
def extraction(tmp_path) -> Path:
    return synthetic_extraction(tmp_path / "extract", 4_000, 2, 8, [0], tokens=(3, 5))


def _edit_part_json(part_dir: Path, edit) -> None:
    """Change a part's part.json as a writer that made it so would have written it."""
    path = part_dir / "part.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("field, value", [("fix_mistral_regex", True), ("blocks_path", "model.other_blocks"),
                                          ("auto_map", {"AutoModel": "modeling_custom.CustomModel"})])
def test_a_part_whose_model_record_differs_is_refused(extraction, field, value):
    """ModelInfo leaves out the record's fields that say how a part's tokens and activations were made:
    a part whose tokenizer ran with the other Mistral regex, whose blocks were found elsewhere, or
    that ran the folder's own code (auto_map: model.trust_remote_code, not in the stage hash, turned on
    for that part's job) was indexed and verified with part 0's record as the whole extraction's."""
    _edit_part_json(extraction / "part-0001", lambda meta: meta["model"].update({field: value}))
    with pytest.raises(FormatError, match=r"part-0001/part\.json: model differs from .*part-0000/part\.json's"):
        write_index(extraction, extraction / "extract.json")
    with pytest.raises(FormatError, match=r"part-0001/part\.json: model differs"):
        open_extraction(extraction)


def test_offsets_through_a_link_out_of_the_part_are_refused(extraction, tmp_path):
    """Every file a part reads is looked up with inside(), which refuses a link leading out of the
    part, except offsets.npy: opened without verify, a part read its token offsets from outside."""
    part = extraction / "part-0000"
    outside = tmp_path / "elsewhere" / "offsets.npy"
    outside.parent.mkdir()
    shutil.move(part / "offsets.npy", outside)
    os.symlink(outside, part / "offsets.npy")
    with pytest.raises(FormatError, match=r"part-0000/part\.json: 'offsets\.npy' leads outside .*part-0000"):
        open_part(part)
    assert any("offsets.npy" in problem for problem in verify(extraction))


def test_a_hook_on_a_module_named_like_a_block_is_stored_and_read(extraction, tmp_path):
    """tensor_file took every name starting with "layer_" for a block's: a hook on a module named
    layer_norm crashed the writer and every reader with int()'s bare ValueError ('norm:output')."""
    hook = "layer_norm:output"
    source = open_part(extraction / "part-0000")
    values = np.arange(source.info.n_tokens * 4, dtype=np.float32).reshape(-1, 4)
    with write_part(tmp_path / "hooked" / "part-0000") as tmp:
        writer = PartWriter(tmp, list(source.samples), source.offsets)
        for name, width in ((*source.tensor_names, 8), (hook, 4)):
            writer.add_tokens(tensor_file(name), width, "float32")
        for local in range(source.info.n_samples):
            rows = source.sample_slice(local)
            writer.write(tensor_file("layer_0"), local, np.ascontiguousarray(source.tensor("layer_0")[rows]))
            writer.write(tensor_file(hook), local, np.ascontiguousarray(values[rows]))
        meta = {key: source.meta[key] for key in source.meta if key not in ("files", "n_samples", "n_tokens")}
        writer.finish({**meta, "tensors": [*source.tensor_names, hook], "hooks": [hook]})
    part = open_part(tmp_path / "hooked" / "part-0000")
    part.verify()
    assert tensor_file(hook) == "hook-layer_norm-output.npy"
    np.testing.assert_array_equal(part.tensor(hook)[:], values)
    np.testing.assert_array_equal(part.tensor("layer_0")[:], source.tensor("layer_0")[:])
