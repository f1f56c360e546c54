"""Review 60 of the SAE stage and the LUT runtime, on extractions, checkpoints and tables written by the
project's own writers: held-out metrics of data without variance, and imports of an SAE of another hook."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from actstore.errors import ConfigError
from actstore.formats.extract import open_extraction, synthetic_extraction, tensor_file
from actstore.sae import build_sae, import_sae, split_tokens, tensors
from actstore.sae.checkpoint import SAELENS_DIR
from actstore.sae.model import TopKSAE, init_sae
from actstore.sae.train import evaluate
from test_sae import _random_checkpoint, saelens_cfg


def constant_extraction(root: Path, value: float):
    """A synthetic extraction (60-odd samples, width 8, layer 1) whose every activation is `value`."""
    extraction = open_extraction(synthetic_extraction(root, 60 * 7 * 8 * 4, 2, 8, [1], tokens=(4, 10)))
    for part in extraction.parts:
        if part.info.n_tokens:
            data = np.load(part.dir / tensor_file("layer_1"), mmap_mode="r+")
            data[:] = value
            data.flush()
            del data
    return open_extraction(extraction.dir)


@pytest.mark.parametrize("value", [3.0, 0.1])
def test_the_heldout_fvu_of_tokens_without_variance_is_none_not_their_error_over_1e_30(tmp_path, value):
    """Held-out tokens all equal have no variance, as one token has none: the FVU was the float32
    rounding error of their reconstruction over 1e-30 (6e26), reported as a result."""
    extraction = constant_extraction(tmp_path / "x", value)
    arrays, split = tensors(extraction, "layer_1"), split_tokens(extraction, 0.2, seed=0)
    sae = TopKSAE(8, 16, 2)
    init_sae(sae, torch.full((8,), value * 1.001), seed=0)
    held = evaluate(sae, arrays, split.heldout)
    assert held["n_tokens"] > 1 and held["mse"] > 0
    assert held["fvu"] is None


QUERY_INPUTS = ("encoder.layer.0.attention.self.query:input", "encoder.layer.1.attention.self.query:input")
SAE = {"num_basis": 32, "k_active": 4, "steps": 5, "batch_size": 64, "device": "cpu"}


def test_an_imported_sae_stage_output_of_another_hook_is_refused_naming_both(extracted, tmp_path):
    """Layer 1's SAE (the sae stage's saelens/ folder, whose cfg.json names its hook) imported for layer
    0's query input, of the same width: it was taken, and the LUT encoded tensors the SAE never saw."""
    config, extract_dir = extracted("bert", extract={"hooks": list(QUERY_INPUTS)})
    trained = copy.deepcopy(config)
    trained["sae"].update(SAE, hook=QUERY_INPUTS[1])
    build_sae(trained, extract_dir, tmp_path / "layer1", progress=False)
    imported = copy.deepcopy(config)
    imported["sae"].update(SAE, hook=QUERY_INPUTS[0], **{"import": {"path": str(tmp_path / "layer1" / SAELENS_DIR),
                                                                    "style": "saelens"}})
    with pytest.raises(ConfigError, match=re.escape(f"hook_name '{QUERY_INPUTS[1]}', but sae.hook is "
                                                    f"'{QUERY_INPUTS[0]}'")):
        build_sae(imported, extract_dir, tmp_path / "layer0", progress=False)
    assert not (tmp_path / "layer0").exists()
    imported["sae"]["hook"] = QUERY_INPUTS[1]
    report = build_sae(imported, extract_dir, tmp_path / "again", progress=False)
    assert report["hook"] == QUERY_INPUTS[1] and report["heldout"]["n_tokens"] > 0


@pytest.mark.parametrize("layout", ["6", "5"])
def test_a_saelens_cfg_naming_another_captured_tensor_is_refused_in_either_layout(tmp_path, layout):
    """SAELens writes hook_name in metadata from 6.0, at the top level before; a TransformerLens hook
    name is no tensor actstore captures and is not compared."""
    save_file(_random_checkpoint(), str(tmp_path / "sae_weights.safetensors"))

    def imported(hook_name: str) -> TopKSAE:
        cfg = saelens_cfg(layout=layout)
        (cfg["metadata"] if layout == "6" else cfg)["hook_name"] = hook_name
        (tmp_path / "cfg.json").write_text(json.dumps(cfg))
        return import_sae(tmp_path, "saelens", k_active=3, hook_width=8, hook=QUERY_INPUTS[0])

    with pytest.raises(ConfigError, match=r"cfg\.json: hook_name 'encoder\.layer\.1\.attention\.self\.query:input'"):
        imported(QUERY_INPUTS[1])
    assert imported(QUERY_INPUTS[0]).d_in == 8
    assert imported("blocks.0.hook_resid_pre").d_in == 8
