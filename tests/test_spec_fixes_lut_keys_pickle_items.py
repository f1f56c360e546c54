"""Review 65 fixes of two spec deviations (tests/test_spec_audit_lut_pickle.py): a LUT's layer keys and file
names are each target's dotted path in the model the lut stage loads (the spec's
`model.layers.{i}.{module}`, what a runtime's get_submodule finds), whatever spelling lut.targets used, and a
LUT keyed by base-model paths (written before) still installs; a pickle item without the optional
`metadata` is read as one whose metadata is null, and an item without a required field is refused naming
the field and the shard."""
from __future__ import annotations

import copy
import pickle
import re

import numpy as np
import pytest
import torch
from test_pickle_reader_shard_ids_dtypes import replant
from test_spec_audit_lut_pickle import spec_only_pickle

from actstore.errors import ConfigError, FormatError
from actstore.formats import lut as lut_format
from actstore.formats import pickle as ps
from actstore.lut import build_lut, build_tables
from actstore.lut_runtime import LutLinear, install_luts
from actstore.models import get_module, load_model, module_full_path
from actstore.sae import build_sae

HOOK = "layers.1.self_attn.q_proj:input"
SHORT_TARGETS = [f"layers.1.self_attn.{m}_proj" for m in "qkv"]
SAE = {"hook": HOOK, "num_basis": 64, "k_active": 4, "steps": 60, "batch_size": 64, "lr": 0.003,
       "dead_tokens": 2000, "device": "cpu"}


@pytest.mark.parametrize("kind, given, full", [
    ("llama", "layers.1.self_attn.q_proj", "model.layers.1.self_attn.q_proj"),
    ("llama", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.q_proj"),
    ("gpt2", "h.1.attn.c_attn", "transformer.h.1.attn.c_attn"),
    ("bert", "encoder.layer.1.attention.self.query", "encoder.layer.1.attention.self.query")])
def test_module_full_path_is_the_path_get_submodule_finds_in_the_loaded_model(model_dir, kind, given, full):
    model = load_model(model_dir(kind), "float32", "cpu").model
    assert module_full_path(model, given, "lut.targets") == full
    assert model.get_submodule(full) is get_module(model, given)
    with pytest.raises(ConfigError, match=r"lut\.targets: module 'layers\.1\.nothing' does not exist"):
        module_full_path(model, "layers.1.nothing", "lut.targets")


def test_a_causal_lm_lut_stage_keys_and_names_its_tables_by_full_paths(extracted, tmp_path):
    """The lut stage on a tiny LlamaForCausalLM, lut.targets in base-model spelling: metadata.json's
    layers, the file names and the report are the model's dotted paths; the store verifies, and a plain
    AutoModelForCausalLM finds every key with get_submodule, which the short keys were not."""
    from transformers import AutoModelForCausalLM

    config, extract_dir = extracted("llama", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    config["sae"].update(SAE)
    config["lut"].update({"targets": SHORT_TARGETS, "budgets": [0, 32], "eval_samples": 2, "device": "cpu"})
    build_sae(config, extract_dir, tmp_path / "sae", progress=False)
    report = build_lut(config, extract_dir, tmp_path / "sae", tmp_path / "lut", progress=False)
    full = [f"model.{target}" for target in SHORT_TARGETS]
    store = lut_format.open_lut(tmp_path / "lut", verify=True)
    assert sorted(store.layers) == sorted(full) == sorted(report["relative_error"])
    assert sorted(p.name for p in store.dir.glob("*.lut.safetensors")) == sorted(f"{t}.lut.safetensors" for t in full)
    model = AutoModelForCausalLM.from_pretrained(config["model"]["path"]).eval()
    for key in store.layers:
        assert isinstance(model.get_submodule(key), torch.nn.Linear), key
    install_luts(model, store, budget=32)
    assert all(isinstance(model.get_submodule(key), LutLinear) for key in full)


def test_a_lut_keyed_by_base_model_paths_still_verifies_and_installs_as_the_full_keyed_one(model_dir, tmp_path):
    """A store written before (keys `layers.1...` as lut.targets spelt them) verifies and installs in the
    causal LM at the same modules, computing what the full-keyed store computes."""
    loaded = load_model(model_dir("llama"), "float32", "cpu")
    generator = torch.Generator().manual_seed(0)
    sae_state = {"encoder_weight": torch.randn(16, 32, generator=generator), "encoder_bias": torch.zeros(16),
                 "decoder_weight": torch.randn(16, 32, generator=generator), "decoder_bias": torch.zeros(32)}
    config = {"lut": {"targets": SHORT_TARGETS, "dtype": "float16"}}
    full_keyed = dict(build_tables(config, loaded.model, sae_state))
    assert sorted(full_keyed) == sorted(f"model.{t}" for t in SHORT_TARGETS)
    roots = {"full": tmp_path / "full", "short": tmp_path / "short"}
    lut_format.write_lut(roots["full"], full_keyed, 4)
    lut_format.write_lut(roots["short"], {key.removeprefix("model."): t for key, t in full_keyed.items()}, 4)
    ids = torch.arange(1, 9)[None]
    logits = {}
    for name, root in roots.items():
        assert lut_format.verify(root) == [], name
        model = load_model(model_dir("llama"), "float32", "cpu").model
        installed = install_luts(model, lut_format.open_lut(root), budget=8)
        assert sorted(installed) == sorted(lut_format.open_lut(root).layers)
        assert all(isinstance(model.get_submodule(f"model.{t}"), LutLinear) for t in SHORT_TARGETS)
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
    assert torch.equal(logits["full"], logits["short"])


def test_a_pickle_item_without_metadata_reads_as_one_with_no_token_count(tmp_path):
    """Every reader serves an item without `metadata` as the same item with `{}`: all its rows are tokens."""
    bare = spec_only_pickle(tmp_path / "bare", None, distributed_config=True)
    given = spec_only_pickle(tmp_path / "given", {}, distributed_config=True)
    for layer in (0, 2):
        for item, same in zip(ps.iter_activations(bare, layer), ps.iter_activations(given, layer), strict=True):
            assert "metadata" not in item
            assert ps.item_tokens(item) == ps.item_tokens(same) == len(item["activation"])
            np.testing.assert_array_equal(item["activation"], same["activation"])
        dataset, reference = ps.ActivationDataset(bare, layer), ps.ActivationDataset(given, layer)
        for index in range(len(dataset)):
            np.testing.assert_array_equal(dataset[index]["activation"], reference[index]["activation"])
            last = len(dataset[index]["activation"]) - 1
            np.testing.assert_array_equal(ps.read_vector(bare, index, layer, last),
                                          ps.read_vector(given, index, layer, last))
            assert ps.read_vector(bare, index, layer, last + 1) is None


@pytest.mark.parametrize("field", ["sample_idx", "activation", "shape", "text_preview"])
def test_a_pickle_item_without_a_required_field_is_refused_naming_the_field_and_shard(tmp_path, field):
    store = spec_only_pickle(tmp_path / "store", None, distributed_config=True)
    shard = ps.load_shard(store, ps.load_metadata(store)["shards"][0])
    del shard["layer_2"][1][field]
    path = replant(store, pickle.dumps(shard, protocol=5))
    named = rf"{re.escape(str(path))}: layer_2 item lacks the required field {field} \(item 1 of 3\)"
    problems = ps.verify(store)
    assert any(re.search(named, problem) for problem in problems), problems
    with pytest.raises(FormatError, match=named):
        list(ps.iter_activations(store, 2))
    with pytest.raises(FormatError, match=named):
        ps.ActivationDataset(store, 2)[0]


def test_a_full_keyed_causal_lm_lut_installs_in_the_bare_base_model_too(model_dir, tmp_path):
    """A causal LM's LUT keyed `model.layers.1...` (its path in LlamaForCausalLM) installs in the model
    AutoModel loads (LlamaModel, whose own path is that prefix), at the same modules, as short keys did."""
    from transformers import AutoModel

    loaded = load_model(model_dir("llama"), "float32", "cpu")
    generator = torch.Generator().manual_seed(0)
    sae_state = {"encoder_weight": torch.randn(16, 32, generator=generator), "encoder_bias": torch.zeros(16),
                 "decoder_weight": torch.randn(16, 32, generator=generator), "decoder_bias": torch.zeros(32)}
    lut_format.write_lut(tmp_path, dict(build_tables({"lut": {"targets": SHORT_TARGETS, "dtype": "float16"}},
                                                     loaded.model, sae_state)), 4)
    bare = AutoModel.from_pretrained(model_dir("llama")).eval()
    installed = install_luts(bare, lut_format.open_lut(tmp_path), budget=8)
    assert sorted(installed) == sorted(f"model.{t}" for t in SHORT_TARGETS)
    assert all(isinstance(bare.get_submodule(t), LutLinear) for t in SHORT_TARGETS)
