"""LUT stage: spec-exact files from a trained SAE on a tiny real BERT, the runtime, verification."""
from __future__ import annotations

import copy
import json
import os
import re
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from actstore import lut_runtime
from actstore.errors import ConfigError, FormatError
from actstore.formats import lut as lut_format
from actstore.lut import build_lut
from actstore.lut_runtime import (CALIBRATION_TOKENS, LutEncoder, LutLinear, calibrate, calibrate_auto, crossover_from,
                                  embedding_bag_rows, install_luts, weighted_rows)
from actstore.model_config import resolve_model_path
from actstore.models import get_module, load_model
from actstore.sae import build_sae, load_sae

HOOK = "encoder.layer.1.attention.self.query:input"
TARGETS = [f"encoder.layer.1.attention.self.{m}" for m in ("query", "key", "value")]
SAE = {"num_basis": 64, "k_active": 4, "steps": 100, "batch_size": 64, "lr": 0.003, "dead_tokens": 2000,
       "device": "cpu"}
LUT = {"targets": TARGETS, "budgets": [0, 8, 32], "eval_samples": 8, "device": "cpu"}
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))
# The Triton kernels run on a GPU, and on the CPU in triton's interpreter (TRITON_INTERPRET=1 with triton
# installed: not a dependency of the project; minutes, so not in make test).
TRITON_DEVICES = [CUDA, pytest.param("cpu", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU: set TRITON_INTERPRET=1 with triton installed"))]


@pytest.fixture(scope="module")
def built(extracted, tmp_path_factory):
    config, extract_dir = extracted("bert", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    config["sae"].update(SAE)
    config["lut"].update(LUT)
    sae_dir, lut_out = tmp_path_factory.mktemp("sae"), tmp_path_factory.mktemp("lut")
    build_sae(config, extract_dir, sae_dir, progress=False)
    report = build_lut(config, extract_dir, sae_dir, lut_out, progress=False)
    return config, extract_dir, sae_dir, lut_out, report


def _fresh_model(built):
    return load_model(resolve_model_path(built[0]["model"]["path"]), "float32", "cpu").model


@pytest.fixture
def model(built):
    """A fresh copy of the real tiny BERT (tests that install LUTs change it)."""
    return _fresh_model(built)


def test_files_follow_the_spec(built, model):
    config, _, sae_dir, lut_out, _ = built
    lut_dir = lut_out / "lut"
    meta = json.loads((lut_dir / "metadata.json").read_text())
    assert meta["version"] == "1.0"
    assert meta["sae_config"] == {"num_basis": 64, "k_active": 4}
    assert meta["model_config"] == {"model_type": "bert", "num_layers": 3, "num_attention_heads": 4, "hidden_size": 32}
    assert set(meta["creation_info"]) >= {"created_at", "source_model", "sae_model"}
    assert sorted(meta["layers"]) == sorted(TARGETS)
    sae, _ = load_sae(sae_dir / "sae.safetensors")
    for target in TARGETS:
        entry = meta["layers"][target]
        assert entry["file"] == f"{target}.lut.safetensors"
        assert (entry["input_dim"], entry["output_dim"]) == (32, 32)
        tables = load_file(str(lut_dir / entry["file"]))
        shapes = {"encoder_weight": [64, 32], "encoder_bias": [64], "decoder_weight": [64, 32],
                  "decoder_bias": [32], "precomputed_products": [64, 32], "bias_product": [32], "target_bias": [32]}
        assert {k: list(v.shape) for k, v in tables.items()} == shapes
        assert all(v.dtype == torch.float16 for v in tables.values())
        linear = get_module(model, target)
        w_target = linear.weight.detach().T
        # P = W_dec @ W_target and bias_product = b_dec @ W_target, within float16 rounding.
        torch.testing.assert_close(tables["precomputed_products"].float(), sae.decoder_weight.data @ w_target,
                                   rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(tables["bias_product"].float(), sae.decoder_bias.data @ w_target,
                                   rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(tables["encoder_weight"].float(), sae.encoder_weight.data, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(tables["target_bias"].float(), linear.bias.detach(), rtol=1e-3, atol=1e-3)
    assert lut_format.verify(lut_out) == []


def _lut_for(built, model, target, budget=0):
    store = lut_format.open_lut(built[3])
    tables = store.load(target)
    return tables, LutLinear(LutEncoder(tables, store.k_active, torch.float32), tables, get_module(model, target),
                             budget, with_bias=False)


def test_runtime_equals_spec_steps_a_and_b(built, model):
    tables, lut = _lut_for(built, model, TARGETS[0])
    t = {k: v.float() for k, v in tables.items()}
    x = torch.randn(7, 32) * 2
    sparse_act = torch.relu(x @ t["encoder_weight"].T + t["encoder_bias"])
    values, indices = torch.topk(sparse_act, 4)
    selected = t["precomputed_products"][indices]  # [batch, k, out]
    expect = (values[..., None] * selected).sum(dim=1) + t["bias_product"]
    torch.testing.assert_close(lut(x), expect, rtol=1e-5, atol=1e-5)
    # The same through a (batch, tokens, dim) input, as inside the model.
    torch.testing.assert_close(lut(x.reshape(7, 1, 32))[:, 0], expect, rtol=1e-5, atol=1e-5)


def _reference_rows(weights, indices, table):
    """The gather the fused path replaces: materialise [rows, k, out], reduce in float64."""
    return torch.einsum("nk,nko->no", weights.double(), table.double()[indices])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_fused_rows_equal_the_reference_gather(device):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(300, 96, generator=g)
    indices = torch.randint(0, 300, (513, 16), generator=g)
    weights = torch.rand(513, 16, generator=g) * 3
    ref = _reference_rows(weights, indices, table)
    out = weighted_rows(weights.to(device), indices.to(device), table.to(device)).cpu()
    assert out.dtype == torch.float32
    assert float((out.double() - ref).norm() / ref.norm()) <= 1e-5
    assert float(((out.double() - ref).norm(dim=1) / ref.norm(dim=1)).max()) <= 1e-5  # every row
    # 16-bit tables: accumulated in float32, only the output rounded to the table's dtype (why a
    # float32 model holds its tables in float32, module docstring).
    for dtype in (torch.float16, torch.bfloat16):
        low = table.to(dtype).to(device)
        w16 = weights.to(dtype)
        out16 = weighted_rows(w16.to(device), indices.to(device), low).cpu()
        assert out16.dtype == dtype
        rounded_fp32_sum = _reference_rows(w16, indices, low.cpu()).float().to(dtype)
        assert float((out16 == rounded_fp32_sum).float().mean()) > 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("rows, k, width", [(1, 32, 256), (8, 32, 384), (513, 16, 96), (3, 100, 200)])
def test_cuda_triton_rows_equal_embedding_bag(rows, k, width):
    """CUDA's Step B (lut_kernels) against embedding_bag (its path without triton): float32 within 1e-5, 16-bit tables
    within one rounding of the output (both sum in float32); k 100 is summed in steps (a compensation
    budget), and a column view is a group target's columns of a wider table."""
    lut_kernels = pytest.importorskip("actstore.lut_kernels", reason="triton is not installed")
    assert lut_runtime._lut_kernels() is lut_kernels  # what weighted_rows runs on CUDA
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(300, 2 * width, generator=g)
    indices = torch.randint(0, 300, (rows, k), generator=g)
    weights = torch.rand(rows, k, generator=g) * 3
    for table in (wide[:, :width].contiguous(), wide[:, width:]):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            args = weights.to(dtype).cuda(), indices.cuda(), table.to(dtype).cuda()
            out, ref = lut_kernels.weighted_rows_triton(*args).cpu(), embedding_bag_rows(*args).cpu()
            assert out.dtype == dtype and out.shape == (rows, width)
            if dtype == torch.float32:
                assert float((out - ref).norm() / ref.norm()) <= 1e-5
            else:
                ulp = torch.finfo(dtype).eps * ref.float().abs().max()
                assert float((out.float() - ref.float()).abs().max()) <= ulp
                assert float((out == ref).float().mean()) > 0.99


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("rows, width, k", [(8, 2100, 32), (3, 64, 4), (2, 1000, 7), (1, 97, 9)])
def test_triton_topk_equals_torch_topk(device, rows, width, k):
    """Step A's ReLU and top-k at decode sizes (lut_kernels.topk_relu_triton) against torch's ops in
    each dtype: the same values in torch.topk's order, the indices equal up to ties (ReLU's zeros tie
    whenever fewer than k latents fire: row 0 here), k distinct latents a row; slices of 1024 latents
    (2100 = two whole slices and a part)."""
    lut_kernels = pytest.importorskip("actstore.lut_kernels", reason="triton is not installed")
    g = torch.Generator().manual_seed(width)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pre = torch.randn(rows, width, generator=g).to(dtype)
        pre[0, : width - k // 2] = -1  # fewer than k fire
        values, indices = (t.cpu() for t in lut_kernels.topk_relu_triton(pre.to(device), k))
        fired = pre.relu()
        expect = torch.topk(fired, k, dim=-1)
        assert values.dtype == dtype and torch.equal(values, expect.values)
        assert torch.equal(fired.gather(1, indices), values)
        assert all(len(set(row.tolist())) == k for row in indices)
        once = (expect.values[:, :, None] == expect.values[:, None, :]).sum(-1) == 1
        untied = once & (expect.values > expect.values[:, -1:])  # tied with nothing, in or out of the top k
        assert torch.equal(indices[untied], expect.indices[untied])


def _cuda_encoder(seed: int = 0) -> LutEncoder:
    """A LutEncoder on CUDA over 1024 latents of 64 inputs with one target of 48 outputs."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"encoder_weight": (1024, 64), "encoder_bias": (1024,), "decoder_weight": (1024, 64),
              "decoder_bias": (64,)}
    encoder = LutEncoder({key: torch.randn(*shape, generator=g) for key, shape in shapes.items()}, 32, torch.float32)
    encoder.add_target(torch.randn(1024, 48, generator=g), torch.randn(48, generator=g), None)
    return encoder.cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_encoder_takes_the_triton_topk_only_in_a_graph(monkeypatch):
    """Step A's ReLU + top-k on CUDA: torch's ops called eagerly at every size (at decode sizes the first
    call of a shape also runs the Triton kernels, result unused, so that a capture can use them), the
    Triton kernels inside a CUDA graph capture of up to DECODE_ROWS rows; torch.topk's values each way."""
    lut_kernels = pytest.importorskip("actstore.lut_kernels", reason="triton is not installed")
    monkeypatch.setattr(lut_runtime, "TRITON_LOADED", set())
    monkeypatch.setattr(lut_runtime, "TRITON_WARNED", set())
    calls, kernel = [], lut_kernels.topk_relu_triton

    def counted(pre: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(len(pre))
        return kernel(pre, k)
    monkeypatch.setattr(lut_kernels, "topk_relu_triton", counted)
    encoder = _cuda_encoder()

    def expected(x: torch.Tensor) -> torch.Tensor:
        return torch.topk((x @ encoder.encoder_weight.T + encoder.encoder_bias).relu(), 32).values
    for rows in (1, 8, 9, 64):
        x = torch.randn(rows, 64, device="cuda")
        torch.testing.assert_close(encoder(x)[0], expected(x))
    assert calls == [1]  # rows 1 and 8 share the kernels' signature: loaded once
    x = torch.randn(lut_runtime.DECODE_ROWS, 64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, indices = encoder(x)
    x.copy_(torch.randn(len(x), 64, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert calls == [1, lut_runtime.DECODE_ROWS]
    torch.testing.assert_close(values, expected(x))
    pre = (x @ encoder.encoder_weight.T + encoder.encoder_bias).relu()
    torch.testing.assert_close(pre.gather(1, indices), values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_lookup_in_a_graph_takes_the_triton_kernel_once_loaded(monkeypatch, caplog):
    """A decode-size Step B captured in a CUDA graph runs the Triton kernel once an eager call of that
    shape has loaded it (a kernel cannot load while a stream captures: the eager call runs it once, its
    result unused); a capture before any such call runs embedding_bag and says so. Either way a replay
    gives embedding_bag's sums."""
    lut_kernels = pytest.importorskip("actstore.lut_kernels", reason="triton is not installed")
    monkeypatch.setattr(lut_runtime, "TRITON_LOADED", set())
    monkeypatch.setattr(lut_runtime, "TRITON_WARNED", set())
    calls, kernel = [], lut_kernels.weighted_rows_triton

    def counted(weights: torch.Tensor, indices: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        calls.append(len(indices))
        return kernel(weights, indices, table)
    monkeypatch.setattr(lut_kernels, "weighted_rows_triton", counted)
    encoder = _cuda_encoder()
    values, indices = encoder(torch.randn(1, 64, device="cuda"))  # cuBLAS and top-k warm; no lookup yet

    def captured() -> torch.Tensor:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = encoder.lookup(values, indices)
        graph.replay()
        torch.cuda.synchronize()
        return out
    expect = embedding_bag_rows(values, indices, encoder.products) + encoder.bias_products
    torch.testing.assert_close(captured(), expect)
    assert calls == [] and "no eager call had made" in caplog.text
    torch.testing.assert_close(encoder.lookup(values, indices), expect)  # eager: embedding_bag, kernel loaded
    assert calls == [1]
    torch.testing.assert_close(captured(), expect)
    assert calls == [1, 1]


def test_fused_lookup_reproduces_the_stage_report(built, model):
    """The report's relative errors (the lut stage's output) recomputed with the reference gather."""
    config, _, _, lut_out, report = built
    from actstore.lut import heldout_inputs
    x, _ = heldout_inputs(config, built[1], built[2])
    for target in TARGETS:
        tables, lut = _lut_for(built, model, target)
        t = {k: v.float() for k, v in tables.items()}
        w = get_module(model, target).weight.detach().T.double()
        values, indices = lut.encoder(x)
        lookup = _reference_rows(values, indices, t["precomputed_products"]) + t["bias_product"].double()
        exact = x.double() @ w
        for budget in config["lut"]["budgets"]:
            out = lookup
            if budget:
                residual = x.double() - (_reference_rows(values, indices, t["decoder_weight"]) + t["decoder_bias"].double())
                top = torch.topk(residual.abs(), budget, dim=-1).indices
                out = lookup + _reference_rows(residual.gather(1, top), top, w)
            expect = float((out - exact).norm() / exact.norm())
            assert report["relative_error"][target][str(budget)]["relative_error"] == pytest.approx(expect, rel=1e-3)


def test_full_compensation_is_exact_and_budget_helps(built, model):
    target = TARGETS[1]
    _, lut = _lut_for(built, model, target)
    w = get_module(model, target).weight.detach().T
    x = torch.randn(64, 32)
    exact = x @ w
    errors = {}
    for budget in (0, 8, 32):
        lut.set_budget(budget)
        errors[budget] = float((lut(x) - exact).norm() / exact.norm())
    assert errors[32] < 5e-3  # float16 rounding of the stored tables only
    assert errors[0] > 10 * errors[32] and errors[8] < errors[0]


def test_shared_encoder_encodes_once_per_forward(built, model):
    installed = install_luts(model, lut_format.open_lut(built[3]))
    encoders = {id(m.encoder) for m in installed.values()}
    assert len(encoders) == 1
    encoder = next(iter(installed.values())).encoder
    ids = torch.tensor([[2, 10, 11, 12, 3]])
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert encoder.counts["encodings"] == 1
    assert encoder.counts["lookups"] == 1  # Step B of q, k and v in one lookup
    assert isinstance(get_module(model, TARGETS[2]), LutLinear)


def test_targets_with_another_encoder_get_their_own(built, model, tmp_path):
    """Targets share a LutEncoder only when their encoder bytes are equal: one bias value changed in
    v's table gives v its own encoder (and group), q and k still share theirs."""
    store = lut_format.open_lut(built[3])
    tables = {target: store.load(target) for target in TARGETS}
    tables[TARGETS[2]]["encoder_bias"][0] += 1
    lut_format.write_lut(tmp_path, tables, store.k_active)
    installed = install_luts(model, lut_format.open_lut(tmp_path))
    q, k, v = (installed[target].encoder for target in TARGETS)
    assert q is k and v is not q and (q.n_targets, v.n_targets) == (2, 1)
    torch.testing.assert_close(v.encoder_bias[0], tables[TARGETS[2]]["encoder_bias"][0].float())


def test_a_table_with_another_decoder_gets_its_own_encoder(built, model, tmp_path):
    """v's table rebuilt (consistently: P = W_dec' @ W_v) from the same encoder and another decoder:
    the group's decoder reconstructs x_hat for every target's compensation, so v may not join q and
    k's group; at full budget it is x @ W up to the tables' rounding."""
    store = lut_format.open_lut(built[3])
    tables = {target: store.load(target) for target in TARGETS}
    sae = {key: tables[TARGETS[2]][key].float() for key in lut_format.REQUIRED_KEYS[:4]}
    g = torch.Generator().manual_seed(1)
    sae["decoder_weight"] += 0.3 * torch.randn(sae["decoder_weight"].shape, generator=g)
    linear = get_module(model, TARGETS[2])
    tables[TARGETS[2]] = lut_format.precompute(sae, linear.weight.detach().T, linear.bias.detach(), "float16")
    lut_format.write_lut(tmp_path, tables, store.k_active)
    installed = install_luts(model, lut_format.open_lut(tmp_path), budget=32)
    q, k, v = (installed[target].encoder for target in TARGETS)
    assert q is k and v is not q and (q.n_targets, v.n_targets) == (2, 1)
    x = torch.randn(2, 5, 32)
    exact = x @ linear.weight.detach().T + linear.bias.detach()
    assert float((installed[TARGETS[2]](x) - exact).norm() / exact.norm()) < 5e-3


@pytest.mark.parametrize("change, named", [
    ("weight", r"(precomputed_products row \d+|bias_product) differs from (decoder_weight\[\d+\]|decoder_bias) "
               r"@ {target}\.weight\.T"),
    ("bias", r"target_bias differs from {target}\.bias")], ids=["weight", "bias"])
def test_tables_of_other_weights_are_refused_at_install(built, change, named):
    """Tables whose sizes fit but that were built from other weights (a changed checkpoint: W or the
    bias moved by 1 % of W's spread) are refused naming the file and the module: the lookup would be
    wrong at every budget. The model's own weights cast to 16 bits still take the tables built from
    float32."""
    target = TARGETS[0]
    model = _fresh_model(built)
    linear = get_module(model, target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        tensor = getattr(linear, change)
        tensor.add_(0.01 * linear.weight.std() * torch.randn(tensor.shape, generator=g))
    pattern = rf"{re.escape(target)}\.lut\.safetensors: " + named.format(target=re.escape(target)) + r".*other weights"
    with pytest.raises(FormatError, match=pattern):
        install_luts(model, lut_format.open_lut(built[3]))
    for dtype in (torch.bfloat16, torch.float16):
        install_luts(_fresh_model(built).to(dtype), lut_format.open_lut(built[3]))


def test_an_inference_tensor_edited_in_place_is_encoded_again(built, model):
    """An inference tensor has no version counter: its encoding serves q, k and v of one forward (one
    encoding), never a later call after an in-place edit, which gets what a fresh tensor gets."""
    installed = install_luts(model, lut_format.open_lut(built[3]))
    luts = [installed[target] for target in TARGETS]
    counts = luts[0].encoder.counts
    with torch.inference_mode():
        x = torch.randn(1, 5, 32)
        for lut in luts:
            lut(x)
        assert counts["encodings"] == 1
        x.mul_(3)
        again = luts[0](x)  # q alone again, as a second forward's first target
        assert counts["encodings"] == 2 and torch.equal(again, luts[0](x.clone()))
        x.mul_(0.5)
        second = [lut(x) for lut in luts]
        assert counts["encodings"] == 4  # one for x.clone(), one for this forward
        fresh = x.clone()
        assert all(torch.equal(out, lut(fresh)) for out, lut in zip(second, luts))


def test_bfloat16_tables_past_float16s_range_are_refused_in_a_float16_model(tmp_path):
    """precompute refuses float16 tables past +-65504 and advises bfloat16; a float16 model would hold
    those bfloat16 tables in float16 (inf: every lookup inf), so install refuses, naming the file and
    what to do; held in float32 (install_luts dtype) they give the dense output."""
    g = torch.Generator().manual_seed(0)
    # The decoder rows carry the scale and the encoder its inverse: x_hat and the outputs are ordinary.
    sae = {"encoder_weight": torch.randn(32, 16, generator=g) * 1e-5, "encoder_bias": torch.zeros(32),
           "decoder_weight": torch.randn(32, 16, generator=g) * 3e4, "decoder_bias": torch.zeros(16)}
    linear = torch.nn.Linear(16, 8, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(8, 16, generator=g))
    tables = {"t": lut_format.precompute(sae, linear.weight.detach().T, None, "bfloat16", "t")}
    lut_format.write_lut(tmp_path, tables, 4)
    model = torch.nn.Sequential()
    model.add_module("t", copy.deepcopy(linear).half())
    with pytest.raises(ConfigError, match=r"t\.lut\.safetensors: \d+ values of decoder_weight exceed float16's "
                                          r"range .*dtype=torch\.float32"):
        install_luts(model, lut_format.open_lut(tmp_path))
    install_luts(model, lut_format.open_lut(tmp_path), budget=16, dtype=torch.float32)
    x = torch.randn(3, 16, generator=g).half()
    exact = x.float() @ linear.weight.detach().T
    out = model(x).float()
    # Full compensation: x @ W up to the rounding of the bfloat16 tables (eps 7.8e-3).
    assert out.isfinite().all() and float((out - exact).norm() / exact.norm()) < 2e-2


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("budget", [0, 8])
def test_group_lookup_equals_each_targets_own_lookup_bit_for_bit(built, model, budget, device):
    """q, k, v share one P [B, 3 x out] and one W [in, 3 x out]; each target's columns of the group's
    lookup and compensation are the sums its own tables give."""
    alone = {target: _lut_for(built, model, target, budget)[1].to(device) for target in TARGETS}
    installed = install_luts(model.to(device), lut_format.open_lut(built[3]), budget)
    encoder = installed[TARGETS[0]].encoder
    assert encoder.products.shape == (64, 3 * 32) and encoder.weights.shape == (32, 3 * 32)
    x = torch.randn(2, 5, 32, device=device) * 2
    with torch.inference_mode():
        for target in TARGETS:
            assert torch.equal(installed[target](x), alone[target](x) + installed[target].target_bias)
            assert torch.equal(installed[target].precomputed_products, alone[target].precomputed_products)
            assert torch.equal(installed[target].w_target, alone[target].w_target)
        assert encoder.counts["lookups"] == 1
        # Every target took its columns, so the group holds nothing for x: a target called again begins
        # another forward, which encodes and looks up again (q/k/v of one forward shared one encoding).
        installed[TARGETS[1]](x)
    assert encoder.counts["lookups"] == 2 and encoder.counts["encodings"] == 2
    # A group's targets all have their W or none has: nothing to compensate with otherwise.
    tables = lut_format.open_lut(built[3]).load(TARGETS[0])
    with pytest.raises(ConfigError, match="linear weight"):
        LutLinear(encoder, tables, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_targets_of_one_sae_on_two_devices_each_get_an_encoder_on_theirs(built, model):
    """A model split across devices: q on the GPU, k and v on the CPU. One shared encoder moved to
    whichever target was installed last, and the others' lookups then met tensors on another device."""
    get_module(model, TARGETS[0]).cuda()
    devices = {target: get_module(model, target).weight.device for target in TARGETS}
    alone = {target: _lut_for(built, model, target, 8)[1].to(devices[target]) for target in TARGETS}
    installed = install_luts(model, lut_format.open_lut(built[3]), budget=8)
    assert installed[TARGETS[0]].encoder is not installed[TARGETS[1]].encoder
    assert installed[TARGETS[1]].encoder is installed[TARGETS[2]].encoder
    x = torch.randn(2, 5, 32) * 2
    with torch.inference_mode():
        for target, device in devices.items():
            out = installed[target](x.to(device))
            assert out.device == device
            assert torch.equal(out, alone[target](x.to(device)) + installed[target].target_bias)


def test_each_targets_output_is_a_tensor_of_its_own(built, model):
    """Without a bias to add, a target's columns of the group's lookup are still copied out, as an
    nn.Linear's output is its own: a view would keep the group's [N, 3 x out] alive and refuse .view."""
    store = lut_format.open_lut(built[3])
    tables = {target: store.load(target) for target in TARGETS}
    encoder = LutEncoder(tables[TARGETS[0]], store.k_active, torch.float32)
    luts = [LutLinear(encoder, tables[t], get_module(model, t), with_bias=False) for t in TARGETS]
    x = torch.randn(2, 5, 32)
    for lut in luts:
        out = lut(x)
        assert out.is_contiguous() and out.untyped_storage().nbytes() == out.numel() * out.element_size()
        assert out.view(-1).shape == (2 * 5 * 32,)
    assert encoder.counts["lookups"] == 1


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_runtime_auto_is_lookup_up_to_a_pinned_crossover_then_dense(built, model, device):
    x = (torch.randn(64, 32) * 2).to(device)
    model.to(device)
    exact = {t: x @ get_module(model, t).weight.detach().T + get_module(model, t).bias.detach() for t in TARGETS}
    lookups = {t: _lut_for(built, model, t)[1].to(device) for t in TARGETS}
    installed = install_luts(model, lut_format.open_lut(built[3]), runtime="auto", crossover_tokens=16)
    encoder = installed[TARGETS[0]].encoder
    for target, lut in installed.items():
        assert lut.crossover_tokens == 16 and lut.calibration is None  # pinned: nothing measured
        below, above = x[:16], x[:17]
        lookup_out = lut(below)
        assert lut.paths == {"lookup": 1, "dense": 0}
        # The lookup path is the runtime "lookup" itself: its error is the documented one.
        torch.testing.assert_close(lookup_out, lookups[target](below) + lut.target_bias, rtol=1e-6, atol=1e-6)
        dense_out = lut(above)
        assert lut.paths == {"lookup": 1, "dense": 1}
        torch.testing.assert_close(dense_out, exact[target][:17], rtol=1e-5, atol=1e-5)
        # A pinned crossover holds at every budget; full compensation is x @ W up to the tables' rounding.
        lut.set_budget(32)
        full = lut(below) - lut.target_bias
        assert lut.paths["lookup"] == 2
        reference = exact[target][:16] - lut.target_bias
        assert float((full - reference).norm() / reference.norm()) < 5e-3
    assert encoder.counts["encodings"] == len(TARGETS)  # one per input tensor (a new slice per target); dense never encodes


def _rows(lookup_ms, dense_ms, tokens=CALIBRATION_TOKENS):
    return [{"tokens": n, "lookup_ms": a, "dense_ms": b} for n, a, b in zip(tokens, lookup_ms, dense_ms)]


@pytest.mark.parametrize("rows, crossover", [
    (_rows([2, 2, 3, 9, 30], [1, 1, 2, 4, 9]), 0),  # never faster: always dense (the CPU demo shape)
    (_rows([1, 2, 10, 50, 200], [2, 3, 5, 20, 60]), 8 + int(56 * 1 / 6)),  # zero of the 8 -> 64 line
    (_rows([1, 1, 1, 1, 1], [2, 2, 2, 2, 2]), 2048),  # never beyond the largest measured count
    (_rows([1, 3, 1, 9, 30], [2, 2, 2, 4, 9]), 64 + int(448 * 1 / 6)),  # the largest count that won
    (_rows([1, 4], [2, 4]), 8),  # a tie at the next count: the threshold reaches it
    ([], 0)])
def test_crossover_rule_on_given_times(rows, crossover):
    assert crossover_from(rows) == crossover


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_calibration_measures_each_group_on_its_device(built, model, device):
    model.to(device)
    installed = install_luts(model, lut_format.open_lut(built[3]), runtime="auto")
    table = installed[TARGETS[0]].calibration
    assert all(lut.calibration is table for lut in installed.values())  # one group: one shared encoder
    assert table["targets"] == TARGETS and table["budgets"] == [0, 0, 0]
    assert table["device"].startswith(device) and table["dtype"] == "float32"
    assert [row["tokens"] for row in table["rows"]] == list(CALIBRATION_TOKENS)[:len(table["rows"])]
    assert all(row["lookup_ms"] > 0 and row["dense_ms"] > 0 for row in table["rows"])
    assert table["crossover_tokens"] == crossover_from(table["rows"]) == installed[TARGETS[0]].crossover_tokens
    assert installed[TARGETS[0]].encoder.counts["encodings"] == 0  # calibration encodings are not counted
    # Another budget: the measured crossover no longer holds until it is measured again.
    for lut in installed.values():
        lut.set_budget(8)
    with pytest.raises(ConfigError, match="calibrate_auto"):
        installed[TARGETS[0]](torch.randn(2, 32, device=device))
    [again] = calibrate_auto(installed)
    assert again["budgets"] == [8, 8, 8] and installed[TARGETS[0]].calibration is again
    # The time bound: past it only the first count is measured.
    assert len(calibrate(list(installed.values()), max_seconds=0)["rows"]) == 1


def test_calibration_time_bound_leaves_out_the_kernels_first_use(built, model, monkeypatch):
    """A first call that takes long (Triton compiling on a GPU: ~5 s) does not use up the time bound:
    the counts after it are still measured."""
    installed = install_luts(model, lut_format.open_lut(built[3]), runtime="auto")
    luts = list(installed.values())
    first_calls, lookup_path = [], luts[0].lookup_path

    def slow_first(x: torch.Tensor) -> torch.Tensor:
        if not first_calls:
            first_calls.append(len(x))
            time.sleep(1.0)
        return lookup_path(x)
    monkeypatch.setattr(luts[0], "lookup_path", slow_first)
    table = calibrate(luts, max_seconds=0.5)
    assert first_calls == [1] and len(table["rows"]) > 1 and table["seconds"] > 1.0


@pytest.mark.parametrize("report, named", [
    (None, "missing"), ('{"hook": "encoder', "not valid JSON"),
    ('{"hook": "%s", "hook": "encoder.layer.0.output"}' % HOOK, "not valid JSON \\(key 'hook' given twice\\)"),
    ('{"hook": ["%s"]}' % HOOK, "hook \\['.*'\\] is not a tensor name"), ("[]", "hook None is not a tensor name")],
    ids=["missing", "truncated", "hook-twice", "hook-list", "not-object"])
def test_a_damaged_sae_report_is_named(built, tmp_path, report, named):
    """The lut stage's evaluation reads its tensor's name from the SAE stage's report.json: a missing
    or cut-short report was a Python traceback, a hook given twice the last of the two."""
    from actstore.lut import heldout_inputs
    config, extract_dir = built[0], built[1]
    if report is not None:
        (tmp_path / "report.json").write_text(report)
    with pytest.raises(FormatError, match=f"{re.escape(str(tmp_path / 'report.json'))}: {named}"):
        heldout_inputs(config, extract_dir, tmp_path)


def test_stage_reports_the_calibration_per_budget(built):
    from actstore.lut import end_to_end, heldout_inputs
    config, extract_dir, sae_dir, lut_out, _ = built
    config = copy.deepcopy(config)
    config["lut"]["runtime"] = "auto"
    loaded = load_model(resolve_model_path(config["model"]["path"]), "float32", "cpu")
    samples = heldout_inputs(config, extract_dir, sae_dir)[1]
    result = end_to_end(config, extract_dir, lut_out / "lut", loaded, samples, [0, 8])
    for budget in ("0", "8"):
        [table] = result["budgets"][budget]["calibration"]
        assert table["budgets"] == [int(budget)] * 3
        crossover = result["budgets"][budget]["crossover_tokens"]
        assert crossover == {t: table["crossover_tokens"] for t in TARGETS}
        by_target = result["budgets"][budget]["paths_by_target"]
        assert set(by_target) == set(TARGETS) and all(sum(paths.values()) > 0 for paths in by_target.values())
        assert result["budgets"][budget]["paths"] == {p: sum(t[p] for t in by_target.values()) for p in ("lookup", "dense")}


def test_report_has_errors_and_end_to_end(built):
    report = built[4]
    on_disk = json.loads((built[3] / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    for target in TARGETS:
        errs = report["relative_error"][target]
        assert set(errs) == {"0", "8", "32"}
        assert errs["32"]["relative_error"] < 5e-3 < errs["0"]["relative_error"]
    assert report["end_to_end"]["runtime"] == "lookup"
    e2e = report["end_to_end"]["budgets"]
    assert all(e2e[b]["calibration"] == [] for b in e2e)  # nothing to measure: the lookup always runs
    assert all(e2e[b]["paths"]["dense"] == 0 < e2e[b]["paths"]["lookup"] for b in e2e)
    assert e2e["32"]["cosine_mean"] > 0.999
    assert -1 <= e2e["0"]["cosine_min"] <= e2e["0"]["cosine_mean"] <= 1


def test_inspect_detect_read_vector(built):
    lut_out = built[3]
    assert lut_format.detect(lut_out) and lut_format.detect(lut_out / "lut")
    assert not lut_format.detect(built[1])
    info = lut_format.inspect(lut_out)
    assert info["format"] == "lut" and info["layers"] == [1] and info["n_shards"] == 3
    assert info["d_model"] == 32 and info["dtype"] == "float16" and info["n_examples"] is None
    assert info["bytes"] == sum(f.stat().st_size for f in (lut_out / "lut").iterdir())
    assert lut_format.read_vector(lut_out, 0, 1, 0) is None


def test_inspect_reads_the_dtype_of_a_store_without_our_extensions(copy_of):
    """Another writer's bfloat16 store, with the spec's fields alone (no dtype in metadata.json): inspect
    says what the tables hold; with the table gone it says nothing rather than failing."""
    meta = json.loads((copy_of / "metadata.json").read_text())
    for target, entry in meta["layers"].items():
        file = copy_of / entry["file"]
        save_file({key: value.bfloat16() for key, value in load_file(str(file)).items()}, str(file))
        meta["layers"][target] = {key: entry[key] for key in ("input_dim", "output_dim", "file")}
    (copy_of / "metadata.json").write_text(json.dumps(meta))
    assert lut_format.verify(copy_of) == []
    assert lut_format.inspect(copy_of)["dtype"] == "bfloat16"
    (copy_of / meta["layers"][TARGETS[0]]["file"]).unlink()
    assert lut_format.inspect(copy_of)["dtype"] is None


@pytest.fixture
def copy_of(built, tmp_path):
    import shutil
    dst = tmp_path / "lut"
    shutil.copytree(built[3] / "lut", dst)
    return dst


def test_flipped_byte_and_missing_file_are_named(copy_of):
    file = copy_of / f"{TARGETS[0]}.lut.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x01
    file.write_bytes(bytes(data))
    (copy_of / f"{TARGETS[2]}.lut.safetensors").unlink()
    problems = lut_format.verify(copy_of)
    assert any(file.name in p and "sha256" in p for p in problems)
    assert any(f"{TARGETS[2]}.lut.safetensors" in p and "missing" in p for p in problems)
    assert len(problems) == 2


def test_a_table_linked_from_outside_the_store_is_refused(copy_of, tmp_path):
    file = copy_of / f"{TARGETS[0]}.lut.safetensors"
    outside = tmp_path / "elsewhere.lut.safetensors"
    outside.write_bytes(file.read_bytes())  # the same bytes: only where they live is wrong
    file.unlink()
    file.symlink_to(outside)
    problems = lut_format.verify(copy_of)
    assert len(problems) == 1 and file.name in problems[0] and "outside" in problems[0]
    with pytest.raises(FormatError, match="outside"):
        lut_format.open_lut(copy_of).load(TARGETS[0])


def _rewrite(copy_of, target, edit):
    """Rewrite one LUT file with edited tensors and re-record its sha256 (a well-formed but wrong file)."""
    from actstore.io_utils import sha256_file
    file = copy_of / f"{target}.lut.safetensors"
    tables = load_file(str(file))
    edit(tables)
    save_file(tables, str(file))
    meta = json.loads((copy_of / "metadata.json").read_text())
    meta["layers"][target].update(sha256=sha256_file(file), bytes=file.stat().st_size)
    (copy_of / "metadata.json").write_text(json.dumps(meta))
    return file


def test_wrong_shape_or_missing_key_is_refused_naming_it(copy_of):
    file = _rewrite(copy_of, TARGETS[0], lambda t: t.update(precomputed_products=t["precomputed_products"][:, :31].contiguous()))
    store = lut_format.open_lut(copy_of)
    with pytest.raises(FormatError, match=rf"{file.name}.*'precomputed_products'.*\[64, 31\]"):
        store.load(TARGETS[0])
    file2 = _rewrite(copy_of, TARGETS[1], lambda t: t.pop("bias_product"))
    with pytest.raises(FormatError, match=rf"{file2.name}.*missing key 'bias_product'"):
        store.load(TARGETS[1])
    problems = lut_format.verify(copy_of)
    assert any(file.name in p and "precomputed_products" in p for p in problems)
    assert any(file2.name in p and "bias_product" in p for p in problems)
    _rewrite(copy_of, TARGETS[2], lambda t: t.update(bias_product=t["bias_product"].float()))
    assert any("bias_product" in p and "F32" in p for p in lut_format.verify(copy_of))


def test_metadata_missing_field_is_named(copy_of):
    meta = json.loads((copy_of / "metadata.json").read_text())
    del meta["sae_config"]["k_active"]
    del meta["layers"][TARGETS[0]]["output_dim"]
    (copy_of / "metadata.json").write_text(json.dumps(meta))
    problems = lut_format.verify(copy_of)
    assert any("sae_config.k_active" in p for p in problems)
    assert any(f"layers.{TARGETS[0]}.output_dim" in p for p in problems)
    with pytest.raises(FormatError, match="sae_config.k_active"):
        lut_format.open_lut(copy_of)
    (copy_of / "metadata.json").write_text("{not json")
    assert "not valid JSON" in lut_format.verify(copy_of)[0]


@pytest.mark.parametrize("edit, named", [
    (lambda m: m["layers"][TARGETS[0]].update(dtype={}), rf"layers\.{TARGETS[0]}\.dtype' must be one of"),
    (lambda m: m["layers"][TARGETS[0]].update(dtype="bfloat16"), r"tables are F16, metadata.json says dtype 'bfloat16'"),
    (lambda m: m["layers"][TARGETS[1]].update(has_bias=1.5), rf"layers\.{TARGETS[1]}\.has_bias' must be true or false"),
    (lambda m: m["layers"][TARGETS[1]].update(has_bias=not m["layers"][TARGETS[1]]["has_bias"]),
     r"metadata.json says has_bias"),
    (lambda m: m["model_config"].update(hidden_size="0"), r"model_config\.hidden_size' must be a positive whole number"),
    (lambda m: m["creation_info"].update(created_at=7), r"creation_info\.created_at' must be an ISO 8601 time"),
    (lambda m: m.update(version=""), r"field 'version' missing or not a version string"),
    (lambda m: m.update(version="2.0"), r"field 'version' '2.0' is not a 1.x LUT: this reader knows version 1.0"),
])
def test_a_metadata_field_of_the_wrong_type_or_value_is_named(copy_of, edit, named):
    """Optional fields (model_config, creation_info, our dtype and has_bias) are checked where given:
    their type, and dtype and has_bias against the table file itself."""
    meta = json.loads((copy_of / "metadata.json").read_text())
    edit(meta)
    (copy_of / "metadata.json").write_text(json.dumps(meta))
    assert any(re.search(named, p) for p in lut_format.verify(copy_of)), lut_format.verify(copy_of)


@pytest.mark.parametrize("key, value", [("precomputed_products", float("nan")), ("encoder_weight", float("inf")),
                                        ("target_bias", float("-inf"))])
def test_a_table_holding_inf_or_nan_is_refused_at_load(copy_of, key, value):
    """A well-formed table (sha256 re-recorded, as another writer's store has none) with one value no
    product of finite weights is: loading names the file and key, where the runtime would make every
    token that selects the row NaN."""
    def edit(tables):
        tables[key].view(-1)[1] = value
    file = _rewrite(copy_of, TARGETS[0], edit)
    with pytest.raises(FormatError, match=rf"{re.escape(file.name)}: key '{key}' holds 1 inf or NaN values"):
        lut_format.open_lut(copy_of, verify=True).load(TARGETS[0])
    lut_format.open_lut(copy_of).load(TARGETS[1])  # the other tables still load


@pytest.mark.parametrize("edit", ["swapped", "shared"])
def test_a_layer_listing_another_layers_file_is_refused(copy_of, edit):
    """metadata.json entries swapped (sizes and sha256 along) or one file listed for two layers: every
    record fits a real file, yet a layer would be served another's table. The spec names each layer's
    file after its path: verify and open_lut name metadata.json, the layer and the file."""
    meta = json.loads((copy_of / "metadata.json").read_text())
    q, k = TARGETS[:2]
    layers = meta["layers"]
    layers[q], layers[k] = (layers[k], layers[q]) if edit == "swapped" else (dict(layers[k]), layers[k])
    (copy_of / "metadata.json").write_text(json.dumps(meta))
    named = rf"metadata\.json: layers\.{re.escape(q)}\.file '{re.escape(k)}\.lut\.safetensors' is not " \
            rf"'{re.escape(q)}\.lut\.safetensors'"
    assert any(re.search(named, p) for p in lut_format.verify(copy_of)), lut_format.verify(copy_of)
    with pytest.raises(FormatError, match=named):
        lut_format.open_lut(copy_of)


def test_causal_lm_end_to_end_reports_kl_and_perplexity(extracted, tmp_path, monkeypatch):
    """A tiny Llama: q/k/v projections (nn.Linear, base-model paths) swapped for LUTs in the real
    causal LM; full compensation must give the original next-token distribution back."""
    hook = "layers.1.self_attn.q_proj:input"
    config, extract_dir = extracted("llama", extract={"hooks": [hook]})
    config = copy.deepcopy(config)
    config["sae"].update({**SAE, "hook": hook})
    config["lut"].update({**LUT, "targets": [f"layers.1.self_attn.{m}_proj" for m in "qkv"]})
    build_sae(config, extract_dir, tmp_path / "sae", progress=False)
    report = build_lut(config, extract_dir, tmp_path / "sae", tmp_path / "lut", progress=False)
    e2e = report["end_to_end"]["budgets"]
    exact = e2e["32"]  # 32 = the hidden size: every input dim compensated
    assert exact["kl_mean"] < 1e-4
    assert abs(exact["perplexity_change"]) < 1e-3 * exact["perplexity_original"]
    assert e2e["0"]["kl_mean"] > exact["kl_mean"]
    assert e2e["0"]["perplexity_original"] == exact["perplexity_original"]
    # Logits bounded: batches of 2 rows when a batch's logits would pass LUT_EVAL_LOGITS; the same report.
    import actstore.lut as lut_module
    loaded = load_model(resolve_model_path(config["model"]["path"]), "float32", "cpu")
    rows, run_model = [], lut_module.run_model
    monkeypatch.setattr(lut_module, "run_model", lambda loaded, inp: rows.append(len(inp["input_ids"])) or run_model(loaded, inp))
    monkeypatch.setattr(lut_module, "LUT_EVAL_LOGITS", 2 * config["extract"]["max_seq_length"] * 300)
    samples = lut_module.heldout_inputs(config, extract_dir, tmp_path / "sae")[1]
    bounded = lut_module.end_to_end(config, extract_dir, tmp_path / "lut" / "lut", loaded, samples, [0, 32])["budgets"]
    assert rows and max(rows) == 2 < config["extract"]["batch_size"]
    for budget in ("0", "32"):
        for key in ("kl_mean", "perplexity_original", "perplexity_lut"):  # to float rounding: other batches
            assert bounded[budget][key] == pytest.approx(e2e[budget][key], rel=1e-4, abs=1e-6), (budget, key)


@pytest.mark.parametrize("target, message", [
    ("encoder.layer.1.attention.output.LayerNorm", "is a LayerNorm, not nn.Linear"),
    ("encoder.layer.1.intermediate.dense.nothing", "does not exist"),
    ("encoder.layer.1.output.dense", "takes 64 inputs, the SAE 32")])
def test_a_bad_lut_target_fails_before_the_sae_trains(built, target, message, monkeypatch):
    import actstore.models
    from actstore.lut import check_targets_before_training
    config = copy.deepcopy(built[0])
    config["lut"]["targets"] = [TARGETS[0], target]
    monkeypatch.setattr(actstore.models, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match=f"{target}.*{message}"):
        check_targets_before_training(config, built[1])
    config["lut"]["targets"] = TARGETS
    check_targets_before_training(config, built[1])


def test_a_table_past_float16s_range_is_refused_naming_it():
    """A product beyond +-65504 would be stored as inf and make every lookup through it inf: the
    precomputation refuses it, naming the module and tensor; bfloat16 keeps it."""
    from actstore.formats.lut import precompute

    torch.manual_seed(0)
    sae = {"encoder_weight": torch.randn(16, 8), "encoder_bias": torch.zeros(16),
           "decoder_weight": torch.randn(16, 8), "decoder_bias": torch.randn(8)}
    w_target = torch.randn(8, 4)
    w_target[:, 1] *= 1e6
    with pytest.raises(ConfigError, match=r"encoder.layer.1.q precomputed_products: \d+ values exceed float16's "
                                          r"range .*use lut.dtype: bfloat16"):
        precompute(sae, w_target, None, "float16", "encoder.layer.1.q")
    tables = precompute(sae, w_target, None, "bfloat16", "encoder.layer.1.q")
    assert torch.isfinite(tables["precomputed_products"].float()).all()
    assert torch.isfinite(precompute(sae, torch.randn(8, 4), None, "float16")["precomputed_products"]).all()
