"""`actstore verify` of an extraction checks extract.json's model_files record against its parts'.

Every Snakefile parse compares the model folder with that record (model_identity), and an extraction
the library wrote (run_part, write_index) has no stage config whose seal would vouch for it."""
from __future__ import annotations

import json
import shutil

import pytest

import tiny
from actstore.extract import run_part
from actstore.formats.extract import INDEX, PART_META, verify, write_index
from actstore.model_identity import MODEL_FILES_KEY

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def library_extraction(model_dir, text_jsonl, tmp_path_factory):
    """An extraction in a folder of the user's own (no stage config), indexed with its model's files."""
    model = model_dir("bert")
    tmp = tmp_path_factory.mktemp("verify-model-files")
    config = tiny.make_config(tmp, model, text_jsonl)
    out = tmp / "extraction"
    for part in range(config["extract"]["parts"]):
        run_part(config, part, out / f"part-{part:04d}", progress=False)
    write_index(out, out / INDEX, model)
    return out


@pytest.fixture
def extraction(library_extraction, tmp_path):
    return shutil.copytree(library_extraction, tmp_path / "extraction")


def rewrite_index(extraction, change) -> None:
    index = json.loads((extraction / INDEX).read_text())
    change(index)
    (extraction / INDEX).write_text(json.dumps(index))


def test_the_record_write_index_made_passes(extraction):
    assert WEIGHTS in json.loads((extraction / INDEX).read_text())[MODEL_FILES_KEY]
    assert verify(extraction) == []


def test_an_index_written_without_the_model_folder_passes(extraction):
    """write_index records the files only when given the folder to hash them from."""
    rewrite_index(extraction, lambda index: index.pop(MODEL_FILES_KEY))
    assert verify(extraction) == []


SHAPE = "model_files is not a map of file names to their bytes, mtime_ns and sha256 (64 hex digits)"


def with_entry(files: dict, **fields) -> dict:
    """`files` with the weights' entry given `fields` (None: without it)."""
    entry = {key: value for key, value in {**files[WEIGHTS], **fields}.items() if value is not None}
    return {**files, WEIGHTS: entry}


@pytest.mark.parametrize("damage, named", [
    (lambda files: [files[WEIGHTS]], SHAPE),
    (lambda files: with_entry(files, mtime_ns=None), SHAPE),
    (lambda files: with_entry(files, sha256="0" * 63), SHAPE),
    (lambda files: with_entry(files, sha256=files[WEIGHTS]["sha256"].upper()), SHAPE),
    (lambda files: with_entry(files, bytes=files[WEIGHTS]["bytes"] + 1), f"model_files['{WEIGHTS}'] = {{'bytes': "),
    (lambda files: with_entry(files, mtime_ns=files[WEIGHTS]["mtime_ns"] - 10**9),
     f"model_files['{WEIGHTS}'] = {{'bytes': "),
    (lambda files: {name: entry for name, entry in files.items() if name != WEIGHTS},
     f"model_files['{WEIGHTS}'] missing, but the parts loaded it"),
    (lambda files: {**files, "extra.bin": files[WEIGHTS]}, "model_files['extra.bin'] listed, but no part loaded it"),
], ids=["not-a-map", "no-mtime", "short-sha256", "uppercase-sha256", "other-size", "other-mtime", "left-out", "added"])
def test_a_damaged_record_is_named(extraction, damage, named):
    """Wrong shape, a sha256 that no hexdigest gives, a size or mtime the parts did not record, a file
    they loaded left out or one they did not added: one problem naming extract.json and the file (before:
    verify passed every one)."""
    rewrite_index(extraction, lambda index: index.update({MODEL_FILES_KEY: damage(index[MODEL_FILES_KEY])}))
    problems = verify(extraction)
    assert len(problems) == 1 and problems[0].startswith(f"{extraction / INDEX}: {named}"), problems


def test_a_record_the_parts_do_not_have_is_named(extraction):
    """Parts of a release that recorded no model files, under an index claiming some."""
    record = json.loads((extraction / INDEX).read_text())[MODEL_FILES_KEY]
    for part_json in sorted(extraction.glob(f"part-*/{PART_META}")):
        meta = json.loads(part_json.read_text())
        del meta[MODEL_FILES_KEY]
        part_json.write_text(json.dumps(meta))
    write_index(extraction, extraction / INDEX)
    rewrite_index(extraction, lambda index: index.update({MODEL_FILES_KEY: record}))
    assert verify(extraction) == [f"{extraction / INDEX}: {MODEL_FILES_KEY} recorded, but "
                                  f"{extraction / 'part-0000' / PART_META} records none"]
