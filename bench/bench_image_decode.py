"""Would decoding and processing images on the GPU feed a ViT faster than the CPU workers do? Measured before it is built.

An image part's bound on a GPU node is the CPU: decoding the JPEGs and running the model's image
processor in extract.num_workers processes (1,300-2,000 images/s on 13 of an H100 node's 16 cores,
sessions 40-44) against 5,800-7,100 images/s of ViT-B/14 forward. Issue 14 welcomes an optional
GPU path (extract.image_pipeline: gpu) if it measures faster, never as the default: its pixels are not
the CPU processor's bits. This bench measures it on bench_extract's vit-b14 row (its generated
500x375 JPEGs, its model and BitImageProcessor), in --repeat interleaved rounds, best of each:
  cpu:     the job's own loader (extract.inputs.image_batches: --workers decoding processes, the
           processor on PIL images, pinned, in the model's dtype) to the device
  gpu:     the files' bytes read by a thread pool, each batch decoded on the device by nvJPEG
           (torchvision.io.decode_jpeg, device="cuda") and processed there by the job's processor
           (transformers' torchvision backend on CUDA tensors), in the model's dtype
  hybrid:  the workers decode only (the job's opener: EXIF orientation, RGB, 8 bits), the uint8
           images go to the device pinned, and the processor runs there (nvJPEG may leave Huffman
           decoding on the CPU; this keeps the decode the CPU path's and moves the rest)
  forward: the model alone on batches already on the device (the bound every path feeds)
  gpu+forward, hybrid+forward: that path and the forward, batch after batch, as run_part would
and how far each device path's pixels are from the cpu path's, in normalised units (max and mean of
the absolute difference; the issue measured 0.12 at most). Needs CUDA and torchvision for the device
rows; without them only the cpu and forward rows run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_extract import bench_config, sync  # noqa: E402

from actstore.datasets.images import check_images  # noqa: E402
from actstore.extract.inputs import image_batches, length_batches, to_model  # noqa: E402
from actstore.extract.run import preflight  # noqa: E402
from actstore.io_utils import lower_priority  # noqa: E402
from actstore.models import TORCH_DTYPES, load_image_processor, load_model  # noqa: E402
from actstore.resources import IMAGES_PER_ITEM, items_ahead  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def cpu_rate(processor, dataset, batches, workers: int, loaded) -> tuple[float, torch.Tensor]:
    """Seconds for the job's loader to put every batch on the device; the first batch's pixels."""
    started, first = time.perf_counter(), None
    pixels = image_batches(processor, dataset.opener, dataset.samples, batches, workers,
                           loaded.device.type == "cuda", loaded.model.dtype)
    for inputs in to_model(loaded, pixels):
        first = inputs["pixel_values"] if first is None else first
    sync(loaded.device)
    return time.perf_counter() - started, first


def file_bytes(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def gpu_batches(processor, paths: list[Path], batches, device: torch.device, dtype: torch.dtype, reads: int):
    """Each batch's pixels decoded and processed on `device`, its files read ahead by `reads` threads."""
    from torchvision.io import ImageReadMode, decode_jpeg
    with ThreadPoolExecutor(reads) as pool:
        pending = [pool.map(file_bytes, [paths[i] for i in batch]) for batch in batches]  # all queued at once
        for read in pending:
            images = decode_jpeg(list(read), mode=ImageReadMode.RGB, device=device)
            yield processor(images=images, return_tensors="pt")["pixel_values"].to(dtype)


class Decoded(torch.utils.data.Dataset):
    """Item = a few images of a batch decoded by the job's opener, as uint8 (3, H, W) tensors."""

    def __init__(self, opener, samples):
        self.opener, self.samples = opener, samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: list[int]) -> list[torch.Tensor]:
        return [torch.from_numpy(np.array(self.opener(self.samples[i]))).permute(2, 0, 1) for i in item]


def hybrid_batches(processor, dataset, batches, workers: int, device: torch.device, dtype: torch.dtype):
    """Each batch decoded by the workers (items of IMAGES_PER_ITEM, as image_batches), processed on `device`."""
    items = [[batch[i:i + IMAGES_PER_ITEM] for i in range(0, len(batch), IMAGES_PER_ITEM)] for batch in batches]
    loader = iter(torch.utils.data.DataLoader(
        Decoded(dataset.opener, dataset.samples), sampler=[item for batch in items for item in batch],
        batch_size=None, num_workers=workers, pin_memory=True,
        prefetch_factor=items_ahead(max(map(len, batches)), workers), worker_init_fn=lower_priority))
    for batch in items:
        images = [image.to(device, non_blocking=True) for _ in batch for image in next(loader)]
        yield processor(images=images, return_tensors="pt")["pixel_values"].to(dtype)


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--limit", type=int, default=1024, help="images")
    parser.add_argument("--workers", type=int, default=max(1, len(os.sched_getaffinity(0)) - 3),
                        help="the cpu path's decoding processes (default: the CPUs less 3, as gpu_suite's vit13 row)")
    parser.add_argument("--reads", type=int, default=4, help="the gpu path's file-reading threads")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT / "image_decode.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-image-decode-") as tmp:
        options = SimpleNamespace(shape="vit-b14", device=args.device, limit=args.limit, all_layers=False, buffers=3,
                                  writer_threads=None, num_workers=args.workers, no_token_logprobs=False)
        config = bench_config(options, Path(tmp))
        model_path, dataset = preflight(config, 0)
        check_images(dataset.opener, dataset.samples, args.workers)
        processor = load_image_processor(model_path)
        loaded = load_model(model_path, config["model"]["torch_dtype"], args.device)
        dtype = TORCH_DTYPES[config["model"]["torch_dtype"]]
        batches = length_batches([1] * len(dataset.samples), config["extract"]["batch_size"])
        paths = [dataset.opener.source.root / s.text for s in dataset.samples]
        result = run(args, processor, dataset, batches, paths, loaded, dtype)
    result.update(device=torch.cuda.get_device_name() if loaded.device.type == "cuda" else "cpu",
                  images=len(paths), workers=args.workers, reads=args.reads, processor=type(processor).__name__)
    for key, value in result.items():
        print(f"{key:28s} {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


def run(args, processor, dataset, batches, paths, loaded, dtype) -> dict:
    gpu = loaded.device.type == "cuda" and importlib.util.find_spec("torchvision") is not None
    ways = {"gpu": lambda chosen: gpu_batches(processor, paths, chosen, loaded.device, dtype, args.reads),
            "hybrid": lambda chosen: hybrid_batches(processor, dataset, chosen, args.workers, loaded.device, dtype)}
    rounds: dict[str, list[float]] = {}
    failed: dict[str, str] = {}  # a device way that raised (an API this node's torchvision or transformers lacks)
    forward_inputs, first_cpu = None, None
    with torch.inference_mode():
        for _ in range(args.repeat):
            seconds, first_cpu = cpu_rate(processor, dataset, batches, args.workers, loaded)
            rounds.setdefault("cpu", []).append(seconds)
            if forward_inputs is None:
                forward_inputs = list(to_model(loaded, image_batches(processor, dataset.opener, dataset.samples,
                                                                     batches, args.workers, gpu, dtype)))
            rounds.setdefault("forward", []).append(timed(lambda: drain(forward_inputs, loaded.model, loaded.device)))
            for way, pixels in ways.items() if gpu else ():
                if way in failed:
                    continue
                try:
                    alone = timed(lambda: drain(pixels(batches), None, loaded.device))
                    fed = timed(lambda: drain(pixels(batches), loaded.model, loaded.device))
                except Exception as exc:  # noqa: BLE001 - recorded, the other ways go on
                    failed[way] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                rounds.setdefault(way, []).append(alone)
                rounds.setdefault(f"{way}+forward", []).append(fed)
        result: dict = {f"{way}_rounds_s": [round(s, 3) for s in seconds] for way, seconds in rounds.items()}
        result.update({f"{way}_images_per_s": round(len(paths) / min(seconds)) for way, seconds in rounds.items()})
        result.update({f"{way}_error": error for way, error in failed.items()})
        if not gpu:
            result["gpu"] = "not run: needs CUDA and torchvision"
        for way, pixels in ways.items() if gpu else ():
            if way not in failed:
                result.update(pixel_difference(way, next(pixels(batches[:1])), first_cpu))
    return result


def pixel_difference(way: str, first: torch.Tensor, first_cpu: torch.Tensor) -> dict:
    """How far a device way's first batch is from the cpu path's, in normalised units."""
    if first.shape != first_cpu.shape:
        return {f"pixels_{way}_shape": f"{tuple(first.shape)}, the cpu path's {tuple(first_cpu.shape)}"}
    difference = (first.float() - first_cpu.float()).abs()
    return {f"pixels_{way}_max_abs_difference": round(float(difference.max()), 4),
            f"pixels_{way}_mean_abs_difference": round(float(difference.mean()), 5),
            f"pixels_{way}_equal": bool(torch.equal(first, first_cpu))}


def drain(pixels, model, device: torch.device) -> None:
    """Every batch of `pixels` (pixel tensors or model inputs) made, and run through `model` when given;
    the device synchronised."""
    for inputs in pixels:
        if model is not None:
            model(**inputs) if isinstance(inputs, dict) else model(pixel_values=inputs)
    sync(device)


if __name__ == "__main__":
    main()
