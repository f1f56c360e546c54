"""Review 63 of model_config.py / model_identity.py: a transformers-4 Mamba 2 config.json (bare Infinity)
refused by the record of the model's files, a tokenizer's legacy list `auto_map` (remote code) passing the
parse, and learned position tables the max_seq_length check did not know: families left out of it, and
RoBERTa's family, whose positions start past its padding id."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers as tf

import tiny
from actstore.errors import ConfigError
from actstore.model_config import check_remote_code, check_sequence_length, read_model_config
from actstore.model_identity import model_files
from actstore.models import load_model, load_tokenizer


def test_a_config_json_with_bare_infinity_is_recorded_and_loads(tmp_path):
    """transformers 4 saved Mamba 2's and Falcon-H1's time_step_limit as `[0.0, Infinity]`, which
    read_model_config and transformers take: the record of the model's files (run before the load) and the
    checkpoint check read config.json strictly and refused it as no JSON."""
    folder = tiny.build_family("mamba2", tmp_path / "mamba2")
    file = folder / "config.json"
    text = re.sub(r'\{\s*"__float__":\s*"Infinity"\s*\}', "Infinity", file.read_text())
    assert "Infinity" in text and "__float__" not in text
    file.write_text(text)
    assert "config.json" in model_files(folder)
    assert load_model(folder, device="cpu").config["time_step_limit"][1] == float("inf")


def test_a_tokenizers_legacy_list_auto_map_is_refused_unless_trusted(model_dir, tmp_path):
    """tokenizer_config.json `auto_map` as a list [slow, fast] (transformers' legacy form) is the
    folder's own tokenizer class too: it passed the parse's check, and the tokenizer load was
    transformers' ValueError once the job ran."""
    folder = tmp_path / "model"
    shutil.copytree(model_dir("bert"), folder)
    (folder / "tokenization_tiny_custom.py").write_text(tiny.CUSTOM_TOKENIZER)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="TinyCustomTokenizer",
                  auto_map=[None, "tokenization_tiny_custom.TinyCustomTokenizer"])
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert type(load_tokenizer(folder, trust_remote_code=True)).__name__ == "TinyCustomTokenizer"
    refusal = (rf"model.path {re.escape(str(folder))}: its tokenizer_config.json maps AutoTokenizer to "
               r"\[None, 'tokenization_tiny_custom.TinyCustomTokenizer'\], Python in the model folder")
    with pytest.raises(ConfigError, match=refusal):
        check_remote_code(folder, False)
    with pytest.raises(ConfigError, match=refusal):
        load_tokenizer(folder)


LEARNED = ("megatron-bert", "rembert", "xlm-roberta-xl", "roberta-prelayernorm", "ibert", "splinter", "luke",
           "markuplm", "layoutlm", "roc_bert", "mra", "marian", "pegasus", "mvp", "blenderbot-small",
           "bert-generation", "nystromformer", "yoso", "xmod")
SIZES = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16, pad_token_id=1,
             default_language="en_XX")  # X-MOD runs only with a language's adapters chosen


def tiny_text_model(model_type: str, folder, **changes) -> torch.nn.Module:
    """A tiny `model_type` model's config.json saved in `folder` (no tokenizer: no model_max_length) and
    the part of it extraction runs (an encoder-decoder's encoder)."""
    config = tf.AutoConfig.for_model(model_type, **{**SIZES, **changes})
    config.save_pretrained(folder)
    model = tf.AutoModel.from_config(config).eval()
    return model.get_encoder() if config.is_encoder_decoder else model


def runs(model: torch.nn.Module, tokens: int) -> bool:
    """Whether the model runs on a text of `tokens` tokens."""
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(3, 300, (1, tokens)))
    except (IndexError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize("model_type", LEARNED)
def test_a_text_past_these_families_learned_positions_is_refused(model_type, tmp_path):
    """Their positions are a table of max_position_embeddings: a longer text passed the parse, then was
    an IndexError or a shape error (a device-side assert on a GPU) once the weights had loaded."""
    model = tiny_text_model(model_type, tmp_path)
    assert runs(model, 14) and not runs(model, 17)
    with pytest.raises(ConfigError, match=rf"\(model_type {model_type}\) has learned positions for 1[46] tokens"):
        check_sequence_length(17, read_model_config(tmp_path), tmp_path)
    check_sequence_length(14, read_model_config(tmp_path), tmp_path)


@pytest.mark.parametrize(("model_type", "pad", "limit"), [("roberta", 1, 14), ("roberta", 3, 12), ("luke", 0, 15),
                                                         ("mpnet", 3, 14), ("xlm-roberta-xl", 1, 14),
                                                         ("markuplm", 0, 15), ("xmod", 1, 14)])
def test_positions_counted_from_the_padding_id_leave_fewer_tokens(model_type, pad, limit, tmp_path):
    """RoBERTa's family numbers a text's positions from pad_token_id + 1 (MPNet's from 2 whatever its
    pad), so its table of max_position_embeddings holds that many fewer tokens. The check took the whole
    table and relied on the tokenizer's model_max_length, which a folder may not state: a text of the
    table's length passed the parse and failed after the load."""
    model = tiny_text_model(model_type, tmp_path, pad_token_id=pad)
    assert runs(model, limit) and not runs(model, limit + 1)
    config = read_model_config(tmp_path)
    with pytest.raises(ConfigError, match=rf"has learned positions for {limit} tokens \(config.json "
                                          rf"max_position_embeddings 16, counted from position {16 - limit}\)"):
        check_sequence_length(limit + 1, config, tmp_path)
    check_sequence_length(limit, config, tmp_path)


def test_a_gpu_ordinal_past_the_jobs_gpus_is_named_with_its_key(monkeypatch):
    """extract.device cuda:1 in a job given one GPU (Slurm numbers a job's GPUs from 0) passed, then
    the first tensor moved raised CUDA's "invalid device ordinal", naming no key. torch's count of
    GPUs is set here (this machine has none); the suite's CUDA step runs the real count."""
    from actstore.models import named_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert named_device("cuda:0", "extract.device") == torch.device("cuda:0")
    assert named_device("cuda", "extract.device") == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"extract.device cuda:1: torch sees 1 GPU\(s\) here, cuda:0 to cuda:0"):
        named_device("cuda:1", "extract.device")


def test_cuda_ordinal_past_this_machines_gpus_is_named():
    """The same on a real GPU machine (bench/gpu_suite.sh's CUDA step): the ordinal one past torch's count."""
    from actstore.models import named_device

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(ConfigError, match="lut.device"):
        named_device(f"cuda:{torch.cuda.device_count()}", "lut.device")
