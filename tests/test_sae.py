"""SAE stage: TopK training on a captured hook of a tiny real BERT, held-out report, import/export."""
from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from actstore.config import resolve_hook
from actstore.errors import ConfigError, FormatError
from actstore.formats import FORMAT_STAGES
from actstore.formats.extract import open_extraction
from actstore.sae import (Prefetcher, TopKSAE, auxk_loss, build_sae, data_mean, import_sae, init_sae, load_sae,
                          split_tokens, stream_batches, tensors)

HOOK = "encoder.layer.1.attention.self.query:input"
SAE = {"num_basis": 64, "k_active": 4, "steps": 150, "batch_size": 64, "lr": 0.003, "dead_tokens": 2000}


@pytest.fixture(scope="module")
def bert(extracted):
    config, extract_dir = extracted("bert", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    config["sae"].update(SAE, device="cpu")
    return config, extract_dir


@pytest.fixture(scope="module")
def trained(bert, tmp_path_factory):
    config, extract_dir = bert
    out = tmp_path_factory.mktemp("sae")
    report = build_sae(config, extract_dir, out, progress=False)
    return config, extract_dir, out, report


def test_split_is_by_whole_sample_and_disjoint(bert):
    config, extract_dir = bert
    extraction = open_extraction(extract_dir)
    split = split_tokens(extraction, 0.2, seed=0)
    assert split.n_train + split.n_heldout == extraction.n_tokens
    assert split.n_heldout > 0 and split.heldout_samples
    for part, train, held in zip(extraction.parts, split.train, split.heldout):
        assert not set(train) & set(held)
        for local, row in enumerate(part.samples):
            rows = set(range(*part.sample_slice(local).indices(part.meta["n_tokens"])))
            side = held if row["sample_idx"] in split.heldout_samples else train
            assert rows <= set(side)


def test_stream_batches_read_training_rows_from_the_memmaps(bert):
    config, extract_dir = bert
    extraction = open_extraction(extract_dir)
    split = split_tokens(extraction, 0.2, seed=0)
    arrays = tensors(extraction, HOOK)
    train = np.concatenate([np.asarray(a)[r] for a, r in zip(arrays, split.train)])
    batch = next(stream_batches(arrays, split.train, 16, np.random.default_rng(0))).numpy()
    assert batch.shape == (16, 32)
    for row in batch:  # every row is a real training token, bit for bit
        assert (train == row).all(axis=1).any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_prefetcher_yields_the_source_batches_in_order(bert, device):
    config, extract_dir = bert
    extraction = open_extraction(extract_dir)
    split = split_tokens(extraction, 0.2, seed=0)
    arrays = tensors(extraction, HOOK)
    expect = stream_batches(arrays, split.train, 16, np.random.default_rng(3))
    # More batches than the pinned ring has slots, so every slot is reused while batches are in use.
    with Prefetcher(stream_batches(arrays, split.train, 16, np.random.default_rng(3)), torch.device(device)) as got:
        kept = [next(got) for _ in range(12)]
    for batch in kept:
        assert batch.device.type == device
        assert torch.equal(batch.cpu(), next(expect))


def test_prefetcher_raises_the_source_error_in_the_training_thread():
    def source():
        yield torch.zeros(2, 3)
        raise ValueError("memmap read failed")

    with Prefetcher(source(), torch.device("cpu")) as batches:
        assert torch.equal(next(batches), torch.zeros(2, 3))
        with pytest.raises(ValueError, match="memmap read failed"):
            next(batches)


def test_encode_is_relu_then_topk_as_spec_step_a():
    torch.manual_seed(0)
    sae = TopKSAE(8, 16, 3)
    with torch.no_grad():
        for p in sae.parameters():
            p.normal_()
    x = torch.randn(5, 8)
    values, indices = sae.encode(x)
    sparse = torch.relu(x @ sae.encoder_weight.T + sae.encoder_bias)
    ref_v, ref_i = torch.topk(sparse, 3, dim=-1)
    torch.testing.assert_close(values, ref_v)
    assert torch.equal(indices, ref_i)
    manual = torch.stack([(ref_v[b, :, None] * sae.decoder_weight[ref_i[b]]).sum(0) for b in range(5)])
    torch.testing.assert_close(sae(x), manual + sae.decoder_bias)
    torch.testing.assert_close(sae.decode_dense(values, indices), manual + sae.decoder_bias)


def test_init_unit_norm_decoder_and_data_mean(bert):
    config, extract_dir = bert
    extraction = open_extraction(extract_dir)
    arrays = tensors(extraction, HOOK)
    split = split_tokens(extraction, 0.1, 0)
    mean = data_mean(arrays, split.train)
    expect = np.concatenate([np.asarray(a)[r] for a, r in zip(arrays, split.train)]).astype(np.float64).mean(0)
    np.testing.assert_allclose(mean.numpy(), expect, rtol=1e-5, atol=1e-6)
    sae = TopKSAE(32, 64, 4)
    init_sae(sae, mean, 0)
    torch.testing.assert_close(sae.decoder_weight.norm(dim=1), torch.ones(64))
    torch.testing.assert_close(sae.decoder_bias.data, mean)
    # encoder_bias = -W_enc @ mean: the first encoding sees centred data.
    torch.testing.assert_close(sae.pre_acts(mean[None])[0], torch.zeros(64), atol=1e-5, rtol=0)


def test_auxk_gives_gradient_to_dead_latents_only():
    torch.manual_seed(0)
    sae = TopKSAE(8, 16, 2)
    init_sae(sae, torch.zeros(8), 0)
    x = torch.randn(32, 8)
    pre = sae.pre_acts(x)
    values, indices = torch.topk(pre, 2, dim=-1)
    x_hat = sae.decode(values, indices)
    dead = torch.zeros(16, dtype=torch.bool)
    dead[[3, 7, 11]] = True
    aux = auxk_loss(sae, x, x_hat, pre, dead, 2)
    assert aux > 0
    aux.backward()
    rows_with_grad = set(torch.nonzero(sae.encoder_weight.grad.abs().sum(1)).flatten().tolist())
    assert rows_with_grad and rows_with_grad <= {3, 7, 11}
    assert auxk_loss(sae, x, x_hat, pre, torch.zeros(16, dtype=torch.bool), 2) == 0


def test_training_reduces_heldout_fvu_and_writes_report(trained):
    config, extract_dir, out, report = trained
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["hook"] == HOOK and on_disk["k_active"] == 4 and on_disk["num_basis"] == 64
    curve = on_disk["loss_curve"]
    assert curve[0]["step"] == 1 and curve[-1]["step"] == SAE["steps"]
    assert curve[-1]["fvu"] < 0.5 * curve[0]["fvu"]
    held = on_disk["heldout"]
    assert 0 < held["fvu"] < 0.5 and 0 <= held["dead_fraction"] < 1 and held["n_tokens"] > 0
    sae, meta = load_sae(out / "sae.safetensors")
    assert meta["hook"] == HOOK and sae.k_active == 4
    torch.testing.assert_close(sae.decoder_weight.norm(dim=1), torch.ones(64), atol=1e-5, rtol=0)
    # The saved checkpoint reproduces the report's held-out FVU.
    extraction = open_extraction(extract_dir)
    split = split_tokens(extraction, config["sae"]["heldout_fraction"], config["sae"]["seed"])
    x = torch.from_numpy(np.concatenate([np.asarray(a)[r] for a, r in zip(tensors(extraction, HOOK), split.heldout)]))
    with torch.no_grad():
        fvu = float((x - sae(x)).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
    assert fvu == pytest.approx(held["fvu"], rel=1e-3)


def test_hook_must_be_captured(bert):
    config, _ = bert
    bad = copy.deepcopy(config)
    bad["sae"]["hook"] = "encoder.layer.2.attention.self.query:input"
    with pytest.raises(ConfigError, match="encoder.layer.2.attention.self.query:input"):
        resolve_hook(bad)
    bad["sae"]["hook"], bad["extract"]["hooks"] = None, []
    with pytest.raises(ConfigError, match="extract.hooks"):
        resolve_hook(bad)
    assert resolve_hook(config) == HOOK


def _random_checkpoint(d_in=8, d_sae=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"W_enc": torch.randn(d_in, d_sae, generator=g), "b_enc": torch.randn(d_sae, generator=g),
            "W_dec": torch.randn(d_sae, d_in, generator=g), "b_dec": torch.randn(d_in, generator=g)}


def saelens_cfg(apply_b_dec: bool = True, k: int = 3, layout: str = "6", **fields) -> dict:
    """A SAELens cfg.json of a TopK SAE as SAELens writes it: 6.x (architecture topk, k) or before 6.0
    (activation_fn_str topk, activation_fn_kwargs k)."""
    if layout == "6":
        cfg = {"architecture": "topk", "k": k, "metadata": {"sae_lens_version": "6.18.0"}}
    else:
        cfg = {"architecture": "standard", "activation_fn_str": "topk", "activation_fn_kwargs": {"k": k},
               "sae_lens_version": "3.13.0"}
    return {**cfg, "d_in": 8, "d_sae": 16, "apply_b_dec_to_input": apply_b_dec, **fields}


def saelens_forward(ckpt: dict, cfg: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents, reconstruction) as SAELens 6.18's TopKSAE computes them (sae.py process_sae_in,
    topk_sae.py encode/TopK/decode): TopK of the pre-activations, then ReLU on the k kept."""
    norms = ckpt["W_dec"].norm(dim=1) if cfg.get("rescale_acts_by_decoder_norm") else torch.ones(ckpt["W_dec"].shape[0])
    x_in = x - ckpt["b_dec"] * cfg["apply_b_dec_to_input"]
    hidden = (x_in @ ckpt["W_enc"] + ckpt["b_enc"]) * norms
    top = torch.topk(hidden, cfg.get("k") or cfg["activation_fn_kwargs"]["k"], dim=-1)
    latents = torch.zeros_like(hidden).scatter(-1, top.indices, top.values.relu())
    return latents, (latents / norms) @ ckpt["W_dec"] + ckpt["b_dec"]


@pytest.mark.parametrize("style,apply_b_dec", [("saelens", True), ("saelens", False), ("saev", True)])
def test_import_folds_b_dec_into_encoder_bias(tmp_path, style, apply_b_dec):
    ckpt = _random_checkpoint()
    save_file(ckpt, str(tmp_path / "sae_weights.safetensors"))
    if style == "saelens":
        (tmp_path / "cfg.json").write_text(json.dumps(saelens_cfg(apply_b_dec)))
    sae = import_sae(tmp_path / "sae_weights.safetensors", style, k_active=3)
    x = torch.randn(6, 8)
    x_in = x - ckpt["b_dec"] if apply_b_dec else x
    ref = torch.topk(torch.relu(x_in @ ckpt["W_enc"] + ckpt["b_enc"]), 3, dim=-1)
    values, indices = sae.encode(x)
    torch.testing.assert_close(values, ref.values, atol=1e-5, rtol=1e-5)
    assert torch.equal(indices, ref.indices)
    torch.testing.assert_close(sae.decoder_weight.data, ckpt["W_dec"])
    torch.testing.assert_close(sae.decoder_bias.data, ckpt["b_dec"])


@pytest.mark.parametrize("layout, rescale", [("6", False), ("6", True), ("5", False)])
def test_import_encodes_and_decodes_as_saelens(tmp_path, layout, rescale):
    """Both cfg.json layouts SAELens reads, and 6.x's decoder-norm rescaling folded in as SAELens folds it."""
    ckpt = _random_checkpoint(seed=1)
    cfg = saelens_cfg(layout=layout, **({"rescale_acts_by_decoder_norm": True} if rescale else {}))
    save_file(ckpt, str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    sae = import_sae(tmp_path / "sae_weights.safetensors", "saelens", k_active=3)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    latents, recon = saelens_forward(ckpt, cfg, x)
    values, indices = sae.encode(x)
    torch.testing.assert_close(torch.zeros_like(latents).scatter(-1, indices, values), latents, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sae(x), recon, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fields, match", [
    ({"architecture": "jumprelu"}, r"cfg\.json: architecture 'jumprelu'"),
    ({"architecture": "batchtopk"}, r"cfg\.json: architecture 'batchtopk'"),
    ({"k": 5}, r"cfg\.json: k 5, but sae\.k_active is 3"),
    ({"normalize_activations": "expected_average_only_in"}, r"cfg\.json: normalize_activations"),
    ({"metadata": {}}, r"cfg\.json: architecture 'standard'"),  # no version: read as before 6.0, a ReLU SAE
])
def test_import_refuses_a_saelens_sae_it_would_encode_otherwise(tmp_path, fields, match):
    save_file(_random_checkpoint(), str(tmp_path / "sae_weights.safetensors"))
    cfg = {**saelens_cfg(), **fields}
    if fields == {"metadata": {}}:
        cfg = {key: value for key, value in cfg.items() if key not in ("architecture", "k")}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        import_sae(tmp_path / "sae_weights.safetensors", "saelens", k_active=3)


def test_saelens_folder_encodes_and_decodes_as_the_sae(trained):
    """saelens/ holds the trained SAE as SAELens 6 loads it: its forward gives the SAE's latents and
    reconstruction, and importing it back gives the same SAE, tensor for tensor."""
    from safetensors.torch import load_file

    config, extract_dir, out, _ = trained
    sae, _ = load_sae(out / "sae.safetensors")
    cfg = json.loads((out / "saelens" / "cfg.json").read_text())
    ckpt = load_file(str(out / "saelens" / "sae_weights.safetensors"))
    assert {key: cfg[key] for key in ("architecture", "d_in", "d_sae", "k", "apply_b_dec_to_input", "dtype")} == {
        "architecture": "topk", "d_in": 32, "d_sae": 64, "k": 4, "apply_b_dec_to_input": False, "dtype": "float32"}
    assert cfg["metadata"]["hook_name"] == HOOK and cfg["metadata"]["sae_lens_version"] == "6.0.0"
    x = torch.from_numpy(np.array(tensors(open_extraction(extract_dir), HOOK)[0][:200]))
    latents, recon = saelens_forward(ckpt, cfg, x)
    with torch.no_grad():
        values, indices = sae.encode(x)
        torch.testing.assert_close(torch.zeros_like(latents).scatter(-1, indices, values), latents)
        torch.testing.assert_close(sae(x), recon, atol=1e-5, rtol=1e-5)
    back = import_sae(out / "saelens", "saelens", k_active=4)  # the folder, as SAELens saves it
    assert all(torch.equal(back.state()[key], sae.state()[key]) for key in sae.state())


def write_saev_checkpoint(path, ckpt: dict, activation: dict | None, schema: int | None = 5, cls: str | None = None):
    """A checkpoint as saev.nn.dump writes it (saev 3d73f1f): one JSON header line, then torch.save of
    the state dict. `activation`: cfg.activation ({"cls", "params"}); `cls`: schema 1's class name."""
    weights = ckpt.get("W_enc")  # the sizes of the weights after it, as saev.nn.dump records them
    d_model, d_sae = weights.shape if isinstance(weights, torch.Tensor) and weights.ndim == 2 else (8, 16)
    header = {"cfg": {"d_model": d_model, "d_sae": d_sae, **({"activation": activation} if activation else {})},
              "commit": "unknown", "lib": "1.0.0"}
    if schema is not None:
        header["schema"] = schema
    if cls:
        header["cls"], header["cfg"]["top_k"] = cls, 3
    with open(path, "wb") as fh:
        fh.write(json.dumps(header).encode() + b"\n")
        torch.save(ckpt, fh)


SAEV_TOPK = {"cls": "TopK", "params": {"key": "top-k", "top_k": 3, "sparsity": {"cls": "NoSparsity", "params": {}}}}


@pytest.mark.parametrize("schema, activation, cls", [(5, SAEV_TOPK, None), (1, None, "TopK")])
def test_import_reads_saevs_own_checkpoint_and_encodes_as_saev(tmp_path, schema, activation, cls):
    """saev's file (header line + torch.save): x @ W_enc + b_enc, no b_dec subtracted (saev.nn.modeling
    SparseAutoencoder.encode), TopK; equal to saev's encoding wherever the k kept are positive."""
    ckpt = _random_checkpoint(seed=3)
    ckpt["b_enc"] = ckpt["b_enc"].abs() + 4  # every token has k positive pre-activations
    write_saev_checkpoint(tmp_path / "sae.pt", ckpt, activation, schema, cls)
    sae = import_sae(tmp_path / "sae.pt", "saev", k_active=3)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
    hidden = x @ ckpt["W_enc"] + ckpt["b_enc"]
    top = torch.topk(hidden, 3, dim=-1)
    latents = torch.zeros_like(hidden).scatter(-1, top.indices, top.values)
    values, indices = sae.encode(x)
    torch.testing.assert_close(torch.zeros_like(hidden).scatter(-1, indices, values), latents)
    torch.testing.assert_close(sae(x), latents @ ckpt["W_dec"] + ckpt["b_dec"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("schema, activation, cls, match", [
    (5, {"cls": "BatchTopK", "params": {"top_k": 3}}, None, "a saev BatchTopK SAE"),
    (5, {"cls": "Relu", "params": {}}, None, "a saev Relu SAE"),
    (None, None, None, "a saev Relu SAE"),  # before schemas every saev SAE was ReLU
    (5, {"cls": "TopK", "params": {"top_k": 8}}, None, "top_k 8, but sae.k_active is 3"),
])
def test_import_refuses_a_saev_sae_that_is_not_topk_k(tmp_path, schema, activation, cls, match):
    write_saev_checkpoint(tmp_path / "sae.pt", _random_checkpoint(), activation, schema, cls)
    with pytest.raises(ConfigError, match=r"sae\.pt: " + match):
        import_sae(tmp_path / "sae.pt", "saev", k_active=3)


def test_a_safetensors_file_whose_first_byte_is_a_brace_is_not_taken_for_saevs_file(tmp_path):
    """A safetensors file starts with its header's length; the library pads it to a multiple of 8, but
    the format does not require it (safetensors reads this one): a length of 379 makes the first
    byte "{", as a saev checkpoint's JSON header line starts."""
    import struct

    from safetensors.torch import save

    ckpt = _random_checkpoint()
    raw = save(ckpt)
    (length,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + length].rstrip(b" ")
    header += b" " * (-(len(header) - 123) % 256)  # header length = 123 mod 256
    (tmp_path / "sae.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length:])
    assert (tmp_path / "sae.safetensors").read_bytes()[:1] == b"{"
    sae = import_sae(tmp_path / "sae.safetensors", "saev", k_active=3)
    torch.testing.assert_close(sae.encoder_weight.data, ckpt["W_enc"].T)


def test_import_of_a_saev_checkpoint_never_runs_its_pickle(tmp_path):
    """The weights are read by torch's weights-only unpickler: a payload that would run code is refused
    and named, never run."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "ran",))

    header = {"schema": 5, "cfg": {"d_model": 8, "d_sae": 16, "activation": SAEV_TOPK}}
    (tmp_path / "sae.pt").write_bytes(json.dumps(header).encode() + b"\n" + pickle.dumps(Payload(), protocol=2))
    with pytest.raises(FormatError, match=r"sae\.pt: saev checkpoint weights unreadable"):
        import_sae(tmp_path / "sae.pt", "saev", k_active=3)
    assert not (tmp_path / "ran").exists()
    (tmp_path / "bad.pt").write_bytes(b"{not json\n")
    with pytest.raises(FormatError, match=r"bad\.pt: saev checkpoint header is not one JSON line"):
        import_sae(tmp_path / "bad.pt", "saev", k_active=3)


def test_import_refuses_missing_key_and_wrong_shape(tmp_path):
    ckpt = _random_checkpoint()
    del ckpt["b_enc"]
    save_file(ckpt, str(tmp_path / "a.safetensors"))
    with pytest.raises(FormatError, match=r"a\.safetensors.*b_enc"):
        import_sae(tmp_path / "a.safetensors", "saev", 3)
    ckpt = _random_checkpoint()
    ckpt["W_dec"] = torch.randn(16, 9)
    save_file(ckpt, str(tmp_path / "b.safetensors"))
    with pytest.raises(FormatError, match=r"b\.safetensors.*W_dec"):
        import_sae(tmp_path / "b.safetensors", "saelens", 3)


def test_build_sae_import_evaluates_on_heldout(bert, tmp_path):
    config, extract_dir = bert
    ckpt = _random_checkpoint(d_in=32, d_sae=64)
    save_file(ckpt, str(tmp_path / "in.safetensors"))
    config = copy.deepcopy(config)
    config["sae"]["import"] = {"path": str(tmp_path / "in.safetensors"), "style": "saev"}
    report = build_sae(config, extract_dir, tmp_path / "out", progress=False)
    assert report["source"] == "import:saev" and report["heldout"]["fvu"] > 0
    sae, _ = load_sae(tmp_path / "out" / "sae.safetensors")
    torch.testing.assert_close(sae.encoder_weight.data, ckpt["W_enc"].T)


def _edited_checkpoint(path: Path, out: Path, tensors: dict | None = None, header: dict | None = None) -> Path:
    """A copy of the actstore checkpoint at `path`, its tensors and header fields replaced by those given."""
    from safetensors import safe_open

    from actstore.safetensors_io import save_safetensors

    with safe_open(str(path), framework="pt") as fh:
        meta, state = fh.metadata(), {key: fh.get_tensor(key) for key in fh.keys()}
    save_safetensors({**state, **(tensors or {})}, out, {**meta, **(header or {})})
    return out


@pytest.mark.parametrize("tensors, header, named", [
    (None, {"k_active": "four"}, r"header k_active 'four' is not a whole number in 1\.\.num_basis \(64\)"),
    (None, {"k_active": "0"}, "header k_active '0'"),
    (None, {"k_active": "65"}, "header k_active '65'"),
    (None, {"num_basis": "32"}, "header num_basis '32', but the tensors' is 64"),
    ({"decoder_weight": torch.zeros(64, 16)}, None, r"decoder_weight has shape \[64, 16\], expected \[64, 32\]"),
    ({"decoder_bias": torch.zeros(5)}, None, r"decoder_bias has shape \[5\], expected \[32\] \(d_in\)"),
    ({"encoder_weight": torch.zeros(64, 32, dtype=torch.int64)}, None, "encoder_weight is int64, expected float32"),
    ({"encoder_bias": torch.zeros(64, dtype=torch.float16)}, None, "encoder_bias is float16, expected float32"),
    ({"decoder_weight": torch.full((64, 32), float("nan"))}, None, "decoder_weight holds NaN or infinite values"),
    ({"encoder_bias": torch.full((64,), float("inf"))}, None, "encoder_bias holds NaN or infinite values"),
])
def test_load_sae_names_the_file_and_key_of_a_bad_checkpoint(trained, tmp_path, tensors, header, named):
    """A checkpoint that is not the four float32 tensors of agreeing shapes and finite values with a
    header k_active in 1..num_basis is refused naming the file and key: never loaded (an int64 or NaN
    SAE became a LUT) nor a bare ValueError or broadcasting RuntimeError."""
    bad = _edited_checkpoint(trained[2] / "sae.safetensors", tmp_path / "bad.safetensors", tensors, header)
    with pytest.raises(FormatError, match=r"bad\.safetensors: " + named):
        load_sae(bad)


def test_load_sae_names_an_unreadable_file(trained, tmp_path):
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes((trained[2] / "sae.safetensors").read_bytes()[:-100])
    with pytest.raises(FormatError, match=r"cut\.safetensors: unreadable safetensors"):
        load_sae(bad)


@pytest.mark.parametrize("edit, named", [
    ({"W_enc": torch.zeros(8)}, r"W_enc has shape \[8\], expected \[8, d_sae\]"),
    ({"W_enc": torch.zeros(8, 16, dtype=torch.int64)}, "W_enc is int64, expected floating point"),
    ({"b_dec": torch.full((8,), float("nan"))}, "b_dec holds NaN or infinite values"),
    ({"W_dec": torch.full((16, 8), 1e300, dtype=torch.float64)}, "W_dec holds NaN or infinite values"),
])
def test_import_names_the_file_and_key_of_a_malformed_checkpoint(tmp_path, edit, named):
    """SAELens' file of SAELens' dtypes (float16 too) imports; one with a tensor of the wrong number of
    dimensions or dtype, or with values float32 cannot hold, is refused naming it."""
    save_file({**_random_checkpoint(), **edit}, str(tmp_path / "sae_weights.safetensors"))
    with pytest.raises(FormatError, match=r"sae_weights\.safetensors: " + named):
        import_sae(tmp_path / "sae_weights.safetensors", "saelens", k_active=3)
    save_file({key: value.half() for key, value in _random_checkpoint().items()}, str(tmp_path / "half.safetensors"))
    assert import_sae(tmp_path / "half.safetensors", "saelens", k_active=3).num_basis == 16


def test_import_names_a_saev_checkpoint_holding_no_tensors_and_too_few_latents(tmp_path):
    write_saev_checkpoint(tmp_path / "sae.pt", {"W_enc": [1.0, 2.0], "b_enc": 3, "W_dec": "x", "b_dec": None},
                          SAEV_TOPK)
    with pytest.raises(FormatError, match=r"sae\.pt: W_enc is a list, not a tensor"):
        import_sae(tmp_path / "sae.pt", "saev", k_active=3)
    save_file(_random_checkpoint(d_sae=2), str(tmp_path / "small.safetensors"))
    with pytest.raises(ConfigError, match=r"small\.safetensors: d_sae 2, fewer latents than sae\.k_active 3"):
        import_sae(tmp_path / "small.safetensors", "saev", k_active=3)


def test_import_takes_no_boolean_for_the_checkpoints_k(tmp_path):
    """true == 1 in Python: a cfg.json k or a saev top_k of true is not sae.k_active 1."""
    save_file(_random_checkpoint(), str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps(saelens_cfg(k=True)))
    with pytest.raises(ConfigError, match=r"cfg\.json: k True, but sae\.k_active is 1"):
        import_sae(tmp_path / "sae_weights.safetensors", "saelens", k_active=1)
    write_saev_checkpoint(tmp_path / "sae.pt", _random_checkpoint(), {"cls": "TopK", "params": {"top_k": True}})
    with pytest.raises(ConfigError, match=r"sae\.pt: top_k True, but sae\.k_active is 1"):
        import_sae(tmp_path / "sae.pt", "saev", k_active=1)


LUT_TARGET = "encoder.layer.1.attention.self.query"


@pytest.fixture(scope="module")
def lut_run(extracted, tmp_path_factory):
    """The extract, sae and lut stages of a run with every format stage off, each stage directory
    sealed by its stage config as the workflow writes it: what the validate stage checks."""
    from actstore.hashing import stage_dirs
    from actstore.lut import build_lut
    from actstore.workflow import record_stage

    config, extract_dir = extracted("bert", extract={"hooks": [HOOK]},
                                    **{stage: {"enabled": False} for stage in FORMAT_STAGES})
    config = copy.deepcopy(config)
    config["sae"].update(SAE, enabled=True, steps=20, device="cpu")
    config["lut"].update(targets=[LUT_TARGET], budgets=[0], eval_samples=2, device="cpu")
    dirs = stage_dirs(config)
    record_stage(config, "extract", extract_dir)
    build_sae(config, extract_dir, dirs["sae"], progress=False)
    record_stage(config, "sae", dirs["sae"])
    build_lut(config, extract_dir, dirs["sae"], dirs["lut"], progress=False)
    record_stage(config, "lut", dirs["lut"])
    return config


@pytest.fixture
def run_copy(lut_run, tmp_path):
    """lut_run's config pointed at a copy of its dump_to that a test may change."""
    shutil.copytree(lut_run["dump_to"], tmp_path / "dump", symlinks=True)
    return {**lut_run, "dump_to": str(tmp_path / "dump")}


def test_validate_refuses_a_lut_built_from_another_sae(run_copy, tmp_path):
    """The sae stage's directory is named by its config, not its output: a rerun (GPU training is not
    bit-reproducible; here another seed) leaves another SAE beside the LUT, which verifies. The sha256
    the LUT records of the SAE it was built from is checked, both files named."""
    from actstore.hashing import stage_dirs
    from actstore.io_utils import sha256_file
    from actstore.sae import SAE_FILE
    from actstore.verify import validate_all
    from actstore.workflow import record_stage

    dirs = stage_dirs(run_copy)
    meta_path, sae_file = dirs["lut"] / "lut" / "metadata.json", dirs["sae"] / SAE_FILE
    assert json.loads(meta_path.read_text())["creation_info"]["sae_sha256"] == sha256_file(sae_file)
    assert validate_all(run_copy, tmp_path / "report.json")["formats"]["lut"]["notes"] == []
    rerun = copy.deepcopy(run_copy)
    rerun["sae"]["seed"] += 1
    build_sae(rerun, dirs["extract"], dirs["sae"], progress=False)
    record_stage(run_copy, "sae", dirs["sae"])  # the stage config as a rerun of the same config writes it
    named = (rf"{re.escape(str(meta_path))}: creation_info\.sae_sha256 '[0-9a-f]{{64}}' is not the sha256 of "
             rf"{re.escape(str(sae_file))} \([0-9a-f]{{64}}\): the LUT was built from another SAE")
    with pytest.raises(FormatError, match=named):
        validate_all(run_copy, tmp_path / "report.json")


def test_validate_notes_a_lut_that_records_no_sae_sha256(run_copy, tmp_path):
    """A LUT written before the SAE's sha256 was recorded: validate passes it and says it did not check."""
    from actstore.hashing import stage_dirs
    from actstore.verify import validate_all
    from actstore.workflow import record_stage

    lut_dir = stage_dirs(run_copy)["lut"]
    meta = json.loads((lut_dir / "lut" / "metadata.json").read_text())
    del meta["creation_info"]["sae_sha256"]
    (lut_dir / "lut" / "metadata.json").write_text(json.dumps(meta))
    record_stage(run_copy, "lut", lut_dir)  # as the stage sealed it then
    report = validate_all(run_copy, tmp_path / "report.json")
    assert report["formats"]["lut"]["notes"] == [
        "creation_info.sae_sha256 absent (a LUT written before actstore recorded it): "
        "not checked against the sae stage's sae.safetensors"]
    assert json.loads((tmp_path / "report.json").read_text())["formats"]["lut"]["notes"] == report["formats"]["lut"]["notes"]


@pytest.mark.parametrize("planted, named", [
    ("link", r"report\.json: a link to .*outside\.json, outside .*: not read"),
    ('{"fvu": 1, "fvu": 2}', r"report\.json: not valid JSON \(key 'fvu' given twice\)"),
    ('{"fvu": ', r"report\.json: not valid JSON \(Expecting value")])
def test_a_stage_report_linked_out_or_not_strict_json_is_named_not_copied(tmp_path, planted, named):
    """validate copies the sae/lut stage's report.json into its own report (and inspect of an sae stage
    reads it) before the stage's seal is checked: a link out of the stage directory was read and
    copied, a key given twice read as its last value, text that is not JSON a JSONDecodeError."""
    from actstore.verify import stage_report

    stage = tmp_path / "stage"
    stage.mkdir()
    if planted == "link":
        (tmp_path / "outside.json").write_text('{"fvu": 0.1}')
        (stage / "report.json").symlink_to(tmp_path / "outside.json")
    else:
        (stage / "report.json").write_text(planted)
    with pytest.raises(FormatError, match=named):
        stage_report(stage)


PICKLE_PARAMS = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 1, "vocab_size": 10}


def _pickle_store(extract_root: Path, out: Path) -> Path:
    from actstore.formats.pickle.write import write_machine
    write_machine(extract_root / "part-0000", out, model_params=PICKLE_PARAMS, progress=False)
    return out


def test_validate_never_takes_a_link_in_a_stage_directory_for_its_store(tmp_path):
    """find_store took the first directory of the stage that held a store, a link to one included: a link
    to a good copy elsewhere was checked (read outside the stage) and passed while the stage's own
    store, a shard of it damaged, went unchecked."""
    from actstore.formats.extract import open_extraction, synthetic_extraction
    from actstore.verify import check_format, find_store, sample_coordinates

    root = synthetic_extraction(tmp_path / "extract", 20_000, 1, 8, [1], tokens=(4, 10))
    stage = tmp_path / "stage"
    store = _pickle_store(root, stage / "store")
    shutil.copytree(store, tmp_path / "elsewhere")
    (stage / "a_copy").symlink_to(tmp_path / "elsewhere")
    shard = next(store.glob("shard_*"))
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    shard.write_bytes(damaged)
    assert find_store(stage, "pickle") == store
    extraction = open_extraction(root)
    problems = check_format("pickle", store, extraction, sample_coordinates(extraction, 4, 0))["problems"]
    assert any(re.search(r"shard_0001\.pkl\.gz: checksum", problem) for problem in problems), problems


def test_validate_names_a_vector_of_another_width_and_passes_nan_copied_faithfully(tmp_path):
    """A store's vector of another width than the extraction's made the problem's own message a
    broadcasting ValueError; NaN activations (a model that overflowed), stored as they are, were
    reported as differing from themselves."""
    from actstore.formats.extract import open_extraction, synthetic_extraction
    from actstore.verify import check_format, sample_coordinates

    root = synthetic_extraction(tmp_path / "extract", 20_000, 1, 8, [1], tokens=(4, 10))
    wide = synthetic_extraction(tmp_path / "wide", 40_000, 1, 16, [1], tokens=(4, 10))  # the same samples
    extraction = open_extraction(root)
    coords = sample_coordinates(extraction, 2, 0)
    problems = check_format("pickle", _pickle_store(wide, tmp_path / "store"), extraction, coords)["problems"]
    assert problems and all(p.endswith("differs from the extraction (shape [16], the extraction's [8])")
                            for p in problems)
    nan = synthetic_extraction(tmp_path / "nan", 20_000, 1, 8, [1], tokens=(4, 10), scale=float("nan"))
    extraction = open_extraction(nan)
    result = check_format("pickle", _pickle_store(nan, tmp_path / "nan_store"), extraction, coords)
    assert result["checked"] == len(coords) and result["problems"] == []


def test_an_extraction_with_an_empty_part_trains(extracted, tmp_path):
    """30 texts in 7 parts of 5: the last part holds no sample, and the extractor writes its data files
    from the first batch's shapes, so it has none. The SAE's data asked that part for its tensor."""
    config, extract_dir = extracted("bert", extract={"hooks": [HOOK], "parts": 7})
    extraction = open_extraction(extract_dir)
    assert extraction.parts[-1].info.n_samples == 0 and "layer_000.npy" not in extraction.parts[-1].meta["files"]
    config = copy.deepcopy(config)
    config["sae"].update(SAE, steps=5, device="cpu")
    report = build_sae(config, extract_dir, tmp_path / "sae", progress=False)
    assert report["n_train_tokens"] + report["n_heldout_tokens"] == extraction.n_tokens


def test_the_sae_data_of_more_parts_than_open_files_reads(tmp_path):
    """tensors() held every part's memory map (each keeps a file descriptor) for the whole run: an
    extraction of more parts than the limit on open files failed with "Too many open files"."""
    import subprocess
    import sys

    from actstore.formats.extract import synthetic_extraction
    root = synthetic_extraction(tmp_path / "x", 100 * 4 * 8 * 4 * 4, 100, 8, [1], tokens=(4, 4))
    code = ("import resource, numpy as np\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "from actstore.formats.extract import open_extraction\n"
            "from actstore.sae import data_mean, split_tokens, tensors\n"
            f"extraction = open_extraction({str(root)!r})\n"
            "assert len(extraction.parts) == 100\n"
            "split = split_tokens(extraction, 0.1, 0)\n"
            "mean = data_mean(tensors(extraction, 'layer_1'), split.train)\n"
            "rows = np.concatenate([p.tensor('layer_1')[r] for p, r in zip(extraction.parts, split.train)])\n"
            "assert np.allclose(mean.numpy(), rows.astype(np.float64).mean(0), atol=1e-6)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def planned_jobs(workdir: Path, config: dict, target: str) -> dict[str, int]:
    """Jobs `snakemake -n <target>` on `config` would run, rule -> count ({} when nothing is to do)."""
    import subprocess
    import sys

    import tiny
    configfile = tiny.save_config(config, workdir / "planned.yaml")
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-s", str(tiny.REPO / "Snakefile"), "-d", str(workdir),
           "--configfile", str(configfile), "--cores", "1", "-n", target]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    if "Nothing to be done" in output:
        return {}
    table = output.split("Job stats:")[1].split("Reasons:")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"}


def test_the_files_an_import_reads_are_its_checkpoint_and_saelens_cfg(tmp_path):
    """config.import_files, the sae rule's import inputs: a SAELens folder's weights and the cfg.json
    beside them (which decides the encoding; a folder without one is refused), a SAELens file alone when
    it has none, saev's file."""
    from actstore.config import import_files

    folder = tmp_path / "saelens"
    folder.mkdir()
    (folder / "sae_weights.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"a SAELens folder without cfg\.json"):
        import_files(folder, "saelens")
    assert import_files(folder / "sae_weights.safetensors", "saelens") == [folder / "sae_weights.safetensors"]
    (folder / "cfg.json").write_text("{}")
    assert import_files(folder, "saelens") == [folder / "sae_weights.safetensors", folder / "cfg.json"]
    assert import_files(folder / "sae_weights.safetensors", "saelens") == import_files(folder, "saelens")
    assert import_files(folder / "sae_weights.safetensors", "saev") == [folder / "sae_weights.safetensors"]


# The checkpoint of each style, and SAELens' cfg.json beside its weights (the weights of a saelens folder
# take the same path through config.import_files as saev's file; a dry run costs ~10 s here).
@pytest.mark.parametrize("style, replaced", [("saelens", "cfg.json"), ("saev", "sae.pt")])
def test_an_imported_file_replaced_at_its_path_reruns_the_sae_and_lut_stages(run_copy, tmp_path, style, replaced):
    """The sae stage's hash names sae.import's path, not the file's bytes: a checkpoint (or SAELens'
    cfg.json, which decides the encoding) replaced at the same path reused the old SAE and its LUT.
    The files are the stage's inputs, and report.json records the sha256 of each."""
    import os

    from actstore.hashing import stage_dirs
    from actstore.io_utils import sha256_file
    from actstore.lut import build_lut
    from actstore.workflow import record_stage

    folder = tmp_path / "import"
    folder.mkdir()
    ckpt = _random_checkpoint(d_in=32, d_sae=64)
    if style == "saelens":
        save_file(ckpt, str(folder / "sae_weights.safetensors"))
        (folder / "cfg.json").write_text(json.dumps(saelens_cfg(k=4, d_in=32, d_sae=64)))
        path, read = folder, [folder / "sae_weights.safetensors", folder / "cfg.json"]
    else:
        write_saev_checkpoint(folder / "sae.pt", ckpt, {"cls": "TopK", "params": {"top_k": 4}})
        path, read = folder / "sae.pt", [folder / "sae.pt"]
    config = copy.deepcopy(run_copy)
    config["sae"]["import"] = {"path": str(path), "style": style}
    dirs = stage_dirs(config)
    report = build_sae(config, dirs["extract"], dirs["sae"], progress=False)
    record_stage(config, "sae", dirs["sae"])
    build_lut(config, dirs["extract"], dirs["sae"], dirs["lut"], progress=False)
    record_stage(config, "lut", dirs["lut"])
    assert report["import_sha256"] == {str(file): sha256_file(file) for file in read}
    assert planned_jobs(tmp_path, config, "lut") == {}
    changed = folder / replaced
    changed.write_bytes(changed.read_bytes() + b" ")  # still readable: JSON and safetensors take trailing spaces
    later = max(file.stat().st_mtime for file in (*dirs["sae"].iterdir(), *dirs["lut"].iterdir())) + 1
    os.utime(changed, (later, later))
    jobs = planned_jobs(tmp_path, config, "lut")
    # Run as import_sae: profiles/osc sends train_sae, by its name, to the GPU partition an import does not need.
    assert jobs.get("import_sae") == 1 and jobs.get("build_lut") == 1 and "train_sae" not in jobs, jobs
    gpu_rules = yaml.safe_load((Path(__file__).resolve().parents[1] / "profiles" / "osc" / "config.yaml").read_text())["set-resources"]
    assert "gpu" in gpu_rules["train_sae"] and "import_sae" not in gpu_rules


@pytest.mark.parametrize("style", ["saelens", "saelens-rescaled", "saev"])
def test_an_imported_sae_stage_encodes_as_a_from_scratch_reference(bert, tmp_path, style):
    """The stage's sae.safetensors (what the LUT is built from) of an import, on the held-out tokens:
    latents and reconstruction as SAELens computes them (b_dec subtracted, decoder-norm rescaling) or
    as saev's file encodes (no b_dec subtracted), and the report's FVU is theirs, about the held-out mean."""
    config, extract_dir = bert
    ckpt = _random_checkpoint(d_in=32, d_sae=64, seed=5)
    if style == "saev":
        write_saev_checkpoint(tmp_path / "sae.pt", ckpt, {"cls": "TopK", "params": {"top_k": 4}})
        path, cfg = tmp_path / "sae.pt", {"apply_b_dec_to_input": False, "k": 4}
    else:
        cfg = saelens_cfg(k=4, d_in=32, d_sae=64, rescale_acts_by_decoder_norm=style == "saelens-rescaled")
        save_file(ckpt, str(tmp_path / "sae_weights.safetensors"))
        (tmp_path / "cfg.json").write_text(json.dumps(cfg))
        path = tmp_path
    config = copy.deepcopy(config)
    config["sae"]["import"] = {"path": str(path), "style": "saev" if style == "saev" else "saelens"}
    report = build_sae(config, extract_dir, tmp_path / "out", progress=False)
    sae, _ = load_sae(tmp_path / "out" / "sae.safetensors")
    extraction = open_extraction(extract_dir)
    split = split_tokens(extraction, config["sae"]["heldout_fraction"], config["sae"]["seed"])
    x = torch.from_numpy(np.concatenate([np.asarray(a)[r] for a, r in zip(tensors(extraction, HOOK), split.heldout)]))
    latents, recon = saelens_forward(ckpt, cfg, x)  # TopK then ReLU: Step A's latents wherever k are positive
    with torch.no_grad():
        values, indices = sae.encode(x)
        torch.testing.assert_close(torch.zeros_like(latents).scatter(-1, indices, values), latents, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(sae(x), recon, atol=1e-4, rtol=1e-5)
    fvu = float((x - recon).double().pow(2).sum() / (x - x.mean(0)).double().pow(2).sum())
    assert report["heldout"]["fvu"] == pytest.approx(fvu, rel=1e-4)


def test_validate_names_an_imported_file_changed_since_the_sae_stage_read_it(tmp_path):
    """The sae stage records the sha256 of the files sae.import read; validate compares the files the
    config names (never a path the report gives) with them: one replaced outside Snakemake, whose stage
    hash names only its path, leaves an SAE and a LUT of other weights that verify."""
    from actstore.io_utils import sha256_file
    from actstore.verify import sae_import_problems

    folder = tmp_path / "sae"
    folder.mkdir()
    (weights := folder / "sae_weights.safetensors").write_bytes(b"weights")
    (cfg := folder / "cfg.json").write_text("{}")
    config = {"sae": {"import": {"path": str(folder), "style": "saelens"}}}
    report = {"import_sha256": {str(weights): sha256_file(weights), str(cfg): sha256_file(cfg)}}
    assert sae_import_problems(config, report, tmp_path) == []
    assert sae_import_problems({"sae": {}}, report, tmp_path) == []  # trained, not imported
    assert sae_import_problems(config, {}, tmp_path) == []  # a report from before the record
    cfg.write_text('{"apply_b_dec_to_input": false}')
    assert sae_import_problems(config, report, tmp_path) == [
        f"{cfg}: not the bytes the sae stage imported (import_sha256 in {tmp_path / 'report.json'}): the SAE and "
        "its LUT are of other weights; rerun the sae stage"]
    weights.unlink()
    assert f"{weights}: missing" in sae_import_problems(config, report, tmp_path)[0]
