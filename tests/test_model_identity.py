"""An extraction records the model files it loaded; weights later saved over the same folder are named
at the next parse instead of the old activations standing for them (a model is named by its path)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tiny
from actstore.errors import ConfigError, FormatError
from actstore.extract import run_part
from actstore.formats.extract import open_extraction, write_index
from actstore.hashing import stage_dir
from actstore.model_identity import check_model_unchanged


def copied_model(model_dir, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir("bert"), tmp_path / "model"))


def new_weights(model: Path) -> None:
    """Other bytes of the same size, a new mtime: a fine-tune saved over its base (the last byte of
    the safetensors data region, so the file still loads)."""
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))


def extract(config: dict, model: Path) -> Path:
    out = stage_dir(config, "extract")
    for part in range(config["extract"]["parts"]):
        run_part(config, part, out / f"part-{part:04d}", progress=False)
    write_index(out, out / "extract.json", model)
    return out


@pytest.fixture
def extraction(model_dir, text_jsonl, tmp_path):
    model = copied_model(model_dir, tmp_path)
    config = tiny.make_config(tmp_path, model, text_jsonl)
    return model, extract(config, model)


def test_the_index_records_the_bytes_of_every_model_file_the_parts_loaded(extraction):
    model, out = extraction
    recorded = (open_extraction(out).parts[0].meta["model_files"],
                json.loads((out / "extract.json").read_text())["model_files"])
    names = sorted(p.name for p in model.iterdir() if p.suffix in (".json", ".safetensors", ".txt"))
    assert sorted(recorded[0]) == sorted(recorded[1]) == names and "model.safetensors" in names
    for name, entry in recorded[1].items():
        assert entry["sha256"] == hashlib.sha256((model / name).read_bytes()).hexdigest()
        assert entry["bytes"] == (model / name).stat().st_size == recorded[0][name]["bytes"]
    check_model_unchanged(model, out)


def test_weights_saved_over_the_folder_are_named(extraction):
    model, out = extraction
    new_weights(model)
    with pytest.raises(ConfigError, match=r"model.safetensors has other bytes.*model.revision"):
        check_model_unchanged(model, out)


def test_a_copy_that_kept_the_bytes_passes(extraction):
    model, out = extraction
    for path in model.iterdir():
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    check_model_unchanged(model, out)


@pytest.mark.parametrize("change, named", [
    (lambda model: (model / "pytorch_model.bin").write_bytes(b"weights"), "pytorch_model.bin is new"),
    (lambda model: (model / "tokenizer.json").unlink(), "tokenizer.json is gone"),
    (lambda model: (model / "config.json").write_text((model / "config.json").read_text() + " "),
     "config.json has other bytes")])
def test_a_model_file_new_gone_or_edited_is_named(extraction, change, named):
    model, out = extraction
    change(model)
    with pytest.raises(ConfigError, match=named):
        check_model_unchanged(model, out)


def test_a_readme_added_to_the_folder_changes_nothing(extraction):
    model, out = extraction
    (model / "README.md").write_text("fine-tuned on ...\n")
    check_model_unchanged(model, out)


def test_parts_that_loaded_other_weights_are_refused(model_dir, text_jsonl, tmp_path):
    model = copied_model(model_dir, tmp_path)
    config = tiny.make_config(tmp_path, model, text_jsonl)
    out = stage_dir(config, "extract")
    run_part(config, 0, out / "part-0000", progress=False)
    new_weights(model)
    run_part(config, 1, out / "part-0001", progress=False)
    with pytest.raises(FormatError, match=r"part-0001/part.json: model_files differs"):
        write_index(out, out / "extract.json", model)


def test_the_index_refuses_a_folder_changed_after_the_parts(model_dir, text_jsonl, tmp_path):
    model = copied_model(model_dir, tmp_path)
    config = tiny.make_config(tmp_path, model, text_jsonl)
    out = stage_dir(config, "extract")
    for part in range(config["extract"]["parts"]):
        run_part(config, part, out / f"part-{part:04d}", progress=False)
    new_weights(model)
    with pytest.raises(ConfigError, match="model.safetensors has other bytes since the extraction's parts"):
        write_index(out, out / "extract.json", model)
    assert not (out / "extract.json").exists()


def test_a_damaged_record_is_named(extraction):
    model, out = extraction
    index = out / "extract.json"
    index.write_text(index.read_text().replace('"sha256"', '"sha"'))
    with pytest.raises(ConfigError, match="extract.json: model_files is not a map"):
        check_model_unchanged(model, out)


def test_snakemake_stops_at_the_parse_when_the_weights_were_replaced(model_dir, text_jsonl, tmp_path):
    """The real workflow: extract, save other weights over the folder, and the next run names the
    file instead of finding nothing to do."""
    model = copied_model(model_dir, tmp_path)
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"parts": 1})
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-s", str(tiny.REPO / "Snakefile"), "-d",
           str(tmp_path), "--configfile", str(configfile), "--cores", "2", "extract"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    new_weights(model)
    stopped = subprocess.run([*cmd, "-n"], capture_output=True, text=True, timeout=300)
    assert stopped.returncode != 0 and "model.safetensors has other bytes" in stopped.stdout + stopped.stderr


def test_a_recorded_name_outside_the_folder_is_never_read(extraction, tmp_path):
    """A name in extract.json is compared with the folder's own listing, never opened: '../x' is gone."""
    model, out = extraction
    (tmp_path / "outside.json").write_text("{}")
    index = out / "extract.json"
    data = json.loads(index.read_text())
    data["model_files"]["../outside.json"] = {"bytes": 2, "mtime_ns": 0, "sha256": "0" * 64}
    index.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"\.\./outside.json is gone"):
        check_model_unchanged(model, out)
