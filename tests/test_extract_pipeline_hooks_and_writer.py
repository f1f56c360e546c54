"""Review 61 of the extraction's capture, token log-probs and write pipeline, on real tiny models and
real part files."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny
from actstore.errors import ConfigError
from actstore.extract import run_part
from actstore.extract.capture import capture
from actstore.extract.pipeline import BatchRows, WritePipeline
from actstore.formats.extract import PART_META, PartWriter, open_part
from actstore.models import load_model


def forward_hooks(model: torch.nn.Module) -> int:
    return sum(len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules())


def test_a_capture_refused_while_registering_leaves_no_hook_on_the_model(model_dir):
    """A hook path that does not exist, after the blocks' hooks were registered: those stayed on the
    model, each holding the last forward's tensors (device memory) for as long as the model lived."""
    loaded = load_model(model_dir("llama"))
    before = forward_hooks(loaded.model)
    with pytest.raises(ConfigError, match="'nonexistent.module' does not exist"):
        with capture(loaded, [0, 1], ["model.layers.0:output", "nonexistent.module:output"]):
            pass
    assert forward_hooks(loaded.model) == before


def test_a_failing_writer_thread_stops_the_job_naming_its_file(tmp_path):
    """A real write refused in a writer thread (a batch whose rows have another width than the file's)
    while the main thread waits for a free staging buffer: the job stops with an error naming the file,
    every writer thread has ended, and no part.json exists."""
    lengths = [3, 2, 4, 1]
    writer = PartWriter(tmp_path / "part", [{"sample_idx": i} for i in range(4)], np.cumsum([0, *lengths]))
    batches = [(BatchRows(np.array([2, 0]), np.array([4, 3])), 5), (BatchRows(np.array([1]), np.array([2])), 6),
               (BatchRows(np.array([3]), np.array([1])), 5)]
    with pytest.raises(OSError, match=r"part/layer_000\.npy: writing the extraction failed: layer_000\.npy: sample 1"):
        with WritePipeline(writer, torch.device("cpu"), 1, 2) as pipeline:
            for rows, width in batches:
                n = int(rows.n_tokens.sum())
                pipeline.submit(rows, {"layer_000.npy": torch.ones(n, width), "token_logprob.npy": torch.ones(n)},
                                {"topk_values.npy": torch.ones(len(rows.n_tokens), 3)})
    assert not any(thread.is_alive() for thread in pipeline.threads)
    assert not (tmp_path / "part" / PART_META).exists()


def test_a_hooked_output_the_model_then_changes_in_place_is_stored_as_the_module_returned_it(text_jsonl, tmp_path):
    """Falcon adds the attention's output into its MLP's output in place (`mlp_output += attention_output`)
    after the MLP returned it: the capture held that very tensor, so `mlp:output` was stored as the sum."""
    model = tiny.build_family("falcon", tmp_path / "falcon")
    hook = "transformer.h.1.mlp:output"
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"parts": 1, "layers": [0], "hooks": [hook]})
    run_part(config, 0, tmp_path / "part", progress=False)
    part, loaded = open_part(tmp_path / "part"), load_model(model)
    returned = {}
    loaded.model.get_submodule(hook.rpartition(":")[0]).register_forward_hook(
        lambda module, args, output: returned.__setitem__("mlp", output.clone()))
    for local in range(len(part.samples)):
        with torch.inference_mode():
            loaded.model(input_ids=torch.from_numpy(part.token_ids(local))[None])
        np.testing.assert_allclose(part.activations(hook, local), returned["mlp"][0].numpy(), rtol=1e-5, atol=1e-5)
