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
  forward: the model alone on batches already on the device (the bound either path feeds)
  gpu+forward: the gpu path and the forward, batch after batch on one stream, as run_part would
and how far the gpu path's pixels are from the cpu path's, in normalised units (max and mean of the
absolute difference; the issue measured 0.12 at most). Needs CUDA and torchvision for the gpu rows;
without them only the cpu row runs.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_extract import bench_config, sync  # noqa: E402

from actstore.datasets.images import check_images  # noqa: E402
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
    rounds: dict[str, list[float]] = {}
    forward_inputs, first_cpu = None, None
    with torch.inference_mode():
        for _ in range(args.repeat):
            seconds, first_cpu = cpu_rate(processor, dataset, batches, args.workers, loaded)
            rounds.setdefault("cpu", []).append(seconds)
            if forward_inputs is None:
                forward_inputs = list(to_model(loaded, image_batches(processor, dataset.opener, dataset.samples,
                                                                     batches, args.workers, gpu, dtype)))

            def forward() -> None:
                for inputs in forward_inputs:
                    loaded.model(**inputs)
                sync(loaded.device)
            rounds.setdefault("forward", []).append(timed(forward))
            if not gpu:
                continue

            def decode() -> None:
                for _ in gpu_batches(processor, paths, batches, loaded.device, dtype, args.reads):
                    pass
                sync(loaded.device)

            def decode_and_forward() -> None:
                for pixel_values in gpu_batches(processor, paths, batches, loaded.device, dtype, args.reads):
                    loaded.model(pixel_values=pixel_values)
                sync(loaded.device)
            rounds.setdefault("gpu", []).append(timed(decode))
            rounds.setdefault("gpu+forward", []).append(timed(decode_and_forward))
    result: dict = {f"{way}_rounds_s": [round(s, 3) for s in seconds] for way, seconds in rounds.items()}
    result.update({f"{way}_images_per_s": round(len(paths) / min(seconds)) for way, seconds in rounds.items()})
    if gpu:
        first_gpu = next(gpu_batches(processor, paths, batches[:1], loaded.device, dtype, args.reads))
        difference = (first_gpu.float() - first_cpu.float()).abs()
        result.update(pixels_max_abs_difference=round(float(difference.max()), 4),
                      pixels_mean_abs_difference=round(float(difference.mean()), 5),
                      pixels_shape_equal=first_gpu.shape == first_cpu.shape)
    else:
        result["gpu"] = "not run: needs CUDA and torchvision"
    return result


if __name__ == "__main__":
    main()
