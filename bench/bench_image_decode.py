"""How fast each image pipeline feeds a ViT: extract.image_pipeline cpu against gpu, and the model alone.

An image part's bound on a GPU node is the CPU: decoding the JPEGs and running the model's image
processor in extract.num_workers processes (1,300-2,000 images/s on 13 of an H100 node's 16 cores,
sessions 40-44) against 5,800-7,100 images/s of ViT-B/14 forward. extract.image_pipeline gpu decodes
the JPEGs on the device instead (extract/device_images.py); it is never the default, its pixels not
being the cpu pipeline's bits. This bench measures both on bench_extract's vit-b14 row (its generated
500x375 JPEGs, its model and BitImageProcessor), in --repeat interleaved rounds, best of each:
  cpu:     extract.image_pipeline cpu (extract.inputs.image_batches: --workers decoding processes,
           the processor on PIL images, pinned, in the model's dtype) to the device
  gpu:     extract.image_pipeline gpu (extract.device_images.device_image_batches: --workers
           processes read the files and look at their headers; each batch's JPEGs decoded on the
           device by nvJPEG and processed there by the job's processor)
  forward: the model alone on batches already on the device (the bound every path feeds)
  gpu+forward: the gpu pipeline and the forward, as run_part runs them (its decoding thread beside it)
  pil, pil+forward: where transformers picked its torchvision backend for the processor (a GPU node),
           the cpu pipeline with the same processor's PIL backend instead (use_fast=False): which
           backend decodes faster in the workers, and how far its pixels are
and how far the gpu pipeline's pixels are from the cpu one's, in normalised units (max and mean of
the absolute difference; session 52 measured 0.58 and 0.0115). Needs CUDA and torchvision for the
gpu rows; without them only the cpu and forward rows run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoImageProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_extract import bench_config, sync  # noqa: E402

from actstore.datasets.images import check_images  # noqa: E402
from actstore.extract.device_images import device_image_batches  # noqa: E402
from actstore.extract.inputs import image_batches, length_batches, to_model  # noqa: E402
from actstore.extract.run import preflight  # noqa: E402
from actstore.models import TORCH_DTYPES, load_image_processor, load_model  # noqa: E402

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


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--limit", type=int, default=1024, help="images")
    parser.add_argument("--workers", type=int, default=max(1, len(os.sched_getaffinity(0)) - 3),
                        help="either pipeline's worker processes (default: the CPUs less 3, as gpu_suite's vit13 row)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT / "image_decode.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-image-decode-") as tmp:
        options = SimpleNamespace(shape="vit-b14", device=args.device, limit=args.limit, all_layers=False, buffers=3,
                                  writer_threads=None, num_workers=args.workers, no_token_logprobs=False,
                                  image_pipeline="cpu")
        config = bench_config(options, Path(tmp))
        model_path, dataset = preflight(config, 0)
        check_images(dataset.opener, dataset.samples, args.workers)
        processor = load_image_processor(model_path)
        loaded = load_model(model_path, config["model"]["torch_dtype"], args.device)
        dtype = TORCH_DTYPES[config["model"]["torch_dtype"]]
        batches = length_batches([1] * len(dataset.samples), config["extract"]["batch_size"])
        pil_processor = AutoImageProcessor.from_pretrained(model_path, use_fast=False, local_files_only=True)
        result = run(args, processor, pil_processor, dataset, batches, loaded, dtype)
    result.update(device=torch.cuda.get_device_name() if loaded.device.type == "cuda" else "cpu",
                  images=len(dataset.samples), workers=args.workers, processor=type(processor).__name__,
                  pil_processor=type(pil_processor).__name__)
    for key, value in result.items():
        print(f"{key:28s} {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


def run(args, processor, pil_processor, dataset, batches, loaded, dtype) -> dict:
    gpu = loaded.device.type == "cuda" and importlib.util.find_spec("torchvision") is not None
    ways = {"gpu": lambda chosen: to_model(loaded, device_image_batches(
        processor, dataset.opener, dataset.samples, chosen, args.workers, loaded.device, dtype))} if gpu else {}
    if type(pil_processor) is not type(processor):  # the cpu pipeline with transformers' PIL backend
        ways["pil"] = lambda chosen: to_model(loaded, image_batches(
            pil_processor, dataset.opener, dataset.samples, chosen, args.workers, gpu, dtype))
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
            for way, pixels in ways.items():
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
        result.update({f"{way}_images_per_s": round(len(dataset.samples) / min(seconds))
                       for way, seconds in rounds.items()})
        result.update({f"{way}_error": error for way, error in failed.items()})
        if not gpu:
            result["gpu"] = "not run: needs CUDA and torchvision"
        for way, pixels in ways.items():
            if way not in failed:
                result.update(pixel_difference(way, next(pixels(batches[:1]))["pixel_values"], first_cpu))
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
    """Every batch of `pixels` (model inputs) made, and run through `model` when given; the device
    synchronised."""
    for inputs in pixels:
        if model is not None:
            model(**inputs)
    sync(device)


if __name__ == "__main__":
    main()
