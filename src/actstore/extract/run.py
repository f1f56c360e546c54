"""Run a model over one part of the dataset and write its token-packed activations (one pipeline,
CPU and GPU): inputs (inputs.py) -> forward with capture hooks (capture.py) -> packed on the device
-> staging buffers and writer threads (pipeline.py) -> the part directory (formats/extract/)."""
from __future__ import annotations

import itertools
import logging
import platform
import time
from contextlib import ExitStack, closing, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from actstore.config import resolve_hook
from actstore.datasets import Dataset, Sample, configured_dataset, read_scan
from actstore.datasets.images import IMAGE_DECODING, check_images
from actstore.errors import ConfigError
from actstore.extract.capture import capture, check_reached, check_shapes, parse_hook
from actstore.extract.device_images import check_device_pipeline, device_image_batches
from actstore.extract.inputs import (TokenIds, check_vocabulary, default_workers, given_token_ids, image_batches,
                                     length_batches, text_batches, to_model, tokenize)
from actstore.extract.logprobs import TokenLogprobs
from actstore.extract.pipeline import BatchRows, WritePipeline
from actstore.formats.extract import (NON_FINITE_KEY, NON_FINITE_LOGITS_KEY, OVERFLOW_KEY, PartWriter, layer_tensor,
                                      tensor_file, write_part)
from actstore.formats.lmprobe import check_dataset_labels
from actstore.io_utils import utc_now
from actstore.model_config import (VISION_TOWER_OF, check_layers, check_logits_topk, check_sequence_length, config_int,
                                   modality_hint, model_kind, resolve_model_path, run_config, run_dtype, saved_dtype,
                                   storage_dtype, trusted)
from actstore.model_identity import MODEL_FILES_KEY, model_files
from actstore.models import (TORCH_DTYPES, LoadedModel, get_module, gpu_label, gpu_precision_warning, host_to_device,
                             load_image_processor, load_model, load_tokenizer, mistral_regex_fixed, model_skeleton,
                             pick_device)

log = logging.getLogger(__name__)


def preflight(config: dict[str, Any], part: int, scan: str | Path | None = None) -> tuple[Path, Dataset]:
    """Every check that needs no weights: model path, layer range, dataset (part `part`'s rows
    read, from the dataset scan file `scan` when given, else scanned here), modality, hooks."""
    model_path = resolve_model_path(config["model"]["path"])
    model_config = run_config(config["model"])
    check_layers(config["extract"]["layers"], model_config)
    check_sequence_length(config["extract"]["max_seq_length"], model_config, model_path)
    check_logits_topk(config["extract"]["logits_topk"], model_config)
    dataset = configured_dataset(config, model_path, part, read_scan(scan) if scan else None)
    check_dataset_labels(config, dataset.labels)
    want = "image" if model_kind(model_config) == "vision" else "text"
    if dataset.modality != want:
        raise ConfigError(f"dataset.path {config['dataset']['path']} holds {dataset.modality}s but the model at "
                          f"{model_path} (model_type {model_config.get('model_type')}) takes {want}s"
                          + modality_hint(model_config))
    check_hooks(config)
    return model_path, dataset


def check_hooks(config: dict[str, Any]) -> None:
    """Each extract.hooks module path found in the model's module tree (no weights: seconds), and when the
    lut stage runs each lut.targets module a linear map (lut_runtime.target_weight); ConfigError naming the
    path and what the module it stops at holds, or the target's type. The dataset scan job runs it too: a
    misspelt hook passed `snakemake -n` and stopped each part's job, on Slurm after its wait for a GPU, and
    a target of another kind (an embedding) stopped the sae job, after every part. sae.import's headers
    are checked too (check_sae_import)."""
    if config["extract"]["hooks"]:
        from actstore.lut_runtime import target_weight

        skeleton = model_skeleton(resolve_model_path(config["model"]["path"]), config["model"].get("tower"),
                                  trusted(config["model"]))
        for spec in config["extract"]["hooks"]:
            get_module(skeleton, parse_hook(spec)[0])
        if config["sae"]["enabled"] and config["lut"]["enabled"]:
            for path in config["lut"]["targets"]:
                target_weight(get_module(skeleton, path, "lut.targets"), f"lut.targets: {path!r}")
        if config["sae"]["enabled"] and config["sae"]["import"]:
            check_sae_import(config, skeleton)


def check_sae_import(config: dict[str, Any], skeleton: nn.Module) -> None:
    """sae.import's headers checked as the import_sae job checks them (read_import_header: cfg.json,
    tensor names and shapes, d_in), against sae.hook's width where its module's kind gives it
    (hook_width; else the job checks the extraction's): that job named an SAE of another width, or a
    cfg.json it refuses (architecture jumprelu), only after every extraction part had run."""
    from actstore.sae.checkpoint import read_import_header

    hook = resolve_hook(config)
    module_path, io = parse_hook(hook)
    imported = config["sae"]["import"]
    read_import_header(imported["path"], imported["style"], config["sae"]["k_active"],
                       hook_width(get_module(skeleton, module_path), io), hook)


def hook_width(module: nn.Module, io: str) -> int | None:
    """The hidden size (last dimension) of the tensor a hook on `module`'s `io` (input or output)
    captures, where the module's kind fixes it: nn.Linear (in_features, out_features), a transformers
    Conv1D (its weight [in, out]), nn.LayerNorm and nn.RMSNorm (their normalized_shape's last, in and
    out), nn.Embedding's output (embedding_dim). None for any other kind: only the captured tensor tells."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
        return module.in_features if io == "input" else module.out_features
    if isinstance(module, Conv1D):
        return module.weight.shape[0 if io == "input" else 1]
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.normalized_shape:
        return module.normalized_shape[-1]
    if isinstance(module, nn.Embedding) and io == "output":
        return module.embedding_dim
    return None


def run_part(config: dict[str, Any], part: int, out_dir: str | Path, progress: bool = True,
             threads: int | None = None, scan: str | Path | None = None) -> dict:
    """Extract part `part` of config's dataset into `out_dir` (atomic); return its part.json dict.
    `threads`: the CPUs the job was given (image decoding workers when extract.num_workers is null).
    `scan`: the dataset's scan file (datasets.write_scan), so that the job reads only its rows."""
    # The image batches are closed however the part ends: an error's traceback keeps _run_part's frame
    # (a notebook keeps the last error), and with it their decoding workers (and the gpu pipeline's
    # thread, with the GPU memory it holds) lived on beside the next part run in the process.
    with ExitStack() as ends:
        return _run_part(config, part, out_dir, progress, threads, scan, ends)


def _run_part(config: dict[str, Any], part: int, out_dir: str | Path, progress: bool, threads: int | None,
              scan: str | Path | None, ends: ExitStack) -> dict:
    began, steps = time.perf_counter(), {}

    def step_done(name: str) -> None:  # part.json extraction_waits.startup_steps
        steps[name] = round(time.perf_counter() - began, 3)
    ext = config["extract"]
    model_path, dataset = preflight(config, part, scan)
    # Picked before decoding or tokenizing: a job given a GPU that torch cannot see stops here.
    device = pick_device(ext["device"], "extract.device")
    step_done("preflight")
    samples = dataset.samples
    cpus = default_workers(threads)
    vision = dataset.modality == "image"
    workers = (ext["num_workers"] if ext["num_workers"] is not None else cpus) if vision else 0
    dtype = run_dtype(config["model"])
    if vision:  # every image has the same token count: the batches are known before the model is
        batches = length_batches([1] * len(samples), ext["batch_size"])
        preprocessor = load_image_processor(model_path, trusted(config["model"]))
        step_done("image_processor")
        if ext["image_pipeline"] == "gpu":  # workers forked, the decoding thread started, then the probe
            pixels = ends.enter_context(closing(device_image_batches(
                preprocessor, dataset.opener, samples, batches, workers, device, TORCH_DTYPES[dtype])))
            check_device_pipeline(preprocessor, device)
        else:
            pixels = ends.enter_context(closing(image_batches(
                preprocessor, dataset.opener, samples, batches, workers, device.type == "cuda", TORCH_DTYPES[dtype])))
        step_done("image_workers")
        # The workers decode the first batches while every image's header is checked here, still
        # before the weights load: decoding, an image part's bound, starts as early as it can.
        check_images(dataset.opener, samples, cpus)
        step_done("image_checks")
    elif ext["image_pipeline"] == "gpu":
        raise ConfigError(f"extract.image_pipeline gpu decodes images, and the dataset is {dataset.modality}: "
                          "remove the key")
    else:  # tokenized before the weights load: a text it cannot take is named in seconds, not after them
        preprocessor = load_tokenizer(model_path, trusted(config["model"]), config["model"].get("fix_mistral_regex"))
        token_ids = text_token_ids(config, preprocessor, dataset)
        lengths = token_ids.lengths()
        batches = length_batches(lengths, ext["batch_size"], run_config(config["model"]).get("model_type"))
    step_done("inputs")
    torch.manual_seed(0)
    loaded_files = model_files(model_path)  # what it loads (model_identity: a folder changed later is named)
    loaded = load_model(model_path, dtype, str(device), config["model"].get("tower"),
                        trusted(config["model"]), preprocessor)
    if loaded.device.type == "cuda" and (advice := gpu_precision_warning(
            config["model"]["torch_dtype"], dtype, saved_dtype(loaded.config),
            torch.cuda.get_device_name(loaded.device), torch.cuda.get_device_capability(loaded.device))):
        log.warning("%s", advice)
    step_done("model_load")
    if vision:
        # The first batch's items, which the workers decoded while the weights loaded: its first image
        # gives the tokens per image, then it goes to the model with the rest (decoding an image again
        # in this process, beside busy workers, delayed every image part's first batch).
        first = next(pixels, None)
        lengths = [vision_tokens(loaded, first[0][:1])] * len(samples) if first else []
        step_done("tokens_per_image")
        token_ids = None
        inputs = to_model(loaded, itertools.chain([first] if first else [], pixels))
    else:
        inputs = text_batches(loaded, token_ids, batches, last_logits_only=not head_hooked(loaded, ext["hooks"]))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    started = time.perf_counter()
    with write_part(out_dir) as tmp:
        rows = sample_rows(dataset, samples, lengths, None if token_ids is None else token_ids.cut)
        writer = PartWriter(tmp, rows, offsets, hash_threads=cpus)
        counts, waited = extract_batches(loaded, ext, zip(batches, inputs, strict=True), lengths, token_ids,
                                         writer, TORCH_DTYPES[storage_dtype(config)],
                                         tqdm(total=len(batches), desc=f"extract part {part}", unit="batch",
                                              disable=not progress), cpus)
        waited["startup_seconds"] = round(started - began, 3)
        waited["startup_steps"] = steps
        log.info("part %d: %.2f s of startup, then %d batches in %.2f s; waited %.2f s for inputs and %.2f s for a "
                 "free staging buffer; the busiest writer thread worked %.2f s; the forward calls took %.2f s, and "
                 "the main thread %.2f s of CPU", part, waited["startup_seconds"], len(batches),
                 waited["batches_seconds"], waited["input_wait_seconds"], waited["staging_wait_seconds"],
                 waited["busiest_writer_seconds"], waited["forward_seconds"], waited["main_thread_cpu_seconds"])
        if overflow := counts.get(OVERFLOW_KEY):
            log.warning("part %d: %d finite activations beyond +-65504 are stored as +-inf (storage dtype "
                        "float16; extract.storage_dtype bfloat16 or float32 keeps them)", part, overflow)
        if non_finite := counts.get(NON_FINITE_KEY):
            log.warning("part %d: %d activations the model computed are NaN or +-inf, stored as computed (part.json "
                        "%s; in float16, model.torch_dtype bfloat16 or float32 may avoid them)", part, non_finite,
                        NON_FINITE_KEY)
        if non_finite := counts.get(NON_FINITE_LOGITS_KEY):
            log.warning("part %d: %d top-k logits or token log-probs the model computed are NaN (or +inf logits), "
                        "stored as computed (part.json %s)", part, non_finite, NON_FINITE_LOGITS_KEY)
        truncated = None if token_ids is None else token_ids.truncated
        if truncated:
            log.warning("part %d: %d of %d texts were longer than extract.max_seq_length %d; their first %d "
                        "tokens are stored (part.json n_truncated_samples)", part, truncated, len(samples),
                        ext["max_seq_length"], ext["max_seq_length"])
        meta = writer.finish(part_meta(config, loaded, dataset, samples, part, model_path) | {
            "storage_dtype": storage_dtype(config), "num_workers": workers, MODEL_FILES_KEY: loaded_files,
            "image_pipeline": ext["image_pipeline"] if vision else None,
            "image_decoding": IMAGE_DECODING if vision else None,
            # transformers picks a processor's backend by what is installed (torchvision, else PIL),
            # and the two differ in the pixels: which one ran is on record.
            "image_processor": type(preprocessor).__name__ if vision else None,
            "extraction_duration_seconds": time.perf_counter() - started, "extraction_waits": waited} | counts | (
            {} if token_ids is None else {"n_truncated_samples": truncated}))
    log.info("part %d: %d samples, %d tokens -> %s", part, meta["n_samples"], meta["n_tokens"], out_dir)
    return meta


def text_token_ids(config: dict[str, Any], tokenizer: Any, dataset: Dataset) -> TokenIds:
    """The part's token ids: its texts tokenized by the model's tokenizer, or its given ids checked
    against the vocabulary, cut to extract.max_seq_length."""
    max_seq_length = config["extract"]["max_seq_length"]
    vocab = config_int(run_config(config["model"]), "vocab_size")
    if dataset.pretokenized:
        return given_token_ids(tokenizer, vocab, dataset.samples, max_seq_length)
    token_ids = tokenize(tokenizer, dataset.samples, max_seq_length, not dataset.chat)
    # A token added to the tokenizer (a chat or tool token) that the model's embedding lacks
    check_vocabulary(token_ids, dataset.samples, vocab, "a token of the tokenizer past the model's embedding")
    return token_ids


def writer_threads(ext: dict[str, Any], cpus: int) -> int:
    """extract.writer_threads, or (null) one per captured tensor up to the job's CPUs: each thread
    owns its files and hashes them as they fill (see io_utils.TreeHashFile)."""
    return ext["writer_threads"] or max(1, min(cpus, len(ext["layers"]) + len(ext["hooks"])))


def extract_batches(loaded: LoadedModel, ext: dict[str, Any], batches: Iterator[tuple[list[int], dict]],
                    lengths: list[int], token_ids: TokenIds | None, writer: PartWriter,
                    dtype: torch.dtype, bar: tqdm, cpus: int) -> tuple[dict[str, int], dict[str, float]]:
    """Forward every batch with the capture hooks on and hand its packed tensors to the pipeline.
    Returns the part's counts that are not zero, counted on the device and read once at the end (no
    sync per batch): the finite activations a float16 storage dtype overflowed to +-inf
    (OVERFLOW_KEY), the activations the model computed as NaN or +-inf (NON_FINITE_KEY), the logits
    and log-probs it computed as NaN or +inf (NON_FINITE_LOGITS_KEY); and where the run waited (waits)."""
    logprobs = TokenLogprobs(loaded) if ext["token_logprobs"] and loaded.kind == "causal" else None
    started, arriving = time.perf_counter(), iter(batches)
    spent = dict.fromkeys(("input_wait", "forward", "pack", "submit"), 0.0)  # the main thread's wall seconds
    cpu_started = time.thread_time()
    with WritePipeline(writer, loaded.device, ext["buffers"], writer_threads(ext, cpus)) as pipeline, \
            capture(loaded, ext["layers"], ext["hooks"]) as captured, torch.inference_mode(), bar, \
            logprobs.attached() if logprobs else nullcontext():
        # Counted for a float16 model too: a module it keeps in float32 (T5's `wo`) makes its block
        # outputs float32, and those can pass float16's range where the model's own tensors cannot.
        counters = {key: torch.zeros((), dtype=torch.int64, device=loaded.device) for key in (
            NON_FINITE_KEY, NON_FINITE_LOGITS_KEY, *([OVERFLOW_KEY] if dtype == torch.float16 else []))}
        while True:
            asked = time.perf_counter()
            if (item := next(arriving, None)) is None:
                break
            forwarded = time.perf_counter()
            spent["input_wait"] += forwarded - asked
            batch, inputs = item
            captured.clear()
            rows = BatchRows(np.asarray(batch, dtype=np.int64), np.asarray([lengths[i] for i in batch]))
            try:
                with last_token_head(loaded, inputs, rows):
                    output = loaded.model(**inputs)
                check_reached(captured, ext["layers"], ext["hooks"], loaded)
                check_shapes(captured, ext["layers"], ext["hooks"], loaded, len(batch), batch_width(inputs, rows))
                packing = time.perf_counter()
                packed = pack_batch(loaded, inputs, output, captured, rows, token_ids, dtype, ext["logits_topk"],
                                    logprobs, counters)
            except torch.OutOfMemoryError as exc:
                raise ConfigError(out_of_memory(loaded, ext, rows, token_ids is None)) from exc
            submitting = time.perf_counter()
            pipeline.submit(rows, *packed)
            # Dropped before the next forward (the copies to the host keep what they still read): held
            # through it, a batch's packed captures and logits raised every later batch's peak memory
            # above the first batch's, which out_of_memory's advice takes for the part's.
            del output, packed
            bar.update()
            spent["forward"] += packing - forwarded
            spent["pack"] += submitting - packing
            spent["submit"] += time.perf_counter() - submitting
        counts = {key: int(counter) for key, counter in counters.items()}
        spent["main_cpu"] = time.thread_time() - cpu_started
    return {key: n for key, n in counts.items() if n}, waits(time.perf_counter() - started, spent, pipeline)


def batch_width(inputs: dict[str, torch.Tensor], rows: BatchRows) -> int:
    """The batch's padded token count, which every captured tensor's dim 1 must be: the texts' padded
    input_ids, else the tokens of each image (one count for all)."""
    return inputs["input_ids"].shape[1] if "input_ids" in inputs else int(rows.n_tokens[0])


def out_of_memory(loaded: LoadedModel, ext: dict[str, Any], rows: BatchRows, images: bool) -> str:
    """What to change when a batch does not fit in the GPU's memory. Batches run longest first
    (length_batches), so the first batch is the largest: a size that passes it passes the part (a
    PADDING_SENSITIVE_TYPES model's batches each hold one length: its first may hold fewer texts)."""
    n = len(rows.n_tokens)
    what = f"{n} images" if images else f"{n} texts of up to {rows.n_tokens.max()} tokens"
    peak = torch.cuda.max_memory_allocated(loaded.device) / 1e9
    total = torch.cuda.get_device_properties(loaded.device).total_memory / 1e9
    shorter = "" if images else f" or extract.max_seq_length ({ext['max_seq_length']})"
    return (f"{gpu_label(loaded.device)} ran out of memory on a batch of {what} "
            f"(torch's peak {peak:.1f} of {total:.1f} GB): lower extract.batch_size ({ext['batch_size']}){shorter}; "
            "batches run longest first, so a size that passes the first batch passes the whole part")


def waits(batches_s: float, spent: dict[str, float], pipeline: WritePipeline) -> dict[str, float]:
    """part.json extraction_waits: which side bounds the run (docs/formats/extract.md). Close to
    batches_seconds, input_wait: decoding or tokenizing; staging_wait: the writers (disk, hashing),
    with busiest_writer the one thread that was busy all along; all small: the model's forward.
    Where the main thread's own time went: forward, pack and submit (less its staging wait), and its
    CPU seconds, which fall short of those when it waited on something else (the GIL, the device)."""
    return {"batches_seconds": round(batches_s, 3), "input_wait_seconds": round(spent["input_wait"], 3),
            "staging_wait_seconds": round(pipeline.staging_wait, 3),
            "busiest_writer_seconds": round(max(pipeline.busy, default=0.0), 3),
            "forward_seconds": round(spent["forward"], 3), "pack_seconds": round(spent["pack"], 3),
            "submit_seconds": round(spent["submit"] - pipeline.staging_wait, 3),
            "main_thread_cpu_seconds": round(spent["main_cpu"], 3)}


def pack_batch(loaded: LoadedModel, inputs: dict[str, torch.Tensor], output: Any,
               captured: dict[str, torch.Tensor], rows: BatchRows, token_ids: TokenIds | None,
               dtype: torch.dtype, topk: int, logprobs: TokenLogprobs | None,
               counters: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The batch's files on the device, padding dropped: token tensors (n_tokens, ...) in batch
    order and per-sample rows. Log-probs (when `logprobs`) and top-k for all rows at once (no per-row
    device sync). `counters` (device scalars, extract_batches' keys) add up the batch's counts:
    OVERFLOW_KEY, when given, the finite values the cast to `dtype` made inf."""
    width = next(iter(captured.values())).shape[1]
    keep_host = np.flatnonzero(np.arange(width) < rows.n_tokens[:, None])  # row j's tokens at j * width + t
    keep = host_to_device(torch.from_numpy(keep_host), loaded.device)
    tokens = {}
    # The captured tensors are packed first: the log-probs' head rerun fires the hooks again.
    for name, tensor in captured.items():
        computed = packed(tensor, keep)
        tokens[tensor_file(name)] = stored = computed.to(dtype)
        finite = computed.isfinite()
        counters[NON_FINITE_KEY].add_(finite.numel() - finite.sum())
        if OVERFLOW_KEY in counters and computed.dtype != dtype:  # a float16 tensor's infs are the model's own
            counters[OVERFLOW_KEY].add_((stored.isinf() & finite).sum())
    per_row: dict[str, torch.Tensor] = {}
    if token_ids is not None:
        tokens["token_ids.npy"] = torch.from_numpy(np.concatenate([token_ids[i] for i in rows.local_idx]))
    if loaded.kind == "causal":
        last = host_to_device(torch.from_numpy(rows.n_tokens - 1), loaded.device)
        # last_token_head fed the LM head each row's last position only, else it ran at all of them
        at = torch.zeros_like(last) if "logits_to_keep" in inputs else last
        if "logits_to_keep" in inputs and output.logits.shape[1] != 1:
            raise ConfigError(f"model.path {loaded.path}: its forward computed logits without calling its output "
                              "embeddings (get_output_embeddings()), so which position each row's logits are "
                              "is unknown: a causal LM's top-k logits are always kept (extract.logits_topk is "
                              "at least 1), and one whose head cannot be narrowed to each text's last token "
                              "is not supported")
        last_logits = output.logits[torch.arange(len(last), device=last.device), at]
        if logprobs is not None:
            tokens["token_logprob.npy"] = scored = logprobs.packed(inputs["input_ids"], keep_host, rows.n_tokens,
                                                                   last_logits)
            counters[NON_FINITE_LOGITS_KEY].add_(scored.isnan().sum() - len(rows.n_tokens))  # first tokens: NaN
        values, indices = top_tokens(last_logits.float(), topk)
        counters[NON_FINITE_LOGITS_KEY].add_((values.isnan() | values.isposinf()).sum())
        per_row = {"topk_values.npy": values, "topk_indices.npy": indices}
    return tokens, per_row


@contextmanager
def last_token_head(loaded: LoadedModel, inputs: dict[str, torch.Tensor], rows: BatchRows) -> Iterator[None]:
    """While the batch's forward runs, its LM head sees each row's last position only: logits_to_keep
    (text_batch) keeps the batch's distinct last positions for every row, (batch, distinct, vocab)
    logits where one per row is read (at Gemma 3's vocabulary and 32 lengths, 1 GB of float32)."""
    keep = inputs.get("logits_to_keep")
    if keep is None:
        yield
        return
    at = torch.searchsorted(keep, host_to_device(torch.from_numpy(rows.n_tokens - 1), loaded.device))
    rows_at = torch.arange(len(at), device=at.device)
    handle = loaded.model.get_output_embeddings().register_forward_pre_hook(
        lambda head, args: (args[0][rows_at, at][:, None], *args[1:]))  # (batch, 1, hidden)
    try:
        yield
    finally:
        handle.remove()


def top_tokens(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk of float32 (rows, vocab) logits with ties ranked by lower token id: torch leaves their
    order (and which tied tokens make the k) to its selection, which depends on the rest of the row.
    Ranked by one int64 key a token: the value's bits made monotone, then the id reversed. -0.0 is
    keyed as +0.0 (adding +0.0), an equal value that the bits alone ranked below it whatever the ids;
    every NaN as one positive NaN, first as torch.topk ranks it (x86 makes inf - inf a NaN with the sign
    bit set, which the bits alone ranked below -inf: out of the top-k, and not counted); the values
    returned are the logits' own."""
    bits = torch.where(logits.isnan(), float("nan"), logits + 0.0).view(torch.int32)
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    ids = torch.arange(logits.shape[1], dtype=torch.int64, device=logits.device)
    indices = torch.topk(monotone * (1 << 32) + (0xFFFFFFFF - ids), k).indices
    return logits.gather(1, indices), indices


def head_hooked(loaded: LoadedModel, hooks: list[str]) -> bool:
    """A hook on the LM head itself: it must see every position (its input is the final hidden states,
    its output the logits), so the forward's head runs at all of them."""
    head = loaded.model.get_output_embeddings() if loaded.kind == "causal" else None
    return head is not None and any(get_module(loaded.model, parse_hook(spec)[0]) is head for spec in hooks)


def packed(tensor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(batch, width, ...) -> (kept tokens, ...): the rows of flat positions `keep`."""
    return tensor.reshape(tensor.shape[0] * tensor.shape[1], *tensor.shape[2:]).index_select(0, keep)


def sample_rows(dataset: Dataset, samples: list[Sample], lengths: list[int], cut: np.ndarray | None) -> list[dict]:
    """samples.jsonl's rows. `cut` (TokenIds.cut; None for images, which are never cut, or a tokenizer that
    cannot tell): a text cut at max_seq_length gets `"truncated": true`, and only such a row, so every other
    row keeps the bytes it had before the field."""
    label_ids = {label: i for i, label in enumerate(dataset.labels)}
    return [
        {"sample_idx": s.sample_idx, "text": s.text, "label": s.label,
         "label_id": label_ids.get(s.label, -1) if s.label is not None else -1,
         "num_tokens": n, **({"truncated": True} if cut is not None and cut[i] else {}), "metadata": s.metadata}
        for i, (s, n) in enumerate(zip(samples, lengths))
    ]


def part_meta(config: dict[str, Any], loaded: LoadedModel, dataset: Dataset, samples: list[Sample],
              part: int, model_path: Path) -> dict[str, Any]:
    """part.json fields that describe what was run (the writer adds sizes, checksums and counts)."""
    ext = config["extract"]
    return {
        "part": part, "parts": ext["parts"],
        "sample_range": [samples[0].sample_idx if samples else 0, samples[-1].sample_idx + 1 if samples else 0],
        "n_dataset_samples": dataset.n_samples,
        "tensors": [layer_tensor(i) for i in ext["layers"]] + list(ext["hooks"]),
        "layers": list(ext["layers"]), "hooks": list(ext["hooks"]),
        "modality": dataset.modality, "model_kind": loaded.kind,
        "model": {"path": str(model_path), "spec": config["model"]["path"],
                  "name": model_name(config, loaded), "revision": config["model"]["revision"],
                  "model_type": loaded.config.get("model_type"),
                  "architecture": (loaded.config.get("architectures") or [type(loaded.model).__name__])[0],
                  "torch_dtype": run_dtype(config["model"]), "blocks_path": loaded.blocks_path,
                  "n_blocks": len(loaded.blocks), **tower_record(config["model"], loaded),
                  # whether a flagged Mistral-family tokenizer ran with transformers' corrected regex
                  **({"fix_mistral_regex": fixed} if (fixed := mistral_regex_fixed(loaded.preprocessor)) is not None
                     else {}),
                  # the classes that ran were the folder's own code (config.json auto_map)
                  **({"auto_map": loaded.config["auto_map"]}
                     if trusted(config["model"]) and "auto_map" in loaded.config else {})},
        "dataset": {"path": str(dataset.root), "name": config["dataset"]["name"] or dataset.root.name,
                    "split": config["dataset"]["split"], "labels": dataset.labels},
        "max_seq_length": ext["max_seq_length"], "batch_size": ext["batch_size"],
        "logits_topk": ext["logits_topk"] if loaded.kind == "causal" else None,
        "device": str(loaded.device), "machine": platform.node(),
        # which GPU ran it: its kernels set the low bits of 16-bit activations
        **({"device_name": torch.cuda.get_device_name(loaded.device)} if loaded.device.type == "cuda" else {}),
        # on a CPU, torch's thread count: its matrix products split their sums by it (the low bits)
        **({"torch_threads": torch.get_num_threads()} if loaded.device.type == "cpu" else {}),
        "created_at": utc_now().isoformat(timespec="seconds"),
        "versions": library_versions(),
    }


def library_versions() -> dict[str, str]:
    import transformers

    import actstore
    return {"actstore": actstore.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def tower_record(model: dict[str, Any], loaded: LoadedModel) -> dict[str, str]:
    """part.json's record of model.tower when set: the tower that ran, and for a vision tower the
    checkpoint's own model_type (model_type is the tower's)."""
    if not model.get("tower"):
        return {}
    return {"tower": model["tower"], **({"checkpoint_model_type": loaded.config[VISION_TOWER_OF]}
                                        if VISION_TOWER_OF in loaded.config else {})}


def model_name(config: dict[str, Any], loaded: LoadedModel) -> str:
    if config["model"]["name"]:
        return config["model"]["name"]
    spec = config["model"]["path"]
    if spec.startswith("package:"):
        return spec.split(":", 1)[1]
    return loaded.config.get("_name_or_path") or loaded.path.name


def vision_tokens(loaded: LoadedModel, pixels: torch.Tensor) -> int:
    """Tokens per image: measured by running one image's processed pixels through the model once."""
    with capture(loaded, [len(loaded.blocks) - 1], []) as captured, torch.inference_mode():
        loaded.model(pixel_values=pixels.to(loaded.device))
        return int(captured[layer_tensor(len(loaded.blocks) - 1)].shape[1])
