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


def test_a_copy_that_kept_the_bytes_passes(extraction, caplog):
    """Hashed again and passed, and the log says how to stop hashing it at every run."""
    model, out = extraction
    for path in model.iterdir():
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    check_model_unchanged(model, out)
    assert "model.safetensors: its mtime moved since the extraction read it, its bytes did not" in caplog.text
    weights = model / "model.safetensors"
    advised = caplog.text.split(f"{weights}: ")[1].split("`touch -d @")[1].split("`")[0]
    subprocess.run(f"touch -d @{advised}", shell=True, check=True)  # pasted as given: it names the file
    assert weights.stat().st_mtime_ns == json.loads((out / "extract.json").read_text())["model_files"][
        "model.safetensors"]["mtime_ns"]


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
    with pytest.raises(FormatError, match=r"part-0001/part.json: model_files differ from .*part-0000/part.json's: "
                                          r"the model folder changed"):
        write_index(out, out / "extract.json", model)


def test_the_index_refuses_a_folder_changed_after_the_parts(model_dir, text_jsonl, tmp_path):
    model = copied_model(model_dir, tmp_path)
    config = tiny.make_config(tmp_path, model, text_jsonl)
    out = stage_dir(config, "extract")
    for part in range(config["extract"]["parts"]):
        run_part(config, part, out / f"part-{part:04d}", progress=False)
    new_weights(model)
    with pytest.raises(ConfigError, match="model.safetensors was written again or touched.* since the extraction"):
        write_index(out, out / "extract.json", model)
    assert not (out / "extract.json").exists()


def test_the_index_says_a_touched_weights_file_may_hold_its_bytes(model_dir, text_jsonl, tmp_path):
    """The parts record no sha256, so a touch (a scratch purge's refresh) between them and the index
    is refused without claiming other bytes the index never compared."""
    model = copied_model(model_dir, tmp_path)
    config = tiny.make_config(tmp_path, model, text_jsonl)
    out = stage_dir(config, "extract")
    for part in range(config["extract"]["parts"]):
        run_part(config, part, out / f"part-{part:04d}", progress=False)
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    with pytest.raises(ConfigError) as refused:
        write_index(out, out / "extract.json", model)
    assert "model.safetensors was written again or touched" in str(refused.value)
    assert "other bytes" not in str(refused.value)


def test_an_edited_chat_template_is_named(model_dir, text_jsonl, tmp_path):
    """chat_template.jinja, which the tokenizer loads (a chat dataset's tokens), is one of the model files."""
    model = tiny.add_chat_template(model_dir("gpt2"), tmp_path / "model")
    out = extract(tiny.make_config(tmp_path, model, text_jsonl), model)
    assert "chat_template.jinja" in json.loads((out / "extract.json").read_text())["model_files"]
    template = model / "chat_template.jinja"
    template.write_text(template.read_text().replace("{{", "{{ ", 1))
    with pytest.raises(ConfigError, match="chat_template.jinja has other bytes"):
        check_model_unchanged(model, out)


def test_a_damaged_record_is_named(extraction):
    model, out = extraction
    index = out / "extract.json"
    index.write_text(index.read_text().replace('"sha256"', '"sha"'))
    with pytest.raises(ConfigError, match="extract.json: model_files is not a map"):
        check_model_unchanged(model, out)


@pytest.mark.slow
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


def test_one_part_of_an_earlier_releases_extraction_can_be_made_again(model_dir, text_jsonl, tmp_path):
    """Parts written before model_files was recorded say nothing about the model: a part made again
    today beside them is not refused, and the index records no model files (nothing to compare)."""
    model = copied_model(model_dir, tmp_path)
    config = tiny.make_config(tmp_path, model, text_jsonl)
    out = extract(config, model)
    old = out / "part-0000" / "part.json"
    old.write_text(json.dumps({k: v for k, v in json.loads(old.read_text()).items() if k != "model_files"}))
    write_index(out, out / "extract.json", model)
    assert len(open_extraction(out).parts) == 2 and "model_files" not in json.loads((out / "extract.json").read_text())


def test_files_the_trainer_writes_beside_the_weights_change_nothing(extraction):
    """An evaluation run adding eval_results.json to the folder is no new weights."""
    model, out = extraction
    (model / "eval_results.json").write_text('{"eval_loss": 1.0}')
    (model / "training_args.bin").write_bytes(b"args")
    check_model_unchanged(model, out)


def test_a_new_file_of_the_users_own_says_to_move_it_out(extraction):
    model, out = extraction
    (model / "notes.txt").write_text("fine-tuned on ...\n")
    with pytest.raises(ConfigError, match=r"notes.txt is new \(if no loading reads it, a file of your own, move it"):
        check_model_unchanged(model, out)


def test_a_damaged_part_record_is_named(extraction):
    model, out = extraction
    meta = out / "part-0001" / "part.json"
    data = json.loads(meta.read_text())
    data["model_files"]["config.json"] = 5
    meta.write_text(json.dumps(data))
    with pytest.raises(FormatError, match=r"part-0001/part.json: model_files is not a map"):
        open_extraction(out)
