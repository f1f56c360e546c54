"""Extraction throughput against the bounds measured in the same run.

Shapes: `minilm` (the demo model and corpus, CPU), `llama-1b` and `vit-b14` (random weights of
those shapes, bf16 on CUDA; a BPE tokenizer trained on the stdlib corpus; generated 500x375 JPEGs),
`wide-vocab` (a small Llama with Gemma 3's 262,144-token vocabulary, 128-token texts: where the LM
head, not the blocks, is the work; `--no-token-logprobs` runs it at each text's last token only).
Reported: the fsync'd sequential write bandwidth of the output disk, GPU-only forward (inputs
already on the device), bare forward (tokenize / decode included), image loading with the job's
CPUs, extraction (`run_part`), bytes written, and the goals:
  text:   extraction time <= 1.2 x max(bare forward time, bytes written / write bandwidth)
  images: extraction rate >= 0.8 x min(GPU-only rate, image loading rate, disk-bound rate)
  minilm: extraction time / bare forward time <= 1.15
`--synthetic` feeds the same write pipeline from a producer emitting tensors at memory speed
(random lengths, batched by length like real text): written bytes/s >= 0.8 x write bandwidth; with
`--synthetic-rate B` the producer emits B bytes/s like a model slower than the disk, and the time is
held to the text goal (<= 1.2 x the slower bound); `synthetic_tail_s` is what remains after the last
batch (drain: writes and hashing; close: fsync and part.json).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import resource
import shutil
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from actstore import io_utils
from actstore.config import validate_config
from actstore.datasets import configured_scan, write_scan
from actstore.datasets.images import check_images
from actstore.extract import length_batches, logprobs, preflight, run_part, tokenize
from actstore.extract.device_images import device_image_batches
from actstore.extract.inputs import image_batches, text_batches, to_model
from actstore.extract.pipeline import BatchRows, WritePipeline
from actstore.formats.extract import PartWriter
from actstore.io_utils import start_writeback
from actstore.memwatch import machine_available_gb
from actstore.model_config import run_dtype
from actstore.models import TORCH_DTYPES, load_image_processor, load_model, weights_to_device

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "data" / "stdlib_docs.jsonl"
SHAPES = {
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=32000, max_position_embeddings=2048),
    "wide-vocab": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                       intermediate_size=2048, vocab_size=262144, max_position_embeddings=2048),
    "vit-b14": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, patch_size=14, image_size=224,
                    mlp_ratio=4),
}
# --synthetic write patterns: text as the llama-1b row (4 layers); vit-b14 as its row (2 layers, 257 tokens an image)
SYNTHETIC_SHAPES = {"text": dict(d=2048, tensors=4, batch=32, tokens=(64, 512)),
                    "vit-b14": dict(d=768, tensors=2, batch=64, tokens=(257, 257))}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_bandwidth(directory: Path, n_bytes: int) -> float:
    """Sequential write of n_bytes in 64 MiB blocks, the disk started on each block as it is
    written (as the part writer does), one fsync at the end: bytes/s."""
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    path = directory / "bandwidth.bin"
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        for _ in range(max(1, n_bytes // len(block))):
            fh.write(block)
            start_writeback(fh.fileno())
        os.fsync(fh.fileno())
    elapsed = time.perf_counter() - started
    size = path.stat().st_size
    path.unlink()
    return size / elapsed


def long_texts(path: Path, n: int, chars: int = 3000) -> Path:
    """n texts of ~`chars` characters: stdlib docstrings concatenated."""
    docs = [json.loads(line)["text"] for line in CORPUS.open()]
    rows, i = [], 0
    for _ in range(n):
        text = ""
        while len(text) < chars:
            text += docs[i % len(docs)] + "\n"
            i += 1
        rows.append({"text": text})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jpeg_folder(root: Path, n: int) -> Path:
    """n 500x375 JPEGs (smooth gradients plus noise, so they compress like photographs), made by one
    process per CPU (~25 ms an image: 4,096 took 100 s of a GPU lease on one core)."""
    for label in range(4):
        (root / f"c{label}").mkdir(parents=True, exist_ok=True)
    # spawn: the bench process already holds CUDA and torch's threads, which a fork would copy
    with ProcessPoolExecutor(len(os.sched_getaffinity(0)), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(save_jpeg, [root] * n, range(n), chunksize=64))
    return root


def save_jpeg(root: Path, i: int) -> None:
    """Image i of jpeg_folder, its noise seeded by i (the same bytes whatever the process count)."""
    from PIL import Image
    yy, xx = np.mgrid[0:375, 0:500]
    base = (np.stack([xx * (i % 7 + 1), yy * (i % 5 + 1), xx + yy], -1) / 4) % 256
    pixels = np.clip(base + np.random.default_rng(i).normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(root / f"c{i % 4}" / f"img_{i:05d}.jpg", quality=90)


def build_model(shape: str, out: Path, device: torch.device) -> Path:
    """A model of `shape` with random weights (bf16 on CUDA, float32 on CPU) saved to `out`."""
    import transformers as tf
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if shape in ("llama-1b", "wide-vocab"):
        train_tokenizer(out, SHAPES[shape]["vocab_size"])
        with torch.device(device):
            model = tf.LlamaForCausalLM(tf.LlamaConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0, **SHAPES[shape]))
    else:
        tf.BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
                             do_center_crop=True).save_pretrained(out)
        with torch.device(device):
            model = tf.Dinov2Model(tf.Dinov2Config(**SHAPES[shape]))
    model.to(dtype).eval().save_pretrained(out)
    return out


def check_items(work: Path, n: int = 40) -> bool:
    """Do the ViT image processors give the same pixels for a batch processed whole and in loader items
    (extract.inputs: IMAGES_PER_ITEM at a time)? tests/test_extract.py asks it of the PIL processors
    installed here; a GPU image's transformers uses torchvision-backed ones."""
    import transformers as tf
    from PIL import Image

    from actstore.resources import IMAGES_PER_ITEM
    images = [Image.open(p).convert("RGB") for p in sorted(jpeg_folder(work / "items", n).rglob("*.jpg"))]
    same = True
    for saved in (tf.BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}),
                  tf.CLIPImageProcessor(size={"shortest_edge": 224}),
                  tf.SiglipImageProcessor(size={"height": 224, "width": 224})):
        saved.save_pretrained(work / "processor")
        processor = load_image_processor(work / "processor")
        whole = processor(images=images, return_tensors="pt")["pixel_values"]
        items = torch.cat([processor(images=images[i:i + IMAGES_PER_ITEM], return_tensors="pt")["pixel_values"]
                           for i in range(0, n, IMAGES_PER_ITEM)])
        print(f"{type(processor).__name__}: items {'equal' if torch.equal(whole, items) else 'DIFFER from'} the whole batch")
        same &= torch.equal(whole, items)
    return same


def train_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((json.loads(line)["text"] for line in CORPUS.open()), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<s>", bos_token="<s>", pad_token="<s>").save_pretrained(out)


def bare_forward(config: dict, threads: int, scan: Path
                 ) -> tuple[float, float, dict, object, object, object, int, dict]:
    """Everything run_part does except capturing and writing: preflight, model load, tokenize or
    decode, forward. Returns seconds, seconds to the first batch's output (no write can start
    before it), the main thread's loop after the first batch as part.json's extraction_waits counts
    extraction's (input_wait_seconds: near the total, the inputs are the bound; near 0, the main
    thread's own forward calls are; forward_seconds and main_thread_cpu_seconds, to hold against
    extraction's), the loaded model, an input factory, the image-loading factory the goal's loading
    rate is measured with (the cpu pipeline's: the job's CPUs; None for texts), units (tokens/images)
    and the seconds from
    the start at which each step before the first output ended (what the floor's first output is
    made of)."""
    started = time.perf_counter()
    marks = {}

    def mark(step: str) -> None:
        marks[step] = round(time.perf_counter() - started, 3)
    model_path, dataset = preflight(config, 0, scan)
    mark("preflight")
    ext = config["extract"]
    samples = dataset.samples
    if dataset.modality == "image":  # as run_part: decoding starts, the images are checked, then the weights load
        batches = length_batches([1] * len(samples), ext["batch_size"])
        processor = load_image_processor(model_path)
        workers = threads if ext["num_workers"] is None else ext["num_workers"]  # as run_part decides
        dtype = run_dtype(config["model"])
        cpu_pixels = lambda: image_batches(processor, dataset.opener, samples, batches, workers,  # noqa: E731
                                           ext["device"] == "cuda", TORCH_DTYPES[dtype])
        pixels = cpu_pixels if ext["image_pipeline"] == "cpu" else lambda: device_image_batches(  # noqa: E731
            processor, dataset.opener, samples, batches, workers, torch.device(ext["device"]), TORCH_DTYPES[dtype])
        first_pixels = pixels()
        check_images(dataset.opener, samples, threads)
        mark("image_checks")
        loaded = load_model(model_path, dtype, ext["device"])
        mark("model_load")
        make_inputs = lambda: to_model(loaded, pixels())  # noqa: E731
        make_loading = lambda: to_model(loaded, cpu_pixels())  # noqa: E731
        first_inputs = to_model(loaded, first_pixels)
        units = len(samples)
    else:
        loaded = load_model(model_path, run_dtype(config["model"]), ext["device"])
        mark("model_load")
        ids = tokenize(loaded.preprocessor, samples, ext["max_seq_length"], not dataset.chat)
        mark("tokenize")
        batches = length_batches([len(x) for x in ids], ext["batch_size"])
        make_inputs = lambda: text_batches(loaded, ids, batches, not ext["token_logprobs"])  # noqa: E731
        make_loading = None
        first_inputs = make_inputs()
        units = sum(len(x) for x in ids)
    first_output, arriving = None, iter(first_inputs)
    loop = dict.fromkeys(("input_wait_seconds", "forward_seconds", "main_thread_cpu_seconds"), 0.0)
    with torch.inference_mode():
        while True:
            asked, cpu = time.perf_counter(), time.thread_time()
            if (inputs := next(arriving, None)) is None:
                break
            forwarded = time.perf_counter()
            loaded.model(**inputs)
            if first_output is None:
                sync(loaded.device)
                first_output = time.perf_counter() - started
                mark("first_forward")
                continue
            loop["input_wait_seconds"] += forwarded - asked
            loop["forward_seconds"] += time.perf_counter() - forwarded
            loop["main_thread_cpu_seconds"] += time.thread_time() - cpu
    sync(loaded.device)
    loop = {key: round(value, 3) for key, value in loop.items()}
    return time.perf_counter() - started, first_output, loop, loaded, make_inputs, make_loading, units, marks


def gpu_only_and_loading(loaded, make_inputs, make_loading) -> dict:
    """Forward with every input already on the device and, for images, the loading rate alone
    (make_loading: decode + processor in the job's workers, no model), the time to its first batch
    and the peak of the decoded images waiting in shared memory."""
    result = {}
    with torch.inference_mode():
        staged = list(make_inputs())
        sync(loaded.device)
        started = time.perf_counter()
        for inputs in staged:
            loaded.model(**inputs)
        sync(loaded.device)
        result["gpu_only_s"] = time.perf_counter() - started
    if loaded.kind == "vision":
        first, peak, stop = [], [0], threading.Event()
        watcher = threading.Thread(target=watch_shared_memory, args=(peak, stop))
        watcher.start()
        started = time.perf_counter()
        for _ in make_loading():
            first = first or [time.perf_counter() - started]
        result["image_loading_s"] = time.perf_counter() - started
        stop.set()
        watcher.join()
        result.update(image_first_batch_s=first[0], image_shared_memory_peak_mb=peak[0] / 1e6)
    return result


def watch_shared_memory(peak: list[int], stop: threading.Event) -> None:
    """Peak growth of the machine's shared memory (/proc/meminfo Shmem: the decoded images the loader's
    workers hand over wait there) until `stop`, sampled every 10 ms."""
    def shmem() -> int:
        with open("/proc/meminfo") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("Shmem:"))
    base = shmem()
    while not stop.wait(0.01):
        peak[0] = max(peak[0], shmem() - base)


def interleaved_rounds(config: dict, out: Path, threads: int, repeats: int, scan: Path) -> dict:
    """Bare forward and extraction alternately, `repeats` rounds (a noisy machine hits both alike):
    best times, every round, and the median of the per-round ratios."""
    bare, first, loops, extract, ratios, peaks = [], [], [], [], [], {"bare": 0.0, "extract": 0.0}
    extract_waits, first_steps = [], []  # part.json's extraction_waits, the first output's steps, of each round
    digests = []  # each round's stored layers (layers_digest): rows run another way must match them
    for repeat in range(repeats):
        with gpu_peak(peaks, "bare"):
            bare_s, first_s, loop, loaded, make_inputs, make_loading, units, steps = bare_forward(config, threads, scan)
        first_steps.append(steps)
        target = out / f"part-{repeat}"
        started = time.perf_counter()
        with gpu_peak(peaks, "extract"):
            meta = run_part(config, 0, target, progress=False, threads=threads, scan=scan)
        extract.append(time.perf_counter() - started)
        bare.append(bare_s)
        first.append(first_s)
        loops.append(loop)
        ratios.append(extract[-1] / bare_s)
        written = sum(info["bytes"] for info in meta["files"].values())
        digests.append(layers_digest(meta))
        waits_of_round = meta["extraction_waits"]  # and what the run took besides its startup and batches:
        extract_waits.append(waits_of_round | {"rest_seconds": round(  # the writers' set-up and close, the rename
            extract[-1] - waits_of_round["startup_seconds"] - waits_of_round["batches_seconds"], 3)})
        shutil.rmtree(target)
    return {"units": units, "bare_forward_s": min(bare), "first_output_s": min(first), "extract_s": min(extract),
            "bytes_written": written, "layers_digest_rounds": digests,
            "bare_forward_rounds_s": [round(x, 3) for x in bare], "extract_rounds_s": [round(x, 3) for x in extract],
            "bare_input_wait_rounds_s": [loop["input_wait_seconds"] for loop in loops],
            "bare_loop_of_best": loops[int(np.argmin(bare))],
            "extract_waits_of_best": extract_waits[int(np.argmin(extract))],
            "first_output_steps_of_best": first_steps[int(np.argmin(first))],
            "median_round_ratio": float(np.median(ratios)), **gpu_only_and_loading(loaded, make_inputs, make_loading),
            **({f"{phase}_peak_gpu_mb": round(mb) for phase, mb in peaks.items()} if torch.cuda.is_available() else {})}


def layers_digest(meta: dict) -> str:
    """The stored layers' bytes in 16 hex digits (their tree hashes from part.json): equal across the
    rounds of a row, and across rows that differ only in how the same model ran (--helper-nice, --hash-threads)."""
    layers = {name: entry["sha256_tree"] for name, entry in sorted(meta["files"].items()) if name.startswith("layer_")}
    return hashlib.sha256(json.dumps(layers).encode()).hexdigest()[:16]


@contextmanager
def gpu_peak(peaks: dict[str, float], phase: str):
    """The most GPU memory `phase` held (MiB), over its rounds: the bare forward's logits against
    extraction's (the (batch, tokens, vocab) logits are what extraction does without)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    yield
    if torch.cuda.is_available():
        peaks[phase] = max(peaks[phase], torch.cuda.max_memory_allocated() / 2**20)


def synthetic(out: Path, device: torch.device, n_bytes: int, args) -> dict:
    """The write pipeline fed at memory speed, or at `args.synthetic_rate` bytes/s like a model
    slower than the disk, with the write pattern of `args.synthetic_shape` (SYNTHETIC_SHAPES: text,
    samples of random length batched by length; vit-b14, every sample 257 tokens, batches of
    consecutive samples), bf16 tensors until n_bytes are written. The tail is the time from the last
    batch handed over to the part finished: what a run pays after its model is done."""
    rng = np.random.default_rng(0)
    shape = SYNTHETIC_SHAPES[args.synthetic_shape]
    d, n_tensors, batch_size, (low, high) = shape["d"], shape["tensors"], shape["batch"], shape["tokens"]
    per_token = d * 2 * n_tensors
    lengths = []
    while sum(lengths) * per_token < n_bytes:
        lengths.append(int(rng.integers(low, high + 1)))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    batches = length_batches(lengths, batch_size)
    source = torch.randn(batch_size * high, d, device=device).to(torch.bfloat16)
    started = time.perf_counter()
    writer = PartWriter(out / "synthetic", [{"sample_idx": i} for i in range(len(lengths))], offsets,
                        hash_threads=args.hash_threads or len(os.sched_getaffinity(0)))
    with WritePipeline(writer, device, args.buffers, args.writer_threads or n_tensors) as pipeline:
        submitted = 0
        for batch in batches:
            rows = BatchRows(np.asarray(batch), np.asarray([lengths[i] for i in batch]))
            n = int(rows.n_tokens.sum())
            if args.synthetic_rate:  # the model's pace: the batch is ready once its bytes are due
                time.sleep(max(0.0, started + submitted / args.synthetic_rate - time.perf_counter()))
            pipeline.submit(rows, {f"layer_{t:03d}.npy": source[:n] for t in range(n_tensors)}, {})
            submitted += n * per_token
        produced = time.perf_counter()
    drained = time.perf_counter()
    read_back = sum(sink.file.read_back for sink in writer.sinks.values())
    meta = writer.finish({})
    elapsed = time.perf_counter() - started
    written = sum(info["bytes"] for info in meta["files"].values())
    return {"synthetic_bytes": written, "synthetic_s": elapsed, "synthetic_bytes_per_s": written / elapsed,
            "synthetic_tail_s": elapsed - (produced - started), "synthetic_drain_s": drained - produced,
            "synthetic_close_s": elapsed - (drained - started), "hashed_from_page_cache": read_back / written}


def synthetic_rounds(work: Path, device: torch.device, gb: float, args) -> dict:
    """Disk bandwidth and the synthetic pipeline alternately (`repeats` rounds): the median of the
    per-round ratios, and the last round's details. At memory speed the bound is the disk; with
    --synthetic-rate, the slower of the disk and the producer, as the text goal states it."""
    ratios, result = [], {}
    for _ in range(args.repeats):
        result["write_bytes_per_s"] = write_bandwidth(work, int(gb * (1 << 30)))
        result.update(synthetic(work, device, int(args.synthetic_gb * (1 << 30)), args))
        shutil.rmtree(work / "synthetic")
        if args.synthetic_rate:
            bound_s = result["synthetic_bytes"] / min(args.synthetic_rate, result["write_bytes_per_s"])
            ratios.append(result["synthetic_s"] / bound_s)
        else:
            ratios.append(result["synthetic_bytes_per_s"] / result["write_bytes_per_s"])
    name, goal = ("synthetic_vs_bound", "<= 1.2") if args.synthetic_rate else ("synthetic_vs_disk", ">= 0.8")
    return {**result, f"{name}_rounds": [round(r, 3) for r in ratios], name: float(np.median(ratios)),
            "goal": f"{name} {goal}"}


def model_load_rounds(model_dir: Path, device: torch.device, repeats: int) -> dict:
    """Seconds to move the checkpoint's weights, loaded on the CPU (memory-mapped, page cache warm),
    to `device`: torch's `.to` (pageable copies) and models.weights_to_device (pinned slots), in
    interleaved rounds, best of each; beside them the seconds to read the checkpoint's files
    (pread, page cache warm), and whether the two moves give the same bits."""
    files = sorted(model_dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    buffer = bytearray(64 << 20)
    times: dict[str, list[float]] = {"read": [], "plain": [], "slots": []}
    for _ in range(repeats):
        started = time.perf_counter()
        for file in files:
            with open(file, "rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass
        times["read"].append(time.perf_counter() - started)
        moved = {}
        for way, move in (("plain", lambda m: m.to(device)), ("slots", lambda m: weights_to_device(m, device))):
            model = load_model(model_dir, "bfloat16", "cpu").model
            sync(device)
            started = time.perf_counter()
            moved[way] = move(model)
            sync(device)
            times[way].append(time.perf_counter() - started)
        same = all(torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))
                   for a, b in zip(moved["plain"].state_dict().values(), moved["slots"].state_dict().values()))
        del moved, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    best = {way: min(seconds) for way, seconds in times.items()}
    return {**cuda_start(device), "model_bytes": size, "model_read_s": best["read"], "model_to_device_plain_s": best["plain"],
            "model_to_device_slots_s": best["slots"], "model_slots_vs_plain": best["slots"] / best["plain"],
            "model_plain_gb_per_s": size / best["plain"] / 1e9, "model_slots_gb_per_s": size / best["slots"] / 1e9,
            "model_moves_equal": same, "model_rounds_s": times}


CUDA_START = """import time, torch
started = time.perf_counter(); torch.empty(1, device="cuda"); torch.cuda.synchronize(); context = time.perf_counter()
x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16); (x @ x).sum().item(); blas = time.perf_counter()
print(context - started, blas - context)"""


def cuda_start(device: torch.device) -> dict:
    """A fresh process's first CUDA tensor (driver and context) and first bf16 matmul (cuBLAS), in
    seconds after `import torch`: the part of a job's model load that is not its weights."""
    if device.type != "cuda":
        return {}
    import subprocess
    import sys
    context, blas = map(float, subprocess.run([sys.executable, "-c", CUDA_START], check=True, capture_output=True,
                                              text=True).stdout.split())
    return {"model_cuda_context_s": context, "model_cuda_first_matmul_s": blas}


def bench_config(args, work: Path) -> dict:
    if args.shape == "minilm":
        import yaml
        raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        raw["dataset"]["path"] = str(REPO / raw["dataset"]["path"])
        raw["dataset"]["limit"] = args.limit or 600
        raw["extract"]["parts"] = 1
    else:
        model = build_model(args.shape, work / "model", torch.device(args.device))
        wide = args.shape == "wide-vocab"
        text = args.shape != "vit-b14"
        data = long_texts(work / "texts.jsonl", args.limit or 512) if text else jpeg_folder(work / "images", args.limit or 1024)
        raw = {"model": {"path": str(model), "torch_dtype": "bfloat16" if args.device == "cuda" else "float32"},
               "dataset": {"path": str(data)},
               "extract": {"layers": (list(range(16)) if args.all_layers else
                                      [0, 2] if not text else [1, 3] if wide else [3, 7, 11, 15]),
                           "max_seq_length": 128 if wide else 512, "batch_size": 8 if wide else 32 if text else 64}}
    raw["dump_to"] = str(work / "dump")
    raw["extract"].update(device=args.device, buffers=args.buffers, writer_threads=args.writer_threads,
                          num_workers=args.num_workers, token_logprobs=not args.no_token_logprobs,
                          image_pipeline=args.image_pipeline)
    return validate_config(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["minilm", "llama-1b", "wide-vocab", "vit-b14"], default="minilm")
    parser.add_argument("--no-token-logprobs", action="store_true",
                        help="causal LMs: extract.token_logprobs false (the LM head at each text's last token)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--limit", type=int, default=None, help="dataset rows (default 600 / 512 / 1024)")
    parser.add_argument("--all-layers", action="store_true", help="llama-1b: store all 16 blocks")
    parser.add_argument("--logprob-elements", type=int, default=None,
                        help="logits per token log-prob chunk (default: extract.logprobs.LOGPROB_ELEMENTS, 2**26; "
                             "256 tokens a head rerun at a 262,144-token vocabulary)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--buffers", type=int, default=3)
    parser.add_argument("--writer-threads", type=int, default=None, help="default: one per tensor, up to the CPUs")
    parser.add_argument("--num-workers", type=int, default=None, help="images: decoding processes (default: the CPUs)")
    parser.add_argument("--image-pipeline", choices=["cpu", "gpu"], default="cpu",
                        help="vit-b14: extract.image_pipeline (the loading rate of the goal stays the cpu one's)")
    parser.add_argument("--synthetic", action="store_true", help="the write pipeline alone, fed at memory speed")
    parser.add_argument("--synthetic-gb", type=float, default=2.0)
    parser.add_argument("--synthetic-shape", choices=sorted(SYNTHETIC_SHAPES), default="text",
                        help="--synthetic's write pattern: text (64-512 tokens, d 2048, 4 tensors) or vit-b14 "
                             "(257 tokens an image, d 768, 2 tensors, batches of consecutive images)")
    parser.add_argument("--hash-threads", type=int, default=None,
                        help="threads hashing the writes (default or 0: the CPUs, as run_part; 1: in the writer "
                             "threads); on a model row an experiment: run_part's part writer is given this many, to "
                             "tell its main thread's waits on CPUs shared with the decoding workers")
    parser.add_argument("--helper-nice", type=int, default=None,
                        help="an experiment: how far below the main thread the decoding workers and hashing "
                             f"threads run (io_utils.HELPER_NICE, default {io_utils.HELPER_NICE}; 0: at its priority)")
    parser.add_argument("--synthetic-rate", type=float, default=None,
                        help="bytes/s the synthetic producer emits (a model slower than the disk); default memory speed")
    parser.add_argument("--bandwidth-gb", type=float, default=None,
                        help="GiB written for the disk bound (default: --synthetic-gb; else 4 on CUDA, 1 on CPU)")
    parser.add_argument("--profile", action="store_true",
                        help="also one extraction under cProfile: where the main thread's time goes (top 25)")
    parser.add_argument("--trace", action="store_true",
                        help="also one extraction under torch.profiler: the device's busy fraction and the top ops "
                             "by device and CPU time")
    parser.add_argument("--model-load", action="store_true",
                        help="only the move of the shape's weights to the device: torch's `.to` against "
                             "models.weights_to_device, interleaved, beside a read of the checkpoint's files")
    parser.add_argument("--check-items", action="store_true",
                        help="only check that the ViT processors give the same pixels whole and in loader items")
    parser.add_argument("--out-dir", default=None, help="where to write (the disk under test); default a temp dir")
    parser.add_argument("--out", default=str(REPO / "bench" / "out" / "extract.json"))
    args = parser.parse_args()
    if args.check_items:
        with tempfile.TemporaryDirectory() as tmp:
            raise SystemExit(0 if check_items(Path(tmp)) else 1)
    device = torch.device(args.device)
    threads = len(os.sched_getaffinity(0))
    if args.logprob_elements:
        logprobs.LOGPROB_ELEMENTS = args.logprob_elements
    result = {"shape": args.shape, "logprob_elements": logprobs.LOGPROB_ELEMENTS, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "token_logprobs": not args.no_token_logprobs, "cpus": threads, "buffers": args.buffers,
              "writer_threads": args.writer_threads, "num_workers": args.num_workers,
              "image_pipeline": args.image_pipeline,
              "memory_available_gb": machine_available_gb()}
    with tempfile.TemporaryDirectory(dir=args.out_dir) as tmp:
        work = Path(tmp)
        # The disk bound is measured on as many bytes as the run writes (a small write is flattered
        # by caches below the page cache); 4 GiB on a GPU host as in ../shared/docs/gpu-measurement.md.
        gb = args.bandwidth_gb or (args.synthetic_gb if args.synthetic else 4.0 if device.type == "cuda" else 1.0)
        if args.model_load:
            result.update(model_load_rounds(build_model(args.shape, work / "model", device), device, args.repeats))
        elif args.synthetic:
            result.update(synthetic_rounds(work, device, gb, args))
        else:
            result["write_bytes_per_s"] = write_bandwidth(work, int(gb * (1 << 30)))
            if args.hash_threads:
                result["hash_threads"] = hash_threads_of_part_writer(args.hash_threads)
            if args.helper_nice is not None:
                io_utils.HELPER_NICE = result["helper_nice"] = args.helper_nice
            config = bench_config(args, work)
            # The part's rows from the dataset's scan, as the workflow's part jobs read them (its
            # extract_scan job lists the dataset once for all parts)
            scan = work / "scan.json"
            write_scan(configured_scan(config, workers=threads), scan)
            result.update(interleaved_rounds(config, work / "parts", threads, args.repeats, scan))
            result.update(goals(result, args.shape))
            if args.profile:
                profile(config, work / "profiled", threads, scan, Path(args.out).with_suffix(".profile.txt"))
            if args.trace:
                result.update(trace(config, work / "traced", threads, scan, Path(args.out).with_suffix(".trace.txt")))
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        print(f"{key:24s} {value:.4g}" if isinstance(value, float) else f"{key:24s} {value}")


def hash_threads_of_part_writer(count: int) -> int:
    """run_part's part writer, from here on, hashes with `count` threads instead of the job's CPUs."""
    import actstore.extract.run as extract_run

    class CountedPartWriter(PartWriter):
        def __init__(self, *args, hash_threads: int = 1, **kwargs):
            super().__init__(*args, hash_threads=count, **kwargs)
    extract_run.PartWriter = CountedPartWriter
    return count


def profile(config: dict, target: Path, threads: int, scan: Path, report: Path) -> None:
    """One run_part under cProfile (main thread: waits on the loader, slots, the final fsync)."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.runcall(run_part, config, 0, target, progress=False, threads=threads, scan=scan)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text.getvalue())
    print(text.getvalue()[-6000:])


def trace(config: dict, target: Path, threads: int, scan: Path, report: Path) -> dict:
    """One run_part under torch.profiler. On a GPU: how much of the run the device was busy (kernel
    intervals merged, over the run's wall time and over the span from its first kernel to its
    last), so idle gaps between batches show as a fraction; and the ops taking the most device and
    CPU time (the main thread's: the writer threads run no torch ops)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run_part(config, 0, target, progress=False, threads=threads, scan=scan)
    wall_us = (time.perf_counter() - started) * 1e6
    tables = [prof.key_averages().table(sort_by=key, row_limit=20)
              for key in (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n\n".join(tables))
    print(tables[0][-5000:])
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels:
        return {}
    busy, (start, end) = 0.0, kernels[0]
    for lo, hi in kernels[1:]:  # merge overlapping intervals (kernels on several streams)
        if lo > end:
            busy, start = busy + end - start, lo
        end = max(end, hi)
    busy += end - start
    return {"trace_device_busy_of_run": busy / wall_us,
            "trace_device_busy_of_kernel_span": busy / (kernels[-1][1] - kernels[0][0])}


def goals(r: dict, shape: str) -> dict:
    """The goal's ratio for the shape, and beside it the ratio to the floor: no byte can be written
    before the first batch's output (model load, tokenize or decode, one forward), so extraction
    takes at least max(bare forward, first output + bytes / bandwidth), which the goal's
    max(bare forward, bytes / bandwidth) does not count when the two are close."""
    disk_s = r["bytes_written"] / r["write_bytes_per_s"]
    floor_s = max(r["bare_forward_s"], r["first_output_s"] + disk_s)
    out = {"disk_bound_s": disk_s, "floor_s": floor_s, "ratio_vs_floor": r["extract_s"] / floor_s,
           "units_per_s_extract": r["units"] / r["extract_s"],
           "units_per_s_bare": r["units"] / r["bare_forward_s"], "units_per_s_gpu_only": r["units"] / r["gpu_only_s"]}
    if shape == "minilm":
        out["ratio_vs_bare"] = r["extract_s"] / r["bare_forward_s"]
        out["goal"] = "ratio_vs_bare <= 1.15"
    elif shape in ("llama-1b", "wide-vocab"):
        out["ratio_vs_bound"] = r["extract_s"] / max(r["bare_forward_s"], disk_s)
        out["goal"] = "ratio_vs_bound <= 1.2"
    else:
        loading = r["units"] / r["image_loading_s"]
        bound = min(out["units_per_s_gpu_only"], loading, r["units"] / disk_s)
        out.update(image_loading_per_s=loading, fraction_of_bound=out["units_per_s_extract"] / bound,
                   bound_by=("CPU image decoding" if bound == loading else "disk" if bound == r["units"] / disk_s
                             else "model forward"), goal="fraction_of_bound >= 0.8")
    return out


if __name__ == "__main__":
    main()
