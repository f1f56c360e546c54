"""Numbers whose YAML 1.1 reading (PyYAML, as Snakemake and actstore read a config) differs from what
YAML 1.2 and Python read: a zero-padded 010 is octal 8, 1:30 is base 60 (90). Refused, naming the file
and line, by load_config and by the Snakefile's parse; the spellings that read the same pass."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import tiny
from actstore.config import check_yaml_numbers, load_config
from actstore.errors import ConfigError

REPO = tiny.REPO
DEMO = REPO / "config" / "config.yaml"


def demo_text(dump_to: Path) -> str:
    """The demo config's text, runnable from any directory: dump_to in tmp, the dataset path absolute."""
    dataset = yaml.safe_load(DEMO.read_text())["dataset"]["path"]
    return (DEMO.read_text().replace("dump_to: results", f"dump_to: {dump_to}", 1)
            .replace(f"path: {dataset}", f"path: {REPO / dataset}", 1))


def edited_demo(tmp_path: Path, old: str, new: str) -> tuple[Path, int]:
    """The demo config with `old` replaced by `new`, and the (1-based) line `new` is on."""
    text = demo_text(tmp_path / "dump")
    assert old in text
    text = text.replace(old, new, 1)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path, text.splitlines().index(next(line for line in text.splitlines() if new in line)) + 1


def test_zero_padded_layers_are_refused_naming_the_file_line_and_octal_value(tmp_path):
    path, line = edited_demo(tmp_path, "layers: [1, 3, 5]", "layers: [1, 3, 010]")
    with pytest.raises(ConfigError, match=rf"^{path}, line {line}: 010 has a leading zero, so YAML 1.1 .* "
                                          r"reads it as octal 8; write it without the leading zero, or quote it"):
        load_config(path)


@pytest.mark.parametrize("spelling, reading", [
    ("-07", "octal -7"), ("+010", "octal 8"), ("0_10", "octal 8"), ("00", "octal 0"),
    ("1:30", "base 60 .* as 90"), ("1:30.5", "base 60 .* as 90.5")])
def test_every_yaml11_octal_or_base_60_spelling_is_refused(tmp_path, spelling, reading):
    path, line = edited_demo(tmp_path, "batch_size: 32", f"batch_size: {spelling}")
    with pytest.raises(ConfigError, match=rf"line {line}: {re.escape(spelling)} .*{reading};"):
        load_config(path)


def test_numbers_that_read_the_same_in_yaml_1_1_1_2_and_python_pass(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(demo_text(tmp_path / "dump")
                    .replace("layers: [1, 3, 5]", "layers: [0, -3]").replace("batch_size: 32", "batch_size: 0x10")
                    .replace("steps: 300", "steps: 1_000").replace("lr: 0.002", "lr: 1.5e-3")
                    .replace("budgets: [0, 8, 32, 128]", "budgets: [0, 10, 0b101]")
                    .replace("dead_tokens: 20000", "dead_tokens: 20000\n  aux_coef: 00.5"))
    loaded = load_config(path)
    assert loaded["extract"]["layers"] == [0, 3] and loaded["extract"]["batch_size"] == 16
    assert loaded["sae"]["steps"] == 1000 and loaded["sae"]["lr"] == 0.0015 and loaded["lut"]["budgets"] == [0, 10, 5]
    assert loaded["sae"]["aux_coef"] == 0.5  # a leading zero before a decimal point reads as decimal


def test_a_quoted_zero_padded_string_is_text(tmp_path):
    path, _ = edited_demo(tmp_path, "name: python-stdlib-docstrings", "name: '010'")
    assert load_config(path)["dataset"]["name"] == "010"
    check_yaml_numbers([path])


def test_every_shipped_config_passes():
    shipped = sorted((REPO / "config").glob("*.yaml"))
    assert DEMO in shipped
    check_yaml_numbers(shipped)
    load_config(DEMO)


def test_a_json_config_snakemake_reads_is_checked_as_json(tmp_path):
    """Snakemake reads a --configfile as JSON first; tab-indented JSON is not YAML 1.1, and JSON's
    numbers read one way (it has no leading zeros)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(yaml.safe_load(DEMO.read_text()), indent="\t"))
    with pytest.raises(yaml.YAMLError):
        yaml.safe_load(path.read_text())
    check_yaml_numbers([path])


@pytest.mark.parametrize("old, new, read", [("steps: 300", "steps: 0300", "octal 192"),
                                            ("name: python-stdlib-docstrings", "name: 010", "octal 8")])
def test_the_snakefile_refuses_a_zero_padded_number_before_any_job(tmp_path, old, new, read):
    """A dry run on the demo config with `steps: 0300` would plan an SAE of 192 steps; `name: 010`
    would be Snakemake's schema error about an 8, not a word about the 010 written."""
    path, line = edited_demo(tmp_path, old, new)
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-s", str(REPO / "Snakefile"), "-d", str(tmp_path),
           "--configfile", str(path), "--cores", "1", "-n"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    written = new.split(": ")[1]
    assert f"{path}, line {line}: {written} has a leading zero, so YAML 1.1" in output and read in output
