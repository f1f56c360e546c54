"""saev writer and patch labels, review 56: faults a user met, each shown against the real writer."""
from __future__ import annotations

import base64
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path, PurePosixPath

import numpy as np
import pytest

from actstore.errors import ConfigError, FormatError
from actstore.formats import saev
from actstore.formats.extract import open_extraction
from actstore.model_config import read_model_config
from actstore.patch_labels import REGISTER_LABEL, image_patch_labels

LABELER = saev.PatchLabeler(image_patch_labels, REGISTER_LABEL)


def test_a_config_without_patch_size_writes_a_store_and_names_it_for_labels(extracted, tmp_path):
    """A config.json whose image tower leaves patch_size out (transformers 4 saved a CLIP's
    vision_config without its class defaults): every image store failed with a bare KeyError
    'patch_size', labels or none. A store without labels is written; labels name the file and field."""
    config, extract_dir = extracted("clip")
    extraction = open_extraction(extract_dir)
    model_config = read_model_config(extraction.meta["model"]["path"])
    assert "vision_config" not in model_config
    del model_config["patch_size"]
    section = {**config["saev"], "patches_per_shard": 100}
    store = saev.write_store(extraction, section, tmp_path / "plain", model_config=model_config, labeler=LABELER,
                             progress=False)
    assert saev.verify(store) == [] and not (store / "labels.bin").exists()
    (tmp_path / "masks").mkdir()
    labelled = {**section, "patch_labels": {"masks": str(tmp_path / "masks"), "mask_suffix": ".png",
                                            "pixel_agg": "majority", "bg_label": 0}}
    config_json = Path(extraction.meta["model"]["path"]) / "config.json"
    for labels in (True, False):  # the finishing job, and a shard job (which reads no mask)
        with pytest.raises(ConfigError, match=rf"saev.patch_labels: {config_json} patch_size = None"):
            saev.plan_store(extraction, labelled, model_config=model_config, labeler=LABELER, labels=labels)


KILLED_WRITER = """
import os, signal, sys
from actstore.formats import saev

root, flavor = sys.argv[1], sys.argv[2]
md = {"family": "dinov2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": 3, "cls_token": True,
      "d_model": 4, "n_examples": 10, "patches_per_shard": 4 * 3, "dtype": "float32",
      "data": saev.encode_data({"source": "test"}), "dataset": root, "protocol": saev.PROTOCOL}

def fill(start, out):
    if start >= 4:  # killed (preempted, out of memory) once a shard is on disk
        os.kill(os.getpid(), signal.SIGKILL)
    out[:] = start

saev.write_raw_store(saev.Plan(md, None, {}, flavor=flavor), fill, root, progress=False)
"""


@pytest.mark.parametrize("flavor", ["spec", "upstream"])
def test_the_shards_of_a_killed_write_are_swept_by_the_next(tmp_path, flavor):
    """write_raw_store fills its shards in a temp dir the next run sweeps; an upstream store's was made
    in root while the sweep looked in root/shards, so a killed upstream run's shards (as large as
    the store) stayed forever beside the stores."""
    root = tmp_path / "saev"
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(root), flavor])
    assert killed.returncode == -signal.SIGKILL
    left = list(root.rglob("*-shards.*.tmp"))
    assert len(left) == 1 and any(left[0].iterdir())  # the killed run's shard, under a temp name
    md = {"family": "dinov2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": 3, "cls_token": True,
          "d_model": 4, "n_examples": 10, "patches_per_shard": 4 * 3, "dtype": "float32",
          "data": saev.encode_data({"source": "test"}), "dataset": str(root), "protocol": saev.PROTOCOL}
    store = saev.write_raw_store(saev.Plan(md, None, {}, flavor=flavor), lambda start, out: out.fill(start), root,
                                 progress=False)
    assert saev.verify(store) == []
    assert not list(root.rglob("*.tmp")), os.listdir(root)


def test_labels_attached_to_a_store_saev_wrote_leave_it_verifying(tmp_path):
    """saev.write_labels on a store saev wrote (no actstore.json, `data` pickling saev's classes) made an
    actstore.json holding only labels.bin: verify then read the store as ours and failed it, its `data`
    'not a plain pickled description' and every shard 'has no sha256'. The labels now stay unrecorded,
    as saev leaves them, and read back."""
    root = tmp_path / "saev"
    md = {"family": "dinov2", "ckpt": "synthetic", "layers": [0], "patches_per_ex": 3, "cls_token": True,
          "d_model": 4, "n_examples": 5, "patches_per_shard": 2 * 4, "dtype": "float32",
          "data": base64.b64encode(pickle.dumps(PurePosixPath("/data/ade20k"))).decode(),  # a class, as saev's
          "dataset": str(root), "protocol": saev.PROTOCOL}
    store = saev.write_raw_store(saev.Plan(md, None, {}, flavor="upstream"), lambda start, out: out.fill(start), root,
                                 progress=False)
    (store / saev.SIDECAR).unlink()  # as saev writes a store
    assert saev.verify(store) == []
    labels = np.arange(15, dtype=np.uint8).reshape(5, 3)
    saev.write_labels(store, labels)
    assert saev.verify(store) == [] and not (store / saev.SIDECAR).exists()
    assert np.array_equal(saev.open_store(store).labels(), labels)


@pytest.mark.parametrize("truncated_allowed", [False, True])
def test_a_cut_mask_is_named_even_where_pil_may_load_truncated_images(tmp_path, monkeypatch, truncated_allowed):
    """A mask file cut short (a copy interrupted): PIL's OSError 'image file is truncated' named no file
    among thousands of masks, and where the process had set ImageFile.LOAD_TRUNCATED_IMAGES (a notebook,
    another library) its missing rows were read as class 0, wrong labels and no error. Both name it."""
    from PIL import Image, ImageFile

    from actstore.patch_labels import read_mask

    path = tmp_path / "img_00.png"
    Image.fromarray(np.random.default_rng(0).integers(1, 9, (64, 96)).astype(np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", truncated_allowed)
    with pytest.raises(FormatError, match=rf"{path}: cannot decode the mask \(image file is truncated"):
        read_mask(path, (96, 64))
    assert ImageFile.LOAD_TRUNCATED_IMAGES is truncated_allowed
