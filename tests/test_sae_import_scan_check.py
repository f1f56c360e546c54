"""Review 65: an sae.import the sae stage refuses is named by the dataset scan job (extract.run.check_hooks,
on the model's skeleton), before any extraction part runs, from the import's headers alone."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tiny
from actstore.errors import ConfigError, FormatError
from actstore.extract.capture import capture, parse_hook
from actstore.extract.run import check_hooks, hook_width
from actstore.models import get_module, load_model, model_skeleton
from actstore.sae.checkpoint import import_sae

BERT_HOOK = "encoder.layer.1.attention.self.query:input"


def model_width(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return config.get("hidden_size") or config["n_embd"]


def saelens_folder(folder: Path, d_in: int, d_sae: int, cfg: dict | None = None,
                   weights: dict[str, torch.Tensor] | None = None) -> Path:
    """sae_weights.safetensors (seeded random, or `weights` in their place) and a TopK cfg.json (k 4)."""
    gen = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True)
    tensors = {"W_enc": torch.randn(d_in, d_sae, generator=gen), "b_enc": torch.zeros(d_sae),
               "W_dec": torch.randn(d_sae, d_in, generator=gen), "b_dec": torch.zeros(d_in)}
    save_file(weights if weights is not None else tensors, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({
        "architecture": "topk", "k": 4, "d_in": d_in, "d_sae": d_sae, "apply_b_dec_to_input": False,
        "normalize_activations": "none", "metadata": {"sae_lens_version": "6.0.0"}, **(cfg or {})}))
    return folder


def import_config(tmp_path: Path, model: Path, hook: str, sae_import: dict) -> dict:
    data = tiny.write_jsonl(tmp_path / "data.jsonl", 4)
    return tiny.make_config(tmp_path, model, data, extract={"layers": [1], "parts": 1, "hooks": [hook]},
                            sae={"enabled": True, "hook": hook, "num_basis": 64, "k_active": 4,
                                 "import": sae_import},
                            lut={"enabled": False})


@pytest.mark.parametrize("kind,hooks", [
    ("bert", ["encoder.layer.1.intermediate.dense:input", "encoder.layer.1.intermediate.dense:output",
              "encoder.layer.1.output.LayerNorm:input", "embeddings.word_embeddings:output"]),
    ("gpt2", ["h.1.attn.c_attn:input", "h.1.attn.c_attn:output", "h.1.mlp.c_fc:output", "h.1.ln_2:output"]),
])
def test_hook_width_is_the_width_of_the_tensor_the_hook_captures(model_dir, kind, hooks):
    """The width read off the skeleton's module is the last dimension of what capture stores from the
    loaded model's forward (in and out differ for these linears: 32 -> 64, 32 -> 96)."""
    path = model_dir(kind)
    skeleton = model_skeleton(path)
    loaded = load_model(path, "float32", "cpu")
    with torch.inference_mode(), capture(loaded, [], hooks) as captured:
        loaded.model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]))
    widths = {spec: hook_width(get_module(skeleton, parse_hook(spec)[0]), parse_hook(spec)[1]) for spec in hooks}
    assert widths == {spec: captured[spec].shape[-1] for spec in hooks}
    assert len(set(widths.values())) > 1  # the input and output widths were told apart


@pytest.mark.parametrize("kind,spec", [("llama", "model.layers.1.post_attention_layernorm:output"),  # LlamaRMSNorm
                                       ("gpt2", "h.1.mlp:output"), ("bert", "embeddings.word_embeddings:input")])
def test_hook_width_is_unknown_for_a_module_whose_kind_does_not_fix_it(model_dir, kind, spec):
    module_path, io = parse_hook(spec)
    assert hook_width(get_module(model_skeleton(model_dir(kind)), module_path), io) is None


def test_an_import_of_another_width_is_named_by_the_scan_check(model_dir, tmp_path):
    model = model_dir("bert")
    folder = saelens_folder(tmp_path / "saelens", model_width(model) // 2, 64)
    config = import_config(tmp_path, model, BERT_HOOK, {"path": str(folder), "style": "saelens"})
    with pytest.raises(ConfigError, match=rf"{folder}/sae_weights.safetensors: d_in {model_width(model) // 2} "
                                          rf"\(its safetensors header's W_enc shape\), but the hook's width is "
                                          rf"{model_width(model)}"):
        check_hooks(config)


def test_the_conv1d_hook_width_passes_its_own_width_and_names_the_output_width(model_dir, tmp_path):
    """GPT-2's c_attn: [n_embd] in, [3 n_embd] out; an SAE of its output's width on its input is named."""
    model, width = model_dir("gpt2"), model_width(model_dir("gpt2"))
    right = saelens_folder(tmp_path / "right", width, 64)
    config = import_config(tmp_path, model, "h.1.attn.c_attn:input", {"path": str(right), "style": "saelens"})
    check_hooks(config)
    wrong = saelens_folder(tmp_path / "wrong", 3 * width, 64)
    config["sae"]["import"]["path"] = str(wrong)
    with pytest.raises(ConfigError, match=rf"d_in {3 * width} .*the hook's width is {width}"):
        check_hooks(config)


@pytest.mark.parametrize("cfg,error,named", [
    ({"architecture": "jumprelu"}, ConfigError, r"cfg.json: architecture 'jumprelu'; sae.import takes TopK SAEs"),
    ({"k": 8}, ConfigError, r"cfg.json: k 8, but sae.k_active is 4"),
    ({"d_sae": 128}, FormatError, r"cfg.json: d_sae 128, but the weights beside it have d_sae 64"),
    ({"metadata": {"sae_lens_version": "6.0.0", "hook_name": "encoder.layer.0.attention.self.query:input"}},
     ConfigError, r"hook_name 'encoder.layer.0.attention.self.query:input', but sae.hook is"),
])
def test_a_cfg_json_the_import_refuses_is_named_by_the_scan_check(model_dir, tmp_path, cfg, error, named):
    """Of the hook's width: the cfg.json alone is refused, as import_sae refuses it."""
    model = model_dir("bert")
    folder = saelens_folder(tmp_path / "saelens", model_width(model), 64, cfg)
    config = import_config(tmp_path, model, BERT_HOOK, {"path": str(folder), "style": "saelens"})
    with pytest.raises(error, match=named):
        check_hooks(config)
    with pytest.raises(error, match=named):
        import_sae(folder, "saelens", 4, model_width(model), BERT_HOOK)


@pytest.mark.parametrize("change,named", [
    (lambda t: t.pop("b_dec"), r"saelens checkpoint lacks \['b_dec'\]"),
    (lambda t: t.update(W_dec=torch.zeros(64, 31)), r"W_dec has shape \[64, 31\], expected \[64, 32\]"),
    (lambda t: t.update(b_enc=torch.zeros(0)), r"b_enc has shape \[0\], expected \[64\]"),
])
def test_tensor_names_and_shapes_in_the_header_are_checked_by_the_scan_check(model_dir, tmp_path, change, named):
    model = model_dir("bert")
    tensors = {"W_enc": torch.zeros(32, 64), "b_enc": torch.zeros(64), "W_dec": torch.zeros(64, 32),
               "b_dec": torch.zeros(32)}
    change(tensors)
    folder = saelens_folder(tmp_path / "saelens", model_width(model), 64, weights=tensors)
    config = import_config(tmp_path, model, BERT_HOOK, {"path": str(folder), "style": "saelens"})
    with pytest.raises(FormatError, match=named):
        check_hooks(config)


def test_the_scan_check_reads_no_weight_and_import_sae_still_checks_them(model_dir, tmp_path):
    """NaN weights of the right width and names pass the scan (their values are never read there);
    the import_sae job names them."""
    model = model_dir("bert")
    width = model_width(model)
    nan = {"W_enc": torch.full((width, 64), float("nan")), "b_enc": torch.zeros(64),
           "W_dec": torch.zeros(64, width), "b_dec": torch.zeros(width)}
    folder = saelens_folder(tmp_path / "saelens", width, 64, weights=nan)
    check_hooks(import_config(tmp_path, model, BERT_HOOK, {"path": str(folder), "style": "saelens"}))
    with pytest.raises(FormatError, match="W_enc holds NaN or infinite values"):
        import_sae(folder, "saelens", 4, width, BERT_HOOK)


def write_saev(path: Path, d_model: int, activation: dict) -> Path:
    """saev's own file (saev.nn.dump): one JSON header line, then torch.save of the state dict."""
    header = {"schema": 5, "cfg": {"d_model": d_model, "d_sae": 64, "activation": activation}}
    with path.open("wb") as fh:
        fh.write(json.dumps(header).encode() + b"\n")
        torch.save({"W_enc": torch.zeros(d_model, 64), "b_enc": torch.zeros(64), "W_dec": torch.zeros(64, d_model),
                    "b_dec": torch.zeros(d_model)}, fh)
    return path


@pytest.mark.parametrize("d_model,activation,named", [
    (16, {"cls": "TopK", "params": {"top_k": 4}}, r"d_in 16 \(its header's cfg.d_model\), but the hook's width is 32"),
    (32, {"cls": "BatchTopK", "params": {"top_k": 4}}, r"a saev BatchTopK SAE"),
    (32, {"cls": "TopK", "params": {"top_k": 5}}, r"top_k 5, but sae.k_active is 4"),
])
def test_a_saev_checkpoint_header_the_import_refuses_is_named_by_the_scan_check(model_dir, tmp_path, d_model,
                                                                                 activation, named):
    model = model_dir("bert")
    assert model_width(model) == 32
    path = write_saev(tmp_path / "sae.pt", d_model, activation)
    config = import_config(tmp_path, model, BERT_HOOK, {"path": str(path), "style": "saev"})
    with pytest.raises(ConfigError, match=named):
        check_hooks(config)


def test_a_saev_checkpoint_the_import_takes_passes_and_imports(model_dir, tmp_path):
    model = model_dir("bert")
    path = write_saev(tmp_path / "sae.pt", 32, {"cls": "TopK", "params": {"top_k": 4}})
    check_hooks(import_config(tmp_path, model, BERT_HOOK, {"path": str(path), "style": "saev"}))
    assert import_sae(path, "saev", 4, 32, BERT_HOOK).d_in == 32


def test_an_unknown_hook_width_leaves_the_width_to_import_sae_and_still_checks_the_cfg_json(model_dir, tmp_path):
    """Llama's RMSNorm (its own class): its width is the extraction's to tell; the cfg.json is checked."""
    model = model_dir("llama")
    hook = "model.layers.1.post_attention_layernorm:output"
    folder = saelens_folder(tmp_path / "saelens", model_width(model) // 2, 64)
    config = import_config(tmp_path, model, hook, {"path": str(folder), "style": "saelens"})
    check_hooks(config)
    (folder / "cfg.json").write_text((folder / "cfg.json").read_text().replace('"topk"', '"jumprelu"'))
    with pytest.raises(ConfigError, match="architecture 'jumprelu'"):
        check_hooks(config)


def test_a_header_entry_without_a_shape_is_named_by_the_scan_check(model_dir, tmp_path):
    """A safetensors header whose W_enc entry has no shape of whole numbers: named as unreadable, with the
    tensor, rather than taken for a missing tensor (the weights after it are not read here)."""
    model = model_dir("bert")
    folder = saelens_folder(tmp_path / "saelens", model_width(model), 64)
    weights = folder / "sae_weights.safetensors"
    raw = weights.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"shape":[32,64]', b'"shape":"32x64"').ljust(n)
    assert header != raw[8:8 + n]
    weights.write_bytes(raw[:8] + header + raw[8 + n:])
    config = import_config(tmp_path, model, BERT_HOOK, {"path": str(folder), "style": "saelens"})
    with pytest.raises(FormatError, match=r"unreadable safetensors \(tensor 'W_enc' has no shape of whole numbers\)"):
        check_hooks(config)
