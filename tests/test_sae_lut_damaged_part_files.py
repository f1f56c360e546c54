"""Review 66: the sae and lut stages check the extraction part files they read against part.json's sha256
(PartsCheck, as every format writer does) before their outputs are renamed into place: an SAE trained,
imported or turned into tables from a part damaged after extraction (a bit a disk flipped) is refused,
naming the file, where it was written from the damaged values and verified OK."""
from __future__ import annotations

import copy
import time

import numpy as np
import pytest

import tiny

from actstore.errors import FormatError
from actstore.formats import extract as ex
from actstore.formats.extract import open_extraction, tensor_file
from actstore.lut import build_lut
from actstore.sae import build_sae, split_tokens

HOOK = "encoder.layer.1.attention.self.query:input"
SAE = {"num_basis": 64, "k_active": 4, "steps": 20, "batch_size": 64, "lr": 0.003, "dead_tokens": 2000,
       "device": "cpu"}
LUT = {"targets": [f"encoder.layer.1.attention.self.{m}" for m in ("query", "key", "value")], "budgets": [0, 8],
       "eval_samples": 8, "device": "cpu"}


@pytest.fixture(scope="module")
def trained(extracted, tmp_path_factory):
    """(config, extract_dir, sae_dir): an SAE trained on an undamaged tiny BERT extraction of 2 parts."""
    config, extract_dir = extracted("bert", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    config["sae"].update(SAE)
    config["lut"].update(LUT)
    sae_dir = tmp_path_factory.mktemp("sae")
    build_sae(config, extract_dir, sae_dir, progress=False)
    return config, extract_dir, sae_dir


def heldout_part(config, extract_dir) -> str:
    """The directory name of a part holding held-out tokens (the ones an import and the lut evaluate)."""
    extraction = open_extraction(extract_dir)
    split = split_tokens(extraction, config["sae"]["heldout_fraction"], config["sae"]["seed"])
    return next(part.dir.name for part, rows in zip(extraction.parts, split.heldout) if len(rows))


def written(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) if directory.exists() else []


def test_sae_training_refuses_a_damaged_hook_file_naming_it(trained, tmp_path):
    """One bit of part 1's hook file flipped: the training reads it, so the stage refuses it and writes no
    sae.safetensors, saelens/ nor report.json (it trained and wrote an SAE of the damaged value)."""
    config, extract_dir, _ = trained
    bad = f"part-0001/{tensor_file(HOOK)}"
    copy_dir = tiny.damaged_copy(extract_dir, tmp_path, bad)
    out = tmp_path / "sae"
    with pytest.raises(FormatError, match=f"{bad}: sha256_tree differs from .*part.json: refused to write"):
        build_sae(config, copy_dir, out, progress=False)
    assert written(out) == []


def test_sae_import_refuses_a_damaged_file_it_evaluates_on(trained, tmp_path):
    """An imported SAE is evaluated on held-out tokens: a flipped bit in a part holding some is refused
    before the stage's files are written (its held-out FVU came from the damaged value)."""
    config, extract_dir, sae_dir = trained
    bad = f"{heldout_part(config, extract_dir)}/{tensor_file(HOOK)}"
    copy_dir = tiny.damaged_copy(extract_dir, tmp_path, bad)
    imported = copy.deepcopy(config)
    imported["sae"]["import"] = {"path": str(sae_dir / "saelens"), "style": "saelens"}
    out = tmp_path / "imported"
    with pytest.raises(FormatError, match=f"{bad}: sha256_tree differs from .*part.json: refused to write"):
        build_sae(imported, copy_dir, out, progress=False)
    assert written(out) == []


def test_lut_refuses_a_damaged_hook_file_it_evaluates_on(trained, tmp_path):
    """The lut stage's relative errors read held-out hook rows: a flipped bit in a part holding some is
    refused, and neither lut/ nor report.json is left (the tables were renamed into place, the report
    written from the damaged rows)."""
    config, extract_dir, sae_dir = trained
    bad = f"{heldout_part(config, extract_dir)}/{tensor_file(HOOK)}"
    copy_dir = tiny.damaged_copy(extract_dir, tmp_path, bad)
    out = tmp_path / "lut"
    with pytest.raises(FormatError, match=f"{bad}: sha256_tree differs from .*part.json: refused to write"):
        build_lut(config, copy_dir, sae_dir, out, progress=False)
    assert written(out) == []


def test_lut_refuses_damaged_token_ids_it_runs_the_model_on(trained, tmp_path):
    """Sample 0's token ids (part 0) are the input of the check that the targets read the hook; one id
    changed by a flipped low bit (still a token of the vocabulary) is refused, naming token_ids.npy."""
    config, extract_dir, sae_dir = trained
    ids = np.load(extract_dir / "part-0000" / "token_ids.npy", mmap_mode="r")
    low_byte_of_first_id = ids.offset if ids.dtype.byteorder in "<=" else ids.offset + ids.itemsize - 1
    bad = "part-0000/token_ids.npy"
    copy_dir = tiny.damaged_copy(extract_dir, tmp_path, bad, flip_at=low_byte_of_first_id)
    out = tmp_path / "lut"
    with pytest.raises(FormatError, match=f"{bad}: sha256_tree differs from .*part.json: refused to write"):
        build_lut(config, copy_dir, sae_dir, out, progress=False)
    assert written(out) == []


def test_a_long_read_is_cut_as_soon_as_the_check_finds_a_damaged_file(trained, tmp_path):
    """PartsCheck.guarded: an SAE's steps (hours on a GPU) stop when the check finds the damage, not at
    their end: here an endless source, read slowly, stops with the check's FormatError within its first
    items (the tiny file is hashed in milliseconds; 60 s of items would be read without the guard)."""
    config, extract_dir, _ = trained
    bad = f"part-0001/{tensor_file(HOOK)}"
    copy_dir = tiny.damaged_copy(extract_dir, tmp_path, bad)
    part = open_extraction(copy_dir).parts[1]
    read = 0
    with pytest.raises(FormatError, match=f"{bad}: sha256_tree differs .*refused to write"):
        with ex.PartsCheck(ex.part_reads(part, [HOOK], samples=False)) as check:
            for _ in check.guarded(range(60_000)):
                read += 1
                time.sleep(0.001)
    assert read < 5_000


def test_a_read_error_of_the_check_cuts_a_long_read_too(trained, monkeypatch):
    """A disk's EIO while the check hashes a part file stops the guarded read then (as a differing file
    does), not after the SAE's steps: the error the hashing raised, as it is."""
    from actstore.formats.extract import read as extract_read

    _, extract_dir, _ = trained

    def eio(*_args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(extract_read, "listed_problem", eio)
    part = open_extraction(extract_dir).parts[1]
    read = 0
    with pytest.raises(OSError, match="Input/output error"):
        with ex.PartsCheck(ex.part_reads(part, [HOOK], samples=False)) as check:
            for _ in check.guarded(range(60_000)):
                read += 1
                time.sleep(0.001)
    assert read < 5_000
