"""Slurm resource estimates (runtime in minutes, mem_mb) that scale with the data, computed from the
config at parse time without loading a model: rules call these in their `resources:` so a 64-part
run on a 7B model asks for more than the demo does. Deliberately generous (a killed job costs more
than an idle reservation) and multiplied by Snakemake's `attempt`, so `--retries 1` doubles them."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actstore.config import enabled_stages
from actstore.checkpoint import BIN_INDEX, BIN_SINGLE, weight_map, checkpoint_names, tensor_bytes
from actstore.datasets.jsonl import size_estimate
from actstore.datasets.source import Source, resolve_source
from actstore.datasets.tables import CSV_BLOCK_BYTES, count_rows, largest_block_bytes
from actstore.datasets.webdataset import estimate_samples
from actstore.jobs import write_jobs
from actstore.model_config import (config_int, config_patches, model_kind, read_model_config, resolve_model_path,
                                   run_config, run_dtype, saved_dtype, tower_config)
from actstore.model_identity import model_files
from actstore.parse_memo import remembered

GPU_FLOPS = 5e12          # sustained fp32 forward throughput assumed for one GPU (V100-class, pessimistic)
# Dense float32 throughput assumed for one CPU thread a job is given, on device `cpu`. Measured on the 2-core
# dev VM (AVX-512 Xeon, shared with other jobs): torch matmuls 35-160 GFLOP/s on one thread, 38-63 a thread on
# two; the demo model's forward 50-225 and an SAE step 30-43 on one thread, counted as the estimates count FLOPs.
# A third of the lowest, as GPU_FLOPS is a third of a V100's peak; an oversubscribed run (two threads on two
# loaded cores: an SAE step at 4-6 a thread) is within _minutes' doubling.
CPU_THREAD_FLOPS = 10e9
IO_BYTES_PER_S = 100e6    # write/read rate assumed on /fs/scratch for one job (shared Lustre, pessimistic)
STARTUP_MIN = 10          # imports, model load, dataset read
MAX_RUNTIME_MIN = 48 * 60


@dataclass(frozen=True)
class Workload:
    rows: int            # dataset rows used (after dataset.limit)
    tokens: int          # upper bound on stored tokens (rows * max_seq_length for text)
    d: int               # widest captured vector, an LM head's output apart (head_values)
    n_tensors: int       # layers + hooks
    weight_bytes: int    # bytes of weight files on disk
    text_bytes: int      # the samples' text: a text dataset's size on disk; for images, their names
    itemsize: int        # bytes per stored value (extract.storage_dtype)
    pixel_bytes: int = 0  # bytes of one processed image in the model's dtype, at most (0 for text)
    block_bytes: int = 0  # a table's largest block (row group, record batch) as Arrow holds it (0 for JSONL)
    weight_widening: float = 1.0  # run over saved dtype, at least 1 (a bfloat16 checkpoint run in float32: 2)
    head_values: int = 0  # values a token of hooks on an LM head's output holds past the d each is counted at
    listing_bytes: int = 0  # a text folder's names, every file's, as its scan lists them (images': text_bytes)
    model_file_bytes: int = 0  # every model file the index hashes (model_identity.model_files), copies unused too

    @property
    def token_values(self) -> int:
        """Values stored per token, every captured tensor's."""
        return self.d * self.n_tensors + self.head_values

    @property
    def activation_bytes(self) -> int:
        return self.tokens * self.token_values * self.itemsize

    @property
    def host_weight_bytes(self) -> float:
        """The model loaded on the host, before it moves to the GPU: its files, widened to the run dtype."""
        return self.weight_bytes * self.weight_widening


def _dataset_source(section: dict[str, Any]) -> Source:
    """The dataset section's source (once a parse: datasets.source.remember_sources)."""
    return resolve_source(section["path"], section.get("format") or "auto", section.get("split") or "train")


ESTIMATE_TEXT_FILES = 1000  # files of a text folder stat'ed for its size at parse time, spread over it


def _count_rows(section: dict[str, Any]) -> tuple[int, int, int]:
    """(rows, bytes, largest block's bytes) of the dataset: JSONL and CSV lines and text estimated
    from the files' starts (datasets.jsonl.size_estimate), other tables' rows and blocks from the
    files' own metadata, a text folder's files (the bytes of 1,000 of them, scaled), or the images
    of a folder (no stat of each: their bytes are never held) or of tar shards (estimated from the
    first shard's start); nothing is parsed. Once per Snakefile parse (parse_memo)."""
    return tuple(remembered("dataset size", section, lambda: _dataset_size(section)))


def _dataset_size(section: dict[str, Any]) -> tuple[int, int, int]:
    source = _dataset_source(section)
    if source.format == "image_folder":
        return max(len(source.files), 1), 0, 0
    if source.format == "text_folder":  # every file a text: their bytes scaled from a sample of them
        picked = source.files[::max(1, len(source.files) // ESTIMATE_TEXT_FILES)]
        text = sum(p.stat().st_size for p in picked) * len(source.files) // max(len(picked), 1)
        return max(len(source.files), 1), text, 0
    if source.format == "webdataset":
        return max(estimate_samples(source.files), 1), 0, 0
    if source.format in ("jsonl", "csv"):  # text, sampled: every parse computes this, on every node
        lines, text = size_estimate(source.files, arrays=source.format == "jsonl")
        if source.format == "jsonl":
            return max(lines, 1), text, 0
        return max(lines - len(source.files), 1), text, CSV_BLOCK_BYTES  # less a header line a file
    size = sum(p.stat().st_size for p in source.files)
    return (max(sum(count_rows(source.format, p) for p in source.files), 1), size,
            max((largest_block_bytes(source.format, p) for p in source.files), default=0))


# An image sample's text: its name in the folder or table (the pixels are read when decoded). A part's
# samples are counted twice, as text is (load_dataset held 480-560 B a sample of ImageNet-style names);
# the listing of a folder, once (the Source's Paths: 320 B an image, 100,000 images measured).
IMAGE_NAME_BYTES = 300
MAX_IMAGE_TOKENS = 1025  # most ViTs emit at most a few hundred tokens (a CLS and 32 x 32 patches)
IMAGES_PER_ITEM = 16  # images one DataLoader item of the extraction decodes (extract/inputs.py)


def items_ahead(batch_size: int, workers: int) -> int:
    """DataLoader items each image-decoding worker keeps ready: 4, and all of them at least two batches."""
    items_per_batch = math.ceil(batch_size / IMAGES_PER_ITEM)
    return max(4, math.ceil(2 * items_per_batch / max(workers, 1)))


@functools.lru_cache(maxsize=16)
def _workload(key: str) -> Workload:
    config = json.loads(key)
    model_path = resolve_model_path(config["model"]["path"])
    model = run_config(config["model"])
    vision = model_kind(model) == "vision"
    model = tower_config(model)
    hidden = config_int(model, "hidden_size") or 1024
    inner = int(model.get("intermediate_size") or model.get("n_inner") or 4 * hidden)
    ext = config["extract"]
    rows, data_bytes, block_bytes = _count_rows(config["dataset"])
    # listed whole whatever dataset.limit; a text folder is never `auto`'s choice, so the config names it
    listing = rows * IMAGE_NAME_BYTES if config["dataset"].get("format") == "text_folder" else 0
    limit = config["dataset"].get("limit")
    if limit and limit < rows:  # the first `limit` rows' share of the text: what a part holds, the scan reads
        rows, data_bytes = limit, data_bytes * limit // rows
    # Text: truncated at max_seq_length. Images: more where config.json says so (Gemma 3's tower: 4,096).
    per_row = max(MAX_IMAGE_TOKENS, config_patches(model) + 1) if vision else ext["max_seq_length"]
    patch = model.get("patch_size") or 16
    patch = max(patch) if isinstance(patch, (list, tuple)) else int(patch)  # some configs give (height, width)
    weights = _weight_bytes(model_path, config["model"].get("tower"))
    computed = run_dtype(config["model"])
    widening = max(1.0, _itemsize(computed) / _itemsize(saved_dtype(read_model_config(model_path))))
    storage = ext.get("storage_dtype", "float32")
    storage = computed if storage == "auto" else storage
    d = inner if ext.get("hooks") else hidden
    vocab = config_int(model, "vocab_size") or 0
    return Workload(rows=rows, tokens=rows * per_row, d=d,
                    n_tensors=len(ext["layers"]) + len(ext.get("hooks", [])),
                    head_values=sum(max(vocab - d, 0) for spec in ext.get("hooks", []) if _head_output(spec)),
                    weight_bytes=weights, weight_widening=widening,
                    text_bytes=rows * IMAGE_NAME_BYTES if vision else data_bytes,
                    itemsize=_itemsize(storage),
                    # RGB over every patch, in the model's dtype: the decoding workers cast what they hand on
                    pixel_bytes=per_row * patch ** 2 * 3 * _itemsize(computed) if vision else 0,
                    block_bytes=block_bytes, listing_bytes=listing,
                    model_file_bytes=sum(entry["bytes"] for entry in model_files(model_path).values()))


# The output-embedding modules (get_output_embeddings) of transformers' causal LMs: GPT-NeoX's embed_out,
# the others' lm_head. Their output is the logits, vocab_size wide at every token (extract.run.head_hooked):
# a Llama 3's 128,256 values, 9x its MLP's 14,336.
HEAD_MODULES = ("lm_head", "embed_out")


def _head_output(spec: str) -> bool:
    """Whether hook `spec` captures an LM head's output (the logits)."""
    module, _, io = spec.rpartition(":")
    return io == "output" and module.rpartition(".")[2] in HEAD_MODULES


def _itemsize(dtype: str) -> int:
    """Bytes a value of a run or storage dtype takes: float32, else a 16-bit float."""
    return 4 if dtype == "float32" else 2


def _weight_bytes(model_path: Path, tower: str | None) -> int:
    """Bytes of the weights an extraction job loads: the checkpoint's files from_pretrained reads, or
    with model.tower: vision only the tower's tensors (a `vision_tower` in their names, the module
    models.load_model reads alone), sized from the safetensors headers: Gemma 3 27B's tower is ~0.8 GB
    of its 54 GB."""
    if tower == "vision":
        return sum(size for name, size in tensor_bytes(model_path).items() if "vision_tower" in name.split("."))
    return sum((model_path / file).stat().st_size for file in loaded_weight_files(model_path))


def loaded_weight_files(folder: Path) -> set[str]:
    """The weight files from_pretrained reads of `folder`, in its order of preference: the safetensors
    checkpoint (checkpoint_names: the file config.json names, model.safetensors or its index's shards),
    else pytorch_model.bin, else the shards its index names. A Hub download holds both a safetensors
    and a .bin copy (Llama 2's repositories): the .bin is never read, and summing both sized twice the
    weights."""
    if files := set(checkpoint_names(folder).values()):
        return files
    if (folder / BIN_SINGLE).exists():
        return {BIN_SINGLE}
    return set(weight_map(folder, BIN_INDEX).values()) if (folder / BIN_INDEX).exists() else set()


def workload(config: dict[str, Any]) -> Workload:
    """Size of the extraction this config describes (cached per model/dataset/extract sections)."""
    key = {k: config[k] for k in ("model", "dataset", "extract")}
    return _workload(json.dumps(key, sort_keys=True, default=str))


def _round_mb(mb: float) -> int:
    return int(math.ceil(mb / 1000.0) * 1000)


def _minutes(seconds: float, attempt: int) -> int:
    """Minutes for `seconds` of estimated work: STARTUP_MIN plus twice the estimate, capped at
    MAX_RUNTIME_MIN, times `attempt`. The cap bounds the estimate, not the retry: a job Slurm killed at
    the cap is retried with twice it (96 h), not run 48 h again to the same kill; the partition must
    allow that (`sinfo -s`, column TIMELIMIT), or Slurm refuses the retry or holds it (PartitionTimeLimit)."""
    return int(min(MAX_RUNTIME_MIN, math.ceil(STARTUP_MIN + 2 * seconds / 60)) * attempt)


def flops_per_second(device: str, threads: int) -> float:
    """Rate of a stage's FLOPs on `device` (extract.device, sae.device, lut.device) in a job of `threads`
    CPUs: CPU_THREAD_FLOPS a thread on `cpu`, else GPU_FLOPS: profiles/osc puts the rules of `auto` and
    `cuda` on the GPU partition with one GPU. At GPU_FLOPS, a CPU job was given about a hundredth of its
    time. The other accelerators the schema takes (xpu, mps, ...) get GPU_FLOPS too: a runtime matters
    only to Slurm, whose OSC nodes have neither (an Apple GPU runs locally, where Snakemake ignores it),
    and an Intel data-centre GPU (xpu) sustains more than a third of a V100."""
    return CPU_THREAD_FLOPS * threads if device.partition(":")[0] == "cpu" else GPU_FLOPS


TEXT_JOB_THREADS = 4  # tokenizing up front and a writer thread per captured tensor (up to these CPUs)
# An image job's CPUs decode: the loader alone ran 504 img/s with 4 workers, 838 with 8 and 932 with 16
# on an H100 host's 500x375 JPEGs (issue 14), where ViT-B/14 runs 5,775 img/s. 16 is within a GPU's
# share of OSC's dual-GPU Pitzer nodes (40 or 48 cores for 2 GPUs, OSC's batch limit rules).
IMAGE_JOB_THREADS = 16


def extract_part_threads(config: dict[str, Any]) -> int:
    """CPUs of one extraction job (its rule's threads, and the Slurm cpus_per_task that follows them).
    Images: extract.num_workers decoding processes + the main process + the writer threads, or
    IMAGE_JOB_THREADS when num_workers is null (then the workers are the job's CPUs). Text:
    TEXT_JOB_THREADS. From config.json alone: a parse lists no dataset for it."""
    if model_kind(run_config(config["model"])) != "vision":
        return TEXT_JOB_THREADS
    ext = config["extract"]
    if ext.get("num_workers") is None:
        return IMAGE_JOB_THREADS
    return ext["num_workers"] + 1 + (ext.get("writer_threads") or len(ext["layers"]) + len(ext.get("hooks", [])))


TOKEN_ID_BYTES = 16  # a text part's token ids (extract.inputs.TokenIds): int64, and a second copy while joined
# What a decoding worker holds for the image it is decoding (extract.inputs.load_pixels: one at a time): a
# 24-megapixel photo (a phone's or a DSLR's largest) through decode and the processor, ~4.7x its RGB bytes
# (measured on a 16 MP JPEG with the PIL backend). A larger image (the decoder refuses past 179 MP) may need
# the retry's doubled memory; the scan reads no image's size.
DECODING_WORKER_BYTES = 5 * 3 * 24_000_000


def extract_part_mem_mb(config: dict[str, Any], attempt: int = 1, threads: int = 1) -> int:
    """Host memory of one extraction job: weights loaded on the host first (host_weight_bytes), what
    reading its rows holds (dataset_bytes), its token ids, the staging ring (extract.buffers batches
    of captures) plus one batch being packed, the decoded images waiting in shared memory
    (extract.num_workers, else the job's CPUs: IMAGE_JOB_THREADS, or `threads` where more; workers'
    items ahead and two batches) and the image each worker is decoding (DECODING_WORKER_BYTES), and 3 GB
    for torch/CUDA."""
    w = workload(config)
    ext = config["extract"]
    batch = ext["batch_size"] * (w.tokens // max(w.rows, 1)) * w.token_values * w.itemsize
    batch *= ext.get("buffers", 3) + 1
    workers = max(threads, IMAGE_JOB_THREADS) if ext.get("num_workers") is None else ext["num_workers"]
    images = workers * items_ahead(ext["batch_size"], workers) * IMAGES_PER_ITEM + 2 * ext["batch_size"]
    token_ids = 0 if w.pixel_bytes else TOKEN_ID_BYTES * w.tokens / ext["parts"]
    decoding = workers * DECODING_WORKER_BYTES if w.pixel_bytes else 0
    held = dataset_bytes(config, workers) + token_ids + batch + images * w.pixel_bytes + decoding
    return _round_mb((1.5 * w.host_weight_bytes + held) / 1e6 + 3000) * attempt


def dataset_bytes(config: dict[str, Any], workers: int = 0) -> float:
    """What reading the dataset holds in one extraction job: its part's rows (their text twice, as
    str and as read, and a Python row each), the table block being converted (Arrow and its Python
    values), and for images their names, the name of every image once (the Snakefile's parse in a
    job lists an image folder when it was handed no facts of the main process's, parse_memo; the
    part's script lists only its rows' folders), and a block of image bytes in each decoding worker."""
    w = workload(config)
    if w.pixel_bytes:
        return w.text_bytes + 2 * w.text_bytes / config["extract"]["parts"] + (3 + workers) * w.block_bytes
    rows = w.rows / config["extract"]["parts"]
    return (2 * w.text_bytes / w.rows + PYTHON_ROW_BYTES) * rows + 3 * w.block_bytes


SCAN_BYTES_PER_S = 20e6  # the dataset scan: JSONL parsed and checked a line at a time (46 MB/s measured here)


SCAN_WORKERS = 8  # processes of the dataset scan at most, a JSONL or tar file each (datasets.scanned_files)
SCAN_WORKER_MB = 200  # one of them: a forked interpreter's own pages, a decompressor's window, a line, its labels


def extract_scan_threads(config: dict[str, Any]) -> int:
    """Processes of the dataset scan: one per JSONL or tar file, up to SCAN_WORKERS; one when
    dataset.limit is set (a single pass that stops there) and for the other formats, whose scan
    reads names or the tables' own metadata."""
    section = config["dataset"]
    if section.get("limit") is not None:
        return 1
    return remembered("dataset scan processes", section, lambda: _scan_processes(_dataset_source(section)))


def _scan_processes(source: Source) -> int:
    """A process per JSONL or tar file (scanned_files), up to SCAN_WORKERS; one for other formats."""
    return min(SCAN_WORKERS, len(source.files)) if source.format in ("jsonl", "webdataset") else 1


def extract_scan_mem_mb(config: dict[str, Any], attempt: int = 1, threads: int = 1) -> int:
    """Host memory of the dataset scan: a Python process with pyarrow (WRITER_BASE_MB) and what the
    scan holds: every image's or text file's name (a folder is listed whole), or a table's label-column
    blocks, or a JSONL line at a time; and the distinct labels, assumed few; SCAN_WORKER_MB for each of its
    `threads` processes past the first."""
    w = workload(config)
    held = 2 * w.text_bytes if w.pixel_bytes else 3 * w.block_bytes + 2 * w.listing_bytes
    return _round_mb(WRITER_BASE_MB + SCAN_WORKER_MB * (threads - 1) + held / 1e6) * attempt


def extract_scan_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes to read every row once (image folders: their names)."""
    return _minutes(workload(config).text_bytes / SCAN_BYTES_PER_S, attempt)


def extract_index_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for the index: the model's files hashed once (model_identity: a .bin copy beside the
    safetensors loaded too), at the scratch rate, and every stored sample's row parsed
    (formats.extract.write.index_of), at the scan's rate (23 MB/s here)."""
    w = workload(config)
    return _minutes(w.model_file_bytes / IO_BYTES_PER_S + w.text_bytes / SCAN_BYTES_PER_S, attempt)


def extract_part_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for one part: forward FLOPs (2 per weight per token) on extract.device (flops_per_second,
    with the job's extract_part_threads) plus writing its share."""
    w = workload(config)
    # On `cpu` an image part's decoding workers share these CPUs with the forward, not taken off the rate:
    # a 500x375 JPEG decoded and processed for a 224px ViT took 10 ms on one thread of the dev VM, 0.3% of a
    # ViT-B/16's forward at CPU_THREAD_FLOPS and 4.7% of a ViT-Ti/16's, within _minutes' doubling.
    rate = flops_per_second(config["extract"]["device"], extract_part_threads(config))
    parts = config["extract"]["parts"]
    # The weights as float32 (a 16-bit checkpoint run in float32: twice its files' bytes), at fp32's rate: a
    # run in 16 bits, counted at half its parameters, runs faster than that
    params = w.host_weight_bytes / 4
    seconds = (2 * params * w.tokens / rate + w.activation_bytes / IO_BYTES_PER_S) / parts
    return _minutes(seconds, attempt)


WRITER_BASE_MB = 1000  # a writer process: interpreter, numpy, pyarrow, zarr (bench_writers: 150-300 MB anonymous)
PYTHON_ROW_BYTES = 400  # a sample row (dict) as samples.jsonl parses to, beyond its text
ROW_INDEX_BYTES = 8     # a row of an opened part's samples.jsonl: where its line starts (SampleRows)
LMPROBE_PLAN_ROW_BYTES = 240  # lmprobe's jobs per prompt: the plan's arrays (72 B traced), 130-230 B of memory measured
WINDOW_BYTES = 24       # saev text windows: (sample_idx, token_start, n_valid) int64
FILES_JSON_ENTRY_BYTES = 400  # one chunk's {bytes, sha256} entry of a zarr meta/files.json, parsed
# The zarr merge's finisher (and verify of the merged store) per sample: the merged 1-D vectors and
# the activations' directory listing. The chunks' records stream through a table on disk (zarr.merge).
ZARR_MERGE_SAMPLE_BYTES = 300


# A file's metadata work on the shared file system, no byte of it read: its record parsed, the file
# linked (zarr_merge_chunks, lmprobe_dataset) or listed and stat'ed (zarr_merge's finisher), its record
# written. The zarr finisher took 0.33 ms a file on the dev VM's disk (80K files in 26 s,
# bench/README.md); three times that for a Lustre metadata server shared with every other job.
FILE_METADATA_SECONDS = 1e-3
# The lmprobe finisher's index, a token: its ids, log-probs and perplexities, its shard offsets, its
# decoded string, built into Arrow, written to parquet and hashed (0.28 us measured on the dev VM without
# the strings, 0.35 more with them), about three times that.
LMPROBE_INDEX_TOKEN_SECONDS = 2e-6


def lmprobe_dataset_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for the lmprobe finisher: the index (every token at LMPROBE_INDEX_TOKEN_SECONDS, every
    sample's row at the scan's rate) and a hard link per tensor file (float32 shards of lmprobe.shard_bytes
    at most) at FILE_METADATA_SECONDS. It reads no activation byte: sized as reading a tenth of them, a
    10B-token run's asked the 48 h cap for a few hours of work."""
    w = workload(config)
    files = w.tokens * w.token_values * 4 / config["lmprobe"]["shard_bytes"] + len(config["extract"]["layers"])
    seconds = (w.tokens * LMPROBE_INDEX_TOKEN_SECONDS + w.text_bytes / SCAN_BYTES_PER_S
               + files * FILE_METADATA_SECONDS)
    return _minutes(seconds, attempt)


def zarr_chunks(w: Workload, config: dict[str, Any]) -> int:
    """Activation chunk files of every zarr shard store, at most: a sample's chunks up to its store's
    T_max (zarr.t_chunk tokens, or the layout's choice); only those holding its tokens are written, a
    number the config alone does not give."""
    return w.rows * len(config["extract"]["layers"]) * -(-zarr_t_max(w, config) // zarr_t_chunk(config, w))


def zarr_merge_chunks_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for the busiest zarr_merge_chunks job: a hard link per chunk file (zarr_chunks) of the
    parts it takes, the most any job takes (jobs.job_items), at FILE_METADATA_SECONDS. It reads no
    activation byte: sized as reading them, a 10B-token run's job asked the 48 h cap."""
    w, parts = workload(config), config["extract"]["parts"]
    most = -(-parts // write_jobs(config, "zarr", "merge_jobs"))
    return _minutes(zarr_chunks(w, config) / parts * most * FILE_METADATA_SECONDS, attempt)


def zarr_merge_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for the zarr merge's finisher: every chunk file of the merged store (zarr_chunks) listed,
    stat'ed and recorded at FILE_METADATA_SECONDS, and every prompt rewritten at the scan's rate; it reads
    no activation byte. The whole store's, whatever extract.parts: sized as a part's share of the
    activations, the same data had 2,359 minutes at 64 parts and 47 at 4,096."""
    w = workload(config)
    return _minutes(zarr_chunks(w, config) * FILE_METADATA_SECONDS + w.text_bytes / SCAN_BYTES_PER_S, attempt)


def zarr_t_max(w: Workload, config: dict[str, Any]) -> int:
    """T_max of a zarr shard store, at most: max_seq_length, or an image's tokens where more (an image
    is never cut, zarr.layout.store_t_max: a ViT-B/16's 197 past the default 128)."""
    return max(config["extract"]["max_seq_length"], w.tokens // max(w.rows, 1))


def zarr_t_chunk(config: dict[str, Any], w: Workload) -> int:
    """Tokens per activation chunk of the zarr stores (zarr.t_chunk, or the layout's choice)."""
    from actstore.formats.zarr.layout import choose_t_chunk

    return choose_t_chunk(zarr_t_max(w, config), w.d, config["zarr"]["t_chunk"])


def writer_buffer_bytes(w: Workload, config: dict[str, Any], job: str) -> int:
    """What format writer job `job` (its rule's name) holds by design: its fixed copy buffers, what
    it plans per sample or per file, and the sample rows (texts) of the parts it reads them from.
    None of it grows with the activations. tests/test_scale.py checks real peaks against it."""
    from actstore.formats.lmprobe.write import (COPY_BYTES, ROW_GROUP_LINE_BYTES, ROW_GROUP_ROWS, ROW_GROUP_TOKENS,
                                                THREADS)
    from actstore.formats.saev.write import CHUNK_BYTES
    from actstore.io_utils import BEHIND

    parts = config["extract"]["parts"]
    row_bytes = ROW_INDEX_BYTES + PYTHON_ROW_BYTES + 2 * w.text_bytes / max(w.rows, 1)
    rows = row_bytes * w.rows  # every row of every part parsed and held (a part's, per part)
    # One index row group's rows: their texts twice, at most its lines' bound (and a line past it) twice
    group = min(w.rows, ROW_GROUP_ROWS)
    text = 2 * w.text_bytes / max(w.rows, 1)
    group_rows = (ROW_INDEX_BYTES * w.rows + (ROW_INDEX_BYTES + PYTHON_ROW_BYTES) * group
                  + min(text * group, 2 * ROW_GROUP_LINE_BYTES + text))
    windows = WINDOW_BYTES * w.tokens // config["saev"]["tokens_per_window"]
    labels = w.rows * 1025 + rows if config["saev"].get("patch_labels") else 0  # labels.bin from the masks
    sample_bytes = 4 * w.d * w.tokens // max(w.rows, 1)  # one sample's rows of one tensor in float32
    # A float32 part's rows are pickled from its mapping (page cache): a thread holds only the compressed
    # blocks in flight, a sample's rows each. A 16-bit part's rows are widened to float32, and the pickler
    # holds every array of a shard until its dump ends (its memo keeps them): a shard a thread, more.
    pickle_shards = config["pickle"]["threads"] * ((BEHIND + 1) * sample_bytes + (
        config["pickle"]["shard_size_mb"] * 1e6 + 2 * sample_bytes if w.itemsize != 4 else 0))
    zarr_records = FILES_JSON_ENTRY_BYTES * zarr_chunks(w, config)  # meta/files.json held whole
    # A zarr shard job's chunk buffers (float32 read + float16 cast), BEHIND more than its threads, and
    # a 16-bit part's rows as read and converted (6 bytes a value), a chunk a thread.
    zarr_threads = config["zarr"]["threads"]
    zarr_buffers = ((zarr_threads + BEHIND) * 6 + (zarr_threads * 6 if w.itemsize != 4 else 0)) \
        * zarr_t_chunk(config, w) * w.d
    buffers = {
        "saev_shards": (BEHIND + 2) * CHUNK_BYTES + windows,  # the ring + a fill's temporaries
        "saev": windows + labels,
        # a ring + its 16-bit casts per file written at once
        "lmprobe_tensors": THREADS * 2 * (BEHIND + 1) * COPY_BYTES + LMPROBE_PLAN_ROW_BYTES * w.rows,
        "lmprobe_dataset": group_rows + 128 * ROW_GROUP_TOKENS + LMPROBE_PLAN_ROW_BYTES * w.rows,
        "pickle_machines": rows / parts + pickle_shards,  # one part at a time
        "zarr_shards": (rows + zarr_records) / parts + zarr_buffers,
        # the meta/files.json of the part it links (their records stream into its job record)
        "zarr_merge_chunks": zarr_records / parts,
        "zarr_merge": ZARR_MERGE_SAMPLE_BYTES * w.rows,
    }[job]
    return int(buffers)


VALIDATE_MEM_MB = 4000  # verify's files at once: pickle shards up to 1 GiB (pickle.check.SHARDS_VERIFY_BYTES)
# A validate share job's estimated reading: 8 h, twice that asked for (_minutes), well within Slurm's 48 h
# cap; the one job a store had ran past it at 100 TB.
VALIDATE_JOB_HOURS = 8
VALIDATE_REPORT_MIN = 30  # validate_stores: the jobs' fingerprints (MBs), the LUT's verify and the SAE's sha256
PLOTS_BASE_MB = 2000  # the validate_plots job: an interpreter with matplotlib and numpy
OPENED_SAMPLE_BYTES = 8 + ROW_INDEX_BYTES  # an opened extraction, a sample: its part's offsets, its row's start


def opened_extraction_mb(config: dict[str, Any], base_mb: int = WRITER_BASE_MB, attempt: int = 1) -> int:
    """mem_mb of a job that opens the whole extraction (extract_index, validate_plots): `base_mb` plus
    every part's offsets and samples.jsonl line index, all held while it runs (1.6 GB at 10^8 samples,
    where a fixed 1,000 MB was asked for)."""
    return _round_mb(base_mb + OPENED_SAMPLE_BYTES * workload(config).rows / 1e6) * attempt


def validate_mem_mb(config: dict[str, Any], attempt: int = 1) -> int:
    """mem_mb of verify in the validate job of the pickle store: VALIDATE_MEM_MB, or where pickle shards
    are larger, four times one (with a tenth for what its opcodes build): a shard is refused past a
    quarter of the job's memory (integrity.memory_budget, from its cgroup's limit), so one must fit in
    that quarter."""
    shard_mb = config["pickle"]["shard_size_mb"] * 1.1 if "pickle" in enabled_stages(config) else 0
    return _round_mb(max(VALIDATE_MEM_MB, 4 * shard_mb)) * attempt


def validate_store_mem_mb(config: dict[str, Any], store: str, attempt: int = 1) -> int:
    """mem_mb of the validate job of `store` (a format, or "extract"): verify's files at once
    (validate_mem_mb for pickle's shards) plus the opened extraction, whose values every job compares."""
    base = validate_mem_mb(config) if store == "pickle" else VALIDATE_MEM_MB
    return opened_extraction_mb(config, base, attempt)


def validate_passes(config: dict[str, Any], store: str) -> float:
    """Reads of the activations by the validate jobs of `store` (a format, or "extract"): verify reads its
    files once and each of its views once more (zarr's merged store a second full view; lmprobe's last
    tokens, a row a prompt, are not counted)."""
    return 3.0 if store == "zarr" and config["zarr"]["merged"] else 2.0


def validate_jobs(config: dict[str, Any], store: str) -> int:
    """The share jobs checking `store` (a format, or "extract"): validate.jobs, or (null) as many as read
    its passes in VALIDATE_JOB_HOURS each at IO_BYTES_PER_S, at least one."""
    jobs = config["validate"].get("jobs")
    seconds = validate_passes(config, store) * workload(config).activation_bytes / IO_BYTES_PER_S
    return jobs or max(1, math.ceil(seconds / (VALIDATE_JOB_HOURS * 3600)))


def validate_runtime(config: dict[str, Any], store: str, attempt: int = 1) -> int:
    """Minutes of one of the validate share jobs of `store` (a format, or "extract")."""
    return io_runtime(config, attempt, jobs=validate_jobs(config, store), passes=validate_passes(config, store))


def writer_mem_mb(config: dict[str, Any], job: str, attempt: int = 1) -> int:
    """mem_mb of format writer job `job`: WRITER_BASE_MB plus writer_buffer_bytes."""
    return _round_mb(WRITER_BASE_MB + writer_buffer_bytes(workload(config), config, job) / 1e6) * attempt


def io_runtime(config: dict[str, Any], attempt: int = 1, jobs: int = 1, passes: float = 2.0) -> int:
    """Minutes for one of `jobs` jobs sharing the work of reading and writing the activations
    `passes` times in total."""
    w = workload(config)
    return _minutes(passes * w.activation_bytes / jobs / IO_BYTES_PER_S, attempt)


def part_jobs_runtime(config: dict[str, Any], attempt: int, stage: str, passes: float, key: str = "jobs") -> int:
    """Minutes for the busiest of `stage`'s jobs over the extraction's parts (write_jobs(config, stage,
    key) of them, jobs.job_items' ranges): `passes` over the activations of each part it takes, the
    most any job takes. A share of the whole by the job count was short where the parts do not divide
    (65 parts in 64 jobs: half the time of the job taking two) or are fewer than the jobs (4 parts in
    16: a quarter of one part's), and Slurm killed the job at its limit."""
    parts = config["extract"]["parts"]
    most = -(-parts // write_jobs(config, stage, key))
    return io_runtime(config, attempt, jobs=parts, passes=passes * most)


def saev_shards_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for the busiest saev_shards job: a job writes whole shards (jobs.job_items' ranges of
    them), each of up to saev.patches_per_shard vectors, the most any job takes. A share of the whole
    by the job count was short where the shards are fewer than the jobs (3 shards of 39 GB in 64 jobs:
    a 64th of the data for a job writing a shard) or do not divide, and Slurm killed the job at its limit."""
    w = workload(config)
    vectors = w.tokens * len(config["saev"].get("layers") or config["extract"]["layers"])
    shards = max(1, -(-vectors // config["saev"]["patches_per_shard"]))
    most = -(-shards // write_jobs(config, "saev"))
    return io_runtime(config, attempt, jobs=shards, passes=2.0 * most)


SAEV_FINISH_MIN = 30  # the saev finishing job without masks: shards hard-linked, small files written
# A segmentation mask read, resized by the model's processor and given a label a patch (patch_labels):
# 4.5 ms measured for 500x375 masks and DINOv2's 256/224 processor on the 2-core dev VM, loaded.
MASK_SECONDS = 0.005


def saev_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for the saev finishing job: SAEV_FINISH_MIN, and with saev.patch_labels every image's
    mask at MASK_SECONDS (labels.bin is computed there): COCO-Stuff's 164k masks took ~14 of a fixed 30."""
    if not config["saev"].get("patch_labels"):
        return SAEV_FINISH_MIN * attempt
    return max(SAEV_FINISH_MIN * attempt, _minutes(workload(config).rows * MASK_SECONDS, attempt))


SAE_MOMENT_TOKENS = 65536  # training tokens read for b_dec's start (sae.data.data_moments' limit)
# Every token's index, once a run: split into training and held-out rows and an epoch's order shuffled
# (sae.data.split_tokens, stream_batches): 80 ns measured on the dev VM.
SAE_TOKEN_SECONDS = 1e-7
SAE_JOB_THREADS = 4  # train_sae's CPUs: rules/sae.smk's threads, profiles/osc's cpus_per_task


def sae_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for train_sae: about 12 x d x num_basis FLOPs per training token (encoder and dense
    decoder, forward and backward) on sae.device (flops_per_second, SAE_JOB_THREADS CPUs), the rows it
    reads (b_dec's sample, sae.steps x sae.batch_size, the held-out evaluation's: sae.eval_tokens, or
    null, every held-out token) four times over (random rows), and every token's index at
    SAE_TOKEN_SECONDS. Sized as reading every token's activations four
    times, a 10B-token run asked the 48 h cap for a thousand steps."""
    w, sae = workload(config), config["sae"]
    trained = sae["steps"] * sae["batch_size"]
    held_out = math.ceil(w.tokens * sae["heldout_fraction"])
    evaluated = min(held_out, sae["eval_tokens"] or held_out)
    flops = 12 * w.d * sae_basis(config, w) * trained
    reads = 4 * (min(w.tokens, SAE_MOMENT_TOKENS) + trained + evaluated) * w.d * w.itemsize
    seconds = flops / flops_per_second(sae["device"], SAE_JOB_THREADS) + reads / IO_BYTES_PER_S
    return _minutes(seconds + w.tokens * SAE_TOKEN_SECONDS, attempt)


def sae_mem_mb(config: dict[str, Any], attempt: int = 1) -> int:
    """Host memory of train_sae: the prefetch ring of float32 batches (pinned on a GPU), the held-out
    evaluation's chunks, the SAE (on the host: its weights, gradients and Adam's two moments; trained
    on a GPU, the trained weights and the state saved from them), the token indices (sae_index_bytes),
    3 GB for torch/CUDA."""
    w = workload(config)
    batches = 8 * config["sae"]["batch_size"] * w.d * 4
    copies = 2 if config["sae"]["device"].startswith("cuda") else 4  # auto may find no GPU
    held = batches + 8192 * w.d * 16 + copies * sae_weight_bytes(config, w)
    return _round_mb((held + sae_index_bytes(w, config["extract"]["parts"])) / 1e6 + 3000) * attempt


def sae_index_bytes(w: Workload, parts: int) -> int:
    """What train_sae holds of token indices: every token's row in its part and an epoch's order of the
    training tokens (sae.data.split_tokens, stream_batches), each int32 where it fits, else int64 (as
    sae.data.index_dtype, which imports torch: the parse does not), and while a part is split, its rows
    and two masks. 12 B a token at 10B tokens (120 GB), where the job asked 5 GB."""
    part_tokens = -(-w.tokens // parts)
    part_index, order = (4 if n <= 2**31 else 8 for n in (part_tokens, w.tokens))
    return w.tokens * (part_index + order) + part_tokens * (part_index + 2)


def sae_basis(config: dict[str, Any], w: Workload) -> int:
    """The SAE's latents, at most: sae.num_basis, or (null) 4x the hook's width, itself at most the
    widest captured vector, w.d."""
    return config["sae"].get("num_basis") or 4 * w.d


def sae_weight_bytes(config: dict[str, Any], w: Workload) -> int:
    """The SAE's float32 encoder and decoder, sae_basis x its input width (at most w.d) each."""
    return 2 * sae_basis(config, w) * w.d * 4


def lut_table_bytes(config: dict[str, Any], w: Workload) -> int:
    """The most bytes build_lut holds in tables at once, about 26 a value of one num_basis x w.d table
    (a target's outputs are counted at w.d: the MLP's width when hooks are captured; an LM head target,
    vocabulary-wide, is not) for one target's, whatever the number of targets: built (build_tables into
    write_lut, one target at a time), the float32 SAE (8), a target's float32 products (4), its three
    16-bit tables (6) and the overflow check's temporaries (about 8, measured); evaluated (the SAE let
    go), a target's 16-bit tables (6), their float32 copies (12) and an encoder's (8). Where the tables
    stay on the host (lut.device not cuda: auto may find no GPU), end_to_end's model holds every
    target's float32 products side by side, twice that while install_luts' torch.cat copies them: 8 a
    value more a target."""
    on_host = not config["lut"]["device"].startswith("cuda")
    return (26 + on_host * 8 * len(config["lut"]["targets"])) * sae_basis(config, w) * w.d


LUT_EVAL_LOGITS = 1 << 27  # logits of one end-to-end LUT evaluation batch, at most (lut.end_to_end)


def lut_mem_mb(config: dict[str, Any], attempt: int = 1) -> int:
    """Host memory of build_lut: the model loaded in float32 on the host first (twice its weight files
    for a 16-bit checkpoint), its tables at their peak (lut_table_bytes), the end-to-end evaluation's
    batch (two runs' float32 outputs and their log-softmaxes: LUT_EVAL_LOGITS each, at most), 3 GB for
    torch/CUDA."""
    w = workload(config)
    return _round_mb(2 * w.weight_bytes / 1e6 * 1.5 + lut_table_bytes(config, w) / 1e6
                     + 6 * LUT_EVAL_LOGITS * 4 / 1e6 + 3000) * attempt


LUT_JOB_THREADS = 4  # build_lut's CPUs: rules/lut.smk's threads, profiles/osc's cpus_per_task
# Reads and writes of a target's table file: written, read for its sha256 and its non-finite check
# (formats.lut.write_table), then twice at each of its two loads (relative_errors', install_luts':
# LutStore.load checks the values, then reads them).
LUT_TABLE_PASSES = 7


def lut_flops(config: dict[str, Any], w: Workload) -> float:
    """build_lut's FLOPs, every target's input and output counted at w.d (as lut_table_bytes counts them):
    each target's products (decoder [B, d] @ W [d, out]); its relative errors on the held-out tokens
    (lut.eval_tokens at most): x @ W once, and at each budget an encoding of its own (x's records are
    dropped after each call), the lookup of k rows and the compensation's reconstruction (k rows) and its
    budget's rows; end to end on lut.eval_samples held-out samples: the original model once, and at each
    budget the LUT one (whose targets' dense products are not taken off) at 2 FLOPs per weight, one
    encoding for the targets (one SAE: one LutEncoder) and each target's lookup and compensation. runtime
    auto's calibration (lut_runtime.CALIBRATION_SECONDS a budget) is within STARTUP_MIN. Counted so at the
    real widths, the relative errors and the end-to-end runs of a LUT of 16,384 latents on the demo's q/k/v
    ran at 20-24 GFLOP/s a thread (wall, one thread, on the 2-core dev VM at a load of 6-8) and 42-51 per
    CPU second: CPU_THREAD_FLOPS is under half of that (the measured runs:
    tests/test_resources_lut_runtime_flops.py)."""
    lut, sae = config["lut"], config["sae"]
    basis, k, d, targets = sae_basis(config, w), sae["k_active"], w.d, len(lut["targets"])
    budgets = [min(budget, d) for budget in lut["budgets"]]
    heldout = min(lut["eval_tokens"], math.ceil(w.tokens * sae["heldout_fraction"]))
    errors = 2 * heldout * d * (d + sum(basis + 2 * k + budget for budget in budgets))
    samples = min(lut["eval_samples"], math.ceil(w.rows * sae["heldout_fraction"]))
    tokens = samples * -(-w.tokens // max(w.rows, 1))
    params = w.weight_bytes / 2  # loaded in float32 whatever model.dtype: at most a 16-bit checkpoint's
    runs = (2 * params + sum(2 * params + 2 * d * basis + targets * 2 * d * (2 * k + budget)
                             for budget in budgets)) * tokens
    return targets * (2 * basis * d * d + errors) + runs


def lut_runtime(config: dict[str, Any], attempt: int = 1) -> int:
    """Minutes for build_lut: lut_flops on lut.device (flops_per_second, LUT_JOB_THREADS CPUs), and
    its reads: the activations twice (the hook's part files are hashed whole beside the rows read,
    PartsCheck), the SAE's file twice (hashed, loaded) and each 16-bit table file (encoder, decoder and
    products, B x d each) LUT_TABLE_PASSES times. Sized by the activations' reads alone, an 8B model's
    LUT on lut.device cpu over 10M tokens asked for 2 h: its end-to-end runs (64 samples of 512 tokens,
    the original model once and the LUT one at each of 4 budgets) are 2.6 PFLOP, 4.6 h on its 4 CPUs at
    40 GFLOP/s each."""
    w = workload(config)
    tables = len(config["lut"]["targets"]) * 3 * sae_basis(config, w) * w.d * 2
    reads = 2 * w.activation_bytes + 2 * sae_weight_bytes(config, w) + LUT_TABLE_PASSES * tables
    rate = flops_per_second(config["lut"]["device"], LUT_JOB_THREADS)
    return _minutes(lut_flops(config, w) / rate + reads / IO_BYTES_PER_S, attempt)
