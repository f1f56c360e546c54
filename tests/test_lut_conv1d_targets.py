"""Review 64: LUT targets that are transformers Conv1D (GPT-2's projections: y = x @ weight + bias, weight
stored [in, out], where an nn.Linear stores [out, in]) are built, checked, installed and evaluated as an
nn.Linear's are, on the tiny GPT-2: c_attn 32 -> 96, c_fc 32 -> 128, and the square attn.c_proj 32 -> 32,
where a transposed weight has the right shape and is silently another map."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tiny
from actstore.errors import ConfigError
from actstore.formats.lut import open_lut, write_lut
from actstore.lut import build_tables, check_targets_read_hook, target_linears
from actstore.lut_runtime import LutEncoder, LutLinear, install_luts
from actstore.model_config import resolve_model_path
from actstore.models import get_module, load_model
from test_lut_runtime_dense_equivalence import dense_reference

D, BASIS, K = 32, 64, 4
HOOK = "h.1.attn.c_attn:input"
CONV1DS = {"h.1.attn.c_attn": 96, "h.1.mlp.c_fc": 128, "h.1.attn.c_proj": 32}  # in 32, out as given


def gpt2(model_dir, dtype: str = "float32"):
    """The tiny GPT-2 loaded as the lut stage loads it, its Conv1D targets given seeded nonzero biases
    (GPT-2 initialises them to 0, which would hide a bias left out)."""
    loaded = load_model(resolve_model_path(str(model_dir("gpt2"))), dtype, "cpu")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for path in CONV1DS:
            bias = get_module(loaded.model, path).bias
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.1)
    return loaded


def sae_state(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"encoder_weight": torch.randn(BASIS, D, generator=g, dtype=dtype),
            "encoder_bias": torch.randn(BASIS, generator=g, dtype=dtype) * 0.1,
            "decoder_weight": torch.randn(BASIS, D, generator=g, dtype=dtype) / 4,
            "decoder_bias": torch.randn(D, generator=g, dtype=dtype) * 0.1}


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("path", list(CONV1DS))
def test_a_lut_linear_on_a_conv1d_is_the_conv1ds_own_output(model_dir, path, dtype, tolerance):
    """Tables made from the Conv1D's weight as stored ([in, out]), held in float64 (float32): at budget
    d_in the LutLinear is the Conv1D's own output to that dtype's rounding, at budget 0 the Conv1D of the
    SAE's reconstruction, at 8 of that plus 8 dims' residual. Its in/out features and W_target follow
    the Conv1D's kind: W_target is its weight, not its transpose."""
    conv = get_module(gpt2(model_dir).model, path).to(dtype)
    tables = sae_state(dtype)
    tables["precomputed_products"] = tables["decoder_weight"] @ conv.weight.detach()
    tables["bias_product"] = tables["decoder_bias"] @ conv.weight.detach()
    lut = LutLinear(LutEncoder(tables, K, dtype), tables, conv)
    assert (lut.in_features, lut.out_features) == (D, CONV1DS[path])
    assert torch.equal(lut.w_target, conv.weight.detach())
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(1), dtype=dtype)
    for budget in (0, 8, D):
        lut.set_budget(budget)
        with torch.inference_mode():
            out = lut(x)
        assert out.shape == (2, 7, CONV1DS[path])
        expect = dense_reference(tables, conv, x, budget, K).reshape(out.shape)
        torch.testing.assert_close(out, expect, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out, conv(x), rtol=tolerance, atol=tolerance)


@pytest.fixture
def gpt2_lut(model_dir, tmp_path):
    """(loaded tiny GPT-2, its lut/ dir): float16 tables of the three Conv1D targets built by build_tables."""
    loaded = gpt2(model_dir)
    root = write_lut(tmp_path, build_tables({"lut": {"targets": list(CONV1DS), "dtype": "float16"}}, loaded.model,
                                            sae_state()), K)
    return loaded, root


def test_tables_built_from_a_conv1d_hold_its_weight_not_its_transpose(gpt2_lut):
    """build_tables' products are decoder_weight @ weight for a Conv1D (its weight is W_target as stored),
    and its target_bias is its bias; a transpose of the square attn.c_proj would fit and be wrong."""
    loaded, root = gpt2_lut
    store, sae = open_lut(root), sae_state()
    for path, out in CONV1DS.items():
        key = f"transformer.{path}"  # the LUT's key: the module's path in GPT2LMHeadModel (the spec's)
        conv, tables = get_module(loaded.model, path), store.load(key)
        assert store.layers[key]["input_dim"] == D and store.layers[key]["output_dim"] == out
        expect = (sae["decoder_weight"] @ conv.weight.detach()).half()
        assert torch.equal(tables["precomputed_products"], expect), path
        assert torch.equal(tables["target_bias"], conv.bias.detach().half()), path


def test_installed_conv1d_luts_replace_the_modules_and_compensation_recovers_them(gpt2_lut):
    """install_luts puts a LutLinear in place of each Conv1D of the real GPT-2 (its check of the tables
    against the live weights passes); at budget d_in each is the Conv1D's output up to the float16 tables'
    rounding, at budget 0 far from it; the model runs with them in."""
    loaded, root = gpt2_lut
    model = loaded.model
    originals = {f"transformer.{path}": get_module(model, path) for path in CONV1DS}  # keyed as the store
    x = torch.randn(40, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        exact = {path: conv(x) for path, conv in originals.items()}
    installed = install_luts(model, open_lut(root), budget=D)
    for path, lut in installed.items():
        assert get_module(model, path) is lut and isinstance(lut, LutLinear)
        with torch.inference_mode():
            full = lut(x)
            lut.set_budget(0)
            lookup = lut(x)
        error = float((full - exact[path]).norm() / exact[path].norm())
        assert error < 5e-3, (path, error)
        assert float((lookup - exact[path]).norm() / exact[path].norm()) > 10 * error, path
    ids = torch.tensor([[0, 5, 17, 42, 7]])
    assert model(input_ids=ids).logits.shape == (1, 5, 300)


def test_conv1d_tables_of_other_weights_are_refused_naming_its_weight(gpt2_lut):
    """install_luts' check of the tables against the live weights holds for a Conv1D: the square
    attn.c_proj's weight moved by 1 % of its spread is named as `{path}.weight` (its W_target, not
    transposed), and the model is left as it was."""
    from actstore.errors import FormatError

    loaded, root = gpt2_lut
    conv = get_module(loaded.model, "h.1.attn.c_proj")
    with torch.no_grad():
        conv.weight.add_(0.01 * conv.weight.std() * torch.randn(conv.weight.shape, generator=torch.Generator()
                                                                  .manual_seed(4)))
    with pytest.raises(FormatError, match=r"h\.1\.attn\.c_proj\.lut\.safetensors: .* differs from .* @ "
                                          r"transformer\.h\.1\.attn\.c_proj\.weight by .*other weights"):
        install_luts(loaded.model, open_lut(root))
    assert all(not isinstance(get_module(loaded.model, path), LutLinear) for path in CONV1DS)


def test_runtime_auto_dense_on_conv1ds_is_the_models_own_logits(gpt2_lut):
    """runtime auto with crossover 0 runs every target's dense x @ W_target + bias: GPT-2's logits are
    the original model's, to the last bit."""
    loaded, root = gpt2_lut
    ids = torch.tensor([[0, 5, 17, 42, 7, 9], [0, 3, 3, 8, 120, 299]])
    with torch.inference_mode():
        original = loaded.model(input_ids=ids).logits
    installed = install_luts(loaded.model, open_lut(root), runtime="auto", crossover_tokens=0)
    with torch.inference_mode():
        dense = loaded.model(input_ids=ids).logits
    assert all(lut.paths == {"lookup": 0, "dense": 1} for lut in installed.values())
    assert torch.equal(dense, original)


def test_a_target_of_another_kind_or_width_is_still_refused_naming_it(model_dir, gpt2_lut):
    """Conv1D joins nn.Linear; an nn.Embedding (wte) or an nn.Conv2d is refused naming its type, at the
    target check and at install (the model left as it was), and a Conv1D whose input width (weight's
    first dim: mlp.c_proj reads 128) is not the SAE's is named with it."""
    skeleton = gpt2(model_dir).model
    with pytest.raises(ConfigError, match=r"lut.targets: 'wte' is a Embedding, not nn.Linear nor a transformers "
                                          r"Conv1D"):
        target_linears(skeleton, ["h.1.attn.c_attn", "wte"], D)
    with pytest.raises(ConfigError, match=r"'h.1.mlp.c_proj' takes 128 inputs, the SAE 32"):
        target_linears(skeleton, ["h.1.mlp.c_proj"], D)
    assert list(target_linears(skeleton, list(CONV1DS), D)) == [f"transformer.{p}" for p in CONV1DS]
    loaded, root = gpt2_lut
    conv2d = nn.Conv2d(D, 96, 1)
    loaded.model.transformer.h[1].attn.c_attn = conv2d
    with pytest.raises(ConfigError, match=r"lut target 'transformer.h.1.attn.c_attn' is a Conv2d, not nn.Linear nor"):
        install_luts(loaded.model, open_lut(root))
    assert get_module(loaded.model, "h.1.attn.c_attn") is conv2d
    assert not isinstance(get_module(loaded.model, "h.1.mlp.c_fc"), LutLinear)


def test_a_conv1d_that_does_not_read_the_hook_tensor_is_refused(extracted, model_dir):
    """The hook check holds for Conv1D targets: c_attn reads the hook's tensor and passes; c_fc (32 wide,
    reading ln_2's output) is named."""
    config, extract_dir = extracted("gpt2", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    loaded = load_model(resolve_model_path(config["model"]["path"]), "float32", "cpu")
    config["lut"]["targets"] = ["h.1.attn.c_attn"]
    check_targets_read_hook(config, extract_dir, loaded, HOOK)
    config["lut"]["targets"] = ["h.1.attn.c_attn", "h.1.mlp.c_fc"]
    with pytest.raises(ConfigError, match=r"'h.1.mlp.c_fc' does not take the SAE's hook tensor"):
        check_targets_read_hook(config, extract_dir, loaded, HOOK)


@pytest.mark.slow
def test_the_workflow_builds_verifies_and_validates_a_gpt2_conv1d_lut(model_dir, tmp_path):
    """snakemake validate on GPT-2 with an SAE on c_attn's input and a LUT on c_attn: every stage passes
    (the sae job's target check on the skeleton, the lut stage, verify of every store), actstore verify
    passes the lut stage, and its report's errors fall with the budget, to the float16 tables' rounding
    at budget d_in (end to end: closer to the original next-token distribution than the pure lookup)."""
    data = tiny.write_jsonl(tmp_path / "data.jsonl", 16)
    config = tiny.make_config(tmp_path, model_dir("gpt2"), data, extract={"hooks": [HOOK]},
                              saev={"enabled": False}, pickle={"enabled": False}, zarr={"enabled": False},
                              lmprobe={"enabled": False},
                              sae={"enabled": True, "num_basis": BASIS, "k_active": K, "steps": 100,
                                   "batch_size": 64, "lr": 0.003, "device": "cpu"},
                              lut={"targets": ["h.1.attn.c_attn"], "budgets": [0, 8, D], "eval_samples": 8,
                                   "device": "cpu"})
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "snakemake"), "-s", str(tiny.REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
           str(configfile), "--cores", "2", "validate"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (lut_stage,) = (tmp_path / "dump" / "lut").glob("*/report.json")
    verify = subprocess.run([str(bin_dir / "actstore"), "verify", str(lut_stage.parent)], capture_output=True,
                            text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    (validate,) = (tmp_path / "dump" / "validate").glob("*/report.json")
    assert json.loads(validate.read_text())["formats"]["lut"]["problems"] == []
    report = json.loads(lut_stage.read_text())
    errors = [report["relative_error"]["transformer.h.1.attn.c_attn"][str(b)]["relative_error"] for b in (0, 8, D)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 5e-3, errors
    e2e = report["end_to_end"]["budgets"]
    assert e2e[str(D)]["kl_mean"] < min(1e-4, e2e["0"]["kl_mean"]), e2e
    assert e2e[str(D)]["paths"]["dense"] == 0 < e2e[str(D)]["paths"]["lookup"], e2e  # the lookup ran
