"""Review: a hooked module's stored input is the argument it was called with; a dataset scan reads back as written."""
from __future__ import annotations

import os

import numpy as np
import pytest

import tiny
from actstore.datasets import load_dataset, read_scan, scan_dataset, write_scan
from actstore.errors import ConfigError
from actstore.extract import run_part
from actstore.formats.extract import open_part

DAY_NS = 86_400 * 10**9


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "paligemma"])
def test_a_language_models_input_is_its_inputs_embeds_not_the_first_keyword_tensor(kind, tmp_path, text_jsonl):
    """A vision-language model calls its language model with keywords only, attention_mask= (Qwen2.5-VL)
    or position_ids= (PaliGemma) before inputs_embeds=: the first tensor keyword was taken as the
    input and the part was refused as shaped (batch, tokens). Its input is what embed_tokens returned."""
    model = tiny.build_model(kind, tmp_path / kind)
    hooks = ["model.language_model:input", "model.language_model.embed_tokens:output"]
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"parts": 1, "layers": [0], "hooks": hooks})
    run_part(config, 0, tmp_path / "part", progress=False)
    part = open_part(tmp_path / "part")
    for i in range(len(part.samples)):
        np.testing.assert_array_equal(part.activations(hooks[0], i), part.activations(hooks[1], i))


def test_a_scan_of_a_file_dated_before_1970_is_read_back_and_still_checks_it(tmp_path):
    """os.stat's mtime_ns is negative for a file dated before 1970 (an archive's members keep their dates):
    the scan rule wrote it, and every part's job refused the scan as holding no whole number."""
    data = tiny.write_jsonl(tmp_path / "docs.jsonl", 5)
    os.utime(data, ns=(-DAY_NS, -DAY_NS))  # 1969-12-31
    write_scan(scan_dataset(data), tmp_path / "scan.json")
    scan = read_scan(tmp_path / "scan.json")
    assert [s.text for s in load_dataset(data, scan=scan).samples] == [s.text for s in load_dataset(data).samples]
    os.utime(data, ns=(-2 * DAY_NS, -2 * DAY_NS))
    with pytest.raises(ConfigError, match="changed since the dataset was scanned"):
        load_dataset(data, scan=scan)
