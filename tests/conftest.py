"""Shared fixtures: tiny seeded models saved to disk, real text and images, resolved configs."""
from __future__ import annotations

import os

import pytest
import torch

import tiny

torch.set_num_threads(int(os.environ.get("ACTSTORE_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(kind) -> folder of a tiny saved model of a kind in tiny.TEXT_KINDS or tiny.VISION_KINDS."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = tiny.build_model(kind, tmp_path_factory.mktemp(f"model-{kind}"))
        return cache[kind]
    return get


@pytest.fixture(scope="session")
def text_jsonl(tmp_path_factory):
    """30 real stdlib docstrings with labels."""
    return tiny.write_jsonl(tmp_path_factory.mktemp("text") / "docs.jsonl", 30)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    """8 real photographs in two class folders."""
    return tiny.write_image_folder(tmp_path_factory.mktemp("images") / "photos")


@pytest.fixture(scope="session")
def extracted(tmp_path_factory, model_dir, text_jsonl, image_folder):
    """extracted(kind, data=None, **sections) -> (config, extract_dir) after running every part of a
    tiny extraction (data: the dataset path, default the shared images or texts for the kind)."""
    from actstore.extract import run_part
    from actstore.formats.extract import write_index
    from actstore.hashing import stage_dir

    cache = {}

    def get(kind: str, data=None, **sections):
        key = (kind, str(data), repr(sorted(sections.items())))
        if key not in cache:
            data = data or (image_folder if kind in tiny.VISION_KINDS else text_jsonl)
            config = tiny.make_config(tmp_path_factory.mktemp(f"run-{kind}"), model_dir(kind), data, **sections)
            out = stage_dir(config, "extract")
            for part in range(config["extract"]["parts"]):
                run_part(config, part, out / f"part-{part:04d}", progress=False)
            write_index(out, out / "extract.json")
            cache[key] = (config, out)
        return cache[key]
    return get
