"""The pixels an image extraction feeds the model, for the image files users have, against the model's
own image processor given the image as Hugging Face `datasets` decodes it.

The convention followed (datasets' Image.decode_example, datasets 2.x to 4.x): PIL opens the file
(by its content, never its extension), takes its first frame (an animated GIF, a multi-page TIFF),
turns it upright with ImageOps.exif_transpose when it has an EXIF Orientation tag, and keeps its
mode; the processor's convert_to_rgb (do_convert_rgb: DINOv2's, CLIP's, SigLIP's) then composites
any transparency (an alpha band, a palette's transparent colour) onto white. actstore decodes so
(datasets/images.py `upright`, `to_rgb`), so its pixel_values equal that bit for bit. A processor
without do_convert_rgb (ViT, DeiT, BEiT) refuses a non-RGB image outright, and users then convert it
themselves: actstore composites on white there too, where PIL's plain convert("RGB") would show the
colour stored under a transparent pixel (one convention for every model, the processors' own).

Refused, naming the file, where `datasets` would differ: an image of more than 8 bits a channel whose
values do not fit 8 bits (RGB conversion would clip them; docs/extraction.md), a truncated file even
where PIL's LOAD_TRUNCATED_IMAGES was set, a file PIL cannot decode. PIL's pixel limit is PIL's:
refused over twice Image.MAX_IMAGE_PIXELS, a warning (and decoded, as `datasets` does) between once
and twice, so a 108-megapixel phone photo still runs."""
from __future__ import annotations

import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps

from actstore.datasets import load_dataset
from actstore.errors import ConfigError
from actstore.extract.inputs import image_batches
from actstore.models import load_image_processor

ORIENTATION = 0x0112


def photo(width: int = 40, height: int = 28, seed: int = 0) -> Image.Image:
    """A smooth gradient with noise: every pixel distinct enough that a turn or a wrong frame shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) * 3 % 256], -1)
    return Image.fromarray((rgb + rng.integers(0, 20, rgb.shape)).clip(0, 255).astype(np.uint8), "RGB")


def with_alpha(img: Image.Image) -> Image.Image:
    """RGBA: a fully transparent band, a half transparent band, the rest opaque."""
    rgba = np.array(img.convert("RGBA"))
    rgba[:, :10, 3], rgba[:, 10:20, 3] = 0, 128
    return Image.fromarray(rgba, "RGBA")


def save(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


def exif(orientation: int) -> Image.Exif:
    tags = Image.Exif()
    tags[ORIENTATION] = orientation
    return tags


def image_files() -> dict[str, bytes]:
    """name -> the file's bytes: the formats and modes users' datasets hold."""
    p = photo()
    frames = [photo(seed=s) for s in range(3)]
    gray16 = Image.fromarray(np.arange(28 * 40, dtype=np.uint16).reshape(28, 40) % 256)  # mode I;16
    files = {
        "baseline.jpg": save(p, "JPEG", quality=90),
        "progressive.jpg": save(p, "JPEG", quality=90, progressive=True),
        "cmyk.jpg": save(p.convert("CMYK"), "JPEG", quality=90),
        "gray.jpg": save(p.convert("L"), "JPEG", quality=90),
        "rgb.png": save(p, "PNG"),
        "rgba.png": save(with_alpha(p), "PNG"),
        "palette_transparent.png": save(p.quantize(16), "PNG", transparency=3),
        "gray16_within_8_bits.png": save(gray16, "PNG"),
        "gray16_transparent.png": save(gray16, "PNG", transparency=20),
        "la.png": save(with_alpha(p).convert("LA"), "PNG"),
        "palette.gif": save(p.quantize(32), "GIF"),
        "animated.gif": save(frames[0].quantize(32), "GIF", save_all=True,
                             append_images=[f.quantize(32) for f in frames[1:]], duration=50, loop=0),
        "lossy.webp": save(p, "WEBP", quality=80),
        "alpha.webp": save(with_alpha(p), "WEBP", quality=80),
        "rgb.bmp": save(p, "BMP"),
        "pages.tiff": save(frames[0], "TIFF", save_all=True, append_images=frames[1:]),
        "rotated_rgba.png": save(with_alpha(p), "PNG", exif=exif(6)),
        "rotated_rgba.webp": save(with_alpha(p), "WEBP", lossless=True, exif=exif(8)),
        "one_pixel.png": save(photo(1, 1), "PNG"),
        "smaller_than_crop.jpg": save(photo(3, 2), "JPEG"),
        "png_named.jpg": save(p, "PNG"),  # an extension that lies: PIL reads the content
    }
    files |= {f"exif_{o}.jpg": save(p, "JPEG", quality=90, exif=exif(o)) for o in range(1, 9)}
    return files


FILES = image_files()


def as_datasets_decodes(path: Path) -> Image.Image:
    """datasets' Image feature (decode_example): opened, loaded, upright if tagged, mode kept."""
    img = Image.open(path)
    img.load()
    return ImageOps.exif_transpose(img) if img.getexif().get(ORIENTATION) is not None else img


def project_pixels(processor, folder: Path, workers: int) -> dict[str, torch.Tensor]:
    """name -> pixel_values as an extraction's image DataLoader gives them (float32, one image a batch)."""
    dataset = load_dataset(folder)
    batches = image_batches(processor, dataset.opener, dataset.samples, [[i] for i in range(len(dataset.samples))],
                            workers, False, torch.float32)
    return {Path(s.text).name: items[0] for s, items in zip(dataset.samples, batches)}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, model_dir):
    """(folder of FILES, the DINOv2 processor, actstore's pixels from 2 decoding workers)."""
    folder = tmp_path_factory.mktemp("zoo") / "images"
    (folder / "all").mkdir(parents=True)
    for name, data in FILES.items():
        (folder / "all" / name).write_bytes(data)
    processor = load_image_processor(model_dir("dinov2"))
    assert processor.do_convert_rgb
    return folder / "all", processor, project_pixels(processor, folder, workers=2)


@pytest.mark.parametrize("name", sorted(FILES))
def test_pixels_equal_the_processors_on_the_image_datasets_decodes(name, zoo):
    folder, processor, pixels = zoo
    expected = processor(images=as_datasets_decodes(folder / name), return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels[name], expected)


@pytest.mark.parametrize("orientation", range(2, 9))
def test_an_exif_orientation_is_applied_as_datasets_applies_it(orientation, zoo):
    """Orientations 2-8 (mirrors, turns, transposes): the tag is honoured, not ignored as torchvision's
    ImageFolder does, and turns the image as exif_transpose (datasets, transformers' load_image) does."""
    folder, processor, pixels = zoo
    stored = processor(images=Image.open(folder / f"exif_{orientation}.jpg").convert("RGB"),
                       return_tensors="pt")["pixel_values"]
    turned = processor(images=ImageOps.exif_transpose(Image.open(folder / f"exif_{orientation}.jpg")),
                       return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels[f"exif_{orientation}.jpg"], turned)
    assert not torch.equal(turned, stored)
    assert torch.equal(pixels["exif_1.jpg"], pixels["baseline.jpg"])  # 1: as stored


@pytest.mark.parametrize("name", ["animated.gif", "pages.tiff"])
def test_a_file_of_several_frames_runs_its_first(name, zoo):
    folder, processor, pixels = zoo
    with Image.open(folder / name) as img:
        assert img.n_frames == 3
        img.seek(1)
        second = processor(images=img.convert("RGB"), return_tensors="pt")["pixel_values"]
    assert not torch.equal(pixels[name], second)  # and equal to the first: the test above


def test_transparency_is_white_for_a_processor_that_does_not_convert(zoo, model_dir):
    """ViT's processor (no do_convert_rgb) refuses an RGBA image; actstore gives it the image composited
    on white, as DINOv2's processor composites it, not PIL's convert("RGB"), which keeps the colour
    stored under a transparent pixel."""
    folder, _, _ = zoo
    vit = load_image_processor(model_dir("vit"))
    assert not vit.do_convert_rgb
    pixels = project_pixels(vit, folder.parent, workers=0)
    for name in ("rgba.png", "palette_transparent.png", "la.png", "alpha.webp"):
        on_white = Image.alpha_composite(Image.new("RGBA", Image.open(folder / name).size, "white"),
                                         Image.open(folder / name).convert("RGBA")).convert("RGB")
        assert torch.equal(pixels[name], vit(images=on_white, return_tensors="pt")["pixel_values"]), name
        dropped = vit(images=Image.open(folder / name).convert("RGB"), return_tensors="pt")["pixel_values"]
        assert not torch.equal(pixels[name], dropped), name


def one_image_dataset(tmp_path: Path, name: str, data: bytes):
    (tmp_path / "images" / "x").mkdir(parents=True)
    (tmp_path / "images" / "x" / name).write_bytes(data)
    dataset = load_dataset(tmp_path / "images")
    return dataset.opener, dataset.samples[0], tmp_path / "images" / "x" / name


def refused(opener, sample) -> str:
    """The ConfigError of checking the sample (before the weights load) or else of decoding it."""
    with pytest.raises(ConfigError) as caught:
        opener.check(sample)
        opener(sample)
    return str(caught.value)


def test_a_16_bit_image_beyond_8_bits_is_refused_naming_it(tmp_path):
    """datasets + the processor would clip it to 0..255 (mostly white); the scaling is the data's."""
    values = (np.arange(28 * 40, dtype=np.uint16).reshape(28, 40) * 50)
    opener, sample, path = one_image_dataset(tmp_path, "gray16.png", save(Image.fromarray(values), "PNG"))
    assert Image.open(path).mode == "I;16"
    assert f"{path}: an image of mode I;16 (values 0 to 55950)" in refused(opener, sample)


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, rows: bytes, after_pixels: bytes = b"") -> bytes:
    """A PNG (8-bit gray) written chunk by chunk: a declared size PIL would not write, a chunk after
    the pixels."""
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + after_pixels + chunk(b"IEND", b""))


def test_a_decompression_bomb_is_refused_naming_it(tmp_path):
    """A 1 KB PNG declaring 50,000 x 50,000 pixels (2.5 GB gray, 7.5 GB RGB): refused at the header."""
    opener, sample, path = one_image_dataset(tmp_path, "bomb.png", png(50_000, 50_000, b"\0" * 50_001))
    assert path.stat().st_size < 1000
    message = refused(opener, sample)
    assert message.startswith(f"{path}: Image size (2500000000 pixels) exceeds limit")
    with pytest.raises(ConfigError, match="could be decompression bomb"):
        opener(sample)


def test_a_text_chunk_over_pils_limit_after_the_pixels_is_refused_naming_it(tmp_path):
    """PIL refuses a compressed text chunk inflating past PngImagePlugin.MAX_TEXT_CHUNK (1 MB) with a
    ValueError; after the pixels, verify never reads it, so the decode met it and named no file."""
    text = chunk(b"zTXt", b"Comment\0\0" + zlib.compress(b"x" * 2_000_000))
    opener, sample, path = one_image_dataset(tmp_path, "metadata.png", png(4, 4, b"\0\x80\x80\x80\x80" * 4, text))
    opener.check(sample)
    with pytest.raises(ConfigError, match=f"^{path}: cannot decode the image .*MAX_TEXT_CHUNK"):
        opener(sample)


def test_a_broken_chunk_met_decoding_is_refused_naming_it(tmp_path):
    """A chunk of no valid type between the pixel chunks: PIL's SyntaxError. The extraction's check
    (verify) names it first; an image decoded alone (a dataset's opener) named no file."""
    compressed = zlib.compress(b"\0\x80\x80\x80\x80" * 4)
    broken = png(4, 4, b"").replace(chunk(b"IDAT", zlib.compress(b"")),
                                    chunk(b"IDAT", compressed[:5]) + chunk(b"\1\2\3\4", compressed[5:]))
    opener, sample, path = one_image_dataset(tmp_path, "broken.png", broken)
    with pytest.raises(ConfigError, match=f"^{path}: cannot decode the image \\(broken PNG file"):
        opener(sample)


TRUNCATABLE = ["baseline.jpg", "progressive.jpg", "cmyk.jpg", "rgb.png", "rgba.png", "palette.gif", "lossy.webp",
               "rgb.bmp", "pages.tiff"]


@pytest.mark.parametrize("truncated_allowed", [False, True])
@pytest.mark.parametrize("name", TRUNCATABLE)
def test_a_truncated_file_is_refused_naming_it(name, truncated_allowed, tmp_path, monkeypatch):
    """Cut to 30 % of its bytes (a copy or a download stopped early): never decoded with its missing
    part filled in, even where code sharing the process (a notebook, a model's remote code) set
    PIL's ImageFile.LOAD_TRUNCATED_IMAGES; the setting is left as it was."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", truncated_allowed)
    opener, sample, path = one_image_dataset(tmp_path, name, FILES[name][:len(FILES[name]) * 3 // 10])
    with warnings.catch_warnings(action="ignore"):  # libtiff's and libjpeg's own
        assert refused(opener, sample).startswith(f"{path}: ")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is truncated_allowed


def test_a_file_that_is_no_image_is_refused_naming_it(tmp_path):
    opener, sample, path = one_image_dataset(tmp_path, "notes.jpg", b"shopping list: eggs\n" * 20)
    assert refused(opener, sample) == f"{path}: not a readable image (cannot identify image file {str(path)!r})"
