"""Review 58 of the workflow's resources, job placement and rerun inputs: which model files stop a run."""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import tiny
from test_workflow_snakemake_dry_runs import dry_run
from actstore import resources
from actstore.datasets import configured_scan, write_scan
from actstore.errors import ConfigError
from actstore.extract import run_part
from actstore.formats.extract import write_index
from actstore.formats.zarr.write import write_shard
from actstore.hashing import stage_dir
from actstore.model_identity import check_model_unchanged


def extract(tmp_path: Path, model: Path, text_jsonl: Path) -> Path:
    """A one-part extraction of `model` with its index (the record a parse compares the folder with)."""
    config = tiny.make_config(tmp_path, model, text_jsonl, extract={"parts": 1})
    out = stage_dir(config, "extract")
    run_part(config, 0, out / "part-0000", progress=False)
    write_index(out, out / "extract.json", model)
    return out


def flip_last_byte(path: Path) -> None:
    """Other bytes of the same size: the safetensors data region's last byte, so the file still loads."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_edited_generation_config_changes_no_activation_and_stops_no_run(model_dir, text_jsonl, tmp_path):
    """generation_config.json is read only by generate(): editing a sampling setting after an extraction
    stopped every later run as if the weights had changed; an extraction of a release that recorded it
    is compared without it."""
    model = Path(shutil.copytree(model_dir("gpt2"), tmp_path / "model"))
    out = extract(tmp_path, model, text_jsonl)
    generation = model / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "max_new_tokens": 77}))
    check_model_unchanged(model, out)
    index = out / "extract.json"
    recorded = json.loads(index.read_text())
    recorded["model_files"]["generation_config.json"] = {"bytes": 1, "mtime_ns": 1, "sha256": "0" * 64}
    index.write_text(json.dumps(recorded))
    check_model_unchanged(model, out)


def test_weights_config_json_names_in_a_subfolder_are_recorded_and_checked(model_dir, text_jsonl, tmp_path):
    """config.json's transformers_weights makes from_pretrained read that file, in a subfolder too,
    which the top-level listing missed: new weights saved there left the old activations standing."""
    model = Path(shutil.copytree(model_dir("gpt2"), tmp_path / "model"))
    (model / "weights").mkdir()
    (model / "model.safetensors").rename(model / "weights" / "tuned.safetensors")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "transformers_weights": "weights/tuned.safetensors"}))
    out = extract(tmp_path, model, text_jsonl)
    assert "weights/tuned.safetensors" in json.loads((out / "extract.json").read_text())["model_files"]
    flip_last_byte(model / "weights" / "tuned.safetensors")
    with pytest.raises(ConfigError, match="weights/tuned.safetensors has other bytes"):
        check_model_unchanged(model, out)


def test_the_zarr_chunk_estimate_counts_an_images_tokens_past_max_seq_length(extracted, tmp_path):
    """An image is never cut at max_seq_length (its zarr store's T_max holds its tokens), but the chunk
    files, and the meta/files.json records the zarr jobs' memory is sized by, were counted up to
    max_seq_length: 16 estimated, 80 written here (17 tokens in chunks of 4)."""
    config, out = extracted("dinov2", extract={"parts": 1, "max_seq_length": 4}, zarr={"t_chunk": 4})
    write_shard(out / "part-0000", tmp_path / "shard", config["zarr"]["t_chunk"], progress=False)
    chunks = [p for p in (tmp_path / "shard" / "arrays" / "activations").rglob("*")
              if p.is_file() and not p.name.startswith(".")]
    assert len(chunks) <= resources.zarr_chunks(resources.workload(config), config)


def finished_saev_run(tmp_path: Path, config: dict) -> None:
    """Every output and benchmark of the saev target made up (its scatter jobs' temp folders apart, gone
    after a run), dated after the masks and their stamp: a run that finished before a mask changed."""
    output = dry_run(tmp_path, config, "saev")
    made = [Path(path) for paths in re.findall(r"^    (?:output|benchmark): (.*)$", output, re.M)
            for path in paths.split(", ") if "/scatter/" not in path]
    finished = time.time() - 50
    for path in made:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.name == "dataset_scan.json":  # the parse compares a finished extraction's scan with the data
            write_scan(configured_scan(config), path)
        else:
            path.mkdir() if path.name.startswith("part-") else path.write_text("{}")
        os.utime(path, (finished, finished))


def test_a_mask_saved_over_in_a_class_folder_redoes_the_patch_labels(model_dir, tmp_path):
    """saev.patch_labels' masks mirror the image folder's class folders; their folder was the saev job's
    input, and its mtime does not move when a mask in a subfolder is saved over in place: labels.bin kept
    the old mask's labels with nothing said."""
    images, masks, _ = tiny.write_segmentation_folder(tmp_path / "seg", (4, 4), (8, 8), n_images=2)
    for path in [masks, *masks.rglob("*")]:
        os.utime(path, (time.time() - 100, time.time() - 100))
    config = tiny.make_config(tmp_path, model_dir("dinov2"), images, extract={"parts": 1},
                              saev={"patch_labels": {"masks": str(masks)}}, sae={"enabled": False})
    finished_saev_run(tmp_path, config)
    assert "Nothing to be done" in dry_run(tmp_path, config, "saev")
    mask = next(masks.rglob("*.png"))
    Image.fromarray(np.full_like(np.asarray(Image.open(mask)), 3)).save(mask)  # PIL writes the path in place
    assert re.search(r"^saev\s+1$", dry_run(tmp_path, config, "saev"), re.M)
