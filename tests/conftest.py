"""Shared fixtures: tiny seeded models saved to disk, real text and images, resolved configs."""
from __future__ import annotations

import os

# Before torch loads OpenMP, for this process and every job the tests start: two xdist workers each
# running Snakemake jobs of 2 torch threads on 2 cores, OpenMP threads spinning while they wait for
# work took the cores from each other (an SAE-sized step loop: 16 s beside a twin, 6 s passive).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

import tiny

torch.set_num_threads(int(os.environ.get("ACTSTORE_TEST_THREADS", "1")))


# The two longest files (a worker's 5-6 and 3-4 minutes on the 2-core development VM, review 68).
LONGEST_FILES = ("test_workflow_demo.py", "test_slurm.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LONGEST_FILES first, then the other files holding a slow test, each file's tests in their order:
    `make test` hands each xdist worker a file at a time in this order (--no-loadscope-reorder), and a
    workflow run's file taken last was the suite's tail (the demo's file: its last 6 minutes)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path.name not in LONGEST_FILES, item.path not in slow))


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
