"""Per-patch labels for image stores, from pixel segmentation masks (saev's labels.bin contents).

Each image `<dataset.path>/<rel>` has a mask `<masks>/<rel with its suffix replaced by mask_suffix>`
(ADE20K's `annotations/` beside `images/`): a single-frame, single-channel image (mode 1, L, P or
16-bit I) of the same size whose pixel values are class ids 0-255, both turned upright by their EXIF
Orientation as the extraction turns images (datasets.images.upright). The mask goes through the model's
own image processor with NEAREST resampling and no rescale/normalise, so it is resized and cropped
exactly like the pixels the model saw; then each patch_size x patch_size tile gets one label:
  majority   the most frequent label in the tile (ties: the smallest label), saev's default
  prefer-fg  the most frequent label other than bg_label, bg_label only if the whole tile is background
Register tokens (DINOv2 with registers, DINOv3) and DeiT's distillation token have no pixels: their
columns hold REGISTER_LABEL, which a mask may then not hold (PASCAL VOC's void id 255 would share its byte).
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from tqdm import tqdm

from actstore.errors import ConfigError, FormatError

REGISTER_LABEL = 255
N_CLASSES = 256
# One channel of class ids: "1" is a boolean mask as PIL saves a numpy bool array (a 1-bit PNG,
# ids 0 and 1); the I;16 modes are 16-bit PNGs and TIFFs of either byte order.
MASK_MODES = ("1", "L", "P", "I", "I;16", "I;16L", "I;16B")


def folder_path(root: str | Path, image_rel: str, where: str) -> Path:
    """`image_rel`, a sample's text read from the extraction, as a path under `root`; FormatError for
    an absolute one or one climbing out with `..` (a file of the machine outside would be read as
    the image's). Links to files are followed, as the image folder's own are when it is extracted."""
    rel = PurePosixPath(image_rel)
    if not image_rel or rel.is_absolute() or ".." in rel.parts:
        raise FormatError(f"{where}: {image_rel!r} is not a relative path inside {root}")
    return Path(root).joinpath(*rel.parts)


def mask_path(masks_dir: str | Path, image_rel: str, suffix: str) -> Path:
    """Where the mask of the image at dataset-relative path `image_rel` lives."""
    return folder_path(masks_dir, image_rel, "saev.patch_labels.masks").with_suffix(suffix)


def read_mask(path: Path, image_size: tuple[int, int]) -> np.ndarray:
    """(H, W) uint8 class ids; raise FormatError naming the file if it is not a label image of that size."""
    from PIL import Image

    # not at the top: it imports pyarrow, which saev jobs need not
    from actstore.datasets.images import upright, whole_images_only
    if not path.is_file():
        raise FormatError(f"{path}: mask missing (saev.patch_labels.masks)")
    # Decoded whole, as the images are: with LOAD_TRUNCATED_IMAGES set in the process a cut file gave
    # class 0 for its missing rows, else an OSError naming no file.
    try:
        with whole_images_only(), Image.open(path) as stored:
            # A multi-frame TIFF/GIF/APNG decodes as its first frame, the rest left out with nothing said.
            if getattr(stored, "n_frames", 1) > 1:
                raise FormatError(f"{path}: mask has {stored.n_frames} frames; need one frame of class ids")
            img = upright(stored)  # as Hugging Face datasets shows a mask, like its image
            if img.size != image_size:
                raise FormatError(f"{path}: mask is {img.size[0]}x{img.size[1]}, its image is "
                                  f"{image_size[0]}x{image_size[1]}")
            if img.mode not in MASK_MODES:
                raise FormatError(f"{path}: mask mode {img.mode!r}; need one channel of class ids (1, L, P or I)")
            mask = np.asarray(img)
    # truncated or not an image (OSError), a broken chunk (SyntaxError), a text chunk past PIL's limit
    # (ValueError), past PIL's pixel limit: PIL's messages name no file
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise FormatError(f"{path}: cannot decode the mask ({exc})") from None
    if mask.max(initial=0) >= N_CLASSES or mask.min(initial=0) < 0:
        raise FormatError(f"{path}: class ids must be 0-255 (labels.bin is uint8), found {mask.min()}-{mask.max()}")
    return mask.astype(np.uint8)


def processed_mask(processor: Any, mask: np.ndarray, where: Path) -> np.ndarray:
    """The mask after the processor's resize/crop, as (H', W') class ids (nearest neighbour only)."""
    from PIL import Image

    rgb = Image.fromarray(np.repeat(mask[:, :, None], 3, axis=2))
    out = processor(images=[rgb], do_rescale=False, do_normalize=False, resample=Image.NEAREST,
                    return_tensors="np")["pixel_values"][0, 0]
    labels = np.rint(out).astype(np.int64)
    # A processor that ignored `resample` would blend class ids into values no pixel had.
    if not np.isin(labels, np.unique(mask)).all() or not np.allclose(out, labels):
        raise ConfigError(f"{where}: {type(processor).__name__} did not resize the mask with nearest-neighbour "
                          "resampling; class ids were interpolated")
    return labels.astype(np.uint8)


def aggregate(mask: np.ndarray, patch_size: int, n_patches: int, pixel_agg: str, bg_label: int,
              where: Path) -> np.ndarray:
    """(n_patches,) uint8: one label per patch_size tile of the processed mask, row-major like the ViT.
    Pixels past the last whole tile (SigLIP so400m-patch14-384: 384 = 27 x 14 + 6) are left out, as
    the ViT's strided patch embedding leaves them out of every patch (saev's own labeller asserts
    there are none)."""
    grid_h, grid_w = mask.shape[0] // patch_size, mask.shape[1] // patch_size
    if grid_h * grid_w != n_patches:
        raise FormatError(f"{where}: processed mask {mask.shape[1]}x{mask.shape[0]} gives {grid_w}x{grid_h} "
                          f"patches of {patch_size} px, the model emitted {n_patches}")
    tiles = mask[:grid_h * patch_size, :grid_w * patch_size].reshape(grid_h, patch_size, grid_w, patch_size)
    tiles = tiles.transpose(0, 2, 1, 3).reshape(n_patches, -1).astype(np.int64)
    counts = np.bincount((tiles + np.arange(n_patches)[:, None] * N_CLASSES).ravel(),
                         minlength=n_patches * N_CLASSES).reshape(n_patches, N_CLASSES)
    if pixel_agg == "majority":
        return counts.argmax(axis=1).astype(np.uint8)
    if pixel_agg == "prefer-fg":
        foreground = counts.copy()
        foreground[:, bg_label] = 0
        return np.where(foreground.any(axis=1), foreground.argmax(axis=1), bg_label).astype(np.uint8)
    raise ConfigError(f"saev.patch_labels.pixel_agg = {pixel_agg!r}; use majority or prefer-fg")


def check_masks_dataset(dataset: dict[str, Any]) -> None:
    """At parse, before any extraction part runs: ConfigError unless the `dataset` section resolves to
    an image folder. Masks are named by an image folder's files (image_file); an image table's rows and
    a webdataset's members are none, which the saev finishing job found only after every part ran."""
    from actstore.datasets.source import resolve_source

    fmt = dataset.get("format", "auto")
    source = resolve_source(str(dataset["path"]), fmt, dataset.get("split", "train"))
    if source.format != "image_folder":
        raise ConfigError(f"saev.patch_labels: dataset.path {dataset['path']} is {source.format.replace('_', ' ')} "
                          f"(dataset.format {fmt}), no image folder; "
                          "masks are named by the files of an image folder dataset (masks/<image's path in the "
                          "folder>), and a table's rows or a webdataset's members are no files: use an image "
                          "folder, or drop saev.patch_labels")


def image_file(dataset_root: str | Path, image_rel: str) -> Path:
    """The image folder's file of a sample (its text), whose size its mask must have; ConfigError for
    a sample that is no such file, as an image table's or webdataset's row ("<shard>#<row>")."""
    path = folder_path(dataset_root, image_rel, "saev.patch_labels: image of a sample")
    if not path.is_file():
        raise ConfigError(f"{path}: no such image under {dataset_root}: saev.patch_labels names masks by "
                          f"the files of an image folder dataset (an image table's rows are no files)")
    return path


def image_patch_labels(dataset_root: str | Path, image_rels: list[str], model_path: str | Path, patch_size: int,
                       section: dict[str, Any], patches_per_ex: int, registers: int,
                       progress: bool = True, trust_remote_code: bool = False) -> np.ndarray:
    """(n_images, patches_per_ex) uint8 labels.bin rows: REGISTER_LABEL for register columns, then
    one label per patch. Every mask is checked before this returns, so a bad one fails before any write.
    `trust_remote_code`: model.trust_remote_code, so a folder's own processor class resizes the masks
    as it resized the pixels (refused by name without it)."""
    from PIL import Image

    from actstore.datasets.images import upright
    from actstore.models import load_image_processor

    processor = load_image_processor(model_path, trust_remote_code)
    n_patches = patches_per_ex - registers
    out = np.full((len(image_rels), patches_per_ex), REGISTER_LABEL, dtype=np.uint8)
    for row, rel in enumerate(tqdm(image_rels, desc="patch labels", unit="image", disable=not progress)):
        path = mask_path(section["masks"], rel, section["mask_suffix"])
        with Image.open(image_file(dataset_root, rel)) as img:
            image_size = upright(img).size  # the size the model saw (datasets.images.decoded_image)
        mask = read_mask(path, image_size)
        # Its patches and the register columns would share one byte (PASCAL VOC's void/boundary id is 255).
        if registers and (mask == REGISTER_LABEL).any():
            raise FormatError(f"{path}: class id {REGISTER_LABEL} marks this model's {registers} register columns "
                              "in labels.bin, so its patches could not be told from register tokens; give it "
                              "another id in the masks, or use saev.flavor: upstream (no register columns)")
        mask = processed_mask(processor, mask, path)
        out[row, registers:] = aggregate(mask, patch_size, n_patches, section["pixel_agg"],
                                         section["bg_label"], path)
    return out
