""""layer i" = the output of transformer block i, bit for bit, across the architectures users bring.

Each model is a tiny seeded one saved to a folder (tiny.py). Extraction runs with batch_size 1, so each
sample's forward is the same computation as the reference's (no padding, no batch companions), and
every stored vector must equal, bit for bit, what a plain forward hook on the block module (found here
by its path in the reference model, written out per architecture, not by actstore's search) saw.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers as tf

import tiny
from actstore.errors import ConfigError
from actstore.extract import preflight, run_part
from actstore.formats.extract import open_part
from actstore.model_config import num_blocks, read_model_config

N_BLOCKS = 3
LAYERS = [0, 1, 2]  # the first, a middle one, the last

# name: (how tiny builds it, the reference's class, the block ModuleList's path in it, hidden_states[-1]
# is the last block's output). Where it is not, the model applies its final norm to the last entry of
# output_hidden_states (GPT-2's ln_f, Llama's norm, T5's final_layer_norm...) and only the hook is the
# reference; an encoder whose final norm is applied to last_hidden_state alone (ViT's, DINOv2's,
# SigLIP's) or that has none (BERT's family), or a CLIP tower (post_layernorm on the pooled CLS only)
# keeps the block's output there.
ARCHITECTURES = {
    "gpt2": ("model", tf.AutoModelForCausalLM, "transformer.h", False),
    "gpt_neox": ("family", tf.AutoModelForCausalLM, "gpt_neox.layers", False),
    "llama": ("model", tf.AutoModelForCausalLM, "model.layers", False),
    "mistral": ("family", tf.AutoModelForCausalLM, "model.layers", False),
    "qwen2": ("family", tf.AutoModelForCausalLM, "model.layers", False),
    "qwen3": ("family", tf.AutoModelForCausalLM, "model.layers", False),
    "gemma": ("family", tf.AutoModelForCausalLM, "model.layers", False),
    "gemma2": ("family", tf.AutoModelForCausalLM, "model.layers", False),
    "gemma3_text": ("family", tf.AutoModelForCausalLM, "model.layers", False),
    "phi": ("family", tf.AutoModelForCausalLM, "model.layers", False),
    "phi3": ("family", tf.AutoModelForCausalLM, "model.layers", False),
    "opt": ("family", tf.AutoModelForCausalLM, "model.decoder.layers", False),
    "bert": ("model", tf.AutoModel, "encoder.layer", True),
    "roberta": ("family", tf.AutoModel, "encoder.layer", True),
    "distilbert": ("family", tf.AutoModel, "transformer.layer", True),
    "t5": ("model", tf.T5EncoderModel, "encoder.block", False),  # text runs the encoder only
    "vit": ("model", tf.AutoModel, "layers", True),
    "dinov2": ("model", tf.AutoModel, "encoder.layer", True),
    "dinov2_registers": ("model", tf.AutoModel, "encoder.layer", True),
    "clip": ("model", tf.AutoModel, "encoder.layers", True),
    "siglip": ("model", tf.AutoModel, "encoder.layers", True),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(name) -> the folder of the tiny saved model `name` (an ARCHITECTURES key)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp(f"arch-{name}")
            build = tiny.build_family if ARCHITECTURES[name][0] == "family" else tiny.build_model
            cache[name] = build(name, out)
        return cache[name]
    return get


@pytest.fixture(scope="module")
def few_texts(tmp_path_factory):
    return tiny.write_jsonl(tmp_path_factory.mktemp("few") / "docs.jsonl", 3)


@pytest.fixture(scope="module")
def few_images(tmp_path_factory):
    return tiny.write_image_folder(tmp_path_factory.mktemp("few-images") / "photos", per_class=1)


def reference_forward(model, name: str, inputs: dict) -> tuple[dict[int, torch.Tensor], tuple]:
    """The block outputs a plain forward hook on each block of ARCHITECTURES' path sees (cloned: a
    later in-place op on the tensor would otherwise change the reference with the stored copy), and
    the model's own output_hidden_states."""
    seen = {}
    blocks = model.get_submodule(ARCHITECTURES[name][2])
    assert len(blocks) == N_BLOCKS

    def keep(index):
        def hook(module, args, output):
            seen[index] = (output[0] if isinstance(output, tuple) else output).clone()
        return hook
    handles = [blocks[i].register_forward_hook(keep(i)) for i in LAYERS]
    with torch.inference_mode():
        hidden = model(**inputs, output_hidden_states=True).hidden_states
    for handle in handles:
        handle.remove()
    return seen, hidden


def model_inputs(folder, name: str, part, local: int, images) -> dict:
    """The sample's forward inputs as extraction gives them with batch_size 1."""
    if name in tiny.VISION_KINDS:
        from PIL import Image
        processor = tf.AutoImageProcessor.from_pretrained(folder)
        image = Image.open(images / part.samples[local]["text"]).convert("RGB")
        return {"pixel_values": processor(images=[image], return_tensors="pt")["pixel_values"]}
    ids = torch.tensor([part.token_ids(local).tolist()])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return inputs | ({"use_cache": False} if ARCHITECTURES[name][1] is tf.AutoModelForCausalLM else {})


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_each_layer_is_its_blocks_own_output_bit_for_bit(name, built, few_texts, few_images, tmp_path):
    folder = built(name)
    vision = name in tiny.VISION_KINDS
    config = tiny.make_config(tmp_path, folder, few_images if vision else few_texts,
                              extract={"layers": "all", "batch_size": 1, "parts": 1})
    assert config["extract"]["layers"] == LAYERS  # `all`: every block, from config.json's count
    run_part(config, 0, tmp_path / "part-0000", progress=False)
    part = open_part(tmp_path / "part-0000")
    assert part.meta["model"]["n_blocks"] == N_BLOCKS
    model = ARCHITECTURES[name][1].from_pretrained(folder).eval()
    for local, row in enumerate(part.samples):
        assert row["sample_idx"] == local  # one part: its rows are the dataset's in order
        seen, hidden = reference_forward(model, name, model_inputs(folder, name, part, local, few_images))
        for i in LAYERS:
            stored = part.activations(f"layer_{i}", local)
            assert stored.dtype == np.float32 and np.array_equal(stored, seen[i][0].numpy()), (name, i, local)
        for i in LAYERS[:-1]:  # inner blocks: hidden_states[i + 1] is block i's output in every model here
            assert torch.equal(hidden[i + 1], seen[i]), (name, i)
        last_is_block = torch.equal(hidden[-1], seen[LAYERS[-1]])
        assert last_is_block == ARCHITECTURES[name][3], (name, "hidden_states[-1]")


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_negative_layers_count_back_from_the_last_block(name, built, few_texts, few_images, tmp_path):
    """-1 is the last block of config.json's count (T5's num_layers, GPT-2's n_layer, a vision
    tower's num_hidden_layers), -n the first; past -n is refused naming the range."""
    folder = built(name)
    data = few_images if name in tiny.VISION_KINDS else few_texts
    assert num_blocks(read_model_config(folder)) == N_BLOCKS
    config = tiny.make_config(tmp_path, folder, data, extract={"layers": [-1, -2, -3]})
    assert config["extract"]["layers"] == [2, 1, 0]
    with pytest.raises(ConfigError, match=r"extract.layers: \[-4\] out of range.*blocks 0..2"):
        tiny.make_config(tmp_path, folder, data, extract={"layers": [-4]})


def test_a_model_whose_blocks_are_no_one_module_is_refused_before_its_weights_load(few_texts, tmp_path):
    """XLM keeps each block's parts in four lists of n_layers (attentions, layer_norm1, ffns,
    layer_norm2), no module being a block: the first list's output (attention alone) was stored as
    "layer i". It is refused, naming the lists, on the weightless skeleton: with its weights gone
    the error is still that one."""
    folder = tmp_path / "xlm"
    folder.mkdir()
    tiny.train_tokenizer(folder, causal=False)
    torch.manual_seed(0)
    tf.XLMWithLMHeadModel(tf.XLMConfig(vocab_size=300, emb_dim=32, n_layers=N_BLOCKS, n_heads=4,
                                       max_position_embeddings=128, pad_index=0)).save_pretrained(folder)
    config = tiny.make_config(tmp_path, folder, few_texts, extract={"layers": [0], "parts": 1})
    refused = r"XLMWithLMHeadModel: its 3 blocks are no one ModuleList but 4 \(transformer.attentions, "
    with pytest.raises(ConfigError, match=refused):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=refused):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    assert not (tmp_path / "part-0000").exists()


DAMAGED = {"not JSON": ("{not json", r"is not valid JSON \(Expecting property name"),
           "a key twice": ('{"model_max_length": 8, "model_max_length": 64}',
                           r"is not valid JSON \(key 'model_max_length' given twice\)"),
           "not an object": ("[1, 2]", "holds a JSON list, not an object")}
NESTED_DAMAGED = ('{"model_type": "gpt2", "text_config": 3}', "holds text_config 3, not an object of settings")


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_json_file_of_the_model_folder_is_named(file, damage, built, few_texts, tmp_path):
    """The user's model folder, often downloaded: a file cut short or edited by hand is a ConfigError
    naming it, not a JSONDecodeError or AttributeError traceback, nor a key given twice read as its
    last value. Both files are read before anything loads (the config's `-1`, the preflight)."""
    folder = shutil.copytree(built("gpt2"), tmp_path / "gpt2")
    text, why = DAMAGED[damage]
    (folder / file).write_text(text)
    with pytest.raises(ConfigError, match=rf"model.path: {folder / file} {why}"):
        config = tiny.make_config(tmp_path, folder, few_texts, extract={"layers": [0]})
        preflight(config, 0)
    with pytest.raises(ConfigError, match=rf"model.path: {folder / file} {why}"):
        tiny.make_config(tmp_path, folder, few_texts, extract={"layers": [-1]})


def test_a_sub_models_config_that_is_no_object_is_named(tmp_path):
    """config.json's text_config or vision_config is read as an object by every size lookup: a number
    there was an AttributeError traceback."""
    text, why = NESTED_DAMAGED
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=rf"model.path: {tmp_path / 'config.json'} {why}"):
        read_model_config(tmp_path)


def test_infinity_in_config_json_is_read_as_transformers_writes_it(tmp_path):
    """Mamba 2's and Falcon-H1's config.json hold `"time_step_limit": [0.0, Infinity]` (json.dumps of
    their default): a checkpoint transformers saved is read, not refused as integrity.read_json would."""
    config = tf.AutoConfig.for_model("mamba2", num_hidden_layers=N_BLOCKS)
    config.save_pretrained(tmp_path)
    assert "Infinity" in (tmp_path / "config.json").read_text()
    assert num_blocks(read_model_config(tmp_path)) == N_BLOCKS
