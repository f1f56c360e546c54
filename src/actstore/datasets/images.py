"""Images: files of a folder (folders.py), a table column of image bytes / {bytes, path} structs
(the Hub's Image feature), or tar shards' members (webdataset.py). ImageOpener decodes them in
whichever process asks, so DataLoader workers do the reading and decoding."""
from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from actstore.datasets.core import Sample, forked_pool, in_order
from actstore.datasets.source import Source
from actstore.datasets.tables import read_block
from actstore.datasets.webdataset import member_file
from actstore.errors import ConfigError, FormatError
from actstore.integrity import inside


# How images become the RGB the processor takes (decoded_image), recorded in part.json: parts decoded
# otherwise (before EXIF and transparency were honoured: no record) are not one extraction.
IMAGE_DECODING = "upright by EXIF orientation, transparency on white, at most 8 bits a channel"


class ImageOpener:
    """sample -> RGB PIL image. Table images are read one block at a time (a Parquet row group or
    an Arrow record batch, the image column only); the last block stays cached as Arrow data, and only
    the rows asked for become Python bytes (converting a whole 100-row block of 70 KB JPEGs cost 3x
    reading it, and a worker decoding 16 images of a block may need none of its other rows)."""

    def __init__(self, source: Source, field: str | None = None):
        self.source = source
        self.field = field
        self._block: tuple[tuple[int, int], Any] | None = None  # (shard, block), its image column

    def __call__(self, sample: Sample) -> Any:
        """The sample's image decoded to RGB; ConfigError naming the file (and column) if it cannot be."""
        return decoded_image(*self._locate(sample))

    def encoded(self, sample: Sample) -> tuple[bytes, str]:
        """The sample's image file as stored (its bytes, undecoded) and its name for errors
        (extract.image_pipeline gpu decodes JPEGs on the GPU)."""
        file, where = self._locate(sample)
        if isinstance(file, io.BytesIO):
            return file.getvalue(), where
        try:
            return file.read_bytes(), where
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read the image ({exc.strerror or exc})") from None

    def check(self, sample: Sample) -> None:
        """The sample's image opened and its structure verified without decoding the pixels (PIL's
        verify: headers, chunk checksums); ConfigError naming it. Pixel data a header cannot vouch
        for (a JPEG's truncated scan) is named when it is decoded."""
        from PIL import Image

        file, where = self._locate(sample)
        try:
            with Image.open(file) as img:
                img.verify()
                wide = is_wide(img.mode)
        except Image.DecompressionBombError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except (OSError, SyntaxError, ValueError) as exc:  # PIL raises SyntaxError for broken headers
            raise ConfigError(f"{where}: not a readable image ({exc})") from None
        if wide:  # rare: only such images are decoded here, for their values
            self(sample)

    def _locate(self, sample: Sample) -> tuple[Any, str]:
        """(path or file object, its name for errors)."""
        if sample.ref is None:
            path = self.source.root / sample.text
            return path, str(path)
        if self.source.format == "webdataset":  # ref: the image member's (shard, offset, size)
            shard, offset, size = sample.ref
            path = self.source.files[shard]
            return member_file(path, offset, size), f"{path}: {sample.text}"
        shard, block, row = sample.ref
        # the row too: a table's image struct names its file (`x.png`), and many rows may name one
        where = f"sample {sample.sample_idx} of {self.source.files[shard]}: {sample.text}, column {self.field!r}"
        return self._image_file(self._column(shard, block)[row].as_py(), shard, sample.sample_idx, where), where

    def _column(self, shard: int, block: int) -> Any:
        if self._block is None or self._block[0] != (shard, block):
            self._block = ((shard, block), read_block(self.source.format, self.source.files[shard], block, self.field))
        return self._block[1]

    def _image_file(self, value: Any, shard: int, sample_idx: int, where: str) -> Any:
        """Bytes as a file object, or the path (relative to the shard's folder) when no bytes are
        stored. A path is resolved inside that folder: a table's row must never read a file of the
        machine outside the dataset (an absolute path, `..`, a link out); ConfigError naming the row."""
        if isinstance(value, dict):
            value = value.get("bytes") or value.get("path")
        if isinstance(value, bytes):
            return io.BytesIO(value)
        if isinstance(value, str):
            row = f"{self.source.files[shard]}: sample {sample_idx}, column {self.field!r}"
            try:
                return inside(self.source.files[shard].parent, value, row)
            except FormatError as exc:
                raise ConfigError(f"{exc}: a table's image is its bytes, or a path relative to the table's "
                                  "folder (store the images' bytes in the table, or put the images under that "
                                  "folder)") from None
        raise ConfigError(f"{where}: holds no image (null)")

    def __getstate__(self) -> dict[str, Any]:  # workers start with no cached block
        return {**self.__dict__, "_block": None}


CHECK_CHUNK = 256  # images one checking process verifies at a time
# A checking process's fork (of a job holding torch, and on a GPU node CUDA) costs more than checking
# a few hundred images: on the H100 host 1,024 JPEGs took 0.108 s in 4 processes and 4,096 0.246 s in
# 16, where one process checks 4,096 in 0.16 s on the 2-core VM.
CHECK_PER_PROCESS = 2048


def check_images(opener: ImageOpener, samples: list[Sample], processes: int) -> None:
    """Every sample's image verified (ImageOpener.check) before the weights load; ConfigError naming
    the first bad one in sample order. PIL parses headers in Python, so threads share one core (4,096
    JPEG headers took 0.84 s in 16 threads on the H200 host, before any image was decoded; on a
    2-core VM a pool of threads took 3x one thread's 0.15 s): files are checked in forked processes,
    CHECK_CHUNK images a task, each inheriting the samples (none is pickled), one process per
    CHECK_PER_PROCESS images up to `processes`."""
    processes = min(processes, len(samples) // CHECK_PER_PROCESS)
    if opener.field is not None or processes < 2:  # table images: blocks are read in order
        for sample in samples:
            opener.check(sample)
        return
    with forked_pool(processes, initializer=_hold, initargs=(opener, samples)) as pool:
        list(in_order([pool.submit(_check_range, start) for start in range(0, len(samples), CHECK_CHUNK)]))


_checking: tuple[ImageOpener, list[Sample]] | None = None  # in a checking process: what it checks


def _hold(opener: ImageOpener, samples: list[Sample]) -> None:
    global _checking
    _checking = (opener, samples)


def _check_range(start: int) -> None:
    opener, samples = _checking
    for sample in samples[start:start + CHECK_CHUNK]:
        opener.check(sample)


def is_wide(mode: str) -> bool:
    """A PIL mode of more than 8 bits a channel: 16- and 32-bit integers (16-bit PNG, TIFF), floats."""
    return mode in ("I", "F") or mode.startswith("I;16")


def decoded_image(file: Any, where: str) -> Any:
    """An RGB image, upright (EXIF), from a path or file object; ConfigError naming `where` if it cannot
    be decoded, or if its values do not fit 8 bits (check_fits_8_bits)."""
    from PIL import Image

    try:
        with whole_images_only(), Image.open(file) as img:
            if is_wide(img.mode):
                check_fits_8_bits(img, where)
            return to_rgb(upright(img))
    except Image.DecompressionBombError as exc:  # PIL's pixel limit (a 20,000 x 20,000 scan); it names no file
        raise ConfigError(f"{where}: {exc}") from None
    # truncated or not an image (OSError), a broken chunk (SyntaxError), a PNG text chunk past PIL's
    # limit after the pixels (ValueError, which verify does not reach): PIL's messages name no file
    except (OSError, SyntaxError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot decode the image ({exc})") from None


class _WholeImagesOnly:
    """The decoders inside whole_images_only, and PIL's setting from before the first of them."""

    lock = threading.Lock()
    decoding = 0
    truncated_allowed = False


@contextmanager
def whole_images_only() -> Iterator[None]:
    """PIL's LOAD_TRUNCATED_IMAGES off while decoding, as it is by default: code sharing the process
    (a notebook, a model's remote code) may have set it, and a truncated file would then decode
    without an error, its missing rows gray or black. Restored when the last decoder leaves: a
    thread's restore while another decoded (the gpu pipeline's decoding thread beside check_images)
    let that one decode a truncated file, and the setting of whichever left last survived."""
    from PIL import ImageFile

    with _WholeImagesOnly.lock:
        if not _WholeImagesOnly.decoding:
            _WholeImagesOnly.truncated_allowed = ImageFile.LOAD_TRUNCATED_IMAGES
        _WholeImagesOnly.decoding += 1
        ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        with _WholeImagesOnly.lock:
            _WholeImagesOnly.decoding -= 1
            if not _WholeImagesOnly.decoding:
                ImageFile.LOAD_TRUNCATED_IMAGES = _WholeImagesOnly.truncated_allowed


EXIF_ORIENTATION = 0x0112


def upright(img: Any) -> Any:
    """The image turned as its EXIF Orientation says (a phone photo is stored sideways with a tag to
    turn it), as Hugging Face datasets' Image feature and transformers' load_image show it; an image
    without the tag as it is. Turned as ImageOps.exif_transpose turns it, but not by it: it also
    writes the EXIF again without the tag, which raised a TypeError or struct.error naming no file
    (in a DataLoader worker, after the weights loaded) where another tag's value is not of its type
    (a damaged byte, a camera's own tags), for an image whose pixels decode."""
    from PIL import Image

    method = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}.get(img.getexif().get(EXIF_ORIENTATION))
    return img if method is None else img.transpose(method)


def to_rgb(img: Any) -> Any:
    """RGB as the HF image processors make it (transformers' convert_to_rgb): an image with an alpha
    band or a transparent palette colour composited onto white, any other converted. PIL's plain
    convert("RGB") drops the alpha, so a transparent pixel would show the colour stored under it
    (often black) where the model's processor, given the file's image, sees white."""
    from PIL import Image

    if "A" not in img.getbands() and img.info.get("transparency") is None:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def check_fits_8_bits(img: Any, where: str) -> None:
    """An image of more than 8 bits a channel converts to RGB (what every image processor takes) by
    clipping each value to 0..255, as torchvision's and the processors' own loaders convert it: a
    16-bit PNG of values up to 65,535 turns white, a float image in [0, 1] black, and the model runs
    on that. Converted only when every value is a whole number in 0..255 (then it is exact);
    otherwise refused: which scaling is right (a CT window, a 12-bit range) is the data's to say."""
    import numpy as np

    values = np.asarray(img)
    if values.size and (values.min() < 0 or values.max() > 255 or not np.array_equal(values, np.round(values))):
        raise ConfigError(f"{where}: an image of mode {img.mode} (values {values.min():g} to {values.max():g}), more "
                          "than 8 bits a channel: its conversion to RGB would clip the values to 0..255; convert "
                          "the images to 8 bits with the scaling the data needs")
