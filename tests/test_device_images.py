"""extract.image_pipeline gpu (extract/device_images.py): which images go to nvJPEG as their bytes and
which the workers decode as the cpu pipeline does, the refusals made before the weights load, the
config hash, and on a CUDA machine with torchvision the parts it writes and the lut stage's inputs."""
from __future__ import annotations

import copy
import importlib.util
import io
import json
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tiny
from actstore.config import validate_config
from actstore.datasets import load_dataset
from actstore.errors import ConfigError
from actstore.extract import run_part
from actstore.extract.device_images import check_device_pipeline, device_image_batches, device_pixels, worker_image
from actstore.hashing import hashed_section, stage_hashes
from test_images import FILES, exif, photo, save

# The files of test_images' zoo that nvJPEG decodes to the opener's RGB: baseline three-channel JPEGs
# that their EXIF tag does not turn. Everything else (progressive, CMYK, gray, turned, PNG, ...) the
# workers decode.
NVJPEG_FILES = {"baseline.jpg", "smaller_than_crop.jpg", "exif_1.jpg"}
CUDA_AND_TORCHVISION = torch.cuda.is_available() and importlib.util.find_spec("torchvision") is not None


def write_folder(folder: Path, files: dict[str, bytes]) -> Path:
    (folder / "all").mkdir(parents=True)
    for name, data in files.items():
        (folder / "all" / name).write_bytes(data)
    return folder


@pytest.fixture(scope="module")
def processor(model_dir):
    from actstore.models import load_image_processor

    return load_image_processor(model_dir("dinov2"))


def cpu_pixels(processor, dataset, samples) -> torch.Tensor:
    """The cpu pipeline's pixel_values of `samples`, one image a processor call as the workers make them."""
    from actstore.extract.inputs import load_pixels

    return torch.cat([load_pixels(processor, dataset.opener, [sample]) for sample in samples])


def test_baseline_jpegs_go_as_their_bytes_and_every_other_image_as_the_cpu_pipelines_pixels(tmp_path, processor):
    dataset = load_dataset(write_folder(tmp_path / "zoo", FILES))
    sent = {}
    for sample in dataset.samples:
        image = worker_image(dataset.opener, processor, sample)
        name = Path(sample.text).name
        assert image.where.endswith(name)
        sent[name] = image.encoded
        if image.encoded:
            width, height = dataset.opener(sample).size
            assert image.data.dtype == torch.uint8 and image.data.numpy().tobytes() == FILES[name]
            assert image.decoded_bytes == 3 * width * height
        else:
            assert torch.equal(image.data, cpu_pixels(processor, dataset, [sample])[0]) and image.decoded_bytes == 0
    assert {name for name, encoded in sent.items() if encoded} == NVJPEG_FILES


def test_an_rgb_jpeg_by_adobes_marker_is_decoded_by_the_workers(tmp_path, processor):
    """A JPEG whose Adobe marker says its channels are RGB, not YCbCr (Pillow's keep_rgb): PIL
    honours the marker; the workers decode it rather than trust nvJPEG to."""
    files = {"rgb.jpg": save(photo(), "JPEG", keep_rgb=True), "ycbcr.jpg": save(photo(), "JPEG")}
    dataset = load_dataset(write_folder(tmp_path / "d", files))
    sent = {Path(s.text).name: worker_image(dataset.opener, processor, s) for s in dataset.samples}
    assert not sent["rgb.jpg"].encoded and sent["ycbcr.jpg"].encoded
    assert torch.equal(sent["rgb.jpg"].data, cpu_pixels(processor, dataset, dataset.samples[:1])[0])


def without_segment(jpeg: bytes, marker: int) -> bytes:
    """`jpeg` with its first segment of `marker` (0xEE: Adobe's APP14) left out."""
    at = 2  # after SOI
    while jpeg[at + 1] != marker:
        at += 2 + int.from_bytes(jpeg[at + 2:at + 4], "big")
    return jpeg[:at] + jpeg[at + 2 + int.from_bytes(jpeg[at + 2:at + 4], "big"):]


def test_an_rgb_jpeg_by_its_components_names_is_decoded_by_the_workers(tmp_path, processor):
    """No JFIF or Adobe marker, components named R, G, B: libjpeg (PIL) reads RGB, which nvJPEG
    would not be told; the workers decode it."""
    rgb = save(photo(), "JPEG", keep_rgb=True)
    files = {"named_rgb.jpg": without_segment(rgb, 0xEE), "adobe_rgb.jpg": rgb}
    dataset = load_dataset(write_folder(tmp_path / "d", files))
    sent = {Path(s.text).name: worker_image(dataset.opener, processor, s) for s in dataset.samples}
    assert not sent["named_rgb.jpg"].encoded
    assert torch.equal(sent["named_rgb.jpg"].data, cpu_pixels(processor, dataset, dataset.samples[1:])[0])
    adobe, named = (np.asarray(dataset.opener(sample)) for sample in dataset.samples)
    assert np.array_equal(named, adobe)  # libjpeg read both as RGB: the marker's absence changed nothing


def test_a_jpeg_not_ending_in_its_end_marker_is_decoded_by_the_workers(tmp_path, processor):
    """nvJPEG may decode what a cut file holds; the opener refuses it, naming the file. A JPEG with
    bytes after its end marker is decoded by the workers (as they decode every other file)."""
    whole = save(photo(64, 48), "JPEG", quality=90)
    dataset = load_dataset(write_folder(tmp_path / "d", {"cut.jpg": whole[:len(whole) // 2],
                                                         "appended.jpg": whole + b"trailer"}))
    by_name = {Path(s.text).name: s for s in dataset.samples}
    with pytest.raises(ConfigError, match=r"cut\.jpg: cannot decode the image"):
        worker_image(dataset.opener, processor, by_name["cut.jpg"])
    appended = worker_image(dataset.opener, processor, by_name["appended.jpg"])
    assert not appended.encoded
    assert torch.equal(appended.data, cpu_pixels(processor, dataset, [by_name["appended.jpg"]])[0])


def test_a_tables_and_a_tar_shards_images_go_as_their_stored_bytes(tmp_path, processor):
    jpeg = save(photo(), "JPEG", quality=90)
    turned = save(photo(), "JPEG", quality=90, exif=exif(6))
    (tmp_path / "table").mkdir()
    pq.write_table(pa.table({"image": [{"bytes": jpeg, "path": "a.jpg"}, {"bytes": turned, "path": "b.jpg"}],
                             "label": [0, 1]}), tmp_path / "table" / "train.parquet")
    (tmp_path / "tar").mkdir()
    with tarfile.open(tmp_path / "tar" / "shard-000000.tar", "w") as tar:
        for key, data in (("a", jpeg), ("b", turned)):
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    for data in (tmp_path / "table", tmp_path / "tar"):
        dataset = load_dataset(data)
        sent = [worker_image(dataset.opener, processor, sample) for sample in dataset.samples]
        assert [image.encoded for image in sent] == [True, False]
        assert sent[0].data.numpy().tobytes() == jpeg and dataset.opener.encoded(dataset.samples[1])[0] == turned
        assert torch.equal(sent[1].data, cpu_pixels(processor, dataset, dataset.samples[1:])[0])  # turned upright


def stand_in_decoder(data, mode, device):
    """torchvision.io.decode_jpeg's contract (a CPU uint8 bytes tensor, or a list of them, to RGB uint8
    (3, H, W) on `device`) kept by PIL's decoder: this machine has no torchvision."""
    from PIL import Image

    if isinstance(data, list):
        return [stand_in_decoder(one, mode, device) for one in data]
    rgb = Image.open(io.BytesIO(data.numpy().tobytes())).convert("RGB")
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).contiguous().to(device)


def test_a_batch_of_jpegs_and_other_images_keeps_its_order(tmp_path, processor, monkeypatch):
    """The JPEGs decoded (here by a stand-in for nvJPEG) and processed in one call, the workers'
    pixels of the rest put back between them in the images' order."""
    stand_in_torchvision(monkeypatch, stand_in_decoder)
    files = {f"img_{i}.{'jpg' if i % 3 else 'png'}": save(photo(seed=i), "JPEG" if i % 3 else "PNG")
             for i in range(7)}
    dataset = load_dataset(write_folder(tmp_path / "mixed", files))
    images = [worker_image(dataset.opener, processor, sample) for sample in dataset.samples]
    assert [image.encoded for image in images] == [bool(i % 3) for i in range(7)]
    assert torch.equal(device_pixels(processor, images, torch.device("cpu")),
                       cpu_pixels(processor, dataset, dataset.samples))


def test_the_loaders_batches_are_the_batches_images_in_order_whatever_the_workers(tmp_path, processor, caplog):
    """device_image_batches' workers and items (here on the CPU, with images no JPEG path takes):
    each batch is its images in order, for 0 and 2 workers; the log says how many went to the GPU's
    decoder."""
    files = {f"img_{i:02d}.png": save(photo(30 + 4 * i, 24, seed=i), "PNG") for i in range(21)}
    dataset = load_dataset(write_folder(tmp_path / "pngs", files))
    batches = [[20, 3, 4] + list(range(5, 20)), [0, 1, 2]]  # 18 images: an item of IMAGES_PER_ITEM (16) and one of 2
    for workers in (0, 2):
        with caplog.at_level("INFO", logger="actstore.extract.device_images"):
            got = list(device_image_batches(processor, dataset.opener, dataset.samples, batches, workers,
                                            torch.device("cpu"), torch.float32))
        assert len(got) == 2 and all(len(items) == 1 for items in got)
        for (pixels,), batch in zip(got, batches):
            assert torch.equal(pixels, cpu_pixels(processor, dataset, [dataset.samples[i] for i in batch]))
    assert "0 of 21 images decoded on the GPU" in caplog.text


def test_the_workers_start_reading_when_the_loader_is_made(tmp_path, model_dir, monkeypatch):
    """As the cpu pipeline's: run_part makes the loader before the weights load, and the workers read
    the first images meanwhile (an image part's bound), not when the model asks for the first batch."""
    import actstore.extract.device_images as device_images
    from actstore.models import load_image_processor

    started = tmp_path / "started"

    def noting(opener, processor, sample):
        started.touch()  # in the worker process: a file, seen from here
        return worker_image(opener, processor, sample)
    monkeypatch.setattr(device_images, "worker_image", noting)
    files = {f"img_{i}.png": save(photo(seed=i), "PNG") for i in range(4)}
    dataset = load_dataset(write_folder(tmp_path / "pngs", files))
    batches = device_image_batches(load_image_processor(model_dir("dinov2")), dataset.opener, dataset.samples,
                                   [[0, 1], [2, 3]], 2, torch.device("cpu"), torch.float32)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "no worker read an image before the first batch was asked for"
    assert len(list(batches)) == 2


def pngs(tmp_path: Path, n: int, bad: int | None = None):
    files = {f"img_{i:02d}.png": save(photo(seed=i), "PNG") for i in range(n)}
    if bad is not None:
        files[f"img_{bad:02d}.png"] = files[f"img_{bad:02d}.png"][:60]  # cut inside its pixels
    return load_dataset(write_folder(tmp_path / "pngs", files))


def decoding_thread_ended(timeout: float = 30) -> bool:
    from actstore.extract.device_images import DECODING_THREAD

    deadline = time.monotonic() + timeout
    while any(t.name == DECODING_THREAD for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not any(t.name == DECODING_THREAD for t in threading.enumerate())


def test_the_decoding_thread_holds_at_most_ahead_bytes_and_hands_batches_in_order(tmp_path, model_dir, monkeypatch):
    """With room for one batch, the thread decodes one batch ahead of the model and a second it waits
    to hand over, never the part: the GPU memory the batches waiting take is bounded."""
    import actstore.extract.device_images as device_images
    from actstore.extract.inputs import load_pixels
    from actstore.models import load_image_processor

    made = []
    monkeypatch.setattr(device_images, "AHEAD_BYTES", 1)
    monkeypatch.setattr(device_images, "device_pixels", lambda *args: made.append(1) or device_pixels(*args))
    dataset = pngs(tmp_path, 12)
    processor = load_image_processor(model_dir("dinov2"))
    batches = [[i, i + 1] for i in range(0, 12, 2)]
    handed = device_image_batches(processor, dataset.opener, dataset.samples, batches, 0, torch.device("cpu"),
                                  torch.float32)
    deadline = time.monotonic() + 30  # the first batch's processor call may be slow on a busy machine
    while len(made) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # room for a third, were the thread not waiting
    assert len(made) == 2
    for (pixels,), batch in zip(handed, batches, strict=True):
        assert torch.equal(pixels, load_pixels(processor, dataset.opener, [dataset.samples[i] for i in batch]))
    assert len(made) == 6 and decoding_thread_ended()


def test_an_image_the_decoding_thread_cannot_decode_is_named_in_the_models_thread(tmp_path, model_dir):
    from actstore.models import load_image_processor

    dataset = pngs(tmp_path, 6, bad=3)
    handed = device_image_batches(load_image_processor(model_dir("dinov2")), dataset.opener, dataset.samples,
                                  [[0, 1], [2, 3], [4, 5]], 2, torch.device("cpu"), torch.float32)
    assert len(next(handed)[0]) == 2
    with pytest.raises(ConfigError, match=r"img_03\.png: cannot decode the image"):
        next(handed)
    assert decoding_thread_ended()


def test_a_batch_the_gpu_has_no_memory_to_decode_is_named_with_what_to_change(tmp_path, processor, monkeypatch):
    import actstore.extract.device_images as device_images

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(device_images, "device_pixels", out_of_memory)
    dataset = pngs(tmp_path, 2)
    handed = device_image_batches(processor, dataset.opener, dataset.samples, [[0, 1]], 0, torch.device("cpu"),
                                  torch.float32)
    with pytest.raises(ConfigError, match=r"ran out of memory decoding .* lower extract\.batch_size"):
        next(handed)


@pytest.mark.parametrize("taken", [0, 1])
def test_a_part_that_stops_early_stops_the_decoding_thread(tmp_path, model_dir, monkeypatch, taken):
    """The model's side failing (out of memory, a full disk) drops the batches, taken from or not:
    the thread, waiting for room, stops rather than wait forever holding GPU memory and its workers."""
    import gc

    import actstore.extract.device_images as device_images
    from actstore.models import load_image_processor

    monkeypatch.setattr(device_images, "AHEAD_BYTES", 1)
    dataset = pngs(tmp_path, 40)
    handed = device_image_batches(load_image_processor(model_dir("dinov2")), dataset.opener, dataset.samples,
                                  [[i, i + 1] for i in range(0, 40, 2)], 0, torch.device("cpu"), torch.float32)
    time.sleep(0.5)  # the thread waits for room
    for _ in range(taken):
        next(handed)
    del handed
    gc.collect()
    assert decoding_thread_ended()


def test_a_batch_is_decoded_in_groups_of_bounded_bytes_with_the_same_pixels(tmp_path, processor, monkeypatch):
    """A batch's JPEGs go to the decoder (here a stand-in for nvJPEG) and the processor in consecutive
    groups of at most DECODE_BYTES decoded bytes (an image larger than that alone), with the pixels
    of one call; the workers' processed images take none of those bytes."""
    import actstore.extract.device_images as device_images

    stand_in_torchvision(monkeypatch, stand_in_decoder)
    widths = [40, 40, 200, 40, 40, 40, 40]
    files = {f"img_{i}.jpg": save(photo(width, 30, seed=i), "JPEG", quality=90) for i, width in enumerate(widths)}
    files["img_7.png"] = save(photo(300, 30), "PNG")
    dataset = load_dataset(write_folder(tmp_path / "jpegs", files))
    images = [worker_image(dataset.opener, processor, sample) for sample in dataset.samples]
    monkeypatch.setattr(device_images, "DECODE_BYTES", 3 * 30 * 40 * 2)
    assert [len(group) for group in device_images.decoding_groups(images)] == [2, 1, 2, 3]
    assert torch.equal(device_pixels(processor, images, torch.device("cpu")),
                       cpu_pixels(processor, dataset, dataset.samples))


def stand_in_torchvision(monkeypatch, decode_jpeg) -> None:
    """torchvision.io as device_images imports it, its decode_jpeg replaced (this machine may have none)."""
    import types

    io_module = types.ModuleType("torchvision.io")
    io_module.decode_jpeg, io_module.ImageReadMode = decode_jpeg, types.SimpleNamespace(RGB="RGB")
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(io=io_module))
    monkeypatch.setitem(sys.modules, "torchvision.io", io_module)


@pytest.mark.parametrize("failure", ["Error while decoding JPEG images: CUDA out of memory. Tried to allocate 2.00 MiB",
                                     "Error while decoding JPEG images: Failed to decode batch: 5"])
def test_a_jpeg_nvjpeg_has_no_gpu_memory_for_is_named_not_decoded_on_the_cpu(tmp_path, monkeypatch, processor,
                                                                             failure):
    """Out of GPU memory (torch's allocator, or nvJPEG's status 5) is the moment's, not the image's: the
    opener's pixels in its place would make the part's bytes depend on what else held memory."""
    from actstore.extract.device_images import nvjpeg

    def failing(data, mode, device):
        raise RuntimeError(failure)
    stand_in_torchvision(monkeypatch, failing)
    dataset = load_dataset(write_folder(tmp_path / "d", {"a.jpg": save(photo(), "JPEG", quality=90)}))
    with pytest.raises(ConfigError, match=r"a\.jpg: nvJPEG ran out of GPU memory .*extract\.batch_size"):
        nvjpeg([worker_image(dataset.opener, processor, dataset.samples[0])], torch.device("cpu"))


def test_a_jpeg_nvjpeg_refuses_is_decoded_by_the_opener(tmp_path, monkeypatch, processor, caplog):
    from actstore.extract.device_images import nvjpeg

    def refusing(data, mode, device):
        raise RuntimeError("Error while decoding JPEG images: Failed to decode jpeg stream: 4")
    stand_in_torchvision(monkeypatch, refusing)
    dataset = load_dataset(write_folder(tmp_path / "d", {"a.jpg": save(photo(), "JPEG", quality=90)}))
    (pixels,) = nvjpeg([worker_image(dataset.opener, processor, dataset.samples[0])], torch.device("cpu"))
    assert torch.equal(pixels, torch.from_numpy(np.array(dataset.opener(dataset.samples[0]))).permute(2, 0, 1))
    assert "a.jpg: nvJPEG cannot decode it" in caplog.text


def test_the_gpu_pipeline_is_refused_off_a_gpu_before_the_weights_load(tmp_path, model_dir, image_folder,
                                                                       monkeypatch):
    import actstore.extract.run as ex
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    config = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder,
                              extract={"parts": 1, "device": "cpu", "image_pipeline": "gpu"})
    with pytest.raises(ConfigError, match="extract.image_pipeline gpu .* extract.device is cpu"):
        run_part(config, 0, tmp_path / "part-0000", progress=False)
    assert not (tmp_path / "part-0000").exists()


def test_the_gpu_pipeline_is_refused_on_texts(tmp_path, model_dir, text_jsonl, monkeypatch):
    import actstore.extract.run as ex
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, extract={"image_pipeline": "gpu"})
    with pytest.raises(ConfigError, match="image_pipeline gpu decodes images, and the dataset is text"):
        run_part(config, 0, tmp_path / "part-0000", progress=False)


@pytest.mark.skipif(CUDA_AND_TORCHVISION, reason="this machine can run the gpu pipeline")
def test_check_device_pipeline_names_what_is_missing(model_dir):
    from actstore.models import load_image_processor

    processor = load_image_processor(model_dir("dinov2"))
    with pytest.raises(ConfigError, match="extract.device is cpu"):
        check_device_pipeline(processor, torch.device("cpu"))


def test_the_cpu_pipeline_keeps_every_earlier_hash_and_the_gpu_one_hashes_apart(tmp_path, model_dir, image_folder):
    config = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder)
    assert config["extract"]["image_pipeline"] == "cpu" and "image_pipeline" not in hashed_section(config, "extract")
    earlier = copy.deepcopy(config)  # what an earlier release's validated config held: no such key
    del earlier["extract"]["image_pipeline"]
    assert stage_hashes(config) == stage_hashes(earlier)
    gpu = validate_config(json.loads(json.dumps(config)) | {"extract": {**config["extract"], "image_pipeline": "gpu"}})
    assert stage_hashes(gpu)["extract"] != stage_hashes(config)["extract"]


def test_the_lut_stage_refuses_gpu_decoded_images_off_a_gpu(tmp_path, model_dir, image_folder):
    from actstore.lut import build_lut

    config = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder,
                              extract={"image_pipeline": "gpu"}, lut={"device": "cpu"})
    with pytest.raises(ConfigError, match="lut.device cpu: .*extract.image_pipeline gpu"):
        build_lut(config, tmp_path / "extract", tmp_path / "no-sae", tmp_path / "lut")


# --- On a CUDA machine with torchvision (gpu_suite.sh's CUDA tests). ---

def jpeg_folder(folder: Path, n: int = 7) -> Path:
    """n photographs as baseline JPEGs, and a PNG and an EXIF-turned JPEG the workers decode."""
    files = {f"img_{i:02d}.jpg": save(photo(96 + 8 * i, 72, seed=i), "JPEG", quality=90) for i in range(n)}
    files |= {"rgb.png": save(photo(80, 60, seed=99), "PNG"),
              "turned.jpg": save(photo(80, 60, seed=98), "JPEG", quality=90, exif=exif(6))}
    return write_folder(folder, files)


@pytest.mark.skipif(not CUDA_AND_TORCHVISION, reason="needs a CUDA device and torchvision")
def test_cuda_gpu_pipeline_parts_are_the_models_outputs_on_its_pixels_whatever_the_workers(tmp_path, model_dir):
    from actstore.extract import capture, length_batches
    from actstore.formats.extract import open_part
    from actstore.models import load_model

    data = jpeg_folder(tmp_path / "images")
    parts, metas = [], []
    for workers in (0, 2):
        config = tiny.make_config(tmp_path, model_dir("dinov2"), data, extract={
            "parts": 1, "num_workers": workers, "batch_size": 4, "device": "cuda", "image_pipeline": "gpu"})
        out = tmp_path / f"w{workers}" / "part-0000"
        metas.append(run_part(config, 0, out, progress=False))
        parts.append({p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "part.json"})
    assert parts[0] == parts[1] and metas[0]["image_pipeline"] == "gpu"
    dataset = load_dataset(data)
    loaded = load_model(config["model"]["path"], "float32", "cuda")
    part = open_part(tmp_path / "w0" / "part-0000")
    with capture(loaded, [0, 2], []) as captured, torch.inference_mode():
        for batch in length_batches([1] * len(dataset.samples), 4):
            images = [worker_image(dataset.opener, loaded.preprocessor, dataset.samples[i]) for i in batch]
            loaded.model(pixel_values=device_pixels(loaded.preprocessor, images, loaded.device))
            for name, tensor in captured.items():
                raw = part.tensor(name).raw
                for row, i in enumerate(batch):
                    assert np.array_equal(np.asarray(raw[part.sample_slice(i)]), tensor[row].cpu().numpy()), (name, i)


@pytest.mark.skipif(not CUDA_AND_TORCHVISION, reason="needs a CUDA device and torchvision")
def test_cuda_gpu_pipeline_pixels_are_near_the_cpu_pipelines(tmp_path, model_dir):
    from actstore.extract.inputs import image_batch
    from actstore.models import load_model

    dataset = load_dataset(jpeg_folder(tmp_path / "images"))
    loaded = load_model(model_dir("dinov2"), "float32", "cuda")
    check_device_pipeline(loaded.preprocessor, loaded.device)
    gpu = image_batch(loaded, dataset, dataset.samples, "gpu")["pixel_values"]
    cpu = image_batch(loaded, dataset, dataset.samples, "cpu")["pixel_values"]
    assert gpu.shape == cpu.shape and not torch.equal(gpu, cpu)
    assert float((gpu - cpu).abs().mean()) < 0.05
