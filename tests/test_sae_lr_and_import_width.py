"""SAE stage review 56, on real files: an lr Adam cannot apply to float32 weights is refused with the
config, naming the key; an imported checkpoint of another width is refused from its header, before
its weights are read."""
from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import save_file

import tiny
from actstore.config import config_schema, load_config
from actstore.errors import ConfigError
from actstore.sae.stage import imported_sae
from actstore.sae.train import train_sae
from test_sae_training import CFG, extraction_of

HOOK_WIDTH = 8  # extraction_of's


def config_file(tmp_path, sae: dict):
    demo = load_config(tiny.REPO / "config" / "config.yaml")
    raw = {"model": {"path": demo["model"]["path"]}, "dataset": {"path": demo["dataset"]["path"]}, "sae": sae}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_an_lr_adam_cannot_apply_is_refused_with_the_config_naming_it(tmp_path):
    """Adam's first step is 10 lr, cast to the weights' float32: lr 3.5e37 stopped the sae stage with
    torch's bare 'value cannot be converted to type float without overflow'."""
    with pytest.raises(ConfigError, match=r"invalid config at sae/lr: 3\.5e\+37 is greater than the maximum"):
        load_config(config_file(tmp_path, {"lr": 3.5e37}))


def test_the_largest_lr_the_config_takes_diverges_by_name_not_with_torchs_error(tmp_path):
    largest = config_schema()["properties"]["sae"]["properties"]["lr"]["maximum"]
    assert load_config(config_file(tmp_path, {"lr": largest}))["sae"]["lr"] == largest
    with pytest.raises(ConfigError, match="the training loss was not finite"):
        train_sae(extraction_of(tmp_path / "x"), "layer_1", dict(CFG, steps=20, lr=largest), progress=False)


def weights(d_in: int, d_sae: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"W_enc": torch.randn(d_in, d_sae, generator=g), "b_enc": torch.randn(d_sae, generator=g),
            "W_dec": torch.randn(d_sae, d_in, generator=g), "b_dec": torch.randn(d_in, generator=g)}


def saev_file(path, d_in: int, sizes_in_header: bool = True):
    """saev.nn.dump's layout: a JSON header line, then torch.save of the state dict."""
    cfg = {"activation": {"cls": "TopK", "params": {"top_k": CFG["k_active"]}}}
    if sizes_in_header:
        cfg.update(d_model=d_in, d_sae=32)
    with open(path, "wb") as fh:
        fh.write(json.dumps({"schema": 5, "cfg": cfg}).encode() + b"\n")
        torch.save(weights(d_in), fh)
    return path


def cut(path, keep: int):
    """`path` with only its first `keep` bytes: weights that cannot be read."""
    path.write_bytes(path.read_bytes()[:keep])
    return path


def import_cfg(path, style: str) -> dict:
    return dict(CFG, **{"import": {"path": str(path), "style": style}})


def saev_cut(tmp_path):
    return cut(saev_file(tmp_path / "sae.pt", 16), 2048)


def safetensors_cut(tmp_path):
    path = tmp_path / "sae_weights.safetensors"
    save_file(weights(16), str(path))
    return cut(path, 1024)


def width_refused(path, source: str) -> str:
    return rf"sae\.import\.path {re.escape(str(path))}: d_in 16 \({source}\), but the hook's width is {HOOK_WIDTH}"


@pytest.mark.parametrize("style, checkpoint, source", [
    ("saev", saev_cut, r"its header's cfg\.d_model"),
    ("saelens", safetensors_cut, "its safetensors header's W_enc shape"),
    ("saev", safetensors_cut, "its safetensors header's W_enc shape")])
def test_a_checkpoint_of_another_width_is_refused_before_its_weights_are_read(tmp_path, style, checkpoint, source):
    """The width is in the file's header (saev's cfg.d_model, safetensors' W_enc shape): the import read
    the whole checkpoint, gigabytes from a shared file system, before comparing it with the hook's. Its
    weights cut short show they are not read: their error came first."""
    path = checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=width_refused(path, source)):
        imported_sae(extraction_of(tmp_path / "x"), "layer_1", import_cfg(path, style))


def test_a_saev_header_without_the_width_is_checked_against_its_weights(tmp_path):
    path = saev_file(tmp_path / "sae.pt", 16, sizes_in_header=False)
    with pytest.raises(ConfigError, match=width_refused(path, "W_enc's shape")):
        imported_sae(extraction_of(tmp_path / "x"), "layer_1", import_cfg(path, "saev"))


def test_a_checkpoint_of_the_hooks_width_is_imported(tmp_path):
    sae, report = imported_sae(extraction_of(tmp_path / "x"), "layer_1",
                               import_cfg(saev_file(tmp_path / "sae.pt", HOOK_WIDTH), "saev"))
    assert (sae.d_in, sae.num_basis, report["heldout"]["n_tokens"] > 0) == (HOOK_WIDTH, 32, True)
