"""Review of the LUT store and its report plot: names and files as a user's config or another writer
gives them."""
from __future__ import annotations

import copy

import pytest
import torch

from actstore import report
from actstore.errors import ConfigError, FormatError

LUT_NAMES = ("h.$\\q$.proj", "a$x^2$b", "one$dollar", "already\\$escaped")


@pytest.mark.parametrize("name", LUT_NAMES)
def test_lut_error_plot_shows_a_target_name_holding_dollars_as_written(name, tmp_path, monkeypatch):
    """A '$' in a LUT target's name is text, never mathtext: two made the legend a formula, or
    savefig a ValueError."""
    legends = []
    save = report._save

    def keep_legend(fig, path):
        legends.extend(text._preprocess_math(text.get_text()) for text in fig.axes[0].get_legend().get_texts())
        save(fig, path)

    monkeypatch.setattr(report, "_save", keep_legend)
    report.lut_error({"lut": {"relative_error": {name: {"0": {"relative_error": 0.5}}}}}, tmp_path / "lut.png")
    assert legends == [(name, False)]
    assert (tmp_path / "lut.png").stat().st_size > 0


HOOK = "encoder.layer.1.attention.self.query:input"
SAE = {"num_basis": 64, "k_active": 4, "steps": 100, "batch_size": 64, "lr": 0.003, "dead_tokens": 2000,
       "device": "cpu"}


@pytest.fixture(scope="module")
def sae_built(extracted, tmp_path_factory):
    from actstore.sae import build_sae

    config, extract_dir = extracted("bert", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    config["sae"].update(SAE)
    config["lut"].update({"budgets": [0], "eval_samples": 2, "device": "cpu"})
    sae_dir = tmp_path_factory.mktemp("sae")
    build_sae(config, extract_dir, sae_dir, progress=False)
    return config, extract_dir, sae_dir


def test_a_target_of_another_layer_of_the_same_width_is_refused_before_tables_are_written(sae_built, tmp_path):
    """Layer 0's query takes 32 inputs like the hook's layer 1 query, but not its tensor: its tables were
    built (and their relative errors, measured on layer 1's tensors, looked fine)."""
    from actstore.lut import build_lut

    config, extract_dir, sae_dir = copy.deepcopy(sae_built[0]), sae_built[1], sae_built[2]
    config["lut"]["targets"] = ["encoder.layer.1.attention.self.key", "encoder.layer.0.attention.self.query"]
    with pytest.raises(ConfigError, match=r"'encoder\.layer\.0\.attention\.self\.query' does not take the SAE's "
                                          r"hook tensor .*another tensor"):
        build_lut(config, extract_dir, sae_dir, tmp_path, progress=False)
    assert not (tmp_path / "lut").exists()


def test_targets_sharing_the_hooks_input_pass_the_check(sae_built):
    from actstore.lut import check_targets_read_hook
    from actstore.model_config import resolve_model_path
    from actstore.models import load_model

    config, extract_dir = copy.deepcopy(sae_built[0]), sae_built[1]
    config["lut"]["targets"] = [f"encoder.layer.1.attention.self.{m}" for m in ("query", "key", "value")]
    check_targets_read_hook(config, extract_dir, load_model(resolve_model_path(config["model"]["path"]), "float32",
                                                            "cpu"), HOOK)


def _tiny_tables() -> dict[str, dict[str, torch.Tensor]]:
    from test_lut_install_hostile_inputs import Tiny, tables_for

    torch.manual_seed(0)
    return tables_for(Tiny())


@pytest.mark.parametrize("edit, named", [
    (lambda t: t.update(decoder_bias=t["decoder_bias"][:8].contiguous()),
     r"'decoder_bias' has shape \[8\], expected \[16\]"),
    (lambda t: t.update(bias_product=t["bias_product"].float()), "'bias_product' has dtype F32, expected F16 or BF16"),
    (lambda t: t.update(encoder_weight=t["encoder_weight"].to(torch.bfloat16)), r"mixed dtypes \['BF16', 'F16'\]"),
    (lambda t: t.pop("decoder_weight"), r"lack \['decoder_weight'\]")])
def test_write_refuses_tables_its_own_verify_would_refuse(tmp_path, edit, named):
    """A table of another width or dtype was written and published: verify refused the store later."""
    from actstore.formats.lut import write_lut

    tables = _tiny_tables()
    edit(tables["layers.0.q"])
    with pytest.raises(FormatError, match=named):
        write_lut(tmp_path, tables, 4)
    assert not (tmp_path / "lut").exists()


def test_write_still_writes_valid_tables(tmp_path):
    from actstore.formats.lut import verify, write_lut

    lut = write_lut(tmp_path, _tiny_tables(), 4)
    assert verify(lut) == []
    assert sorted(p.name for p in lut.iterdir()) == ["layers.0.k.lut.safetensors", "layers.0.q.lut.safetensors",
                                                     "metadata.json"]


def test_one_module_listed_by_two_paths_fails_before_the_sae_trains(extracted):
    """A causal LM's module by its full and its base-model path: the pre-training check let both
    through, two tables were built and install_luts refused them only after the SAE had trained."""
    from actstore.lut import check_targets_before_training

    hook = "layers.1.self_attn.q_proj:input"
    config, extract_dir = extracted("llama", extract={"hooks": [hook]})
    config = copy.deepcopy(config)
    config["sae"]["hook"] = hook
    config["lut"]["targets"] = ["layers.1.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    with pytest.raises(ConfigError, match=r"lut\.targets: 'layers\.1\.self_attn\.q_proj' and "
                                          r"'model\.layers\.1\.self_attn\.q_proj' are one module of the model"):
        check_targets_before_training(config, extract_dir)


def test_an_extraction_of_one_sample_fails_before_the_sae_trains(extracted, tmp_path):
    """One sample leaves the SAE no held-out sample, and the lut stage evaluated on those: after the
    SAE had trained and the tables were written, a bare ValueError (np.concatenate of nothing)."""
    import json

    from actstore.lut import check_targets_before_training

    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": "The only sample of this dataset."}) + "\n")
    config, extract_dir = extracted("bert", data=data, extract={"hooks": [HOOK], "parts": 1})
    config = copy.deepcopy(config)
    config["sae"]["hook"] = HOOK
    config["lut"]["targets"] = ["encoder.layer.1.attention.self.query"]
    with pytest.raises(ConfigError, match=r"holds 1 sample, and the lut stage evaluates its tables on samples the "
                                          r"SAE did not train on"):
        check_targets_before_training(config, extract_dir)
