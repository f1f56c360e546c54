"""Extraction on tiny real models: every stored vector equals the model's own computation."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import numpy as np
import pytest
import torch

import tiny
from actstore.errors import ConfigError, FormatError
from actstore.extract import preflight, run_part
from actstore.extract.inputs import zero_token_rows
from actstore.formats.extract import PartWriter, open_extraction, open_part
from actstore.models import get_module, load_image_processor, load_model

REL_TOL = 1e-5


def reference_outputs(model_path, sample_text, layers, hooks, image_root=None):
    """Block outputs (and hooked tensors) computed one sample at a time, without padding."""
    loaded = load_model(model_path)
    captured = {}

    def keep(name, use_input):
        def hook(module, args, kwargs, output):
            source = args[0] if use_input else output
            captured[name] = (source[0] if isinstance(source, tuple) else source)[0].clone()
        return hook

    handles = [loaded.blocks[i].register_forward_hook(keep(f"layer_{i}", False), with_kwargs=True) for i in layers]
    for spec in hooks:
        path, io = spec.rsplit(":", 1)
        handles.append(get_module(loaded.model, path).register_forward_hook(keep(spec, io == "input"), with_kwargs=True))
    with torch.inference_mode():
        if image_root is not None:
            from PIL import Image
            img = Image.open(image_root / sample_text).convert("RGB")
            out = loaded.model(pixel_values=loaded.preprocessor(images=[img], return_tensors="pt")["pixel_values"],
                               output_hidden_states=True)
        else:
            ids = loaded.preprocessor(sample_text, truncation=True, max_length=24, return_tensors="pt")
            out = loaded.model(input_ids=ids["input_ids"], output_hidden_states=True)
    for h in handles:
        h.remove()
    return captured, out


def rel_err(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


@pytest.mark.parametrize("kind", tiny.TEXT_KINDS + tiny.VISION_KINDS)
@pytest.mark.slow
def test_every_vector_equals_unbatched_block_output(kind, extracted, image_folder):
    hooks = ["encoder.layer.1.attention.self.query:input"] if kind == "bert" else []
    config, out = extracted(kind, extract={"layers": [0, 2], "hooks": hooks})
    extraction = open_extraction(out)
    assert extraction.n_samples == (8 if kind in tiny.VISION_KINDS else 30)
    assert [row["sample_idx"] for _, _, row in extraction.iter_samples()] == list(range(extraction.n_samples))
    image_root = image_folder if kind in tiny.VISION_KINDS else None
    processor = type(load_image_processor(config["model"]["path"])).__name__ if image_root else None
    assert all(part.meta["image_processor"] == processor for part in extraction.parts)  # which backend ran
    lengths = set()
    for part, local, row in extraction.iter_samples():
        ref, model_out = reference_outputs(config["model"]["path"], row["text"], [0, 2], hooks, image_root)
        for name in ["layer_0", "layer_2", *hooks]:
            stored = part.activations(name, local)
            assert stored.dtype == np.float32
            assert stored.shape == tuple(ref[name].shape), (kind, name)
            assert rel_err(stored, ref[name].numpy()) <= REL_TOL, (kind, name, row["sample_idx"])
        # Inner blocks also equal the model's own output_hidden_states (block i -> hidden_states[i+1]).
        assert rel_err(part.activations("layer_0", local), model_out.hidden_states[1][0].numpy()) <= REL_TOL
        lengths.add(row["num_tokens"])
        if image_root is None:
            assert part.token_ids(local).tolist() == model_ids(config, row["text"])
    if image_root is None:
        assert len(lengths) >= 3, "test data should have varied lengths so padding is exercised"



@pytest.mark.parametrize("model_type", sorted(tiny.FAMILIES))
@pytest.mark.slow
def test_each_familys_stored_vectors_are_its_own_block_outputs(model_type, text_jsonl, tmp_path):
    """The families users bring (dense, mixture-of-experts, state-space and hybrid causal LMs;
    encoders; an encoder-decoder's encoder), each under its own config names: every stored vector of
    blocks 0 and 2, batched with padding, equals the block's output on the sample alone; a causal
    LM's log-probs and top-k are its own logits'."""
    model = tiny.build_family(model_type, tmp_path / "model")
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"batch_size": 8, "parts": 1})
    run_part(config, 0, tmp_path / "part-0000", progress=False)
    part = open_part(tmp_path / "part-0000")
    loaded = load_model(model)
    assert part.meta["model"]["n_blocks"] == 3 and loaded.kind == tiny.FAMILIES[model_type][0]
    assert len({row["num_tokens"] for row in part.samples}) >= 3  # padding exercised
    for local in range(len(part.samples)):
        outputs = {}

        def keep(module, args, output):  # returns None: the block's output goes on unchanged
            outputs[module] = output[0] if isinstance(output, tuple) else output
        handles = [loaded.blocks[i].register_forward_hook(keep) for i in (0, 2)]
        ids = torch.tensor([part.token_ids(local).tolist()])
        with torch.inference_mode():
            model_out = loaded.model(input_ids=ids)
        for handle in handles:
            handle.remove()
        for i in (0, 2):
            stored = part.activations(f"layer_{i}", local)
            ref = outputs[loaded.blocks[i]][0, :len(stored)].numpy()  # Longformer pads to a window multiple inside
            assert stored.shape == ref.shape and rel_err(stored, ref) <= REL_TOL, (model_type, i, local)
        if loaded.kind == "causal":  # the head rerun for log-probs follows each family's own head
            logits = model_out.logits[0].float()
            ref = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0].numpy()
            np.testing.assert_allclose(part.token_logprob(local)[1:], ref, rtol=1e-5, atol=1e-5)
            assert part.topk(local)[1].tolist() == torch.topk(logits[-1], len(part.topk(local)[1])).indices.tolist()

def model_ids(config, text):
    loaded = load_model(tiny.Path(config["model"]["path"]))
    return loaded.preprocessor(text, truncation=True, max_length=24)["input_ids"]


def test_llama_last_layer_is_block_output_not_final_norm(extracted):
    config, out = extracted("llama", extract={"layers": [2]})
    extraction = open_extraction(out)
    part, local = extraction.locate(3)
    _, model_out = reference_outputs(config["model"]["path"], part.samples[local]["text"], [2], [])
    stored = part.activations("layer_2", local)
    normed = model_out.hidden_states[-1][0].numpy()
    assert rel_err(stored, normed) > 1e-2  # hidden_states[-1] has the final norm applied


def test_deit_emits_cls_then_its_distillation_token_then_the_patches(model_dir, extracted):
    """DeiTModel, which every model_type deit checkpoint loads as, puts its distillation token after
    CLS (where DeiTForImageClassificationWithTeacher's distillation head reads it): a store counts it
    as a register, so its patches start at token 2."""
    from actstore.model_config import read_model_config, register_tokens

    loaded = load_model(model_dir("deit"))
    embeddings = loaded.model.embeddings
    with torch.inference_mode():
        first = loaded.model(pixel_values=torch.zeros(1, 3, tiny.IMAGE_SIZE, tiny.IMAGE_SIZE),
                             output_hidden_states=True).hidden_states[0][0]
    position = embeddings.position_embeddings[0]
    assert torch.equal(first[0], embeddings.cls_token[0, 0] + position[0])
    assert torch.equal(first[1], embeddings.distillation_token[0, 0] + position[1])
    assert register_tokens(read_model_config(model_dir("deit"))) == 1
    assert register_tokens(read_model_config(model_dir("vit"))) == 0
    assert register_tokens(read_model_config(model_dir("dinov2_registers"))) == tiny.REGISTERS
    _, out = extracted("deit")
    assert open_extraction(out).sample(0)["num_tokens"] == 2 + (tiny.IMAGE_SIZE // tiny.PATCH) ** 2


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5", "qwen2_5_vl"])
def test_a_vision_language_model_runs_its_language_model_on_text(kind, model_dir, extracted):
    """Gemma 3 (from 4B), Qwen3.5 and Qwen2.5-VL (its language model's sizes at the top level, as the
    Hub's checkpoints have them) hold a vision tower beside the language model: text runs the language
    model, so its blocks (the Qwens' towers have as many, as shallow) and its sizes (the tower is
    wider) are the ones recorded, and its logits are kept."""
    from actstore.model_config import model_params, num_blocks, read_model_config

    config_json = read_model_config(model_dir(kind))
    assert num_blocks(config_json) == 3 and model_params(config_json)["hidden_size"] == 32 != tiny.VISION_TOWER_WIDTH
    loaded = load_model(model_dir(kind))
    assert loaded.kind == "causal" and loaded.blocks is loaded.model.get_decoder().layers
    config, out = extracted(kind)
    part = open_extraction(out).parts[0]
    assert part.meta["model"]["blocks_path"] == loaded.blocks_path and "language_model" in loaded.blocks_path
    assert part.meta["model"]["n_blocks"] == 3 and part.tensor("layer_0").shape[1] == 32
    ids = torch.tensor([part.token_ids(0).tolist()])
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[0, -1].float()
    assert part.topk(0)[1].tolist() == torch.topk(logits, config["extract"]["logits_topk"]).indices.tolist()


@pytest.mark.parametrize("kind, family, cls_token", [("gemma3", "siglip", False), ("llava", "clip", True)])
def test_a_vision_language_models_vision_tower_runs_on_images(kind, family, cls_token, model_dir, image_folder,
                                                                tmp_path):
    """model.tower: vision runs Gemma 3's SigLIP tower, or LLaVA's CLIP tower, on images with the
    checkpoint's own image processor: "layer i" is the tower's block i, every stored vector equals the
    tower's own hidden state, its sizes are the tower's (48 wide, the language model 32), and the saev
    store is the tower's family."""
    from PIL import Image

    from actstore.formats import saev
    from actstore.formats.extract import write_index
    from actstore.model_config import model_params, run_config

    folder = model_dir(kind) if kind in tiny.TEXT_KINDS else tiny.build_model(kind, tmp_path / f"model-{kind}")
    config = tiny.make_config(tmp_path, folder, image_folder, model={"tower": "vision"}, extract={"layers": [0, 1]})
    assert model_params(run_config(config["model"])) == {"hidden_size": tiny.VISION_TOWER_WIDTH,
                                                         "num_hidden_layers": 2, "num_attention_heads": 4,
                                                         "vocab_size": None}
    out = tmp_path / "extract"
    for part in range(2):
        run_part(config, part, out / f"part-{part:04d}", progress=False)
    write_index(out, out / "extract.json")
    extraction = open_extraction(out)
    loaded = load_model(folder, tower="vision")
    patches = (tiny.IMAGE_SIZE // tiny.PATCH) ** 2
    for part, local, row in extraction.iter_samples():
        image = Image.open(image_folder / row["text"]).convert("RGB")
        with torch.inference_mode():
            hidden = loaded.model(pixel_values=loaded.preprocessor(images=[image], return_tensors="pt")["pixel_values"],
                                  output_hidden_states=True).hidden_states
        assert row["num_tokens"] == patches + cls_token
        for layer in (0, 1):
            assert rel_err(part.activations(f"layer_{layer}", local), hidden[layer + 1][0].numpy()) <= REL_TOL
    record = extraction.parts[0].meta["model"]
    assert (record["tower"], record["checkpoint_model_type"], record["n_blocks"]) == ("vision", kind, 2)
    assert extraction.parts[0].meta["model_kind"] == "vision" and extraction.parts[0].tensor("layer_0").shape[1] == 48
    store = saev.write_store(extraction, config["saev"], tmp_path / "saev", model_config=run_config(config["model"]),
                             progress=False)
    metadata = json.loads((store / "metadata.json").read_text())
    assert (metadata["family"], metadata["cls_token"], metadata["patches_per_ex"]) == (family, cls_token, patches)


@pytest.mark.parametrize("kind, tower, message", [
    ("bert", "vision", r"model.tower: vision runs a vision-language checkpoint's vision tower; .* \(model_type bert\)"),
    ("qwen2_5_vl", "vision", r"vision tower \(model_type qwen2_5_vl_vision\) is not one actstore runs"),
    ("dinov2", "language", r"model.tower: language: .* \(model_type dinov2\) is an image model"),
])
def test_a_tower_the_checkpoint_cannot_run_is_named(kind, tower, message, model_dir, image_folder, tmp_path):
    from actstore.model_config import run_config

    config = tiny.make_config(tmp_path, model_dir(kind), image_folder, model={"tower": tower})
    with pytest.raises(ConfigError, match=message):
        run_config(config["model"])
    with pytest.raises(ConfigError, match=message):
        preflight(config, 0)


def test_llama_3_2_visions_cross_attention_blocks_are_refused_for_text(text_jsonl, tmp_path):
    """Mllama's language model skips its cross-attention blocks on text alone: asking for one is named
    before any weight loads (and at parse time); the blocks text runs are stored as the model computes them."""
    from actstore.formats.extract import write_index

    folder = tiny.build_model("mllama", tmp_path / "model-mllama")
    config = tiny.make_config(tmp_path, folder, text_jsonl, extract={"layers": [0, 1], "parts": 1})
    with pytest.raises(ConfigError, match=re.escape("extract.layers: [1] are cross-attention blocks of mllama's "
                                                    "language model ([1]), which run only with an image")):
        preflight(config, 0)
    config = tiny.make_config(tmp_path, folder, text_jsonl, extract={"layers": [0, 2], "parts": 1})
    run_part(config, 0, tmp_path / "extract" / "part-0000", progress=False)
    write_index(tmp_path / "extract", tmp_path / "extract" / "extract.json")
    part = open_extraction(tmp_path / "extract").parts[0]
    ref, _ = reference_outputs(folder, part.samples[2]["text"], [0, 2], [])
    assert all(rel_err(part.activations(f"layer_{i}", 2), ref[f"layer_{i}"].numpy()) <= REL_TOL for i in (0, 2))


def test_an_encoder_decoder_runs_its_encoder(model_dir, extracted):
    """T5 (and BART): text goes into the encoder; "layer i" is encoder block i (the decoder, which has
    as many, is never run), hooks are named inside the encoder, sizes come from T5's own names."""
    from actstore.model_config import model_params, read_model_config

    assert model_params(read_model_config(model_dir("t5"))) == {"hidden_size": 32, "num_hidden_layers": 3,
                                                                 "num_attention_heads": 4, "vocab_size": 300}
    hook = "block.1.layer.0.SelfAttention.q:input"
    config, out = extracted("t5", extract={"layers": [0, 2], "hooks": [hook]})
    loaded = load_model(model_dir("t5"))
    assert loaded.kind == "encoder" and loaded.blocks_path == "block" and type(loaded.model).__name__ == "T5Stack"
    part = open_extraction(out).parts[0]
    ref, _ = reference_outputs(config["model"]["path"], part.samples[1]["text"], [0, 2], [hook])
    assert rel_err(part.activations(hook, 1), ref[hook].numpy()) <= REL_TOL
    assert part.topk(1) is None


def test_a_module_the_forward_never_reaches_is_named(model_dir, text_jsonl, tmp_path):
    """A hook on a vision-language model's vision tower, which text never reaches: named, no part left."""
    hook = "model.vision_tower.encoder.layers.0:output"
    config = tiny.make_config(tmp_path, model_dir("gemma3"), text_jsonl, extract={"parts": 1, "hooks": [hook]})
    with pytest.raises(ConfigError, match=re.escape(f"the forward never ran ['{hook}']")):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    assert not (tmp_path / "part-0000").exists()


@pytest.mark.parametrize("kind, hook, shapes", [
    ("bert", "pooler:output", "(4, 32), expected (4, 24, hidden) for a batch of 4 samples of 24 tokens"),
    ("dinov2", "embeddings.patch_embeddings:output",
     "(4, 16, 32), expected (4, 17, hidden) for a batch of 4 samples of 17 tokens")])
def test_a_hook_whose_tensor_is_not_batch_tokens_hidden_is_named_before_a_byte_is_written(
        kind, hook, shapes, model_dir, text_jsonl, image_folder, tmp_path):
    """Packing takes dim 1 as the token axis. BERT's pooler, (batch, hidden), was stored as a per-token
    file of its hidden units that verified and changed with batch_size; DINOv2's patch embeddings lack
    the CLS token the blocks add, one token fewer than the images', and every file was laid askew."""
    data = image_folder if kind in tiny.VISION_KINDS else text_jsonl
    config = tiny.make_config(tmp_path, model_dir(kind), data, extract={"parts": 1, "hooks": [hook]})
    with pytest.raises(ConfigError, match=re.escape(
            f"extract.hooks {hook!r} produced shape {shapes}: extract.hooks entries must name a module whose "
            "input/output is (batch, tokens, hidden)")):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    assert list(tmp_path.glob("*part-0000*")) == []


@pytest.mark.parametrize("kind, message", [
    ("gemma3", "takes texts; a vision-language checkpoint runs its language model, on text, or its vision tower, "
               "on images, with model.tower: vision"),
    ("t5", re.escape("(model_type t5) takes texts; the image models actstore runs are model_type dinov2, ")),
    ("dinov3", r"holds texts but the model at .* \(model_type dinov3_vit\) takes images$")])
def test_data_the_model_does_not_take_is_named_with_why(kind, message, model_dir, image_folder, text_jsonl, tmp_path):
    data = text_jsonl if kind == "dinov3" else image_folder
    with pytest.raises(ConfigError, match=message):
        preflight(tiny.make_config(tmp_path, model_dir(kind), data), 0)


def test_a_siglip2_naflex_model_is_refused_at_parse_time(image_folder, tmp_path):
    """SigLIP 2's NaFlex towers give each image its own patch count; a store needs one for all."""
    from actstore.model_config import num_blocks

    folder = tmp_path / "siglip2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "siglip2", "architectures": ["Siglip2Model"],
                                                    "vision_config": {"num_hidden_layers": 3}}))
    with pytest.raises(ConfigError, match="siglip2 .NaFlex. model gives each image its own patch count"):
        num_blocks(json.loads((folder / "config.json").read_text()))  # what common.smk's parse asks first
    with pytest.raises(ConfigError, match="NaFlex"):
        preflight(tiny.make_config(tmp_path, folder, image_folder), 0)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision loads it here")
def test_an_image_processor_this_machine_cannot_load_is_named_before_weights_load(model_dir, image_folder, tmp_path,
                                                                                 monkeypatch):
    """DINOv3's checkpoints ship a processor transformers has only with torchvision: named, with the folder."""
    import shutil

    import actstore.extract.run as ex
    folder = shutil.copytree(model_dir("dinov3"), tmp_path / "dinov3")
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {**processor, "image_processor_type": "DINOv3ViTImageProcessorFast"}))
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(folder))}: its image processor .*Torchvision"):
        run_part(tiny.make_config(tmp_path, folder, image_folder), 0, tmp_path / "part-0000", progress=False)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gemma3"])
def test_causal_lm_keeps_topk_logits_and_token_logprobs(kind, model_dir, text_jsonl, monkeypatch, tmp_path):
    """Top-k and log-probs equal the model's own full logits, while the forward's LM head runs at
    each batch's last tokens only and the log-probs' head reruns on chunks (here of 5 tokens):
    the (batch, tokens, vocab) logits never exist."""
    import actstore.extract.logprobs as logprobs_module
    import actstore.extract.run as ex

    head_inputs, real_load = [], ex.load_model

    def load_watched(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        loaded.model.get_output_embeddings().register_forward_hook(
            lambda module, args, output: head_inputs.append(tuple(args[0].shape[:2])))
        monkeypatch.setattr(logprobs_module, "LOGPROB_ELEMENTS", 5 * loaded.model.get_output_embeddings().out_features)
        return loaded
    monkeypatch.setattr(ex, "load_model", load_watched)
    config = tiny.make_config(tmp_path, model_dir(kind), text_jsonl, extract={"layers": [0], "parts": 1})
    out = tmp_path / "extract"
    run_part(config, 0, out / "part-0000", progress=False)
    batch = config["extract"]["batch_size"]
    # the forward's head: each row's last position only (last_token_head); its reruns: chunks of 5 tokens
    assert head_inputs and all((positions == 1 and rows <= batch) or (rows == 1 and positions <= 5)
                               for rows, positions in head_inputs), head_inputs
    assert any(rows > 1 for rows, _ in head_inputs)
    loaded = load_model(tiny.Path(config["model"]["path"]))
    part = open_part(out / "part-0000")
    for local in range(len(part.samples)):
        ids = torch.tensor([part.token_ids(local).tolist()])
        with torch.inference_mode():
            logits = loaded.model(input_ids=ids).logits[0].float()
        values, indices = part.topk(local)
        ref_values, ref_indices = torch.topk(logits[-1], config["extract"]["logits_topk"])
        np.testing.assert_allclose(values, ref_values.numpy(), rtol=1e-5, atol=1e-6)
        assert indices.tolist() == ref_indices.tolist()
        logprob = part.token_logprob(local)
        assert np.isnan(logprob[0]) and not np.isnan(logprob[1:]).any()
        ref = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0].numpy()
        np.testing.assert_allclose(logprob[1:], ref, rtol=1e-5, atol=1e-5)


def test_a_hook_on_the_lm_head_sees_every_token(model_dir, text_jsonl, tmp_path):
    """lm_head:input (the final hidden states) is stored at every token: with a hook on the head the
    forward runs it at all positions, not only at the last ones the top-k needs."""
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl,
                              extract={"layers": [0], "hooks": ["lm_head:input"], "parts": 1})
    run_part(config, 0, tmp_path / "part-0000", progress=False)
    part = open_part(tmp_path / "part-0000")
    for local in (0, 7):
        ref, _ = reference_outputs(config["model"]["path"], part.samples[local]["text"], [0], ["lm_head:input"])
        assert rel_err(part.activations("lm_head:input", local), ref["lm_head:input"].numpy()) <= REL_TOL


# What the causal LM's forward does after its LM head, and where its base model is.
HEAD_CASES = {
    "gemma2": {"final_logit_softcapping": 2.0},  # soft-capped logits
    "cohere": {"logit_scale": 0.37},
    "granite": {"logits_scaling": 3.0},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},  # its forward calls model.decoder, not model
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True},
}


@pytest.mark.parametrize("model_type", sorted(HEAD_CASES))
def test_token_logprobs_follow_the_models_own_head(model_type, monkeypatch):
    """The chunked head rerun is the model's own forward after its base model: soft-capping and
    scaling applied, a base model one level down found, an MoE's router outputs carried; the
    log-probs equal a full log_softmax of the model's logits, in chunks of 4 tokens."""
    import types

    from transformers import AutoConfig, AutoModelForCausalLM

    import actstore.extract.logprobs as logprobs_module

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, vocab_size=300, **HEAD_CASES[model_type])
    model = AutoModelForCausalLM.from_config(config).eval()
    for param in model.parameters():  # logits of several units, where the post-processing shows
        param.data.normal_(0, 0.3) if param.dim() > 1 else param.data.normal_(1.0, 0.1)
    monkeypatch.setattr(logprobs_module, "LOGPROB_ELEMENTS", 4 * 300)
    lengths, width = np.array([9, 6, 1, 4]), 9
    ids = torch.randint(0, 300, (4, width))
    mask = (torch.arange(width)[None] < torch.from_numpy(lengths)[:, None]).long()
    keep = np.concatenate([row * width + np.arange(n) for row, n in enumerate(lengths)])
    logprobs = logprobs_module.TokenLogprobs(types.SimpleNamespace(model=model))
    with torch.inference_mode(), logprobs.attached():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        final = logprobs.base()[1].last_hidden_state
        got = logprobs.packed(ids, keep, lengths, logits[torch.arange(4), torch.from_numpy(lengths - 1)])
        head_only = torch.log_softmax(model.get_output_embeddings()(final).float(), -1)
    def at_kept(log_softmax):
        chosen = log_softmax[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
        return torch.cat([torch.full((4, 1), float("nan")), chosen], 1).reshape(-1)[torch.from_numpy(keep)]
    ref = at_kept(torch.log_softmax(logits, -1))
    assert torch.equal(got.isnan(), ref.isnan()) and int(got.isnan().sum()) == 4
    torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-5)
    if model_type in ("gemma2", "cohere", "granite"):  # the post-processing matters at these logits
        assert float((at_kept(head_only) - ref).nan_to_num().abs().max()) > 0.05


def test_token_logprobs_refuse_a_forward_the_head_rerun_does_not_follow(model_dir, text_jsonl, monkeypatch, tmp_path):
    """A forward whose logits depend on more than the base model's output (here: on the input ids)
    is caught on the first batch, named, and leaves no part: no wrong log-probs are stored."""
    import actstore.extract.run as ex

    real_load = ex.load_model

    def load_reading_ids(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        forward = loaded.model.forward

        def scaled(*args, input_ids=None, **kwargs):
            output = forward(*args, input_ids=input_ids, **kwargs)
            output.logits = output.logits * (2.0 if bool(input_ids.any()) else 1.0)
            return output
        loaded.model.forward = scaled
        return loaded
    monkeypatch.setattr(ex, "load_model", load_reading_ids)
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl, extract={"layers": [0], "parts": 1})
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM: its LM head rerun .* extract.token_logprobs: false"):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    assert not (tmp_path / "part-0000").exists()
    config["extract"]["token_logprobs"] = False
    assert run_part(config, 0, tmp_path / "part-0000", progress=False)["n_samples"] == 30


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_without_token_logprobs_the_lm_head_runs_at_the_last_tokens_only(kind, extracted, monkeypatch, tmp_path):
    """extract.token_logprobs false: no token_logprob.npy; the LM head sees only each batch's distinct
    last positions; the activations are byte-identical and the top-k the full logits' (its values to
    the float rounding of a head run at fewer positions); lmprobe is written and verifies; the hash
    changes only for false."""
    import copy

    import actstore.extract.run as ex
    from actstore.formats import lmprobe
    from actstore.hashing import stage_hash

    head_inputs, real_load = [], ex.load_model

    def load_watched(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        loaded.model.get_output_embeddings().register_forward_hook(
            lambda module, args, output: head_inputs.append(tuple(args[0].shape[:2])))
        return loaded
    monkeypatch.setattr(ex, "load_model", load_watched)
    config, out = extracted(kind, extract={"layers": [0, 2], "token_logprobs": False})
    monkeypatch.setattr(ex, "load_model", real_load)
    full_config, full_out = extracted(kind)
    last_only, full = open_extraction(out), open_extraction(full_out)
    for part, full_part in zip(last_only.parts, full.parts):
        part.verify()
        files, full_files = data_files(part.dir), data_files(full_part.dir)
        assert "token_logprob.npy" in full_files and set(files) == set(full_files) - {"token_logprob.npy"}
        assert all(files[name] == full_files[name] for name in files if name != "topk_values.npy")
        for local in range(len(part.samples)):
            np.testing.assert_allclose(part.topk(local)[0], full_part.topk(local)[0], rtol=1e-5, atol=1e-6)
            assert part.token_logprob(local) is None
    batch = config["extract"]["batch_size"]
    assert len(head_inputs) == sum(-(-len(p.samples) // batch) for p in last_only.parts)
    assert all(rows <= batch and positions <= rows for rows, positions in head_inputs), head_inputs
    lmprobe.write_dataset(out, tmp_path / "lmprobe", {"token_strings": False}, progress=False)
    assert lmprobe.verify(tmp_path / "lmprobe") == []
    before_the_key = copy.deepcopy(full_config)
    del before_the_key["extract"]["token_logprobs"]
    assert stage_hash(full_config, "extract") == stage_hash(before_the_key, "extract") != stage_hash(config, "extract")


def test_causal_lms_run_without_a_generation_cache(model_dir):
    """No block's keys and values are kept for generation: they would stay alive to the end of each
    forward (Llama-8B, 32 texts x 2,048 tokens: ~8.6 GB) for nothing to read."""
    from actstore.extract import text_batch

    for kind in ("llama", "gemma3"):
        loaded = load_model(model_dir(kind))
        with torch.inference_mode():
            output = loaded.model(**text_batch(loaded, [[5, 6, 7], [8, 9]]))
        assert output.past_key_values is None, kind
    assert "use_cache" not in text_batch(load_model(model_dir("bert")), [[5, 6, 7]])


def test_encoder_has_no_logits(extracted):
    _, out = extracted("bert")
    part = open_extraction(out).parts[0]
    assert part.topk(0) is None and part.token_logprob(0) is None


def test_parts_are_contiguous_slices_and_index_summarises(extracted):
    config, out = extracted("bert", extract={"parts": 3})
    index = json.loads((out / "extract.json").read_text())
    ranges = [p["sample_range"] for p in index["parts"]]
    assert ranges == [[0, 10], [10, 20], [20, 30]]
    assert index["n_samples"] == 30
    assert index["n_tokens"] == sum(p["n_tokens"] for p in index["parts"])


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_truncated_texts_are_counted_not_silent(kind, extracted, capsys):
    """Each part records how many of its texts max_seq_length cut (their untokenized length said so),
    and inspect sums them: a user can tell that documents lost their ends."""
    from actstore.cli import main
    from actstore.formats.extract import check

    config, out = extracted(kind, extract={"parts": 3})
    tokenizer = load_model(config["model"]["path"]).preprocessor
    limit = config["extract"]["max_seq_length"]
    counts = []
    for part in open_extraction(out).parts:
        texts = [row["text"] for row in part.samples]
        expected = sum(len(ids) > limit for ids in tokenizer(texts)["input_ids"])
        assert part.meta["n_truncated_samples"] == expected
        counts.append(expected)
    assert 0 < sum(counts) < 30, counts  # the shared texts are long and short
    assert check.inspect(out)["n_truncated_samples"] == sum(counts)
    assert main(["inspect", str(out)]) == 0
    assert f"n_truncated_samples {sum(counts)}\n" in capsys.readouterr().out


def test_a_custom_code_model_runs_only_when_trusted(model_dir, text_jsonl, tmp_path, monkeypatch):
    """A checkpoint whose classes are Python in its folder (config.json auto_map, as nomic-embed's):
    without model.trust_remote_code the job names the key and the code before any weight loads;
    with it, every stored vector equals the model's own block output, part.json records the
    auto_map, and the extract hash is the same (the key changes no byte)."""
    import actstore.extract.run as ex
    from actstore.hashing import stage_hash

    folder = model_dir("custom_code")
    config = tiny.make_config(tmp_path, folder, text_jsonl, extract={"layers": [0, 2], "parts": 1})
    real_load = ex.load_model
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match=r"maps AutoConfig to 'configuration_tiny_custom.TinyCustomConfig'.*"
                                          r"model.trust_remote_code: true"):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    monkeypatch.setattr(ex, "load_model", real_load)
    trusted = tiny.make_config(tmp_path, folder, text_jsonl, model={"trust_remote_code": True},
                               extract={"layers": [0, 2], "parts": 1})
    assert stage_hash(trusted, "extract") == stage_hash(config, "extract")
    run_part(trusted, 0, tmp_path / "part-0000", progress=False)
    part = open_part(tmp_path / "part-0000")
    assert part.meta["model"]["auto_map"]["AutoModel"] == "modeling_tiny_custom.TinyCustomModel"
    assert part.meta["model"]["blocks_path"] == "blocks"
    loaded = load_model(folder, trust_remote_code=True)
    for local in range(len(part.samples)):
        captured = {}
        handles = [loaded.blocks[i].register_forward_hook(
            lambda module, args, output, i=i: captured.__setitem__(i, output[0])) for i in (0, 2)]
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([part.token_ids(local).tolist()]))
        for handle in handles:
            handle.remove()
        for i in (0, 2):
            assert rel_err(part.activations(f"layer_{i}", local), captured[i].numpy()) <= REL_TOL, (local, i)


@pytest.mark.parametrize("kind, limit", [("bert", 128), ("gpt2", 128)])
def test_a_sequence_longer_than_learned_positions_is_refused_before_the_weights(kind, limit, model_dir, text_jsonl,
                                                                                tmp_path, monkeypatch):
    """A learned position table of 128 (BERT's max_position_embeddings, GPT-2's n_positions):
    max_seq_length 129 is named with the limit before any weight loads (before: a shape error after
    loading, a device-side assert on a GPU), and so is a tokenizer's smaller model_max_length; a
    rotary model (Llama) takes it."""
    import shutil

    import actstore.extract.run as ex

    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    config = tiny.make_config(tmp_path, model_dir(kind), text_jsonl, extract={"max_seq_length": limit + 1})
    with pytest.raises(ConfigError, match=rf"extract.max_seq_length {limit + 1}: .* learned positions for {limit} "
                                          rf"tokens \(config.json (max_position_embeddings|n_positions)\)"):
        run_part(config, 0, tmp_path / "part", progress=False)
    folder = shutil.copytree(model_dir(kind), tmp_path / "model")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 100}))
    config = tiny.make_config(tmp_path, folder, text_jsonl, extract={"max_seq_length": 101})
    with pytest.raises(ConfigError, match=r"learned positions for 100 tokens \(tokenizer_config.json model_max_length\)"):
        run_part(config, 0, tmp_path / "part", progress=False)
    monkeypatch.undo()
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl, extract={"max_seq_length": 129, "parts": 1})
    assert run_part(config, 0, tmp_path / "llama-part", progress=False)["n_samples"] == 30


def test_a_tokenizer_without_pad_eos_or_unk_token_still_batches(model_dir, text_jsonl, tmp_path):
    """Some byte-level BPE tokenizers are saved with no special token at all: texts of several lengths
    are still right-padded in one batch (pad positions are never stored), and each vector equals the
    unbatched block output."""
    import shutil

    folder = shutil.copytree(model_dir("gpt2"), tmp_path / "model")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {k: v for k, v in settings.items() if k not in ("bos_token", "eos_token", "pad_token", "unk_token")}))
    assert load_model(folder).preprocessor.pad_token_id == 0
    config = tiny.make_config(tmp_path, folder, text_jsonl, extract={"layers": [1], "parts": 1})
    run_part(config, 0, tmp_path / "part", progress=False)
    part = open_part(tmp_path / "part")
    for local in (0, 11):
        ref, _ = reference_outputs(folder, part.samples[local]["text"], [1], [])
        assert rel_err(part.activations("layer_1", local), ref["layer_1"].numpy()) <= REL_TOL


def test_a_text_that_tokenizes_to_nothing_is_named_before_the_weights_load(model_dir, tmp_path, monkeypatch):
    """GPT-2's tokenizer adds no special token: an empty text (wikitext's blank rows) has no token to
    store. The row is named while the job tokenizes, before any weight loads, and no part is left."""
    import actstore.extract.run as ex

    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in ["a first text", "more", "", "last", ""]))
    config = tiny.make_config(tmp_path, model_dir("gpt2"), data, extract={"parts": 1})
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(ConfigError, match=r"dataset rows 2, 4: text tokenizes to zero tokens.*drop empty texts"):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    assert not (tmp_path / "part-0000").exists()
    rows = list(range(3, 40, 3))  # at most ten named, then how many more
    assert zero_token_rows(rows).startswith("dataset rows 3, 6, 9, 12, 15, 18, 21, 24, 27, 30 and 3 more: ")


def test_part_checksums_catch_a_flipped_byte(extracted, tmp_path):
    import shutil
    _, out = extracted("bert")
    copy = tmp_path / "part"
    shutil.copytree(out / "part-0000", copy)
    open_part(copy).verify()
    target = copy / "layer_000.npy"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(Exception, match="layer_000.npy"):
        open_part(copy).verify()


def test_a_truncated_tensor_file_is_named_not_a_numpy_error(extracted, tmp_path):
    import shutil
    _, out = extracted("bert")
    copy = tmp_path / "part"
    shutil.copytree(out / "part-0000", copy)
    target = copy / "layer_000.npy"
    target.write_bytes(target.read_bytes()[:-4096])
    with pytest.raises(FormatError, match=r"layer_000.npy: \d+ bytes, part.json says \d+"):
        open_part(copy).tensor("layer_0")[0]


def test_a_truncated_image_is_named_before_weights_load(model_dir, image_folder, tmp_path, monkeypatch):
    import shutil

    import actstore.extract.run as ex
    data = tmp_path / "images"
    shutil.copytree(image_folder, data)
    victim = sorted(data.rglob("*.png"))[3]
    victim.write_bytes(victim.read_bytes()[:200])
    config = tiny.make_config(tmp_path, model_dir("dinov2"), data, extract={"parts": 1})
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match=f"{victim.name}: not a readable image"):
        run_part(config, 0, tmp_path / "part", progress=False)



@pytest.mark.parametrize("suffix, values", [(".png", np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 64),
                                            (".tif", np.linspace(0, 1, 32 * 32, dtype=np.float32).reshape(32, 32))])
def test_an_image_of_more_than_8_bits_is_refused_before_weights_load(suffix, values, model_dir, image_folder,
                                                                      tmp_path, monkeypatch):
    """A 16-bit grayscale PNG (values to 65,535) or a float TIFF in [0, 1]: converting it to RGB, as
    the processors and torchvision's loader do, clips it to 0..255 (white or black); refused, named."""
    import shutil

    from PIL import Image

    import actstore.extract.run as ex
    data = tmp_path / "images"
    shutil.copytree(image_folder, data)
    source = sorted(data.rglob("*.png"))[3]
    source.unlink()
    victim = source.with_suffix(suffix)
    Image.fromarray(values).save(victim)
    assert Image.open(victim).mode in ("I;16", "F")
    config = tiny.make_config(tmp_path, model_dir("dinov2"), data, extract={"parts": 1})
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match=f"{victim.name}: an image of mode (I;16|F) .*would clip the values"):
        run_part(config, 0, tmp_path / "part", progress=False)


def test_a_16_bit_image_of_8_bit_values_runs_as_its_8_bit_copy(model_dir, image_folder, tmp_path):
    """A 16-bit PNG whose values all fit 8 bits converts exactly: the same activations as the same
    pixels saved as an 8-bit grayscale PNG."""
    import shutil

    from PIL import Image
    parts = {}
    for mode in ("L", "I;16"):
        data = tmp_path / mode.replace(";", "") / "images"
        shutil.copytree(image_folder, data)
        victim = sorted(data.rglob("*.png"))[3]
        gray = np.asarray(Image.open(victim).convert("L"))
        Image.fromarray(gray if mode == "L" else gray.astype(np.uint16)).save(victim)
        assert Image.open(victim).mode == mode
        config = tiny.make_config(data.parent, model_dir("dinov2"), data, extract={"parts": 1})
        run_part(config, 0, data.parent / "part", progress=False)
        parts[mode] = open_part(data.parent / "part")
    assert np.array_equal(parts["L"].activations("layer_0", 3), parts["I;16"].activations("layer_0", 3))


@pytest.mark.parametrize("mode", ["RGBA", "P"])
def test_a_transparent_image_is_composited_onto_white_as_the_models_processor_does(mode, model_dir, image_folder,
                                                                                 tmp_path):
    """An RGBA PNG with a transparent half (its hidden pixels black), or a palette PNG with a
    transparent colour: the stored activations are the model's on what its own processor makes of
    the file's image (transparency onto white), not on PIL's convert("RGB") pixels (the black showing;
    a converted palette image keeps its transparency note, which the processor then honours)."""
    import shutil

    from PIL import Image
    data = tmp_path / "images"
    shutil.copytree(image_folder, data)
    victim = sorted(data.rglob("*.png"))[3]
    rgba = np.asarray(Image.open(victim).convert("RGBA")).copy()
    rgba[rgba.shape[0] // 2:] = 0  # transparent black
    image = Image.fromarray(rgba, "RGBA")
    if mode == "P":  # the transparent colour: the black of the bottom half
        image = image.convert("RGB").quantize(16)
        image.save(victim, transparency=int(np.asarray(image)[-1, -1]))
    else:
        image.save(victim)
    assert Image.open(victim).mode == mode
    config = tiny.make_config(tmp_path, model_dir("dinov2"), data, extract={"parts": 1, "layers": [0]})
    run_part(config, 0, tmp_path / "part", progress=False)
    stored = open_part(tmp_path / "part").activations("layer_0", 3)
    loaded = load_model(model_dir("dinov2"))

    def block_0(img):
        with torch.inference_mode():
            pixels = loaded.preprocessor(images=[img], return_tensors="pt")["pixel_values"]
            return loaded.model(pixel_values=pixels, output_hidden_states=True).hidden_states[1][0].numpy()
    assert loaded.preprocessor.do_convert_rgb
    assert rel_err(stored, block_0(Image.open(victim))) <= REL_TOL
    dropped = Image.fromarray(np.asarray(Image.open(victim).convert("RGB")))  # PIL's alpha-dropping pixels alone
    assert rel_err(stored, block_0(dropped)) > 0.01


@pytest.mark.parametrize("orientation", [6, 3])
def test_an_image_with_an_exif_orientation_runs_upright(orientation, model_dir, image_folder, tmp_path):
    """A photo stored sideways (EXIF Orientation 6: turn 90 degrees) or upside down (3) runs as Hugging
    Face datasets and transformers' load_image show it: the same activations as the turned pixels
    saved without the tag."""
    import shutil

    from PIL import Image
    parts = {}
    for tagged in (True, False):
        data = tmp_path / str(tagged) / "images"
        shutil.copytree(image_folder, data)
        victim = sorted(data.rglob("*.png"))[3]
        image = Image.open(victim).convert("RGB")
        exif = Image.Exif()
        exif[0x0112] = orientation
        if tagged:
            image.save(victim, exif=exif)
        else:  # orientation 6 shows the stored pixels turned 90 degrees clockwise (PIL turns anticlockwise)
            image.transpose(Image.Transpose.ROTATE_270 if orientation == 6 else Image.Transpose.ROTATE_180).save(victim)
        config = tiny.make_config(data.parent, model_dir("dinov2"), data, extract={"parts": 1, "layers": [0]})
        run_part(config, 0, data.parent / "part", progress=False)
        parts[tagged] = open_part(data.parent / "part").activations("layer_0", 3)
    assert np.array_equal(parts[True], parts[False])

def test_an_image_over_pils_pixel_limit_is_named_before_weights_load(model_dir, image_folder, tmp_path, monkeypatch):
    """PIL refuses an image of more than twice Image.MAX_IMAGE_PIXELS (a decompression bomb, or a
    gigapixel scan) with a message that names no file: the error names it."""
    import shutil
    import warnings

    from PIL import Image

    import actstore.extract.run as ex
    data = tmp_path / "images"
    shutil.copytree(image_folder, data)
    victim = sorted(data.rglob("*.png"))[3]
    image = Image.open(victim)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", image.width * image.height)  # the others: a warning only
    image.resize((image.width * 3, image.height * 3)).save(victim)
    config = tiny.make_config(tmp_path, model_dir("dinov2"), data, extract={"parts": 1})
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match=f"{victim.name}: Image size .* could be decompression bomb"), \
            warnings.catch_warnings(action="ignore", category=Image.DecompressionBombWarning):
        run_part(config, 0, tmp_path / "part", progress=False)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_image_only_decoding_can_fault_is_named_when_decoded(model_dir, image_folder, tmp_path, workers):
    import shutil

    from PIL import Image
    data = tmp_path / "images"
    shutil.copytree(image_folder, data)
    source = sorted(data.rglob("*.png"))[3]
    victim = source.with_suffix(".jpg")
    Image.open(source).convert("RGB").save(victim, quality=90)
    source.unlink()
    victim.write_bytes(victim.read_bytes()[:-600])  # headers intact, the scan cut short: verify() passes
    config = tiny.make_config(tmp_path, model_dir("dinov2"), data, extract={"parts": 1, "num_workers": workers})
    with pytest.raises(Exception, match=f"{victim.name}: cannot decode the image"):
        run_part(config, 0, tmp_path / "part", progress=False)
    assert not (tmp_path / "part").exists()


def test_a_rerun_removes_what_a_killed_writer_left_and_sizes_ignore_it(model_dir, text_jsonl, tmp_path):
    from actstore.integrity import dir_bytes
    stage = tmp_path / "stage"
    stale = stage / ".part-0000.k1ll3d_x.tmp"  # kill -9 leaves atomic_path's temp (8 random characters)
    stale.mkdir(parents=True)
    (stale / "layer_000.npy").write_bytes(b"x" * 1000)
    other = stage / ".part-0001.k1ll3d_x.tmp"  # another job's: not this writer's to remove
    other.mkdir()
    assert dir_bytes(stage) == 0
    run_part(tiny.make_config(tmp_path, model_dir("bert"), text_jsonl), 0, stage / "part-0000", progress=False)
    assert not stale.exists() and other.exists()
    assert dir_bytes(stage) == dir_bytes(stage / "part-0000") > 0


def test_killed_job_leaves_nothing_that_looks_complete(model_dir, text_jsonl, tmp_path, monkeypatch):
    import actstore.extract.run as ex
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl)
    calls = {"n": 0}
    real = ex.pack_batch

    def crash_after_one(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(ex, "pack_batch", crash_after_one)
    target = tmp_path / "part-0000"
    with pytest.raises(KeyboardInterrupt):
        run_part(config, 0, target, progress=False)
    assert not target.exists()
    assert list(tmp_path.glob(".part-0000*")) == []


@pytest.mark.parametrize("change, message", [
    ({"model": {"path": "/nonexistent/model"}}, "/nonexistent/model"),
    ({"extract": {"layers": [0, 7]}}, r"\[7\] out of range"),
    ({"extract": {"hooks": ["encoder.layer.9.nothing:input"]}}, "encoder.layer.9.nothing"),
])
def test_bad_input_fails_before_heavy_work_naming_the_value(change, message, model_dir, text_jsonl, tmp_path,
                                                           monkeypatch):
    import actstore.extract.run as ex
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, **change)
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match=message):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    assert not (tmp_path / "part-0000").exists()


def test_empty_dataset_and_line_without_text_are_named(model_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty.jsonl holds no samples"):
        preflight(tiny.make_config(tmp_path, model_dir("bert"), empty), 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"label": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: line has no string field 'text'"):
        preflight(tiny.make_config(tmp_path, model_dir("bert"), bad), 0)


def test_image_labels_are_first_level_folders(extracted):
    _, out = extracted("dinov2")
    rows = [row for _, _, row in open_extraction(out).iter_samples()]
    assert [r["label"] for r in rows] == ["animal"] * 4 + ["object"] * 4
    assert rows[0]["text"] == "animal/img_00.png"
    assert len({r["num_tokens"] for r in rows}) == 1  # 1 CLS + (32/8)^2 patches
    assert rows[0]["num_tokens"] == 1 + 16


# --- The write pipeline: staging buffers, writer threads, storage dtype, image workers. ---

def data_files(part_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(part_dir.iterdir()) if p.name != "part.json"}


def previous_release_files(config, part_dir) -> dict[str, bytes]:
    """What the synchronous extractor of earlier releases wrote for block outputs: the same length
    batches, each sample's rows `.float().cpu()` into an open_memmap .npy, sample_idx order."""
    from actstore.extract import capture, length_batches, text_batch
    part = open_part(part_dir)
    loaded = load_model(config["model"]["path"])
    ids = [part.token_ids(i).tolist() for i in range(len(part.samples))]
    out = {}
    with capture(loaded, config["extract"]["layers"], []) as captured, torch.inference_mode():
        arrays = {}
        for batch in length_batches([len(x) for x in ids], config["extract"]["batch_size"]):
            loaded.model(**text_batch(loaded, [ids[i] for i in batch]))
            for name, tensor in captured.items():
                path = part_dir.parent / f"ref-{name}.npy"
                if name not in arrays:
                    arrays[name] = np.lib.format.open_memmap(path, mode="w+", dtype="float32",
                                                             shape=(part.meta["n_tokens"], tensor.shape[-1]))
                for row, i in enumerate(batch):
                    arrays[name][part.sample_slice(i)] = tensor[row, :len(ids[i])].float().cpu().numpy()
        for name, array in arrays.items():
            array.flush()
            out[f"layer_{int(name[6:]):03d}.npy"] = (part_dir.parent / f"ref-{name}.npy").read_bytes()
    return out


def test_bytes_do_not_depend_on_buffers_or_writer_threads_and_match_the_previous_release(
        model_dir, text_jsonl, tmp_path):
    runs = {}
    for buffers, writers in [(1, 1), (2, 3), (4, 1), (4, 3)]:
        config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl,
                                  extract={"parts": 1, "buffers": buffers, "writer_threads": writers})
        out = tmp_path / f"b{buffers}-w{writers}" / "part-0000"
        meta = run_part(config, 0, out, progress=False)
        open_part(out).verify()
        runs[(buffers, writers)] = data_files(out)
        assert meta["storage_dtype"] == "float32"
    first = runs[(1, 1)]
    assert all(files == first for files in runs.values())
    assert {"topk_values.npy", "topk_indices.npy", "token_logprob.npy", "token_ids.npy"} <= set(first)
    reference = previous_release_files(config, out)
    assert reference and all(first[name] == data for name, data in reference.items())


def test_a_run_of_consecutive_samples_is_one_write_hashed_from_the_slot(tmp_path):
    """Images all have one token count, so a batch is a run of consecutive samples: each file gets
    one write a batch, whose whole 1 MiB leaves are hashed from the staging slot. Written sample by
    sample (395 KB each, as a ViT-B/14 layer in bf16), nearly every leaf was cut by a sample's end
    and read back through the page cache to be hashed."""
    from actstore.extract.pipeline import BatchRows, WritePipeline
    from actstore.formats.extract import PartWriter
    from actstore.io_utils import TREE_LEAF, sha256_tree_file
    n, tokens, width, per_batch = 24, 257, 384, 8
    values = torch.randn(n * tokens, width)
    offsets = np.arange(n + 1, dtype=np.int64) * tokens
    writer = PartWriter(tmp_path / "part", [{"sample_idx": i} for i in range(n)], offsets)
    with WritePipeline(writer, torch.device("cpu"), 2, 1) as pipeline:
        for first in range(0, n, per_batch):
            rows = BatchRows(np.arange(first, first + per_batch), np.full(per_batch, tokens))
            pipeline.submit(rows, {"layer_000.npy": values[first * tokens:(first + per_batch) * tokens]}, {})
    sink = writer.sinks["layer_000.npy"].file
    read_back = sink.read_back
    meta = writer.finish({})
    path = tmp_path / "part" / "layer_000.npy"
    assert np.array_equal(np.load(path), values.numpy())
    assert meta["files"]["layer_000.npy"]["sha256_tree"] == sha256_tree_file(path, threads=1)
    assert read_back <= (n // per_batch + 1) * TREE_LEAF < sink.size / 2  # the header's leaf and batch ends only


def test_samples_written_together_must_be_their_bytes(tmp_path):
    from actstore.formats.extract import PartWriter
    writer = PartWriter(tmp_path / "part", [{"sample_idx": i} for i in range(3)], np.array([0, 2, 5, 6]))
    writer.add_tokens("layer_000.npy", 4, "float32")
    with pytest.raises(ValueError, match=r"layer_000.npy: samples 0..1 have 64 bytes, expected 80"):
        writer.write("layer_000.npy", 0, np.zeros((4, 4), np.float32), 2)
    writer.write("layer_000.npy", 1, np.ones((4, 4), np.float32), 2)
    writer.write("layer_000.npy", 0, np.zeros((2, 4), np.float32))
    writer.finish({})
    assert np.array_equal(np.load(tmp_path / "part" / "layer_000.npy"), np.repeat([0.0, 1.0], [2, 4])[:, None] * np.ones(4))


def test_a_sample_written_twice_or_never_is_named_and_no_part_json_is_written(tmp_path):
    """The tree hash counts the bytes of each leaf: sample 1 written twice made up for sample 2, of the
    same size, never written; finish() passed and sample 2 read as zeros. Named by sample_idx."""
    writer = PartWriter(tmp_path / "part", [{"sample_idx": 10 + i} for i in range(9)], np.arange(10) * 3)
    writer.add_tokens("layer_000.npy", 4, "float32")
    writer.add_rows("topk_values.npy", 2, "float32")
    path = tmp_path / "part" / "layer_000.npy"
    for i in (0, 1, 3):
        writer.write("layer_000.npy", i, np.full((3, 4), i, np.float32))
    with pytest.raises(OSError, match=re.escape(f"{path}: sample_idx 11 written twice")):
        writer.write("layer_000.npy", 1, np.full((3, 4), 1, np.float32))
    with pytest.raises(OSError, match=re.escape(f"{path}: sample_idx 13 written twice")):
        writer.write("layer_000.npy", 2, np.full((6, 4), 2, np.float32), 2)  # a run ending in a written sample
    writer.write("topk_values.npy", 0, np.zeros((9, 2), np.float32), 9)
    with pytest.raises(OSError, match=re.escape(f"{path}: sample_idx 12, 14, 15, 16, 17 and 1 more never written")):
        writer.finish({})
    assert not (tmp_path / "part" / "part.json").exists()


def test_part_json_says_which_side_the_run_waited_on(model_dir, text_jsonl, tmp_path, monkeypatch):
    """extraction_waits: writes slowed down (one staging buffer, one writer thread) show as the model
    waiting for a free buffer while the writer thread works; inputs slowed down as the input wait; a
    slow model load as startup, in its step."""
    import time

    import actstore.extract.run as ex
    from actstore.formats.extract import PartWriter
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl, dataset={"limit": 16},
                              extract={"parts": 1, "buffers": 1, "writer_threads": 1, "batch_size": 4})
    slept, write = [], PartWriter.write

    def slow_write(self, *args, **kwargs):
        time.sleep(0.01)
        slept.append(0.01)
        return write(self, *args, **kwargs)
    monkeypatch.setattr(PartWriter, "write", slow_write)
    waits = run_part(config, 0, tmp_path / "slow-writes", progress=False)["extraction_waits"]
    assert waits["busiest_writer_seconds"] >= sum(slept)
    assert waits["staging_wait_seconds"] >= sum(slept) / 2 > waits["input_wait_seconds"]
    assert waits["batches_seconds"] >= waits["busiest_writer_seconds"]
    assert waits["submit_seconds"] < waits["staging_wait_seconds"] / 2  # the wait is not the submit's own time
    monkeypatch.setattr(PartWriter, "write", write)

    batches, given = [], ex.text_batches

    def slow_inputs(*args, **kwargs):
        for inputs in given(*args, **kwargs):
            time.sleep(0.05)
            batches.append(0.05)
            yield inputs
    monkeypatch.setattr(ex, "text_batches", slow_inputs)
    waits = run_part(config, 0, tmp_path / "slow-inputs", progress=False)["extraction_waits"]
    assert waits["input_wait_seconds"] >= sum(batches) > waits["staging_wait_seconds"]
    monkeypatch.setattr(ex, "text_batches", given)

    load, stalled = ex.load_model, []

    def stalling_forward(*args, **kwargs):  # the forward's main thread blocked, not computing (a device sync)
        loaded = load(*args, **kwargs)
        loaded.blocks[0].register_forward_pre_hook(lambda *_: time.sleep(0.25) or stalled.append(0.25))
        return loaded
    monkeypatch.setattr(ex, "load_model", stalling_forward)
    waits = run_part(config, 0, tmp_path / "stalled-forward", progress=False)["extraction_waits"]
    loop = sum(waits[f"{part}_seconds"] for part in ("input_wait", "staging_wait", "forward", "pack", "submit"))
    assert waits["forward_seconds"] >= sum(stalled) > waits["pack_seconds"] + waits["submit_seconds"]
    assert loop <= waits["batches_seconds"] + 0.005  # each rounded to 1 ms
    assert loop - waits["main_thread_cpu_seconds"] >= sum(stalled) - 0.01  # blocked: wall seconds, no CPU

    def slow_load(*args, **kwargs):
        time.sleep(0.3)
        return load(*args, **kwargs)
    monkeypatch.setattr(ex, "load_model", slow_load)
    began = time.perf_counter()
    waits = run_part(config, 0, tmp_path / "slow-load", progress=False)["extraction_waits"]
    took = time.perf_counter() - began
    assert 0.3 <= waits["startup_seconds"] < took - waits["batches_seconds"]
    steps = waits["startup_steps"]  # the seconds since the job's start at which each step ended
    assert list(steps) == ["preflight", "inputs", "model_load"]
    assert steps["model_load"] - steps["inputs"] >= 0.3 and steps["model_load"] <= waits["startup_seconds"]


def test_a_left_truncating_tokenizer_keeps_each_texts_first_tokens(model_dir, text_jsonl, tmp_path):
    """A checkpoint whose tokenizer_config.json says truncation_side: left kept each long text's last
    tokens, where the docs, n_truncated_samples and given token ids all cut the end: the first
    max_seq_length tokens are stored, as a right-truncating tokenizer gives them."""
    import shutil

    from transformers import AutoTokenizer
    model = tmp_path / "left-truncating"
    shutil.copytree(model_dir("llama"), model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "truncation_side": "left"}))
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"parts": 1, "max_seq_length": 8})
    meta = run_part(config, 0, tmp_path / "part", progress=False)
    part = open_part(tmp_path / "part")
    texts = [row["text"] for row in part.samples]
    right, left = AutoTokenizer.from_pretrained(model_dir("llama")), AutoTokenizer.from_pretrained(model)
    assert left.truncation_side == "left" and meta["n_truncated_samples"] > 0
    first, last = (tokenizer(texts, truncation=True, max_length=8)["input_ids"] for tokenizer in (right, left))
    assert [part.token_ids(i).tolist() for i in range(len(texts))] == first != last


def test_texts_tokenized_a_few_at_a_time_store_the_same_bytes(model_dir, text_jsonl, tmp_path, monkeypatch):
    """A part's texts are tokenized TOKENIZE_TOKENS at a time into one flat array (the tokenizer's
    lists for a whole part took ~230 B a token): 3 texts a call store the bytes one call does, and
    the stored ids are the tokenizer's own for each text."""
    from transformers import AutoTokenizer

    from actstore.extract import inputs
    config = tiny.make_config(tmp_path, model_dir("gpt2"), text_jsonl, extract={"parts": 1})
    run_part(config, 0, tmp_path / "whole" / "part-0000", progress=False)
    monkeypatch.setattr(inputs, "TOKENIZE_TOKENS", 3 * config["extract"]["max_seq_length"])
    run_part(config, 0, tmp_path / "chunked" / "part-0000", progress=False)
    assert data_files(tmp_path / "chunked" / "part-0000") == data_files(tmp_path / "whole" / "part-0000")
    part = open_part(tmp_path / "chunked" / "part-0000")
    tokenizer = AutoTokenizer.from_pretrained(config["model"]["path"])
    expected = tokenizer([row["text"] for row in part.samples], truncation=True,
                         max_length=config["extract"]["max_seq_length"])["input_ids"]
    assert [part.token_ids(i).tolist() for i in range(len(part.samples))] == expected


def test_disk_writeback_started_while_writing_changes_no_byte(model_dir, text_jsonl, tmp_path, monkeypatch):
    from actstore import io_utils
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl, extract={"parts": 1})
    run_part(config, 0, tmp_path / "default", progress=False)
    results, start_writeback = [], io_utils.start_writeback
    monkeypatch.setattr(io_utils, "WRITEBACK_BYTES", 4096)  # start the disk after every few rows
    monkeypatch.setattr(io_utils, "start_writeback", lambda fd: results.append(start_writeback(fd)))
    run_part(config, 0, tmp_path / "eager", progress=False)
    open_part(tmp_path / "eager").verify()
    assert data_files(tmp_path / "eager") == data_files(tmp_path / "default")
    assert len(results) > 10 and set(results) == {0}  # sync_file_range accepted every call


def test_a_failing_writer_names_the_file_leaves_nothing_complete_and_never_hangs(
        model_dir, text_jsonl, tmp_path):
    """Disk full, simulated with RLIMIT_FSIZE: the layer files (88 KB) cannot be written, the
    small ones (< 9 KB) can. The error comes from a writer thread, in the job's own process. The part
    is aborted (its files closed) only once every writer thread has stopped: aborted while the
    others still wrote, they wrote to closed descriptors, which the kernel may give another file."""
    import subprocess
    import sys
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"parts": 1, "writer_threads": 3})
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    target = tmp_path / "out" / "part-0000"
    code = ("import json, resource, sys, threading; from actstore.extract import run_part; "
            "from actstore.formats.extract import PartWriter; abort = PartWriter.abort; "
            "PartWriter.abort = lambda self: (print('writer threads at abort:', [t.name for t in threading.enumerate() "
            "if t.name.startswith('part-writer-')], file=sys.stderr), abort(self)); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); "
            f"run_part(json.load(open({str(config_path)!r})), 0, {str(target)!r}, progress=False)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "File too large" in proc.stderr and "layer_00" in proc.stderr, proc.stderr[-2000:]
    assert re.findall(r"writer threads at abort: (.*)", proc.stderr) == ["[]"], proc.stderr[-2000:]
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_bfloat16_storage_is_the_models_bfloat16_output_bit_for_bit(model_dir, text_jsonl, tmp_path):
    from actstore.extract import capture, length_batches, text_batch
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl, model={"torch_dtype": "bfloat16"},
                              extract={"parts": 1})
    out = tmp_path / "part-0000"
    meta = run_part(config, 0, out, progress=False)
    part = open_part(out)
    assert meta["storage_dtype"] == "bfloat16" and meta["files"]["layer_000.npy"]["dtype"] == "bfloat16"
    assert np.load(out / "layer_000.npy").dtype == np.uint16  # numpy has no bfloat16: its bits
    loaded = load_model(config["model"]["path"], "bfloat16")
    ids = [part.token_ids(i).tolist() for i in range(len(part.samples))]
    with capture(loaded, [0, 2], []) as captured, torch.inference_mode():
        for batch in length_batches([len(x) for x in ids], config["extract"]["batch_size"]):
            loaded.model(**text_batch(loaded, [ids[i] for i in batch]))
            for name, tensor in captured.items():
                assert tensor.dtype == torch.bfloat16
                raw = part.tensor(name).raw
                for row, i in enumerate(batch):
                    want = tensor[row, :len(ids[i])].view(torch.int16).numpy().view(np.uint16)
                    assert np.array_equal(raw[part.sample_slice(i)], want)
                    widened = part.activations(name, i)
                    assert widened.dtype == np.float32
                    assert np.array_equal(widened, tensor[row, :len(ids[i])].float().numpy())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16bit_vit_stores_its_own_outputs_bit_for_bit_from_pixels_cast_in_the_workers(dtype, model_dir,
                                                                                       image_folder, tmp_path):
    """The decoding workers cast the processor's float32 pixels to the model's dtype (half the bytes
    through shared memory and the main process): the stored block outputs are the bits the model
    gives for those float32 pixels cast in its own process, batch by batch."""
    from PIL import Image

    from actstore.extract import capture
    from actstore.extract.inputs import image_batches
    config = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder, model={"torch_dtype": dtype},
                              extract={"parts": 1, "num_workers": 2, "batch_size": 3})
    out = tmp_path / "part-0000"
    assert run_part(config, 0, out, progress=False)["storage_dtype"] == dtype
    part = open_part(out)
    loaded = load_model(config["model"]["path"], dtype)
    images = [Image.open(image_folder / row["text"]).convert("RGB") for row in part.samples]
    pixels = loaded.preprocessor(images=images, return_tensors="pt")["pixel_values"]
    assert pixels.dtype == torch.float32
    _, dataset = preflight(config, 0)
    items = next(image_batches(loaded.preprocessor, dataset.opener, dataset.samples, [[0, 1, 2]], 2, False,
                               getattr(torch, dtype)))
    assert [item.dtype for item in items] == [getattr(torch, dtype)]  # cast before leaving the worker
    with capture(loaded, [0, 2], []) as captured, torch.inference_mode():
        for start in range(0, len(images), 3):
            loaded.model(pixel_values=pixels[start:start + 3].to(getattr(torch, dtype)))
            for name, tensor in captured.items():
                raw = part.tensor(name).raw
                for row, i in enumerate(range(start, min(start + 3, len(images)))):
                    want = tensor[row].view(torch.int16).numpy().view(np.uint16)
                    assert np.array_equal(np.asarray(raw[part.sample_slice(i)]).view(np.uint16), want), (dtype, name, i)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_decoding_workers_and_hashing_threads_run_below_the_thread_that_feeds_the_model(model_dir, image_folder,
                                                                                       tmp_path):
    """An image part's decoding workers and a part's hashing threads run HELPER_NICE below the job's
    own threads, which keep theirs: on a job's last free cores the main thread is not the one left
    waiting."""
    import multiprocessing
    import threading
    import time

    from actstore.extract.inputs import image_batches
    from actstore.io_utils import HELPER_NICE
    config = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder, extract={"parts": 1, "batch_size": 3})
    model_path, dataset = preflight(config, 0)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    below = min(19, own + HELPER_NICE)
    others = {p.pid for p in multiprocessing.active_children()}  # any an earlier test left running
    pixels = image_batches(load_image_processor(model_path), dataset.opener, dataset.samples, [[0, 1, 2]], 2, False, torch.float32)
    next(pixels)
    workers = [p for p in multiprocessing.active_children() if p.pid not in others]
    assert len(workers) == 2
    # Each worker lowers its own nice value as it starts: the first batch can come from one before
    # the other has run its init (on a busy machine), so wait for both, up to a deadline.
    deadline = time.monotonic() + 20
    while [os.getpriority(os.PRIO_PROCESS, w.pid) for w in workers] != [below, below] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [os.getpriority(os.PRIO_PROCESS, w.pid) for w in workers] == [below, below]
    writer = PartWriter(tmp_path / "part", [], np.zeros(1, np.int64), hash_threads=3)
    niceness = [writer.hashers.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                for _ in range(3)]
    assert {f.result() for f in niceness} == {below}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    writer.abort()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_16bit_casts_round_the_same_on_cpu_and_cuda():
    """Pixels are cast to a 16-bit model's dtype in the CPU decoding workers where the GPU cast them
    before: the two casts give the same bits (round to nearest even), ties and subnormals included."""
    torch.manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 22,), dtype=torch.int64).to(torch.int32)
    values = torch.cat([bits.view(torch.float32), torch.randn(1 << 20) * 3, torch.linspace(-70000, 70000, 1 << 16)])
    values = values[values.isfinite()]
    for dtype in (torch.bfloat16, torch.float16):
        on_cpu = values.to(dtype).view(torch.int16)
        on_gpu = values.cuda().to(dtype).view(torch.int16).cpu()
        assert torch.equal(on_cpu, on_gpu), dtype


def test_model_dtype_auto_runs_the_checkpoint_as_saved(model_dir, text_jsonl, tmp_path):
    """model.torch_dtype auto = the dtype config.json names: a bfloat16 checkpoint runs (and with
    storage_dtype auto stores) bfloat16, the same extraction and hash as naming bfloat16; a float32
    checkpoint's auto is the default float32's hash."""
    import shutil

    from actstore.hashing import stage_hash
    from actstore.model_config import run_dtype
    from transformers import AutoModelForCausalLM

    bf16 = shutil.copytree(model_dir("llama"), tmp_path / "llama-bf16", ignore=shutil.ignore_patterns("*.safetensors"))
    AutoModelForCausalLM.from_pretrained(model_dir("llama")).to(torch.bfloat16).save_pretrained(bf16)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    auto = tiny.make_config(tmp_path / "auto", bf16, text_jsonl, model={"torch_dtype": "auto"}, extract={"parts": 1})
    named = tiny.make_config(tmp_path / "named", bf16, text_jsonl, model={"torch_dtype": "bfloat16"},
                             extract={"parts": 1})
    assert run_dtype(auto["model"]) == "bfloat16" and stage_hash(auto, "extract") == stage_hash(named, "extract")
    meta = run_part(auto, 0, tmp_path / "auto" / "part-0000", progress=False)
    assert meta["model"]["torch_dtype"] == meta["storage_dtype"] == "bfloat16"
    run_part(named, 0, tmp_path / "named" / "part-0000", progress=False)
    assert data_files(tmp_path / "auto" / "part-0000") == data_files(tmp_path / "named" / "part-0000")
    f32_auto = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl, model={"torch_dtype": "auto"})
    assert stage_hash(f32_auto, "extract") == stage_hash(tiny.make_config(tmp_path, model_dir("llama"), text_jsonl),
                                                         "extract")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_weights_reach_cuda_through_the_pinned_slots_as_to_moves_them(model_dir, kind, monkeypatch):
    """load_model onto a GPU copies the weights through two pinned slots, here of 1000 bytes, so a
    tensor crosses many of them in turn (and with no minimum size, as the tiny model would take `.to`):
    every parameter and buffer (the rotary frequencies, a non-persistent one, included) has the bits,
    dtype, shape and strides `.to("cuda")` gives, and a tied weight (GPT-2's embedding and head) stays
    one tensor."""
    from actstore import models

    monkeypatch.setattr(models, "STAGING_BYTES", 1000)
    monkeypatch.setattr(models, "SLOTS_MIN_BYTES", 0)
    through_slots, copy = [], models._PinnedSlots.copy

    def counted(self, tensor: torch.Tensor) -> torch.Tensor:
        through_slots.append(tensor.shape)
        return copy(self, tensor)
    monkeypatch.setattr(models._PinnedSlots, "copy", counted)
    staged = models.load_model(model_dir(kind), "bfloat16", "cuda").model
    assert len(through_slots) >= len(list(staged.parameters()))
    plain = models.load_model(model_dir(kind), "bfloat16", "cpu").model.to("cuda")

    def tensors(model):
        return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))

    def ties(model):
        groups = {}
        for name, tensor in tensors(model).items():
            groups.setdefault(tensor.data_ptr(), []).append(name)
        return sorted(names for names in groups.values() if len(names) > 1)

    got, want = tensors(staged), tensors(plain)
    assert got.keys() == want.keys() and any("rotary" in name or "wpe" in name for name in got)
    for name, tensor in want.items():
        mine = got[name]
        assert (mine.device, mine.dtype, mine.shape, mine.stride()) == (tensor.device, tensor.dtype, tensor.shape,
                                                                       tensor.stride()), name
        assert torch.equal(mine.flatten().view(torch.uint8), tensor.flatten().view(torch.uint8)), name
    assert ties(staged) == ties(plain) and (kind != "gpt2" or ties(plain))


def test_the_log_says_when_a_cuda_gpu_runs_the_model_in_a_costly_dtype():
    """bfloat16 on a GPU without bfloat16 arithmetic (Pitzer's V100s) is emulated: the part's log
    names the GPU and the two dtypes that run natively; float32 for a 16-bit checkpoint costs twice
    the memory; the dtype a GPU runs natively gets no warning. On a CUDA machine, the warning agrees
    with torch's own answer for its device."""
    from actstore.models import gpu_precision_warning

    v100 = gpu_precision_warning("auto", "bfloat16", "bfloat16", "Tesla V100-SXM2-32GB", (7, 0))
    assert "Tesla V100-SXM2-32GB" in v100 and "7.0" in v100 and "emulates" in v100
    assert "float32" in v100 and "float16" in v100 and "65504" in v100
    assert gpu_precision_warning("bfloat16", "bfloat16", "float32", "Tesla T4", (7, 5)) is not None
    for gpu, capability in [("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA H100 80GB HBM3", (9, 0))]:
        assert gpu_precision_warning("auto", "bfloat16", "bfloat16", gpu, capability) is None
    assert gpu_precision_warning("float16", "float16", "bfloat16", "Tesla V100-SXM2-32GB", (7, 0)) is None
    wide = gpu_precision_warning("float32", "float32", "bfloat16", "NVIDIA H100 80GB HBM3", (9, 0))
    assert "twice its memory" in wide and "bfloat16" in wide
    assert gpu_precision_warning("float32", "float32", "float32", "NVIDIA H100 80GB HBM3", (9, 0)) is None
    if torch.cuda.is_available():
        here = gpu_precision_warning("auto", "bfloat16", "bfloat16", torch.cuda.get_device_name(),
                                     torch.cuda.get_device_capability())
        assert (here is None) == torch.cuda.is_bf16_supported(including_emulation=False)


@pytest.mark.parametrize("kind,tower", [("llama", None), ("gpt2", None), ("qwen2_5_vl", None), ("t5", None),
                                       ("clip", None), ("gemma3", "vision")])
def test_cuda_preflight_sizes_the_weights_that_run_before_reading_any(kind, tower, model_dir, tmp_path):
    """The GPU memory check sizes, from the meta-device skeleton alone, exactly the weights the run
    puts on the device: a whole causal LM (a tied head once; GPT-2's Conv1D), a whole VLM, T5's
    encoder alone, CLIP's vision model alone, a VLM's vision tower alone, in float32 and bfloat16.
    Weights past the GPU's free memory are refused with the sizes and the GPU named, and the 16-bit
    dtypes offered for float32.
    A quantized checkpoint is not sized (its quantizer lays out its weights)."""
    import shutil
    from pathlib import Path

    from actstore.models import bytes_to_load, gpu_memory_error, model_skeleton, weight_bytes

    for dtype in ("float32", "bfloat16"):
        loaded = load_model(model_dir(kind), dtype, "cpu", tower)
        actual = weight_bytes(loaded.model, dtype)
        on_device = {t.data_ptr(): t.numel() * t.element_size() for t in loaded.model.state_dict().values()}
        assert actual == sum(on_device.values())
        assert bytes_to_load(model_dir(kind), model_skeleton(model_dir(kind), tower), dtype) == actual
    path = Path("/models/llama-8b")
    error = gpu_memory_error(path, 32_120_000_000, "float32", 15_600_000_000, 16_900_000_000,
                             "cuda:0 (Tesla V100-PCIE-16GB)")
    assert "/models/llama-8b" in error and "32.1 GB in float32" in error and "15.6 GB free of 16.9 GB" in error
    assert "Tesla V100-PCIE-16GB" in error and "16-bit model.torch_dtype" in error
    assert "16-bit" not in gpu_memory_error(path, 16_100_000_000, "bfloat16", 15_600_000_000, 16_900_000_000, "x")
    assert gpu_memory_error(path, 16_000_000_000, "bfloat16", 78_000_000_000, 80_000_000_000, "x") is None
    quantized = tmp_path / "quantized"  # sized by its quantizer, not by the skeleton: never refused by it
    shutil.copytree(model_dir(kind), quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "fp8"}}))
    assert bytes_to_load(quantized, model_skeleton(quantized, tower), "bfloat16") is None
    if torch.cuda.is_available():  # the real check passes a tiny model on the real device
        from actstore.models import check_fits_on_gpu
        check_fits_on_gpu(model_dir(kind), model_skeleton(model_dir(kind), tower), "bfloat16", torch.device("cuda"))


def test_device_auto_refuses_a_slurm_job_given_gpus_torch_cannot_see(model_dir, text_jsonl, tmp_path, monkeypatch):
    """A Slurm job given GPUs (SLURM_JOB_GPUS, SLURM_GPUS_ON_NODE) that torch cannot see (a CPU-only
    build, a driver it cannot use) is refused under `device: auto`, naming the key, the GPUs, torch
    and what to do, where it would run on the CPU; no GPU given, or `cpu` named: the CPU."""
    from actstore.models import pick_device, unseen_gpus_error

    cpu_build = unseen_gpus_error({"SLURM_JOB_GPUS": "0"}, "2.13.0+cpu", None, "extract.device")
    assert "extract.device auto" in cpu_build and "GPUs (0)" in cpu_build and "torch 2.13.0+cpu" in cpu_build
    assert "CPU-only build" in cpu_build and "extract.device: cpu" in cpu_build
    driver = unseen_gpus_error({"SLURM_GPUS_ON_NODE": "2"}, "2.11.0+cu130", "13.0", "sae.device")
    assert "2 on this node" in driver and "CUDA 13.0" in driver and "nvidia-smi" in driver and "sae.device" in driver
    for env in ({}, {"SLURM_GPUS_ON_NODE": "0"}, {"SLURM_JOB_GPUS": ""}, {"SLURM_JOB_ID": "7"}):
        assert unseen_gpus_error(env, "2.13.0", None) is None
    monkeypatch.setenv("SLURM_JOB_GPUS", "0")
    assert pick_device("cpu", "extract.device").type == "cpu"
    if torch.cuda.is_available():  # torch sees the GPU: it runs there
        assert pick_device("auto").type == "cuda"
        return
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"parts": 1})
    with pytest.raises(ConfigError, match="extract.device auto: this Slurm job was given GPUs"):
        run_part(config, 0, tmp_path / "part", progress=False)
    assert not (tmp_path / "part").exists()


def test_float16_storage_counts_the_activations_it_turns_into_inf(model_dir, text_jsonl, tmp_path, caplog):
    """A float32 model whose block-0 output is scaled far past float16's range (its LayerNorm
    weight x 1e6): part.json's float16_overflow_count is exactly the infs stored, and a warning
    says so; a part with no overflow has no such key (its part.json as before)."""
    import transformers as tf

    scaled = tmp_path / "scaled-bert"
    model = tf.BertModel.from_pretrained(model_dir("bert"))
    with torch.no_grad():
        model.encoder.layer[0].output.LayerNorm.weight.mul_(1e6)
    model.save_pretrained(scaled)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir("bert") / name).is_file():
            (scaled / name).write_bytes((model_dir("bert") / name).read_bytes())
    config = tiny.make_config(tmp_path, scaled, text_jsonl, extract={"parts": 1, "storage_dtype": "float16"})
    with caplog.at_level("WARNING", logger="actstore.extract.run"):
        meta = run_part(config, 0, tmp_path / "part-0000", progress=False)
    stored = sum(int(np.isinf(np.load(tmp_path / "part-0000" / f)).sum()) for f in ("layer_000.npy", "layer_002.npy"))
    assert stored > 1000 and meta["float16_overflow_count"] == stored
    assert json.loads((tmp_path / "part-0000" / "part.json").read_text())["float16_overflow_count"] == stored
    assert f"part 0: {stored} finite activations beyond +-65504" in caplog.text
    from actstore.formats import extract as extract_format
    assert extract_format.verify(tmp_path / "part-0000") == []
    assert extract_format.inspect(tmp_path / "part-0000")["float16_overflow_count"] == stored
    plain = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"parts": 1, "storage_dtype": "float16"})
    assert "float16_overflow_count" not in run_part(plain, 0, tmp_path / "plain", progress=False)


def test_vit_parts_are_identical_with_and_without_decoding_workers(model_dir, image_folder, tmp_path):
    """Also: an image part's startup steps, in order, each ended before the first batch was asked for."""
    parts = []
    for workers in (0, 2):
        config = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder,
                                  extract={"parts": 1, "num_workers": workers, "batch_size": 3})
        out = tmp_path / f"w{workers}" / "part-0000"
        meta = run_part(config, 0, out, progress=False)
        assert meta["num_workers"] == workers
        waits = meta["extraction_waits"]
        steps = waits["startup_steps"]
        assert list(steps) == ["preflight", "image_processor", "image_workers", "image_checks", "inputs", "model_load",
                               "tokens_per_image"]
        assert list(steps.values()) == sorted(steps.values()) and steps["tokens_per_image"] <= waits["startup_seconds"]
        parts.append(data_files(out))
    assert parts[0] == parts[1]


@pytest.mark.parametrize("kind", ["dinov2", "clip", "siglip"])
def test_vit_parts_are_identical_whether_a_batch_is_decoded_whole_or_in_items(model_dir, image_folder, tmp_path,
                                                                            monkeypatch, kind):
    import actstore.extract.inputs as inputs
    parts = []
    for per_item, workers in ((16, 0), (2, 2)):  # a batch of 5 decoded in one processor call; in calls of 2, 2, 1
        monkeypatch.setattr(inputs, "IMAGES_PER_ITEM", per_item)
        config = tiny.make_config(tmp_path, model_dir(kind), image_folder,
                                  extract={"parts": 1, "num_workers": workers, "batch_size": 5})
        run_part(config, 0, tmp_path / f"{per_item}" / "part-0000", progress=False)
        parts.append(data_files(tmp_path / f"{per_item}" / "part-0000"))
    assert parts[0] == parts[1]


def test_execution_keys_do_not_change_the_extraction_hash(model_dir, text_jsonl, tmp_path):
    from actstore.hashing import stage_hash, stage_payload
    base = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl)
    same = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={
        "num_workers": 3, "buffers": 1, "writer_threads": 5, "storage_dtype": "float32"})
    assert stage_hash(base, "extract") == stage_hash(same, "extract")
    # float32 storage hashes as releases before storage_dtype did: the key is absent from the payload.
    assert "storage_dtype" not in stage_payload(base, "extract")["config"]["extract"]
    bf16 = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"storage_dtype": "bfloat16"})
    auto_bf16 = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, model={"torch_dtype": "bfloat16"})
    pinned_bf16 = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, model={"torch_dtype": "bfloat16"},
                                   extract={"storage_dtype": "bfloat16"})
    assert stage_hash(bf16, "extract") != stage_hash(base, "extract")
    assert stage_hash(auto_bf16, "extract") == stage_hash(pinned_bf16, "extract")


@pytest.mark.slow
def test_every_format_from_a_bfloat16_extraction_verifies_and_validates(model_dir, text_jsonl, tmp_path):
    """Real Snakemake, target validate: saev/pickle (float32, exact), lmprobe (dtype auto: bfloat16,
    its bits copied), zarr (float16) are built from bf16 parts; validate compares each reader with
    the stored values; verify is clean."""
    import subprocess
    import sys

    import yaml
    from actstore.config import load_config
    from actstore.hashing import stage_dir
    from actstore.verify import find_store
    from test_cli import actstore
    bin_dir = tiny.Path(sys.executable).parent
    config = {"dump_to": str(tmp_path / "dump"), "model": {"path": str(model_dir("llama")), "torch_dtype": "bfloat16"},
              "dataset": {"path": str(text_jsonl)},
              "extract": {"layers": [0, 2], "max_seq_length": 24, "batch_size": 8, "parts": 2},
              "lmprobe": {"dtype": "auto"}}
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    proc = subprocess.run([str(bin_dir / "snakemake"), "-s", str(tiny.REPO / "Snakefile"), "-d", str(tmp_path),
                           "--configfile", str(configfile), "--cores", "2", "validate"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    resolved = load_config(configfile)
    report = json.loads((stage_dir(resolved, "validate") / "report.json").read_text())
    assert set(report["formats"]) == {"extract", "saev", "pickle", "lmprobe", "zarr"}
    assert all(f["checked"] > 0 and not f["problems"] for f in report["formats"].values())
    assert report["formats"]["extract"]["inspect"]["dtype"] == report["formats"]["lmprobe"]["inspect"]["dtype"] == \
        "bfloat16"
    # saev: verified through its stage dir's pointer (its seal), the store beside it inspected.
    assert report["formats"]["saev"]["store"] == f"saev/{stage_dir(resolved, 'saev').name}"
    assert report["formats"]["saev"]["inspect"]["path"] != report["formats"]["saev"]["store"]
    for stage in ("extract", "saev", "pickle", "lmprobe", "zarr"):
        store = stage_dir(resolved, stage) if stage == "extract" else find_store(stage_dir(resolved, stage), stage)
        verify = actstore("verify", str(store))  # in this process: a command's imports cost ~2-3 s a store
        assert verify.returncode == 0, (stage, verify.stdout + verify.stderr)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pipeline_stores_the_models_outputs_whatever_the_buffers(model_dir, text_jsonl, tmp_path):
    """Pinned staging, the side copy stream and the events, and input ids and indices copied from
    pinned memory without waiting for the stream: the same bytes for 1 and 4 buffers, and the
    activations and token log-probs of a float32 CPU extraction within float tolerance (GPU kernels
    round differently)."""
    files = []
    for buffers in (1, 4):
        config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl,
                                  extract={"parts": 1, "device": "cuda", "buffers": buffers})
        meta = run_part(config, 0, tmp_path / f"cuda-{buffers}", progress=False)
        assert meta["device_name"] == torch.cuda.get_device_name()
        files.append(data_files(tmp_path / f"cuda-{buffers}"))
    assert files[0] == files[1]
    cpu = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl, extract={"parts": 1, "device": "cpu"})
    assert "device_name" not in run_part(cpu, 0, tmp_path / "cpu", progress=False)
    gpu_part, cpu_part = open_part(tmp_path / "cuda-1"), open_part(tmp_path / "cpu")
    for i in range(len(cpu_part.samples)):
        assert rel_err(gpu_part.activations("layer_2", i), cpu_part.activations("layer_2", i)) <= 1e-3
        gpu_logprob, cpu_logprob = gpu_part.token_logprob(i), cpu_part.token_logprob(i)
        assert np.isnan(gpu_logprob[0]) and np.isnan(cpu_logprob[0])
        assert len(gpu_logprob) == 1 or rel_err(gpu_logprob[1:], cpu_logprob[1:]) <= 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_out_of_memory_names_the_batch_and_what_to_lower(model_dir, tmp_path):
    """A first batch past the GPU's memory (torch held to the weights and 32 MiB more) stops the job
    naming the GPU, the batch's shape and the two keys to lower, and leaves no part."""
    from actstore.models import bytes_to_load, model_skeleton

    texts = tmp_path / "long.jsonl"
    line = json.dumps({"text": " ".join(f"token{i}" for i in range(400))}) + "\n"
    texts.write_text(line * 512)
    config = tiny.make_config(tmp_path, model_dir("llama"), texts, extract={
        "parts": 1, "device": "cuda", "batch_size": 512, "max_seq_length": 128, "layers": [0]})
    torch.cuda.empty_cache()
    weights = bytes_to_load(model_dir("llama"), model_skeleton(model_dir("llama")), "float32")
    allowed = torch.cuda.memory_reserved() + weights + (32 << 20)
    torch.cuda.set_per_process_memory_fraction(allowed / torch.cuda.get_device_properties(0).total_memory)
    try:
        with pytest.raises(ConfigError) as caught:
            run_part(config, 0, tmp_path / "part", progress=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    message = str(caught.value)
    assert torch.cuda.get_device_name() in message and "512 texts of up to 128 tokens" in message
    assert "extract.batch_size (512)" in message and "extract.max_seq_length (128)" in message
    assert not (tmp_path / "part").exists()


def test_verify_names_a_missing_part_an_unlisted_file_and_a_path_outside_the_part(extracted, tmp_path):
    import shutil

    from actstore.errors import FormatError
    from actstore.formats import extract as extract_format
    _, out = extracted("bert", extract={"parts": 3})
    copy = tmp_path / "extract"
    shutil.copytree(out, copy)
    assert extract_format.verify(copy) == []
    shutil.rmtree(copy / "part-0001")
    assert any("part-0001/part.json: missing (listed in extract.json)" in p for p in extract_format.verify(copy))
    with pytest.raises(FormatError, match="part-0001"):
        open_extraction(copy)  # extract.json says 3 parts: never half the samples
    (copy / "part-0000" / "layer_002.npy").with_name("junk.txt").write_text("x")
    assert any("junk.txt: not listed in part.json" in p for p in extract_format.verify(copy))
    meta_path = copy / "part-0002" / "part.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["../../../etc/passwd"] = meta["files"].pop("offsets.npy")
    meta_path.write_text(json.dumps(meta))
    assert any("'../../../etc/passwd' is not a relative path inside" in p for p in extract_format.verify(copy))


@pytest.mark.parametrize("record", [-1, {}, {"bytes": "x", "sha256": "0" * 64}])
def test_a_mistyped_file_record_is_named_by_verify_and_inspect(extracted, tmp_path, record):
    """A part.json file record of the wrong shape is a FormatError naming part.json, for verify and for
    inspect (which sums the records' bytes), never a TypeError or KeyError."""
    import shutil

    from actstore.formats import extract as extract_format
    _, out = extracted("bert")
    copy = tmp_path / "extract"
    shutil.copytree(out, copy)
    meta_path = copy / "part-0001" / "part.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["layer_002.npy"] = record
    meta_path.write_text(json.dumps(meta))
    named = rf"{meta_path}: files\['layer_002.npy'\] must be an object with a whole number of bytes"
    assert any(re.match(named, p) for p in extract_format.verify(copy))
    with pytest.raises(FormatError, match=named):
        extract_format.inspect(copy)


@pytest.mark.parametrize("key, value", [("n_tokens", 1), ("layers", [1]), ("tensors", ["layer_1"]),
                                        ("parts", None), ("model", {"name": "another"})])
def test_an_index_that_misstates_its_parts_is_named(extracted, tmp_path, key, value):
    """extract.json's totals, tensors, model and part list are checked against the parts themselves
    (each part.json has its sha256 there, so the parts are what is trusted)."""
    import shutil

    from actstore.formats import extract as extract_format
    _, out = extracted("bert")
    copy = tmp_path / "extract"
    shutil.copytree(out, copy)
    index = json.loads((copy / "extract.json").read_text())
    right = index[key] if key != "parts" else index["parts"][1]["sample_range"]
    if key == "parts":  # a part's own line: the sample range it covers
        key, value = "parts[1].sample_range", [right[0] + 1, right[1]]
        index["parts"][1]["sample_range"] = value
    else:
        index[key] = value
    (copy / "extract.json").write_text(json.dumps(index))
    assert extract_format.verify(copy) == [f"{copy / 'extract.json'}: {key} = {value!r} but the parts say {right!r:.100}"]


def test_without_its_index_a_deleted_or_misplaced_part_is_still_named(extracted, tmp_path):
    """extract.json names a deleted part; with it gone too, verify names the missing index, and the
    reader still refuses a stage missing a part (every part.json says how many parts there are and
    which rows it holds) rather than returning the parts that are left."""
    import shutil

    from actstore.formats import extract as extract_format
    _, out = extracted("bert")
    copy = tmp_path / "extract"
    shutil.copytree(out, copy)
    (copy / "extract.json").unlink()
    assert extract_format.verify(copy) == [f"{copy / 'extract.json'}: missing (it lists the parts, so that a deleted "
                                           f"part is named)"]
    assert open_extraction(copy).n_samples == open_extraction(out).n_samples
    shutil.rmtree(copy / "part-0001")
    with pytest.raises(FormatError, match=r"part-0001: no part\.json; the extraction part is missing"):
        open_extraction(copy)
    shutil.copytree(out / "part-0001", copy / "part-0001")
    meta = json.loads((copy / "part-0001" / "part.json").read_text())
    start, stop = meta["sample_range"]
    meta["sample_range"] = [start + 1, stop + 1]  # rows it does not hold, as if moved from elsewhere
    (copy / "part-0001" / "part.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=rf"part-0001/part\.json: sample_range \[{start + 1}, {stop + 1}\]"):
        open_extraction(copy)



@pytest.mark.parametrize("edit, named", [
    (lambda meta: meta["dataset"]["labels"].insert(0, "zz"), "dataset"),  # another numbering of the label_ids
    (lambda meta: meta.update(layers=meta["layers"][::-1]), "layers"),
    (lambda meta: meta["model"].update(torch_dtype="bfloat16"), "model"),
    (lambda meta: meta.update(storage_dtype="bfloat16"), "storage_dtype"),
    (lambda meta: meta.pop("image_decoding"), "image_decoding"),  # decoded before EXIF and alpha counted
    (lambda meta: meta.update(image_processor="BitImageProcessorFast"), "image_processor"),  # another backend
    (lambda meta: meta.update(image_pipeline="gpu"), "image_pipeline")])
def test_a_part_from_another_run_is_refused_naming_what_differs(edit, named, extracted, tmp_path):
    """Every format reads the run-wide fields (labels, layers, model, dtype) from part 0: a part
    whose part.json says otherwise (made by another config, or an actstore that numbers labels
    or decodes images otherwise, or in an environment whose image processor backend differs, then
    copied in) is named, not read under part 0's labels."""
    import shutil

    _, out = extracted("dinov2", extract={"parts": 2})
    copy = tmp_path / "extract"
    shutil.copytree(out, copy)
    meta = json.loads((copy / "part-0001" / "part.json").read_text())
    edit(meta)
    (copy / "part-0001" / "part.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=rf"part-0001/part\.json: {named} differs from .*part-0000/part\.json's"):
        open_extraction(copy)

def test_the_extraction_contract_types_part_json_and_names_a_missing_field(extracted, tmp_path):
    import shutil
    config, out = extracted("gpt2")
    part = open_part(out / "part-0000")
    info = part.info
    assert (info.layers, info.modality, info.model_kind) == (config["extract"]["layers"], "text", "causal")
    assert (info.n_samples, info.n_tokens) == (len(part.samples), int(part.offsets[-1]))
    assert info.model.record == part.meta["model"] and info.model.name == part.meta["model"]["name"]
    assert info.logits_topk == config["extract"]["logits_topk"]
    copy = tmp_path / "part"
    shutil.copytree(out / "part-0000", copy)
    meta = json.loads((copy / "part.json").read_text())
    del meta["model"]["architecture"]
    (copy / "part.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=r"part.json: field 'architecture' missing"):
        open_part(copy)
    # A field of the wrong type is named before anything computes with it (was a ValueError from
    # the layer's file name, or a TypeError).
    from actstore.formats import extract as extract_format
    for key, value, want in (("layers", [None], "a non-empty list of block numbers"), ("n_tokens", "12", "a whole number"),
                             ("sample_range", [3], r"\[start, stop\]"), ("hooks", [1], "a list of strings")):
        bad = json.loads((out / "part-0000" / "part.json").read_text()) | {key: value}
        (copy / "part.json").write_text(json.dumps(bad))
        with pytest.raises(FormatError, match=rf"part.json: field '{key}' must be {want}"):
            extract_format.inspect(copy)


def tekken_like_mistral(model_dir_path, out):
    """A Mistral folder as a tekken checkpoint saved by transformers 4 looks to transformers 5: config.json
    of model_type mistral and an older transformers_version, a tokenizer of over 100,000 entries whose
    pre-tokenizer is a Split regex (here whitespace only, where the corrected regex also splits a word
    from its punctuation and digit from digit, and keeps a space with the word after it) and
    byte-level. Three merges tell the two apart ("o," and "12" only as saved, " t" only corrected); the
    other entries past the bytes are never produced, so every id fits the tiny model's vocabulary."""
    import shutil

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model_dir_path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "transformers_version": "4.46.0"}))
    vocab = {symbol: i for i, symbol in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    merges = [("o", ","), ("1", "2"), ("Ġ", "t")]
    vocab |= {a + b: len(vocab) + i for i, (a, b) in enumerate(merges)}
    vocab |= {f"unused_{i}": len(vocab) + i for i in range(100_001 - len(vocab))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    for file in out.glob("tokenizer*"):
        file.unlink()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="unused_0", pad_token="unused_0").save_pretrained(out)
    return out


def test_model_fix_mistral_regex_is_the_users_answer_to_transformers_warning(tmp_path, text_jsonl, caplog):
    """transformers 5 flags a tekken-style Mistral tokenizer saved before it and runs it as saved: the
    part's log says which key decides, and part.json records the answer. `true` tokenizes as
    transformers' corrected regex does (other ids than the saved regex gives), `false` as saved, and
    `true` on a tokenizer with no Split regex (a sentencepiece or byte-level one, whose every token the
    fix would change) is refused before any weight loads. The key is part of the extraction's hash."""
    from transformers import AutoTokenizer

    from actstore.hashing import stage_hash
    folder = tekken_like_mistral(tiny.build_family("mistral", tmp_path / "built"), tmp_path / "tekken")
    texts = [json.loads(line)["text"] for line in text_jsonl.read_text().splitlines()]
    runs = {}
    for fix in (None, False, True):
        model = {} if fix is None else {"fix_mistral_regex": fix}
        config = tiny.make_config(tmp_path / str(fix), folder, text_jsonl, model=model,
                                  extract={"parts": 1, "max_seq_length": 32, "layers": [0]})
        caplog.clear()
        meta = run_part(config, 0, tmp_path / str(fix) / "part", progress=False)
        part = open_part(tmp_path / str(fix) / "part")
        runs[fix] = [part.token_ids(i).tolist() for i in range(len(part.samples))]
        flagged = "model.fix_mistral_regex: true for a tekken tokenizer" in caplog.text
        assert flagged == (fix is None) and meta["model"]["fix_mistral_regex"] is bool(fix), fix
        runs[f"hash {fix}"] = stage_hash(config, "extract")
    assert runs[None] == runs[False] != runs[True]
    fixed = AutoTokenizer.from_pretrained(folder, fix_mistral_regex=True)
    assert runs[True] == fixed(texts, truncation=True, max_length=32)["input_ids"]
    assert len({runs["hash None"], runs["hash False"], runs["hash True"]}) == 3

    byte_level = tiny.build_family("mistral", tmp_path / "bpe")
    config = tiny.make_config(tmp_path / "refused", byte_level, text_jsonl, model={"fix_mistral_regex": True})
    with pytest.raises(ConfigError, match=r"model.fix_mistral_regex: true, but .*tokenizer.json splits text with "
                                          r"\['ByteLevel'\]"):
        run_part(config, 0, tmp_path / "refused" / "part", progress=False)
    assert not (tmp_path / "refused" / "part").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_part_reads_back_as_its_float32_values_rounded(tmp_path, dtype):
    """The same synthetic extraction stored in float32 and in a 16-bit dtype: each row of the 16-bit
    part, read by index or by `read_rows` into a float32 buffer, is the float32 row rounded to that
    dtype (torch's rounding) and widened back exactly; `read_rows` into a buffer of the stored dtype
    gives the stored bits, and into any other dtype is refused."""
    from actstore.formats.extract import synthetic_extraction
    wide = open_part(synthetic_extraction(tmp_path / "f32", 200_000, 1, 32, [1], tokens=(4, 40)) / "part-0000")
    narrow = open_part(synthetic_extraction(tmp_path / dtype, 200_000, 1, 32, [1], tokens=(4, 40), dtype=dtype)
                       / "part-0000")
    assert narrow.meta["files"]["layer_001.npy"]["dtype"] == dtype
    expected = torch.from_numpy(np.array(wide.tensor("layer_1")[:])).to(getattr(torch, dtype)).float().numpy()
    for i in range(len(narrow.samples)):
        a, b = narrow.sample_slice(i).start, narrow.sample_slice(i).stop
        rows = np.full((50, 32), np.nan, np.float32)
        narrow.tensor("layer_1").read_rows(a, b, rows[:b - a])
        assert np.array_equal(rows[:b - a], expected[a:b]) and np.isnan(rows[b - a:]).all()
        assert np.array_equal(narrow.tensor("layer_1")[a:b], expected[a:b])
        bits = np.empty((b - a, 32), narrow.tensor("layer_1").raw.dtype)  # as stored: no widening
        narrow.tensor("layer_1").read_rows(a, b, bits)
        assert bits.tobytes() == narrow.tensor("layer_1").raw[a:b].tobytes()
    with pytest.raises(ValueError, match=f"layer_001.npy \\({dtype}\\) into float64"):
        narrow.tensor("layer_1").read_rows(0, 4, np.empty((4, 32)))


def _offsets_changed(part):
    """offsets.npy with one offset moved past the next (same size, so the cheap open's size check passes)."""
    offsets = np.load(part / "offsets.npy")
    offsets[5] = offsets[6] + 3
    np.save(part / "offsets.npy", offsets)


def _tensor_rewritten(array):
    def rewrite(part):
        np.save(part / "layer_001.npy", array(np.load(part / "layer_001.npy")))
    return rewrite


def _dtype_misstated(dtype):
    def misstate(part):
        meta = json.loads((part / "part.json").read_text())
        meta["files"]["layer_001.npy"]["dtype"] = dtype
        (part / "part.json").write_text(json.dumps(meta))
    return misstate


@pytest.mark.parametrize("damage, named", [
    (_offsets_changed, r"offsets\.npy: token offsets do not run from 0 up to part\.json's n_tokens"),
    (_tensor_rewritten(np.asfortranarray), r"layer_001\.npy: \.npy holds float32 \[\d+, 8\] Fortran order"),
    (_dtype_misstated("float16"), r"layer_001\.npy: \.npy holds float32 .* records dtype 'float16'"),
    (_dtype_misstated("float64"), r"layer_001\.npy: \.npy holds float32 .* records dtype 'float64'"),
    (_dtype_misstated("no such dtype"), r"layer_001\.npy: \.npy holds float32 .* records dtype 'no such dtype'")])
def test_a_part_whose_offsets_or_tensor_header_disagree_with_part_json_is_refused_not_misread(
        tmp_path, damage, named):
    """Every sample's rows are read through offsets.npy and the tensor's .npy header: a changed offset,
    a Fortran-order file, a dtype part.json misstates (bfloat16 bits read as float16 values) each read
    other values without an error before; now the part names the file."""
    from actstore.formats.extract import synthetic_extraction
    part = synthetic_extraction(tmp_path / "x", 50_000, 1, 8, [1], tokens=(4, 10)) / "part-0000"
    damage(part)
    with pytest.raises(FormatError, match=named):
        open_part(part).activations("layer_1", 5)


def test_a_tensor_shorter_than_its_token_count_is_refused_not_read_short(tmp_path):
    """A tensor file (and its part.json record) with fewer rows than n_tokens: the last samples' slices
    came back short or empty (numpy clips a slice at the end) without an error."""
    from actstore.formats.extract import synthetic_extraction
    part = synthetic_extraction(tmp_path / "x", 50_000, 1, 8, [1], tokens=(4, 10)) / "part-0000"
    _tensor_rewritten(lambda array: array[:-20])(part)
    meta = json.loads((part / "part.json").read_text())
    meta["files"]["layer_001.npy"].update(bytes=(part / "layer_001.npy").stat().st_size,
                                          shape=list(np.load(part / "layer_001.npy").shape))
    (part / "part.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=rf"layer_001\.npy: .* and {meta['n_tokens']} rows"):
        open_part(part).activations("layer_1", meta["n_samples"] - 1)


def test_validates_coordinates_check_every_layer(tmp_path):
    """validate reads its coordinates through every store: each row drew its layer at random, so 48
    rows (validate.n_coords' default) left some of 24 layers unchecked at most seeds, and a store
    wrong in those layers alone passed. The rows now take the layers in turn."""
    from actstore.formats.extract import synthetic_extraction
    from actstore.verify import sample_coordinates
    layers = list(range(24))
    extraction = open_extraction(synthetic_extraction(tmp_path / "x", 400_000, 2, 8, layers, tokens=(4, 10)))
    for seed in range(5):
        assert {layer for _, layer, _ in sample_coordinates(extraction, 48, seed)} == set(layers)


@pytest.mark.parametrize("row, named", [
    ('{"sample_idx": 0, "num_tokens": 3, "label": "cat", "label": "dog"}', r"line 1 is not valid JSON \(key 'label' given twice\)"),
    ("[0, 3]", r"line 1 is not a sample's JSON object with a whole-number sample_idx: b'\[0, 3\]'"),
    ('{"num_tokens": 3}', r"line 1 is not a sample's JSON object with a whole-number sample_idx")])
def test_a_samples_row_with_a_key_twice_or_not_an_object_is_named(tmp_path, row, named):
    """samples.jsonl rows were parsed with plain json.loads: a key given twice read as its last value
    (the part's sha256 saw both), and a row that is not an object, or has no sample_idx, reached its
    callers (a TypeError, or a KeyError from verify's summary of a part rehashed to match)."""
    from actstore.formats.extract import synthetic_extraction
    root = synthetic_extraction(tmp_path / "x", 20_000, 1, 8, [1], tokens=(4, 10))
    path = root / "part-0000" / "samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(row + "\n" + "".join(lines[1:]))
    with pytest.raises(FormatError, match=rf"samples\.jsonl: {named}"):
        open_extraction(root).sample(0)


def test_a_fifo_in_place_of_samples_jsonl_is_named_not_opened(tmp_path):
    """Opened for a blocking read, a FIFO hung the first reader of a sample row forever."""
    from actstore.formats.extract import synthetic_extraction
    root = synthetic_extraction(tmp_path / "x", 20_000, 1, 8, [1], tokens=(4, 10))
    (root / "part-0000" / "samples.jsonl").unlink()
    os.mkfifo(root / "part-0000" / "samples.jsonl")
    code = f"from actstore.formats.extract import open_extraction; open_extraction({str(root)!r}).sample(0)"
    import subprocess
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "samples.jsonl: not a regular file" in proc.stderr


@pytest.mark.parametrize("parts", [5, "ab", None])
def test_an_index_whose_parts_is_not_a_list_is_named(tmp_path, parts):
    """open_extraction counted the parts with len(extract.json's parts): a number was a TypeError, an
    index without it a KeyError, and a string taken for as many parts as it has characters."""
    from actstore.formats.extract import synthetic_extraction
    root = synthetic_extraction(tmp_path / "x", 20_000, 2, 8, [1], tokens=(4, 10))
    index = json.loads((root / "extract.json").read_text())
    index.pop("parts") if parts is None else index.update(parts=parts)
    (root / "extract.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match=r"extract\.json: not an object whose 'parts' is a list"):
        open_extraction(root)


def test_a_part_of_another_tensor_width_is_refused(tmp_path):
    """Writers size their rows from the first part: a part holding its tensor at another width (copied
    from a run of another model of the same name) was read into them as other bytes, no error."""
    import shutil

    from actstore.formats.extract import synthetic_extraction
    root = synthetic_extraction(tmp_path / "a", 40_000, 2, 8, [1], tokens=(4, 10))
    wide = synthetic_extraction(tmp_path / "b", 80_000, 2, 16, [1], tokens=(4, 10))  # the same samples
    shutil.rmtree(root / "part-0001")
    shutil.copytree(wide / "part-0001", root / "part-0001")
    meta = json.loads((root / "part-0001" / "part.json").read_text())
    meta["model"]["path"] = meta["dataset"]["path"] = str(root)  # the synthetic writer records its folder
    (root / "part-0001" / "part.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=r"part-0001/part\.json: files' row shapes and dtypes \{'layer_001\.npy': "
                                          r"\(\[16\], 'float32'\).* differ from .*part-0000/part\.json's"):
        open_extraction(root, n_parts=2)


def test_verify_names_a_dtype_part_json_misstates(tmp_path):
    """The dtype part.json records is no byte of the tensor file, so its sha256 passed: verify passed a
    part whose bfloat16 bits it called float16 (read as other values)."""
    from actstore.formats import extract as extract_format
    from actstore.formats.extract import synthetic_extraction
    from actstore.io_utils import sha256_file
    root = synthetic_extraction(tmp_path / "x", 20_000, 1, 8, [1], tokens=(4, 10), dtype="bfloat16")
    meta_path = root / "part-0000" / "part.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["layer_001.npy"]["dtype"] = "float16"
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    index = json.loads((root / "extract.json").read_text())
    index["parts"][0]["part_json_sha256"] = sha256_file(meta_path)
    (root / "extract.json").write_text(json.dumps(index))
    assert [re.sub(r"\[\d+, 8\]", "[n, 8]", p) for p in extract_format.verify(root)] == [
        f"{root / 'part-0000' / 'layer_001.npy'}: .npy holds uint16 [n, 8] C order; part.json records dtype "
        f"'float16' shape [n, 8] and {meta['n_tokens']} rows"]


def test_an_oversized_offsets_file_is_refused_without_reading_it(tmp_path):
    """offsets.npy was read whole before anything checked it: with its record gone from part.json (so
    no size is compared), a 256 MiB file (sparse) took 256 MiB of memory to refuse."""
    from actstore.formats.extract import synthetic_extraction
    part = synthetic_extraction(tmp_path / "x", 20_000, 1, 8, [1], tokens=(4, 10)) / "part-0000"
    meta = json.loads((part / "part.json").read_text())
    del meta["files"]["offsets.npy"]
    (part / "part.json").write_text(json.dumps(meta))
    n = 1 << 25
    with open(part / "offsets.npy", "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<i8", "fortran_order": False, "shape": (n,)})
        fh.truncate(fh.tell() + 8 * n)
    def refused() -> None:
        with pytest.raises(FormatError, match=rf"offsets\.npy: int64 \[{n}\], part\.json says int64"):
            open_part(part)

    assert tiny.traced_peak(refused)[1] < 64 << 20


PICKLE_PARAMS = {"hidden_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2, "vocab_size": 100}
LMPROBE_DEFAULTS = {"storage": "full_sequence", "prompt_ordering": "original", "seed": 0, "dtype": "float32",
                    "shard_bytes": 1 << 30, "layers": None, "logits_topk": None, "jobs": None, "token_strings": False}


def write_real_store(name, root, out, parts=(0, 1), **section):
    """A store of format `name` written by its real writer from the extraction at `root`: of the
    extraction parts `parts` only (pickle, zarr), or of `section`'s options (saev, lmprobe)."""
    from actstore.formats.lmprobe import write_dataset
    from actstore.formats.pickle import merge_machines, write_machine
    from actstore.formats.saev import write_store
    from actstore.formats.zarr import write_manifest, write_shard
    if name == "pickle":
        machines = [write_machine(root / f"part-{p:04d}", out / f"machine-{p:04d}", model_params=PICKLE_PARAMS,
                                  progress=False) and out / f"machine-{p:04d}" for p in parts]
        if len(machines) == 1:  # a machine's own store: the merge refuses a subset of the machines
            return machines[0]
        merge_machines(machines, out)
    elif name == "zarr":
        shards = [out / "shards" / f"shard-{p:04d}.zarr" for p in parts]
        for p, shard in zip(parts, shards):
            write_shard(root / f"part-{p:04d}", shard, progress=False)
        write_manifest(out, shards)
    elif name == "saev":
        return write_store(open_extraction(root), {"patches_per_shard": 2_400_000, "tokens_per_window": 4,
                                                   **section}, out, model_config=None, progress=False)
    else:
        write_dataset(root, out, {**LMPROBE_DEFAULTS, **section}, progress=False)
    return out


@pytest.mark.parametrize("name, written, config, lacking", [
    ("pickle", {"parts": (0,)}, {}, r"holds 44 samples \(statistics.total_samples\), the extraction 88"),
    ("zarr", {"parts": (0,)}, {}, r"holds 44 samples, the extraction 88"),
    ("saev", {"layers": [1]}, {"layers": None},
     r"holds layers \[1\], lacks layers \[2\] the config lists \(extract.layers \[1, 2\]\)"),
    ("saev", {"layers": [1]}, {"layers": [1, 2]},
     r"holds layers \[1\], lacks layers \[2\] the config lists \(saev.layers \[1, 2\]"),
    ("lmprobe", {"layers": [2]}, {"layers": None}, r"holds layers \[2\], lacks layers \[1\] the config lists"),
    ("lmprobe", {"storage": "pooled"}, {"storage": "full_sequence"},
     r"storage 'pooled' \(last tokens only\), the config's lmprobe.storage 'full_sequence'")])
def test_validate_names_a_store_that_lacks_samples_or_layers_its_config_says_it_holds(
        name, written, config, lacking, tmp_path):
    """A coordinate a store's reader returned None for was counted "not stored" and passed: a store
    of one extraction part of two, or written without a layer or token the config lists, verified on
    its own and passed validate. Now what its metadata says it holds is checked against the config
    and the extraction, and each coordinate it lacks without its format leaving it out is named."""
    from actstore.formats.extract import synthetic_extraction
    from actstore.verify import check_format, sample_coordinates
    root = synthetic_extraction(tmp_path / "x", 40_000, 2, 8, [1, 2], tokens=(4, 10))
    extraction = open_extraction(root)
    store = write_real_store(name, root, tmp_path / name, **written)
    section = {**LMPROBE_DEFAULTS, **config} if name == "lmprobe" else config
    report = check_format(name, store, extraction, sample_coordinates(extraction, 48, 0), section)
    assert any(re.search(rf"^{re.escape(str(store))}: {lacking}", p) for p in report["problems"]), report["problems"]
    assert any(re.search(rf"^{re.escape(str(store))}: does not hold \d+ of the 85 coordinates read", p)
               for p in report["problems"]), report["problems"]


@pytest.mark.parametrize("name, section, why", [
    ("saev", {"layers": [1]}, "layers outside saev.layers [1]"),
    ("lmprobe", {"storage": "pooled"}, "lmprobe.storage pooled holds last tokens only"),
    ("lmprobe", {"layers": [2]}, "layers outside lmprobe.layers [2]"),
    ("pickle", {}, None), ("zarr", {}, None), ("saev", {}, None), ("lmprobe", {}, None)])
def test_validate_passes_what_a_format_leaves_out_by_design_and_says_why(name, section, why, tmp_path):
    """What a store leaves out by its config (saev/lmprobe layers, lmprobe's pooled last tokens) is
    still "not stored" and no problem, and the report says why; a whole store holds every coordinate."""
    from actstore.formats.extract import synthetic_extraction
    from actstore.verify import check_format, sample_coordinates
    root = synthetic_extraction(tmp_path / "x", 40_000, 2, 8, [1, 2], tokens=(4, 10))
    extraction = open_extraction(root)
    store = write_real_store(name, root, tmp_path / name, **section)
    coords = sample_coordinates(extraction, 48, 0)
    report = check_format(name, store, extraction, coords, {**LMPROBE_DEFAULTS, **section} if name == "lmprobe"
                          else section)
    assert report["problems"] == []
    assert report["not_stored_why"] == ([why] if why else [])
    assert (report["not_stored"] > 0) == bool(why) and report["checked"] + report["not_stored"] == len(coords)


def test_validates_rows_read_every_extraction_part(tmp_path):
    """The rows were drawn at random: 8 rows of 8 parts missed some part at most seeds, so a store
    that lacked a part's samples could pass. Each part holding samples now gives a row."""
    from actstore.formats.extract import synthetic_extraction
    from actstore.verify import sample_coordinates
    extraction = open_extraction(synthetic_extraction(tmp_path / "x", 100_000, 8, 8, [1], tokens=(4, 10)))
    for seed in range(5):
        rows = {sample_idx for sample_idx, _, _ in sample_coordinates(extraction, 8, seed)}
        assert len(rows) == 8 and {extraction.locate(row)[0].dir.name for row in rows} == \
            {part.dir.name for part in extraction.parts}


@pytest.mark.parametrize("flavor, why", [
    ("spec", []),
    ("upstream", ["register tokens, which saev's upstream layout leaves out (actstore.json dropped_tokens)"])])
def test_validate_passes_an_image_saev_store_holding_every_token_but_the_registers_upstream_drops(
        flavor, why, extracted, tmp_path):
    from actstore.formats.saev import write_store
    from actstore.model_config import run_config
    from actstore.verify import check_format
    config, extract_dir = extracted("dinov2_registers")
    extraction = open_extraction(extract_dir)
    store = write_store(extraction, {**config["saev"], "flavor": flavor}, tmp_path / "saev",
                        model_config=run_config(config["model"]), progress=False)
    tokens = extraction.activations(f"layer_{extraction.info.layers[0]}", 0).shape[0]
    coords = [(s, layer, t) for s in range(extraction.n_samples) for layer in extraction.info.layers
              for t in range(tokens)]
    report = check_format("saev", store, extraction, coords, config["saev"])
    assert report["problems"] == [] and report["not_stored_why"] == why
    assert report["checked"] == len(coords) - report["not_stored"] and (report["not_stored"] > 0) == bool(why)


@pytest.mark.parametrize("name", ["pickle", "zarr", "saev", "lmprobe"])
def test_validate_passes_every_format_written_from_a_real_extraction_of_two_parts(name, extracted, tmp_path):
    """What each store's metadata says it holds (samples, tokens, layers) is the extraction's, and
    every coordinate validate reads is stored: no coordinate is left "not stored"."""
    from actstore.verify import check_format, sample_coordinates
    config, extract_dir = extracted("gpt2", extract={"parts": 2})
    extraction = open_extraction(extract_dir)
    section = {**config[name], "token_strings": False} if name == "lmprobe" else config[name]
    store = write_real_store(name, extract_dir, tmp_path / name, **section)
    report = check_format(name, store, extraction, sample_coordinates(extraction, 48, 0), section)
    assert report["problems"] == [] and report["not_stored"] == 0 and report["checked"] > 0
