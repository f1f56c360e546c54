"""Shared integrity helpers, config cross-field checks and lmprobe verify on mistaken or damaged
inputs, each through the real writers' stores."""
from __future__ import annotations

import copy
import json

import pyarrow.parquet as pq
import pytest
import torch

import tiny
from actstore.config import load_config, validate_config
from actstore.errors import ConfigError, FormatError
from actstore.formats import lmprobe
from actstore.formats import zarr as zs
from actstore.formats.lut import check as lut_check
from actstore.formats.lut import write_lut
from actstore.formats.lut.layout import META_FILE
from actstore.models import get_module
from test_lmprobe_verify_bounds import rewrite_index, with_column
from test_lut_install_hostile_inputs import K, Tiny, tables_for
from test_zarr import bert_run, copied_run  # noqa: F401 (bert_run: a fixture)

TOO_LONG = "x" * 300  # one path component over any file system's 255-byte NAME_MAX


def test_a_lut_table_name_too_long_to_look_up_is_named(tmp_path):
    """A layer whose '{layer_path}.lut.safetensors' name is over NAME_MAX: verify reports it and inspect
    refuses it naming metadata.json's field (both raised the file system's bare 'File name too long')."""
    torch.manual_seed(0)
    lut = write_lut(tmp_path, tables_for(Tiny()), K)
    meta = json.loads((lut / META_FILE).read_text())
    layer = f"layers.{TOO_LONG}"
    meta["layers"][layer] = {**meta["layers"].pop("layers.0.q"), "file": f"{layer}.lut.safetensors"}
    (lut / META_FILE).write_text(json.dumps(meta))
    named = f"{lut / META_FILE} layers.{layer}.file"
    assert any(p.startswith(named) and "cannot be looked up" in p for p in lut_check.verify(lut))
    with pytest.raises(FormatError, match="cannot be looked up") as caught:
        lut_check.inspect(lut)
    assert str(caught.value).startswith(named)


def test_a_zarr_store_path_too_long_to_look_up_is_named(bert_run, tmp_path):
    """The manifest's shards[0].path over NAME_MAX: verify reports it against manifest.json (and still
    checks the other stores), open_zarr refuses it naming manifest.json."""
    run = copied_run(bert_run, tmp_path, lambda m: m["shards"][0].update(path=TOO_LONG))
    problems = zs.verify(run)
    assert any(p.startswith(str(run / zs.MANIFEST)) and "cannot be looked up" in p for p in problems), problems
    with pytest.raises(FormatError, match=f"{zs.MANIFEST}.*cannot be looked up"):
        zs.open_zarr(run)


def test_get_module_names_the_key_or_file_that_gave_the_path():
    """get_module said 'extract.hooks' for every missing module, a LUT's layer on the wrong model too;
    its caller now names where the path came from (extract.hooks when it names none)."""
    with pytest.raises(ConfigError, match=r"^lut\.targets: module 'layers\.0\.v' does not exist in Tiny; "):
        get_module(Tiny(), "layers.0.v", where="lut.targets")
    with pytest.raises(ConfigError, match=r"^extract\.hooks: module 'layers\.0\.v' does not exist in Tiny; "):
        get_module(Tiny(), "layers.0.v")


def test_more_active_latents_than_latents_is_refused_at_load():
    """sae.k_active above sae.num_basis passed the config and was refused when the sae stage started,
    after the extraction; now at load, naming both keys. Not for an imported SAE (its num_basis is the
    file's) nor with the sae stage off."""
    config = load_config(tiny.REPO / "config" / "config.yaml")
    config["sae"].update(num_basis=16, k_active=17)
    with pytest.raises(ConfigError, match=r"sae\.k_active 17 is more than sae\.num_basis 16"):
        validate_config(copy.deepcopy(config))
    for edit in ({"enabled": False}, {"import": {"path": "sae.safetensors", "style": "saelens"}}, {"k_active": 16}):
        validate_config({**copy.deepcopy(config), "sae": {**config["sae"], **edit}})


def test_a_pooled_prompt_of_no_tokens_is_named(extracted, tmp_path):
    """A pooled index's num_tokens of 0 or less (the address columns intact, the digests updated) passed
    verify, and read_vector then called the prompt's stored last token absent."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, {"storage": "pooled"}, progress=False)
    table = pq.read_table(lmprobe.find_index(root))
    num_tokens = table.column("num_tokens").to_pylist()
    num_tokens[0], num_tokens[2] = 0, -3
    index = rewrite_index(root, with_column(table, "num_tokens", num_tokens))
    problems = lmprobe.verify(root)
    assert problems[0] == f"{index}: num_tokens is not a token count (1 or more) at row 0: 0, row 2: -3"
    # and the token columns, whose lists no longer hold num_tokens entries at those rows
    assert problems[1:] and all("holds a list of another length than num_tokens at row 0" in p for p in problems[1:])
