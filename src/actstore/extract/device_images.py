"""extract.image_pipeline gpu: JPEGs decoded on the model's GPU (nvJPEG, torchvision.io.decode_jpeg)
and the model's image processor run there (transformers' torchvision backend on CUDA tensors).

The cpu pipeline decodes and processes in DataLoader workers, and on a GPU node those CPUs are an
image part's bound: on an H100 host (session 52, bench_image_decode) 13 workers fed 1,093 images/s,
this path 2,885 with the ViT-B/14 forward running beside it. Its pixels are not the cpu pipeline's
bits (nvJPEG's IDCT and the GPU's resize: at most 0.58, on average 0.0115 in normalised units), so it
is never the default and part.json records which pipeline ran.

The workers still read each image's bytes and look at its header. A JPEG that nvJPEG decodes to what
the cpu pipeline's opener means (ImageOpener: upright, RGB, 8 bits) goes to the GPU as its bytes: three
channels (YCbCr), baseline, no EXIF turn. Any other image (PNG, grayscale, CMYK, progressive, turned by
its EXIF tag) is decoded and processed in the worker as the cpu pipeline does it, its pixels the cpu
pipeline's (moving its decoded pixels to the GPU instead took more memory and fed 659 images/s where
the cpu pipeline fed 1,093: session 52's hybrid row). Which way an image goes depends on its bytes
alone, so the pixels do not depend on the worker count."""
from __future__ import annotations

import collections
import contextlib
import io
import logging
import re
import threading
from typing import Any, Generator, Iterator, NamedTuple

import numpy as np
import torch

from actstore.datasets import Sample
from actstore.datasets.images import EXIF_ORIENTATION, ImageOpener, decoded_image
from actstore.errors import ConfigError
from actstore.extract.inputs import item_loader

log = logging.getLogger(__name__)

# Decoded pixels one processor call holds on the GPU at most (a batch of 64 12-megapixel photos
# would hold 2.3 GB, 64 500 x 375 JPEGs 36 MB): a batch's images are decoded and processed in
# consecutive groups of up to this many bytes (at least one image), whatever their sizes.
DECODE_BYTES = 1 << 30
# Processed pixels the decoding thread holds on the GPU ahead of the model, at most (one batch at
# least): ViT-B/14's 64 images at 224 in bfloat16 are 19 MB, so this is the first ~1,700 images,
# which it decodes while the weights load (the cpu pipeline's workers decode so meanwhile).
AHEAD_BYTES = 1 << 29
DECODING_THREAD = "actstore-gpu-decoding"


class WorkerImage(NamedTuple):
    """One image as a worker hands it to the GPU."""
    where: str  # its file (and row) for errors
    data: torch.Tensor  # the JPEG's bytes for nvJPEG when `encoded`, else its processed (3, H, W) float32 pixels
    encoded: bool
    decoded_bytes: int  # what decoding it takes on the GPU: 3 x height x width for a JPEG, else 0


JPEG_END = b"\xff\xd9"  # the EOI marker


def nvjpeg_decodable(img: Any, data: bytes) -> bool:
    """An opened PIL image (header only) whose file `data` nvJPEG decodes to the opener's RGB: a
    baseline three-channel YCbCr JPEG of 8 bits that its EXIF tag does not turn, and whole. The opener
    refuses a truncated JPEG (datasets.images.whole_images_only) where nvJPEG may decode what it has:
    a file not ending in its EOI marker (cut, or with bytes appended) goes to the opener."""
    return (img.format == "JPEG" and img.mode == "RGB" and not img.info.get("progressive")
            and img.info.get("adobe_transform", 1) != 0 and not rgb_components(img)
            and img.getexif().get(EXIF_ORIENTATION, 1) == 1 and data.endswith(JPEG_END))


def rgb_components(img: Any) -> bool:
    """Whether a three-component JPEG may hold RGB, not YCbCr, as libjpeg (PIL's decoder) reads it:
    components named R, G, B, unless a JFIF or an Adobe marker says YCbCr. (An Adobe marker of
    transform 0 says RGB: nvjpeg_decodable refuses it apart.)"""
    named_rgb = [component[0] for component in img.layer] == list(b"RGB")
    return named_rgb and "jfif" not in img.info and img.info.get("adobe_transform") != 1


def worker_image(opener: ImageOpener, processor: Any, sample: Sample) -> WorkerImage:
    """The sample's image as a worker hands it to the GPU (see WorkerImage), its file read once."""
    from PIL import Image

    data, where = opener.encoded(sample)
    try:
        with Image.open(io.BytesIO(data)) as img:
            if nvjpeg_decodable(img, data):
                return WorkerImage(where, torch.frombuffer(bytearray(data), dtype=torch.uint8), True,
                                   3 * img.width * img.height)
    # not an image PIL knows, or past its pixel limit: decoded_image names the file and why
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        pass
    pixels = processor(images=[decoded_image(io.BytesIO(data), where)], return_tensors="pt")["pixel_values"][0]
    return WorkerImage(where, pixels, False, 0)


class WorkerImages(torch.utils.data.Dataset):
    """Item = a few images of one batch (a list of local indices) as WorkerImage tuples, split as the
    cpu pipeline's ImageItems splits them (the model sees whole batches either way)."""

    def __init__(self, opener: ImageOpener, processor: Any, samples: list[Sample]):
        self.opener, self.processor, self.samples = opener, processor, samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: list[int]) -> list[WorkerImage]:
        return [worker_image(self.opener, self.processor, self.samples[i]) for i in item]


def device_image_batches(processor: Any, opener: ImageOpener, samples: list[Sample], batches: list[list[int]],
                         num_workers: int, device: torch.device, dtype: torch.dtype
                         ) -> Generator[list[torch.Tensor], None, None]:
    """Processed pixels on `device` in the model's `dtype`, batch by batch, as image_batches yields
    them (a list of tensors per batch: here one). The workers start at once and read ahead, and a
    thread decodes and processes each batch on the GPU (on its own CUDA stream) up to AHEAD_BYTES
    ahead of the model: call it before loading the model, so that the first batches are ready when
    the weights are, as the cpu pipeline's workers decode them meanwhile. Closing it ends the thread."""
    items, loader = item_loader(WorkerImages(opener, processor, samples), batches, num_workers, device.type == "cuda")
    ahead = Ahead()
    threading.Thread(target=_decode_ahead, args=(processor, loader, items, device, dtype, ahead),
                     name=DECODING_THREAD, daemon=True).start()
    batches_out = _handed_over(ahead, device)
    # Run to its first yield, inside its try: closed (run_part's end) or dropped before its first batch,
    # it stops the thread too (a generator closed before it started runs nothing).
    next(batches_out)
    return batches_out


class Ahead:
    """Batches the decoding thread hands to the model's, in order: at most AHEAD_BYTES of pixels held
    (one batch at least), so the GPU memory they take is bounded; stop() ends the handing over."""

    def __init__(self):
        self.ready: collections.deque = collections.deque()
        self.held = 0
        self.stopped = False
        self.changed = threading.Condition()

    def put(self, item: Any, nbytes: int) -> bool:
        """Wait for room, then hand `item` over; False once stopped."""
        with self.changed:
            self.changed.wait_for(lambda: self.stopped or not self.ready or self.held + nbytes <= AHEAD_BYTES)
            if self.stopped:
                return False
            self.ready.append((item, nbytes))
            self.held += nbytes
            self.changed.notify_all()
            return True

    def get(self) -> Any:
        with self.changed:
            self.changed.wait_for(lambda: self.ready)
            item, nbytes = self.ready.popleft()
            self.held -= nbytes
            self.changed.notify_all()
            return item

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()


def _decode_ahead(processor: Any, loader: Iterator[list[WorkerImage]], items: list[list[list[int]]],
                  device: torch.device, dtype: torch.dtype, ahead: Ahead) -> None:
    """The decoding thread: each batch's images from `loader`, decoded and processed on `device` (on a
    CUDA stream of its own, an event marking when they are ready), handed over with the count of
    images nvJPEG decoded; then None. An exception is handed over for the model's thread to raise."""
    try:  # (from its first step: a thread that died silently would leave the model's waiting for ever)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for batch in items:
                images = [image for _ in batch for image in next(loader)]
                pixels = device_pixels(processor, images, device).to(dtype)
                ready = None
                if stream is not None:
                    ready = torch.cuda.Event()
                    ready.record(stream)
                if not ahead.put((pixels, ready, sum(image.encoded for image in images), len(images)),
                                 pixels.nbytes):
                    return
    except torch.OutOfMemoryError as exc:  # the decoding shares the GPU with the model
        ahead.put(ConfigError(f"{device} ran out of memory decoding and processing a batch's images beside the model "
                              f"(extract.image_pipeline gpu; {str(exc).splitlines()[0][:200]}): lower "
                              "extract.batch_size, or use image_pipeline cpu"), 0)
        return
    except BaseException as exc:  # noqa: BLE001 - raised in the model's thread, naming what failed
        ahead.put(exc, 0)
        return
    ahead.put(None, 0)


def _handed_over(ahead: Ahead, device: torch.device) -> Iterator[list[torch.Tensor]]:
    """The decoding thread's batches, each made ready for the model's stream (it waits for the
    thread's event, and the allocator keeps the pixels' memory until the model's stream is done)."""
    on_gpu = images_seen = 0
    try:
        yield []  # taken by device_image_batches
        while (got := ahead.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            pixels, ready, encoded, n_images = got
            if ready is not None:
                model_stream = torch.cuda.current_stream(device)
                model_stream.wait_event(ready)
                pixels.record_stream(model_stream)
            on_gpu += encoded
            images_seen += n_images
            yield [pixels]
    finally:
        ahead.stop()
    log.info("extract.image_pipeline gpu: %d of %d images decoded on the GPU (baseline JPEGs), the rest decoded and "
             "processed by the workers as image_pipeline cpu does", on_gpu, images_seen)


def device_pixels(processor: Any, images: list[WorkerImage], device: torch.device) -> torch.Tensor:
    """(n, 3, H, W) pixel_values on `device`, in the images' order, processed in groups of at most
    DECODE_BYTES of decoded pixels (decoding_groups)."""
    groups = [group_pixels(processor, group, device) for group in decoding_groups(images)]
    return groups[0] if len(groups) == 1 else torch.cat(groups)


def decoding_groups(images: list[WorkerImage]) -> list[list[WorkerImage]]:
    """`images` cut in order into groups of up to DECODE_BYTES decoded bytes, each of one image at
    least. The cuts depend on the images alone, never on the worker count."""
    groups: list[list[WorkerImage]] = [[]]
    held = 0
    for image in images:
        if groups[-1] and held + image.decoded_bytes > DECODE_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(image)
        held += image.decoded_bytes
    return groups


def group_pixels(processor: Any, images: list[WorkerImage], device: torch.device) -> torch.Tensor:
    """The group's pixel_values in the images' order: its JPEGs decoded on `device` in one nvJPEG call
    and processed there in one processor call, the workers' processed pixels copied there."""
    pixels: list[torch.Tensor | None] = [
        None if image.encoded else image.data.to(device, non_blocking=True) for image in images]
    jpegs = [i for i, image in enumerate(images) if image.encoded]
    if jpegs:
        decoded = nvjpeg([images[i] for i in jpegs], device)
        for i, row in zip(jpegs, processor(images=decoded, return_tensors="pt")["pixel_values"], strict=True):
            pixels[i] = row
    return torch.stack(pixels)


# A decode that failed for want of GPU memory: torch's allocator ("CUDA out of memory", which torchvision
# wraps in a RuntimeError), or nvJPEG's own (status 5, NVJPEG_STATUS_ALLOCATOR_FAILURE: torchvision's
# "Failed to decode batch: 5").
GPU_MEMORY_FAILED = re.compile(r"out of memory|: 5\b")


def nvjpeg(images: list[WorkerImage], device: torch.device) -> list[torch.Tensor]:
    """The JPEGs' RGB uint8 (3, H, W) pixels on `device`, decoded there in one nvJPEG call. When the
    call fails (one failing image fails it), each is decoded alone, and one nvJPEG refuses (arithmetic
    coding, a sampling it does not know) is decoded by the cpu pipeline's opener here, with a warning
    naming it: its bytes decide that, so its pixels do not depend on its batch companions. The opener
    names an image that is not whole, and one_jpeg an image nvJPEG had no GPU memory for (ConfigError)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg([image.data for image in images], mode=ImageReadMode.RGB, device=device)
    except RuntimeError:  # the call names no image
        return [one_jpeg(image, device) for image in images]


def one_jpeg(image: WorkerImage, device: torch.device) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(image.data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError as exc:
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        # The GPU's memory, shared with the model's forward, is not the image's: decoded on the CPU
        # then, its pixels would depend on what else held memory at that moment.
        if GPU_MEMORY_FAILED.search(str(exc)):
            raise ConfigError(f"{image.where}: nvJPEG ran out of GPU memory decoding it ({why}): lower "
                              "extract.batch_size, or use image_pipeline cpu") from None
        log.warning("%s: nvJPEG cannot decode it (%s); decoded on the CPU as image_pipeline cpu decodes it",
                    image.where, why)
    rgb = decoded_image(io.BytesIO(image.data.numpy().tobytes()), image.where)
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).contiguous().to(device)


def check_device_pipeline(processor: Any, device: torch.device) -> None:
    """Before the weights load: ConfigError unless this job can run extract.image_pipeline gpu: a CUDA
    device, torchvision decoding a JPEG there, and an image processor that processes it there (the
    torchvision backend; the PIL one would bring the pixels back to the CPU)."""
    from PIL import Image

    if device.type != "cuda":
        raise ConfigError(f"extract.image_pipeline gpu decodes images on the model's GPU, and extract.device is "
                          f"{device}: use image_pipeline cpu, or run on a GPU")
    encoded = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 100, 50)).save(encoded, format="JPEG")
    try:
        from torchvision.io import ImageReadMode, decode_jpeg

        decoded = decode_jpeg([torch.frombuffer(bytearray(encoded.getvalue()), dtype=torch.uint8)],
                              mode=ImageReadMode.RGB, device=device)
    except ImportError as exc:
        raise ConfigError(f"extract.image_pipeline gpu needs torchvision (built for this torch, with CUDA): {exc}"
                          ) from None
    except RuntimeError as exc:  # a torchvision built without nvJPEG, a CUDA it cannot use
        raise ConfigError(f"extract.image_pipeline gpu: torchvision cannot decode a JPEG on {device} ({exc})") from None
    try:  # the PIL backend cannot take a CUDA tensor (it converts to numpy), or hands back CPU pixels
        pixels = processor(images=decoded, return_tensors="pt")["pixel_values"]
        why = None if pixels.device.type == "cuda" else f"its pixels came back on {pixels.device}"
    except (TypeError, ValueError, RuntimeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why:
        raise ConfigError(f"extract.image_pipeline gpu: the model's image processor ({type(processor).__name__}) "
                          f"cannot process images on {device} ({why}): it needs transformers' torchvision backend "
                          "(install torchvision), or use image_pipeline cpu")
