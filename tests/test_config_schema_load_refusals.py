"""Config values the schema passed that a job refused only once it ran, after its wait in the queue
(or, for lut.targets, after the extraction's GPU hours): now refused at load."""
from __future__ import annotations

import copy
import re

import pytest
import torch

from actstore.config import validate_config
from actstore.errors import ConfigError

BASE = {"dump_to": "dump", "model": {"path": "model"}, "dataset": {"path": "docs.jsonl"},
        "extract": {"layers": [0], "hooks": ["a.c:input"]}}


def config_with(**sections: dict) -> dict:
    config = copy.deepcopy(BASE)
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    return config


def torch_takes(name: str) -> bool:
    try:
        torch.device(name)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("section", ["extract", "sae", "lut"])
@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12", "cpu:0", "mps", "xpu:1",
                                  "gpu", "cuda0", "CUDA", "cuda:01", "cuda: 0", "cuda:-1", " cuda", "cuda:", ""])
def test_a_device_is_refused_at_load_exactly_when_torch_refuses_its_name(section, name):
    """A typo (gpu, cuda0) passed the schema and was refused by models.named_device in the job; the
    schema takes what torch.device takes, no less, so no working device is refused."""
    config = config_with(**{section: {"device": name}})
    if torch_takes(name):
        assert validate_config(config)[section]["device"] == name
    else:
        with pytest.raises(ConfigError, match=f"{section}/device: {re.escape(repr(name))} does not match"):
            validate_config(config)


def test_device_auto_is_the_default_and_takes_no_index():
    assert {validate_config(config_with())[s]["device"] for s in ("extract", "sae", "lut")} == {"auto"}
    with pytest.raises(ConfigError, match="extract/device: 'auto:0' does not match"):
        validate_config(config_with(extract={"device": "auto:0"}))


@pytest.mark.parametrize("where", [("dump_to",), ("model", "path"), ("dataset", "path"),
                                   ("saev", "patch_labels", "masks"), ("sae", "import", "path")])
def test_an_empty_path_is_refused_at_load(where):
    """"" is the working directory to Path: masks passed the Snakefile's is_dir check, and an empty
    sae.import.path read the working directory's sae_weights.safetensors (saelens) or stopped the
    Snakefile's parse on a bare ValueError (saev)."""
    config = config_with(saev={"patch_labels": {"masks": "masks"}},
                         sae={"enabled": True, "import": {"path": "sae.safetensors", "style": "saev"}},
                         lut={"targets": ["a.q"]})
    validate_config(copy.deepcopy(config))
    *sections, key = where
    holder = config
    for section in sections:
        holder = holder[section]
    holder[key] = ""
    with pytest.raises(ConfigError, match=f"{'/'.join(where)}: '' should be non-empty"):
        validate_config(config)


def test_no_lut_targets_is_refused_at_load_when_the_lut_stage_runs():
    """Refused by the sae job only (before it trains), after the extraction."""
    with pytest.raises(ConfigError, match="lut.targets is empty while sae.enabled and lut.enabled are true"):
        validate_config(config_with(sae={"enabled": True}))
    for sections in ({"sae": {"enabled": True}, "lut": {"enabled": False}}, {"sae": {"enabled": False}},
                     {"sae": {"enabled": True}, "lut": {"targets": ["a.q"]}}):
        validate_config(config_with(**sections))
