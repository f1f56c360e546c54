"""Review: the extraction intermediate's index rebuilt over parts made again, part.json's format keys
as the writer's own, and hook file names split as the capture splits hook specs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actstore.extract.capture import parse_hook
from actstore.formats.extract import (FORMAT_NAME, FORMAT_VERSION, PartWriter, open_part, synthetic_extraction,
                                      tensor_file, verify, write_index, write_part)


def test_an_index_is_rebuilt_over_parts_made_again_with_another_part_count(tmp_path):
    """write_index counted the parts from the extract.json it was replacing: an extraction made again
    with 3 parts where one of 2 had been (synthetic_extraction, or write_index after a rerun) was
    refused, part 0 blamed for saying 3 parts "in an extraction of 2 parts"."""
    root = synthetic_extraction(tmp_path / "extract", 4_000, 2, 8, [0], tokens=(3, 5))
    synthetic_extraction(root, 4_000, 3, 8, [0], tokens=(3, 5))
    index = json.loads((root / "extract.json").read_text())
    assert [entry["dir"] for entry in index["parts"]] == ["part-0000", "part-0001", "part-0002"]
    assert index["n_samples"] == sum(entry["n_samples"] for entry in index["parts"])
    assert verify(root) == []


def _rewrite_part(source_dir: Path, out_dir: Path, meta: dict) -> dict:
    """Write `source_dir`'s part again with PartWriter, finished with `meta`."""
    source = open_part(source_dir)
    with write_part(out_dir) as tmp:
        writer = PartWriter(tmp, list(source.samples), source.offsets)
        writer.add_tokens(tensor_file("layer_0"), 8, "float32")
        for local in range(source.info.n_samples):
            writer.write(tensor_file("layer_0"), local,
                         np.ascontiguousarray(source.tensor("layer_0")[source.sample_slice(local)]))
        return writer.finish(meta)


def test_a_part_copying_another_parts_format_keys_is_written_as_this_format(tmp_path):
    """finish put the caller's meta over the writer's format and version: a part rewritten with the
    meta of a version-1 part (plain sha256) claimed version 1 over its tree hashes, and one given
    another format name was written, then refused by every reader as not an extraction part."""
    root = synthetic_extraction(tmp_path / "extract", 2_000, 1, 8, [0], tokens=(3, 5))
    source = open_part(root / "part-0000")
    meta = {key: value for key, value in source.meta.items() if key not in ("files", "n_samples", "n_tokens")}
    written = _rewrite_part(root / "part-0000", tmp_path / "again" / "part-0000",
                            {**meta, "format": "actstore-part-old", "version": 1})
    on_disk = json.loads((tmp_path / "again" / "part-0000" / "part.json").read_text())
    assert (written["format"], written["version"]) == (on_disk["format"], on_disk["version"]) == (
        FORMAT_NAME, FORMAT_VERSION)
    open_part(tmp_path / "again" / "part-0000").verify()


@pytest.mark.parametrize("spec", ["blocks.a:b:output", "blocks.a:b:input", "x::output", "layer_norm:output",
                                  "encoder.layer.0:output"])
def test_a_hook_file_is_named_by_the_module_path_the_capture_hooks(spec):
    """tensor_file split a hook spec at its first ':', parse_hook at its last: a module path holding a
    ':' (a ModuleDict key "a:b") was hooked as module "blocks.a:b" but stored as hook-blocks.a-b:output.npy,
    another module path and an io of "b:output"."""
    module_path, io = parse_hook(spec)
    assert tensor_file(spec) == f"hook-{module_path}-{io}.npy"
