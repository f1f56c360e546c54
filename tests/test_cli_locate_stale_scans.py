"""Review 65, adversarial second review of the session's changes (git diff 47d7f83 HEAD): the faults it
found, on real files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tiny
from actstore import integrity
from actstore.config import load_config
from actstore.datasets import scan_dataset, write_scan
from actstore.hashing import stage_dir

ACTSTORE = str(Path(sys.executable).with_name("actstore"))


# ---------------------------------------------------------------- LUT keys as full module paths

def test_a_full_checkpoint_path_lut_target_on_a_bare_base_model_resolves(model_dir):
    """`bert.encoder...` (the checkpoint's spelling) on the bare BertModel AutoModel loads: the scan job's
    check accepts it, and the LUT key is the module's path in that model. (module_full_path returned
    '.bert.encoder...', and the sae job, after every part, raised `BertModel has no attribute ''`.)"""
    from actstore.extract.run import check_hooks
    from actstore.lut import target_linears
    from actstore.model_config import resolve_model_path
    from actstore.models import get_module, model_skeleton

    skeleton = model_skeleton(resolve_model_path(str(model_dir("bert"))))
    full = "bert.encoder.layer.0.attention.self.query"
    assert skeleton.base_model is skeleton and skeleton.base_model_prefix == "bert"
    linear = get_module(skeleton, full, "lut.targets")  # the scan job's check accepts the path
    assert linear is skeleton.encoder.layer[0].attention.self.query
    hook = "encoder.layer.0.attention.self.query:input"
    config = tiny.make_config(Path("/tmp"), model_dir("bert"), "/tmp/none.jsonl",
                              extract={"hooks": [hook]}, sae={"enabled": True, "hook": hook}, lut={"targets": [full]})
    check_hooks(config)  # the dataset scan job: no error
    linears = target_linears(skeleton, [full], linear.in_features)  # the sae job's check_targets_before_training
    assert list(linears) == ["encoder.layer.0.attention.self.query"]


# ---------------------------------------------------------------- actstore locate: stale

def _finished_extract(tmp_path: Path) -> tuple[dict, Path, Path]:
    """(config, config file, extract dir) of a finished (stand-in) extraction of a one-row JSONL file, its
    dataset_scan.json written by write_scan (sealed), as test_cli's locate tests make it."""
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "a"}\n{"text": "b"}\n')
    config = {"dump_to": str(tmp_path / "dump"), "model": {"path": str(tmp_path / "model")},
              "dataset": {"path": str(data)}, "extract": {"layers": [0, 2]}}
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    extract = stage_dir(load_config(configfile), "extract")
    extract.mkdir(parents=True)
    write_scan(scan_dataset(str(data)), extract / "dataset_scan.json")
    for name in ("extract.json", integrity.STAGE_CONFIG_FILE):
        (extract / name).write_text("{}")
    return config, configfile, extract


def _locate(configfile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ACTSTORE, "locate", "--configfile", str(configfile), *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("json_out", [False, True])
def test_locate_lists_the_stages_of_an_extraction_whose_scan_was_edited(tmp_path, json_out):
    """An edited dataset_scan.json (its seal no longer matches): locate lists the stages, calling the
    extraction stale and naming the scan. (Its FormatError escaped: exit 2, no stage listed.)"""
    _, configfile, extract = _finished_extract(tmp_path)
    scan = json.loads((extract / "dataset_scan.json").read_text())
    scan["n_samples"] = 1  # well formed; the seal no longer matches
    (extract / "dataset_scan.json").write_text(json.dumps(scan))
    proc = _locate(configfile, *(["--json"] if json_out else []))
    assert proc.returncode == 0, proc.stderr
    assert str(extract) in proc.stdout
    if not json_out:
        assert "(done, stale)" in proc.stdout and f"stale: {extract / 'dataset_scan.json'}: edited" in proc.stdout


def test_locate_does_not_call_an_extraction_stale_where_its_data_is_not_at_hand(tmp_path):
    """The data not on this machine (a dump_to looked at elsewhere): nothing to compare, as for the model
    folder. (It was `done, stale` with the data's absence as the reason.)"""
    config, configfile, extract = _finished_extract(tmp_path)
    Path(config["dataset"]["path"]).rename(tmp_path / "elsewhere.jsonl")
    proc = _locate(configfile)
    assert proc.returncode == 0, proc.stderr
    assert f"{extract}  (done)\n" in proc.stdout and "stale" not in proc.stdout, proc.stdout
