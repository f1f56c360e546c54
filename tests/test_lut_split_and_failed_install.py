"""Review 61 of the lut stage and the LUT runtime, on a real tiny BERT, a trained SAE and LUT stores
written by the project's own writers: the held-out split the SAE recorded, and a model left as it was
when installing fails."""
from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
import torch
from torch import nn

from actstore import lut_runtime
from actstore.errors import ConfigError
from actstore.formats import lut as lut_format
from actstore.lut import heldout_inputs
from actstore.lut_runtime import install_luts
from actstore.models import get_module
from actstore.sae import REPORT_FILE, split_tokens
from actstore.formats.extract import open_extraction
from test_lut import TARGETS, built, model  # noqa: F401 (fixtures)


def test_a_config_whose_split_differs_from_the_sae_stages_is_refused(built, tmp_path):
    """The lut stage recomputed the SAE's held-out split from its own config: one whose sae.seed (or
    heldout_fraction) differs from the SAE stage's (build_lut called on another stage's SAE) evaluated
    the tables on tokens the SAE trained on, silently. The SAE report records the held-out samples."""
    config, extract_dir, sae_dir = built[0], built[1], built[2]
    shutil.copy(sae_dir / REPORT_FILE, tmp_path / REPORT_FILE)
    other = copy.deepcopy(config)
    other["sae"]["seed"] = config["sae"]["seed"] + 1
    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    recorded = json.loads((sae_dir / REPORT_FILE).read_text())["heldout_samples"]
    assert split_tokens(extraction, other["sae"]["heldout_fraction"], other["sae"]["seed"]).heldout_samples != recorded
    with pytest.raises(ConfigError, match=f"{re.escape(str(tmp_path / REPORT_FILE))}: heldout_samples"):
        heldout_inputs(other, extract_dir, tmp_path)
    assert heldout_inputs(config, extract_dir, tmp_path)[1] == recorded  # the SAE stage's own config passes


def test_a_failed_calibration_leaves_the_model_as_it_was(built, model, monkeypatch):
    """install_luts promises an error leaves the model as it was, but it replaced the targets before
    runtime auto's calibration: one failing there (out of memory on the GPU timing 2048 tokens, a
    Triton compile error) left every target a LutLinear with no crossover, a model whose next forward
    raised and whose second install_luts refused the targets as not nn.Linear."""
    store = lut_format.open_lut(built[3] / "lut")
    x = torch.randint(0, 100, (1, 7))
    with torch.inference_mode():
        before = model(input_ids=x).last_hidden_state

    def failing(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")  # what a real device raises there
    monkeypatch.setattr(lut_runtime, "calibrate", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        install_luts(model, store, runtime="auto")
    assert all(type(get_module(model, target)) is nn.Linear for target in TARGETS)
    with torch.inference_mode():
        assert torch.equal(model(input_ids=x).last_hidden_state, before)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_dtype_the_runtime_cannot_compute_in_is_refused_at_install(built, model, dtype):
    """install_luts took any floating dtype for its tables: float8_e5m2 installed and the model's next
    forward failed in torch ("add_stub" not implemented), float8_e4m3fn failed in the overflow check
    ("isinf" not implemented), neither naming the argument."""
    store = lut_format.open_lut(built[3] / "lut")
    with pytest.raises(ConfigError, match=re.escape(f"lut dtype {dtype!r}")):
        install_luts(model, store, dtype=dtype)
    assert all(type(get_module(model, target)) is nn.Linear for target in TARGETS)
