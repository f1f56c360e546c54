"""Review 56 of the extraction stage: what a part stores and records is what the model computed."""
from __future__ import annotations

import json
import shutil
import weakref

import numpy as np
import torch

import tiny
from actstore.extract import run, run_part
from actstore.extract.pipeline import WritePipeline


def test_float16_overflow_is_counted_for_a_float16_model_whose_blocks_output_float32(model_dir, text_jsonl, tmp_path):
    """T5 keeps its feed-forward `wo` in float32 when loaded in float16, so its block outputs are
    float32: stored as float16 (storage_dtype auto), those past +-65504 become inf. The count was only
    kept for a model whose dtype was not float16, so part.json said nothing of the infs it held."""
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(model_dir("t5"))
    with torch.no_grad():  # activations past float16's range, as T5's feed-forward reaches in float16
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(50000.0)
    folder = shutil.copytree(model_dir("t5"), tmp_path / "t5")  # its tokenizer, then the scaled weights
    model.save_pretrained(folder)
    config = tiny.make_config(tmp_path, folder, text_jsonl, model={"torch_dtype": "float16"},
                              extract={"parts": 1, "layers": [0]})
    meta = run_part(config, 0, tmp_path / "part", progress=False)
    stored = np.load(tmp_path / "part" / "layer_000.npy")
    assert meta["storage_dtype"] == "float16" and stored.dtype == np.float16
    infs = int(np.isinf(stored).sum())
    assert infs > 0
    assert meta.get("float16_overflow_count") == infs
    assert json.loads((tmp_path / "part" / "part.json").read_text())["float16_overflow_count"] == infs


def test_a_batchs_packed_tensors_and_logits_are_freed_before_the_next_forward(model_dir, text_jsonl, tmp_path,
                                                                              monkeypatch):
    """The main loop kept the last batch's packed captures, log-probs, top-k and the forward's output
    (its logits) through the next batch's forward: on a GPU, every batch after the first ran with one
    batch more of activations held than the first, which out_of_memory's advice says is the largest."""
    held: list[weakref.ref] = []  # every tensor a batch handed over or its forward returned
    alive_at_forward: list[int] = []
    submit, load_model = WritePipeline.submit, run.load_model

    def handing_over(self, rows, token_tensors, row_tensors):
        held.extend(weakref.ref(t) for t in [*token_tensors.values(), *row_tensors.values()])
        return submit(self, rows, token_tensors, row_tensors)

    def batch_forward(kwargs: dict) -> bool:  # not a token log-probs head rerun, which runs while packing
        return "attention_mask" in kwargs

    def loading(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        loaded.model.register_forward_pre_hook(
            lambda module, args, kwargs: alive_at_forward.append(sum(ref() is not None for ref in held))
            if batch_forward(kwargs) else None, with_kwargs=True)
        loaded.model.register_forward_hook(
            lambda module, args, kwargs, output: held.append(weakref.ref(output.logits))
            if batch_forward(kwargs) else None, with_kwargs=True)
        return loaded

    monkeypatch.setattr(WritePipeline, "submit", handing_over)
    monkeypatch.setattr(run, "load_model", loading)
    config = tiny.make_config(tmp_path, model_dir("gpt2"), text_jsonl, extract={"parts": 1, "batch_size": 8})
    run_part(config, 0, tmp_path / "part", progress=False)
    # 30 texts in 4 batches; each: 2 layers, token ids, log-probs, top-k values and indices, logits
    assert len(alive_at_forward) == 4 and len(held) == 4 * 7
    assert alive_at_forward == [0, 0, 0, 0]
