"""saev review 59: patch labels from masks whose ids or frames labels.bin could not hold faithfully."""
from __future__ import annotations

import numpy as np
import pytest

import tiny
from actstore.errors import FormatError
from actstore.patch_labels import REGISTER_LABEL, image_patch_labels, read_mask

SECTION = {"mask_suffix": ".png", "pixel_agg": "majority", "bg_label": 0}


def voc_image_and_mask(root):
    """A 32x32 image and its mask: class 3, with PASCAL VOC's void id 255 over the top-left quadrant."""
    from PIL import Image

    images, masks = root / "images", root / "masks"
    images.mkdir()
    masks.mkdir()
    Image.fromarray(np.zeros((tiny.IMAGE_SIZE, tiny.IMAGE_SIZE, 3), np.uint8)).save(images / "a.png")
    mask = np.full((tiny.IMAGE_SIZE, tiny.IMAGE_SIZE), 3, np.uint8)
    mask[:tiny.IMAGE_SIZE // 2, :tiny.IMAGE_SIZE // 2] = 255
    Image.fromarray(mask).save(masks / "a.png")
    return images, {**SECTION, "masks": str(masks)}


def test_a_mask_class_that_is_the_register_label_is_refused_where_there_are_registers(model_dir, tmp_path):
    """A DINOv2 with registers: its register columns hold 255 in labels.bin, and VOC masks mark void
    with 255, so the void patches got the registers' byte and a keep_labels=[255] probe read both."""
    images, section = voc_image_and_mask(tmp_path)
    grid = (tiny.IMAGE_SIZE // tiny.PATCH) ** 2
    with pytest.raises(FormatError, match=rf"{section['masks']}/a.png: class id {REGISTER_LABEL} marks this "
                                          rf"model's {tiny.REGISTERS} register columns"):
        image_patch_labels(images, ["a.png"], model_dir("dinov2_registers"), tiny.PATCH, section,
                           tiny.REGISTERS + grid, tiny.REGISTERS, progress=False)
    # Without register columns (a model without registers, or saev.flavor: upstream) 255 is a class.
    labels = image_patch_labels(images, ["a.png"], model_dir("dinov2"), tiny.PATCH, section, grid, 0, progress=False)
    assert (labels == 255).sum() == grid // 4


@pytest.mark.parametrize("suffix", [".tif", ".gif"])
def test_a_multi_frame_mask_is_refused_naming_it(tmp_path, suffix):
    """A mask saved as a multi-frame TIFF or GIF was read as its first frame, the others left out with
    nothing said."""
    from PIL import Image

    path = tmp_path / f"mask{suffix}"
    frames = [Image.fromarray(np.full((16, 24), cls, np.uint8)) for cls in (1, 2)]
    frames[0].save(path, save_all=True, append_images=frames[1:])
    with pytest.raises(FormatError, match=rf"{path}: mask has 2 frames"):
        read_mask(path, (24, 16))


def test_a_shard_count_given_as_true_is_refused_naming_shards_json(tmp_path):
    """`"n_examples": true` is 1 to isinstance(n, int): verify passed it and a read crashed inside
    numpy's memmap naming no file."""
    import json

    from actstore.formats import saev
    from actstore.formats.extract import open_extraction, synthetic_extraction
    from test_extract import write_real_store
    root = synthetic_extraction(tmp_path / "x", 4_000, 1, 8, [1], tokens=(4, 6))
    examples = saev.open_store(write_real_store("saev", root, tmp_path / "probe")).n_examples
    store = write_real_store("saev", root, tmp_path / "saev", patches_per_shard=4 * (examples - 1))
    shards = json.loads((store / "shards.json").read_text())
    assert shards[-1]["n_examples"] == 1
    shards[-1]["n_examples"] = True
    (store / "shards.json").write_text(json.dumps(shards))
    assert any("shards.json" in p and "n_examples=True" in p for p in saev.verify(store)), saev.verify(store)
    assert open_extraction(root).n_samples  # the extraction itself is untouched
