"""sae.import of hostile or damaged checkpoints, on real files (safetensors, cfg.json, saev's header line +
torch.save): each is refused naming the file and field before any SAE is made, never imported as
another SAE nor failing with a bare Python error."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from actstore.errors import ConfigError, FormatError
from actstore.sae import import_sae

SAELENS_6 = {"architecture": "topk", "k": 3, "d_in": 8, "d_sae": 16, "metadata": {"sae_lens_version": "6.18.0"}}
SAEV_TOPK_3 = {"schema": 5, "cfg": {"d_model": 8, "d_sae": 16, "activation": {"cls": "TopK", "params": {"top_k": 3}}}}


def checkpoint(d_in: int = 8, d_sae: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"W_enc": torch.randn(d_in, d_sae, generator=g), "b_enc": torch.randn(d_sae, generator=g),
            "W_dec": torch.randn(d_sae, d_in, generator=g), "b_dec": torch.randn(d_in, generator=g)}


def saelens_folder(folder: Path, cfg: dict | str, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """The folder SAELens saves: sae_weights.safetensors and cfg.json (`cfg` as JSON, or its text)."""
    save_file(weights or checkpoint(), str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return folder


def write_saev(path: Path, header: bytes, state: dict) -> Path:
    """saev's own file (saev.nn.dump): one JSON header line, then torch.save of the state dict."""
    with open(path, "wb") as fh:
        fh.write(header + b"\n")
        torch.save(state, fh)
    return path


@pytest.mark.parametrize("fields, named", [
    ({"metadata": "6.18.0"}, r"cfg\.json: metadata is a str, not a JSON object"),
    ({"metadata": ["6.18.0"]}, r"cfg\.json: metadata is a list, not a JSON object"),
    ({"architecture": "standard", "metadata": {}, "activation_fn_str": "topk", "activation_fn_kwargs": "k=3"},
     r"cfg\.json: activation_fn_kwargs is a str, not a JSON object"),
])
def test_a_cfg_json_field_of_the_wrong_type_is_named(tmp_path, fields, named):
    """They raised AttributeError / TypeError, naming neither the file nor the field."""
    folder = saelens_folder(tmp_path, {**SAELENS_6, **fields})
    with pytest.raises(FormatError, match=named):
        import_sae(folder, "saelens", k_active=3)


def test_a_cfg_json_nested_too_deeply_is_named(tmp_path):
    """json.loads raised RecursionError."""
    folder = saelens_folder(tmp_path, "[" * 100_000)
    with pytest.raises(FormatError, match=r"cfg\.json: not valid JSON \(nested too deeply"):
        import_sae(folder, "saelens", k_active=3)


def test_a_saev_header_nested_too_deeply_is_named(tmp_path):
    path = write_saev(tmp_path / "sae.pt", b'{"schema": ' + b"[" * 100_000, checkpoint())
    with pytest.raises(FormatError, match=r"sae\.pt: saev checkpoint header is not one JSON line"):
        import_sae(path, "saev", k_active=3)


def test_a_pre_6_jumprelu_sae_with_a_topk_activation_is_not_taken_for_a_topk_sae(tmp_path):
    """Before SAELens 6.0 the activation function of a jumprelu SAE was applied before its threshold:
    its latents are TopK's less those under the threshold. It was imported as a TopK SAE, threshold dropped."""
    weights = {**checkpoint(), "threshold": torch.full((16,), 0.5)}
    cfg = {"architecture": "jumprelu", "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 3},
           "d_in": 8, "d_sae": 16, "sae_lens_version": "5.9.0"}
    folder = saelens_folder(tmp_path, cfg, weights)
    with pytest.raises(ConfigError, match=r"cfg\.json: architecture 'jumprelu'"):
        import_sae(folder, "saelens", k_active=3)


@pytest.mark.parametrize("field, value", [("d_sae", 4096), ("d_in", 768), ("d_in", "8"), ("d_sae", None)])
def test_a_cfg_json_of_other_weights_is_named(tmp_path, field, value):
    """cfg.json decides the encoding (b_dec subtracted, rescaling, k); one whose d_in or d_sae is not the
    weights' (SAELens refuses to load it) is another SAE's: the import took its encoding silently."""
    cfg = {key: item for key, item in SAELENS_6.items() if value is not None or key != field}
    folder = saelens_folder(tmp_path, {**cfg, **({field: value} if value is not None else {})})
    with pytest.raises(FormatError, match=rf"cfg\.json: {field} {value!r}, but the weights beside it have "):
        import_sae(folder, "saelens", k_active=3)


def test_a_zero_decoder_row_of_a_rescaled_sae_is_named(tmp_path):
    """rescale_acts_by_decoder_norm divides by each W_dec row's norm: a zero row (a pruned latent) made
    NaN weights, imported and written to sae.safetensors, that load_sae refused only at the lut stage."""
    weights = checkpoint()
    weights["W_dec"][5] = 0
    folder = saelens_folder(tmp_path, {**SAELENS_6, "rescale_acts_by_decoder_norm": True}, weights)
    with pytest.raises(FormatError, match=r"sae_weights\.safetensors: W_dec row 5 has norm 0"):
        import_sae(folder, "saelens", k_active=3)
    folder = saelens_folder(tmp_path, SAELENS_6, weights)  # without the rescaling a zero row is a dead latent
    assert torch.isfinite(import_sae(folder, "saelens", k_active=3).decoder_weight).all()


def test_a_sparse_tensor_in_a_saev_checkpoint_is_named(tmp_path):
    """torch's weights-only unpickler rebuilds sparse tensors: one raised NotImplementedError from aten."""
    state = checkpoint()
    state["W_enc"] = state["W_enc"].to_sparse()
    path = write_saev(tmp_path / "sae.pt", json.dumps(SAEV_TOPK_3).encode(), state)
    with pytest.raises(FormatError, match=r"sae\.pt: W_enc is a sparse_coo tensor, not a dense one"):
        import_sae(path, "saev", k_active=3)


def saev_header(cfg: dict) -> bytes:
    """saev's header line with these cfg sizes and a TopK of 3."""
    return json.dumps({"schema": 5, "cfg": {**cfg, "activation": SAEV_TOPK_3["cfg"]["activation"]}}).encode()


@pytest.mark.parametrize("cfg, named", [
    ({"d_model": 768, "d_sae": 16}, r"cfg\.d_model 768, but the weights after it have d_model 8"),
    ({"d_model": 8, "d_sae": 24576}, r"cfg\.d_sae 24576, but the weights after it have d_sae 16"),
    ({"d_vit": 8, "exp_factor": 16}, r"cfg\.exp_factor 16, but the weights after it have exp_factor 2"),
    ({"d_model": "8", "d_sae": 16}, r"cfg\.d_model '8'"),
])
def test_a_saev_header_of_another_sae_is_named(tmp_path, cfg, named):
    """The header's top_k decides the encoding; one whose sizes are not the weights' is another SAE's
    header (saev.nn.load builds the SAE it describes and refuses these weights), imported before."""
    path = write_saev(tmp_path / "sae.pt", saev_header(cfg), checkpoint())
    with pytest.raises(FormatError, match=r"sae\.pt: header " + named):
        import_sae(path, "saev", k_active=3)


@pytest.mark.parametrize("cfg", [{"d_model": 8, "d_sae": 16}, {"d_vit": 8, "exp_factor": 2}, {}])
def test_a_saev_header_of_these_weights_imports(tmp_path, cfg):
    """Sizes as saev writes them now (d_model, d_sae) and before (d_vit, exp_factor), or none."""
    path = write_saev(tmp_path / "sae.pt", saev_header(cfg), checkpoint())
    assert import_sae(path, "saev", k_active=3).num_basis == 16
