"""Review of the lut stage and its runtime: an extraction that holds out nothing, an input refilled
through numpy between two forwards, a padding-sensitive model's end-to-end evaluation."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from actstore.errors import ConfigError
from actstore.formats.lut import open_lut, precompute, write_lut
from actstore.lut_runtime import install_luts
from test_lut_install_hostile_inputs import K, Tiny, tables_for

HOOK = "encoder.layer.1.attention.self.query:input"


def test_an_extraction_that_holds_out_nothing_is_named_before_the_model_loads(extracted, tmp_path):
    """One sample is all the SAE's training data: the lut stage loaded the model, wrote its tables and
    then stopped on numpy's bare 'need at least one array to concatenate'."""
    from actstore.lut import build_lut
    from actstore.sae import build_sae

    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": "The only sample of this dataset."}) + "\n")
    config, extract_dir = extracted("bert", data=data, extract={"hooks": [HOOK], "parts": 1})
    config = copy.deepcopy(config)
    config["sae"].update({"hook": HOOK, "num_basis": 64, "k_active": 4, "steps": 10, "batch_size": 8,
                          "device": "cpu"})
    config["lut"].update({"targets": ["encoder.layer.1.attention.self.query"], "budgets": [0], "device": "cpu"})
    build_sae(config, extract_dir, tmp_path / "sae", progress=False)
    with pytest.raises(ConfigError, match=r"sae\.heldout_fraction 0\.1 of its 1 sample\(s\) holds out no token"):
        build_lut(config, extract_dir, tmp_path / "sae", tmp_path / "lut", progress=False)
    assert not (tmp_path / "lut" / "lut").exists()


def test_an_input_refilled_through_numpy_is_encoded_again_in_the_next_forward(tmp_path):
    """torch.from_numpy(buffer), refilled in numpy between two forwards, keeps its version counter: the
    runtime served the first forward's encoding again, the previous output with no error."""
    torch.manual_seed(0)
    model = Tiny()
    install_luts(model, open_lut(write_lut(tmp_path, tables_for(model), K)))
    buffer = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    x = torch.from_numpy(buffer)

    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model.layers[0].q(x), model.layers[0].k(x)]

    first = forward(x)
    buffer[:] = np.random.default_rng(1).standard_normal((5, 16))
    refilled, fresh = forward(x), forward(x.clone())
    for out_refilled, out_fresh, out_first in zip(refilled, fresh, first):
        assert torch.equal(out_refilled, out_fresh) and not torch.equal(out_refilled, out_first)


def random_lut(model: torch.nn.Module, target: str, root: Path) -> Path:
    """A LUT for `target` (32 inputs) from a seeded random SAE of 64 latents, k 4: end_to_end's batching
    is under test, not the tables' accuracy."""
    from actstore.models import get_module

    linear, gen = get_module(model, target), torch.Generator().manual_seed(0)
    sae = {"encoder_weight": torch.randn(64, 32, generator=gen), "encoder_bias": torch.zeros(64),
           "decoder_weight": torch.randn(64, 32, generator=gen), "decoder_bias": torch.zeros(32)}
    return write_lut(root, {target: precompute(sae, linear.weight.detach().T, linear.bias.detach())}, 4)


def test_a_padding_sensitive_models_targets_are_evaluated_on_their_stored_inputs(text_jsonl, tmp_path):
    """FNet mixes the whole padded sequence: end_to_end batched held-out texts of many lengths together,
    so the target's inputs (and the reference outputs) were not the sample's own, which the SAE was
    trained on (0.15 to 1.6 off, relative). Batched one length at a time, as extraction batches them."""
    from actstore.extract import run_part
    from actstore.formats.extract import open_extraction, write_index
    from actstore.lut import end_to_end
    from actstore.models import get_module, load_model
    from test_extract import REL_TOL, rel_err
    from test_models_padding_sensitive import build_encoder

    hook, target = "encoder.layer.1.intermediate.dense:input", "encoder.layer.1.intermediate.dense"
    config = tiny.make_config(tmp_path, build_encoder("fnet", tmp_path / "model"), text_jsonl,
                              extract={"batch_size": 8, "parts": 1, "max_seq_length": 64, "hooks": [hook]},
                              lut={"eval_samples": 30, "device": "cpu"})
    run_part(config, 0, tmp_path / "extract" / "part-0000", progress=False)
    write_index(tmp_path / "extract", tmp_path / "extract" / "extract.json")
    part = open_extraction(tmp_path / "extract", 1).locate(0)[0]
    loaded = load_model(config["model"]["path"])
    seen = []  # (input_ids, attention_mask) of each forward, then the target's input in it
    loaded.model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(
        (kwargs["input_ids"], kwargs["attention_mask"])), with_kwargs=True)
    get_module(loaded.model, "encoder.layer.1.fourier.output.LayerNorm").register_forward_hook(
        lambda _, args, output: seen.append(output))
    end_to_end(config, tmp_path / "extract", random_lut(loaded.model, target, tmp_path / "lut"), loaded,
               list(range(30)), [0])
    samples = {tuple(part.token_ids(local).tolist()): local for local in range(30)}
    compared = 0
    for (ids, mask), inputs in zip(seen[0::2], seen[1::2]):
        for row in range(len(ids)):
            real = mask[row].bool()
            local = samples[tuple(ids[row][real].tolist())]
            assert rel_err(inputs[row][real].numpy(), part.activations(hook, local)) <= REL_TOL, local
            compared += 1
    assert compared == 2 * 30  # the original model's and the LUT model's forward of every sample


def test_end_to_end_runs_a_sample_of_every_heldout_sample_not_the_first(extracted, tmp_path):
    """lut.eval_samples of the held-out samples were the first in index order: one class's in a dataset
    sorted by label (an image folder's first class only). Now a seeded uniform sample, as the held-out
    tokens of the relative errors are."""
    from actstore.formats.extract import open_extraction
    from actstore.lut import end_to_end
    from actstore.models import load_model
    from actstore.sae import split_tokens

    config, extract_dir = extracted("bert", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    config["sae"]["heldout_fraction"] = 0.5
    config["lut"].update({"eval_samples": 4, "device": "cpu"})
    extraction = open_extraction(extract_dir, config["extract"]["parts"])
    heldout = split_tokens(extraction, 0.5, config["sae"]["seed"]).heldout_samples
    loaded = load_model(config["model"]["path"])
    target = "encoder.layer.1.attention.self.query"
    lut = random_lut(loaded.model, target, tmp_path)
    texts = {tuple(part.token_ids(local).tolist()): sample for sample in range(extraction.n_samples)
             for part, local in [extraction.locate(sample)]}
    ran = set()
    loaded.model.register_forward_pre_hook(lambda _, args, kwargs: ran.update(
        texts[tuple(ids[mask.bool()].tolist())] for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"])),
        with_kwargs=True)
    end_to_end(config, extract_dir, lut, loaded, heldout, [0])
    assert len(heldout) == 15 and len(ran) == 4 and ran <= set(heldout) and sorted(ran) != heldout[:4]
