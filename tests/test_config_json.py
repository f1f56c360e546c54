"""load_config reads a config file as Snakemake reads a configfile: JSON first, then YAML."""
from __future__ import annotations

import json
import re

import pytest
import yaml
from snakemake.common.configfile import load_configfile

import tiny
from actstore.config import load_config, validate_config
from actstore.errors import ConfigError

DEMO = tiny.REPO / "config" / "config.yaml"


@pytest.mark.parametrize("indent", [2, "\t"])
def test_a_json_config_reads_as_snakemake_reads_it(tmp_path, indent):
    """The demo as JSON with its learning rate spelled 2e-3 (a float to JSON, text to YAML 1.1), indented
    with spaces or tabs (which YAML refuses): load_config gives what Snakemake's reader gives, and what the
    YAML demo gives (before: ConfigError "'2e-3' is not of type 'number'", or not valid YAML for tabs)."""
    text = json.dumps(yaml.safe_load(DEMO.read_text()), indent=indent)
    assert '"lr": 0.002' in text
    path = tmp_path / "config.json"
    path.write_text(text.replace('"lr": 0.002', '"lr": 2e-3'))
    config = load_config(path)
    assert config == validate_config(load_configfile(str(path)))
    assert config == load_config(DEMO)


def test_a_yaml_config_still_reads_an_exponent_without_a_dot_as_text(tmp_path):
    """YAML 1.1, as Snakemake reads a YAML file: `lr: 2e-3` is text, which the schema refuses."""
    path = tmp_path / "config.yaml"
    path.write_text(DEMO.read_text().replace("lr: 0.002", "lr: 2e-3"))
    assert load_configfile(str(path))["sae"]["lr"] == "2e-3"
    with pytest.raises(ConfigError, match=re.escape("invalid config at sae/lr: '2e-3' is not of type 'number'")):
        load_config(path)


@pytest.mark.parametrize("layers", ["[010, 011]", "[1:30]"])
def test_a_file_that_is_not_json_still_refuses_yaml11_numbers(tmp_path, layers):
    """JSON has no leading zero or base 60, so such a file is YAML to Snakemake too, and refused naming
    the file and line whether it is written in block or in flow (JSON-like) style."""
    for name, text in [("block.yaml", f"extract:\n  layers: {layers}\n"),
                       ("flow.json", f'{{"extract": {{"layers": {layers}}}}}')]:
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(str(path)) + r", line \d+: (010|1:30) "):
            load_config(path)


def test_a_file_neither_json_nor_yaml_is_named_with_both_errors(tmp_path):
    """Snakemake tries JSON then YAML: the error names the file and where each parse stopped."""
    path = tmp_path / "config.json"
    path.write_text('{"model": {"path": "m"},\n "extract": {"layers": [1, 2,, 3]}}')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: not valid YAML (")
    assert f'in "{path}", line 2, column' in message
    assert message.endswith("nor JSON (line 2, column 30: Expecting value)")
