"""The lut stage's end-to-end evaluation runs each batch through the original model once, not once a
budget (its outputs do not depend on the budget): each budget's numbers, path counts and crossovers are
still its own."""
from __future__ import annotations

import copy

import pytest

import actstore.lut as lut_module
from actstore.lut import end_to_end
from actstore.models import get_module, load_model
from test_lut_heldout_and_padding_eval import random_lut

HOOK = "encoder.layer.1.attention.self.query:input"
TARGET = "encoder.layer.1.attention.self.query"
BUDGETS = [0, 8, 32]


@pytest.fixture
def setup(extracted, tmp_path):
    """(config, extract_dir, held-out samples, LUT root): 8 of the tiny BERT's held-out texts, in 2 batches."""
    from actstore.formats.extract import open_extraction
    from actstore.sae import split_tokens

    config, extract_dir = extracted("bert", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    config["sae"]["heldout_fraction"] = 0.5
    config["lut"].update({"eval_samples": 8, "device": "cpu"})
    heldout = split_tokens(open_extraction(extract_dir, config["extract"]["parts"]), 0.5,
                           config["sae"]["seed"]).heldout_samples
    lut = random_lut(load_model(config["model"]["path"]).model, TARGET, tmp_path)
    return config, extract_dir, heldout, lut


def run(setup, budgets: list[int]) -> tuple[dict, int, int]:
    """end_to_end on a fresh model (it installs the LUT in it): its result, the model's forwards and
    those of the original target (the original model's)."""
    config, extract_dir, heldout, lut = setup
    loaded = load_model(config["model"]["path"])
    forwards, originals = [], []
    loaded.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    get_module(loaded.model, TARGET).register_forward_hook(lambda *_: originals.append(1))
    return end_to_end(config, extract_dir, lut, loaded, heldout, budgets), len(forwards), len(originals)


def test_each_batch_runs_the_original_model_once_and_every_budget_reports_its_own_numbers(setup):
    """The original model ran once per batch and budget (4 budgets: 16 forwards where 10 suffice on the
    demo); each budget's statistics and path counts are those of end_to_end run at that budget alone."""
    result, forwards, originals = run(setup, BUDGETS)
    assert originals == 2 and forwards == originals * (1 + len(BUDGETS))
    assert list(result["budgets"]) == [str(budget) for budget in BUDGETS]
    for budget in BUDGETS:
        alone = run(setup, [budget])[0]
        assert result["budgets"][str(budget)] == alone["budgets"][str(budget)]  # the same floats, not close ones
    assert result["budgets"]["0"]["cosine_mean"] != result["budgets"]["32"]["cosine_mean"]
    assert all(by_budget["paths"] == {"lookup": 2, "dense": 0} for by_budget in result["budgets"].values())


def test_each_budget_runs_with_the_crossover_calibrated_at_it(setup, monkeypatch):
    """Every budget is calibrated before the batches, which then switch between budgets: each must run
    with its own crossover, not the last one calibrated. Measured times on a tiny model give one
    crossover at every budget, so budget 8's is made 0 (every call dense), the others' past any batch."""
    calibrate_auto = lut_module.calibrate_auto

    def calibrated(installed):
        tables = calibrate_auto(installed)
        for lut in installed.values():
            lut.crossover_tokens = 0 if lut.budget == 8 else 1 << 20
        return tables

    monkeypatch.setattr(lut_module, "calibrate_auto", calibrated)
    setup[0]["lut"]["runtime"] = "auto"
    result = run(setup, BUDGETS)[0]["budgets"]
    for budget in BUDGETS:
        ran, dense = result[str(budget)], budget == 8
        assert ran["crossover_tokens"] == {TARGET: 0 if dense else 1 << 20}
        assert ran["paths"] == {"lookup": 0 if dense else 2, "dense": 2 if dense else 0}, budget
        [table] = ran["calibration"]
        assert table["budgets"] == [budget]
