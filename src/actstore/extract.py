"""Run a model over one part of the dataset and write its token-packed activations."""
from __future__ import annotations

import logging
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from actstore.datasets import Dataset, Sample, load_dataset, part_range
from actstore.errors import ConfigError
from actstore.formats.parts import PartWriter, layer_tensor, write_part
from actstore.io_utils import utc_now
from actstore.models import (LoadedModel, first_tensor, get_module, load_model, model_kind, num_blocks,
                             read_model_config, resolve_model_path)

log = logging.getLogger(__name__)
LOGPROB_CHUNK = 256  # tokens per log-softmax chunk: bounds memory at chunk * vocab floats


def check_layers(layers: list[int], n_blocks: int) -> None:
    bad = [layer for layer in layers if not 0 <= layer < n_blocks]
    if bad:
        raise ConfigError(f"extract.layers: {bad} out of range; the model has blocks 0..{n_blocks - 1}")


def parse_hook(spec: str) -> tuple[str, str]:
    module_path, _, io = spec.rpartition(":")
    if io not in ("input", "output") or not module_path:
        raise ConfigError(f"extract.hooks: {spec!r} must be '<module path>:input' or ':output'")
    return module_path, io


def preflight(config: dict[str, Any]) -> tuple[Path, Dataset]:
    """Every check that needs no weights: model path, layer range, dataset, modality, hooks."""
    model_path = resolve_model_path(config["model"]["path"])
    model_config = read_model_config(model_path)
    check_layers(config["extract"]["layers"], num_blocks(model_config))
    dataset = load_dataset(config["dataset"]["path"], config["dataset"]["limit"])
    want = "image" if model_kind(model_config) == "vision" else "text"
    if dataset.modality != want:
        raise ConfigError(f"dataset.path {config['dataset']['path']} holds {dataset.modality}s "
                          f"but the model at {model_path} takes {want}s")
    for spec in config["extract"]["hooks"]:
        parse_hook(spec)
    return model_path, dataset


@contextmanager
def capture(loaded: LoadedModel, layers: list[int], hooks: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Register forward hooks for block outputs and module inputs/outputs; yield the capture dict."""
    captured: dict[str, torch.Tensor] = {}
    handles = []

    def keep(name: str, use_input: bool):
        def hook(module, args, kwargs, output):
            if use_input:
                source = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            else:
                source = output
            captured[name] = first_tensor(source)
        return hook

    for layer_idx in layers:
        handles.append(loaded.blocks[layer_idx].register_forward_hook(
            keep(layer_tensor(layer_idx), False), with_kwargs=True))
    for spec in hooks:
        module_path, io = parse_hook(spec)
        handles.append(get_module(loaded.model, module_path).register_forward_hook(
            keep(spec, io == "input"), with_kwargs=True))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def tokenize(loaded: LoadedModel, samples: list[Sample], max_seq_length: int) -> list[list[int]]:
    encoded = loaded.preprocessor([s.text for s in samples], truncation=True, max_length=max_seq_length,
                                  add_special_tokens=True)["input_ids"]
    for sample, ids in zip(samples, encoded):
        if not ids:
            raise ConfigError(f"dataset row {sample.sample_idx}: text tokenizes to zero tokens")
    return encoded


def length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Local indices grouped by length (longest first) so batches carry little padding."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def text_batch(loaded: LoadedModel, ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-padded input_ids and attention_mask; pad positions are never stored."""
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), loaded.preprocessor.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    return {"input_ids": input_ids.to(loaded.device), "attention_mask": mask.to(loaded.device)}


def image_batch(loaded: LoadedModel, dataset: Dataset, samples: list[Sample]) -> dict[str, torch.Tensor]:
    from PIL import Image

    images = []
    for sample in samples:
        with Image.open(dataset.image_path(sample)) as img:
            images.append(img.convert("RGB"))
    pixels = loaded.preprocessor(images=images, return_tensors="pt")["pixel_values"]
    return {"pixel_values": pixels.to(loaded.device, loaded.model.dtype)}


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1, NaN at t = 0; chunked over tokens."""
    out = torch.full((ids.shape[0],), float("nan"), dtype=torch.float32)
    for start in range(0, ids.shape[0] - 1, LOGPROB_CHUNK):
        stop = min(start + LOGPROB_CHUNK, ids.shape[0] - 1)
        chunk = torch.log_softmax(logits[start:stop].float(), dim=-1)
        out[start + 1:stop + 1] = chunk.gather(1, ids[start + 1:stop + 1, None].to(chunk.device))[:, 0].cpu()
    return out


def sample_rows(dataset: Dataset, samples: list[Sample], lengths: list[int]) -> list[dict]:
    label_ids = {label: i for i, label in enumerate(dataset.labels)}
    return [
        {"sample_idx": s.sample_idx, "text": s.text, "label": s.label,
         "label_id": label_ids.get(s.label, -1) if s.label is not None else -1,
         "num_tokens": n, "metadata": s.metadata}
        for s, n in zip(samples, lengths)
    ]


def library_versions() -> dict[str, str]:
    import transformers

    import actstore
    return {"actstore": actstore.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def run_part(config: dict[str, Any], part: int, out_dir: str | Path, progress: bool = True) -> dict:
    """Extract part `part` of config's dataset into `out_dir` (atomic); return its part.json dict."""
    ext = config["extract"]
    model_path, dataset = preflight(config)
    torch.manual_seed(0)
    loaded = load_model(model_path, config["model"]["torch_dtype"], ext["device"])
    for spec in ext["hooks"]:
        get_module(loaded.model, parse_hook(spec)[0])
    samples = [dataset.samples[i] for i in part_range(len(dataset.samples), ext["parts"], part)]
    if loaded.kind == "vision":
        lengths = [vision_tokens(loaded, dataset)] * len(samples) if samples else []
        token_ids = None
    else:
        token_ids = tokenize(loaded, samples, ext["max_seq_length"]) if samples else []
        lengths = [len(x) for x in token_ids]
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    tensors = [layer_tensor(i) for i in ext["layers"]] + list(ext["hooks"])
    started = time.perf_counter()
    with write_part(out_dir) as tmp:
        writer = PartWriter(tmp, sample_rows(dataset, samples, lengths), offsets)
        with capture(loaded, ext["layers"], ext["hooks"]) as captured, torch.inference_mode():
            batches = length_batches(lengths, ext["batch_size"])
            for batch in tqdm(batches, desc=f"extract part {part}", unit="batch", disable=not progress):
                run_batch(loaded, dataset, samples, token_ids, batch, captured, writer, ext["logits_topk"])
        meta = writer.finish({
            "part": part, "parts": ext["parts"],
            "sample_range": [samples[0].sample_idx if samples else 0,
                             samples[-1].sample_idx + 1 if samples else 0],
            "n_dataset_samples": len(dataset.samples),
            "tensors": tensors, "layers": list(ext["layers"]), "hooks": list(ext["hooks"]),
            "modality": dataset.modality, "model_kind": loaded.kind,
            "model": {"path": str(model_path), "spec": config["model"]["path"],
                      "name": model_name(config, loaded), "revision": config["model"]["revision"],
                      "model_type": loaded.config.get("model_type"),
                      "architecture": (loaded.config.get("architectures") or [type(loaded.model).__name__])[0],
                      "torch_dtype": config["model"]["torch_dtype"], "blocks_path": loaded.blocks_path,
                      "n_blocks": len(loaded.blocks)},
            "dataset": {"path": str(dataset.root), "name": config["dataset"]["name"] or dataset.root.name,
                        "split": config["dataset"]["split"], "labels": dataset.labels},
            "max_seq_length": ext["max_seq_length"], "batch_size": ext["batch_size"],
            "logits_topk": ext["logits_topk"] if loaded.kind == "causal" else None,
            "device": str(loaded.device), "machine": platform.node(),
            "extraction_duration_seconds": time.perf_counter() - started,
            "created_at": utc_now().isoformat(timespec="seconds"),
            "versions": library_versions(),
        })
    log.info("part %d: %d samples, %d tokens -> %s", part, meta["n_samples"], meta["n_tokens"], out_dir)
    return meta


def model_name(config: dict[str, Any], loaded: LoadedModel) -> str:
    if config["model"]["name"]:
        return config["model"]["name"]
    spec = config["model"]["path"]
    if spec.startswith("package:"):
        return spec.split(":", 1)[1]
    return loaded.config.get("_name_or_path") or loaded.path.name


def vision_tokens(loaded: LoadedModel, dataset: Dataset) -> int:
    """Tokens per image: measured by running the first image through the model once."""
    with capture(loaded, [len(loaded.blocks) - 1], []) as captured, torch.inference_mode():
        loaded.model(**image_batch(loaded, dataset, dataset.samples[:1]))
        return int(captured[layer_tensor(len(loaded.blocks) - 1)].shape[1])


def run_batch(loaded: LoadedModel, dataset: Dataset, samples: list[Sample], token_ids: list[list[int]] | None,
              batch: list[int], captured: dict[str, torch.Tensor], writer: PartWriter, topk: int) -> None:
    captured.clear()
    if token_ids is None:
        inputs = image_batch(loaded, dataset, [samples[i] for i in batch])
    else:
        inputs = text_batch(loaded, [token_ids[i] for i in batch])
    output = loaded.model(**inputs)
    lengths = [writer.offsets[i + 1] - writer.offsets[i] for i in batch]
    for name, tensor in captured.items():
        host = tensor.float().cpu().numpy()
        for row, (local_idx, n) in enumerate(zip(batch, lengths)):
            writer.write_tokens(name, local_idx, host[row, :n])
    if token_ids is not None:
        for row, local_idx in enumerate(batch):
            writer.write_token_values("token_ids.npy", local_idx, np.asarray(token_ids[local_idx]), "int64")
    if loaded.kind == "causal":
        for row, (local_idx, n) in enumerate(zip(batch, lengths)):
            logits = output.logits[row, :n]
            values, indices = torch.topk(logits[n - 1].float(), topk)
            writer.write_row("topk_values.npy", local_idx, values.cpu().numpy(), "float32")
            writer.write_row("topk_indices.npy", local_idx, indices.cpu().numpy(), "int64")
            ids = inputs["input_ids"][row, :n]
            writer.write_token_values("token_logprob.npy", local_idx, token_logprobs(logits, ids).numpy(), "float32")


def write_index(extract_dir: str | Path, index_path: str | Path) -> dict:
    """Summarise all parts of an extraction (totals, tensors, per-part part.json sha256) in one JSON."""
    from actstore.formats.parts import PART_META, open_extraction
    from actstore.io_utils import sha256_file, write_json_atomic

    extraction = open_extraction(extract_dir)
    seen = [row["sample_idx"] for _, _, row in extraction.iter_samples()]
    if seen != list(range(len(seen))):
        raise ConfigError(f"{extract_dir}: parts do not cover sample_idx 0..{len(seen) - 1} exactly once")
    index = {
        "n_samples": extraction.n_samples, "n_tokens": extraction.n_tokens,
        "tensors": extraction.tensor_names, "layers": extraction.meta["layers"],
        "model": extraction.meta["model"], "dataset": extraction.meta["dataset"],
        "extraction_duration_seconds": sum(p.meta["extraction_duration_seconds"] for p in extraction.parts),
        "parts": [{"dir": p.dir.name, "n_samples": p.meta["n_samples"], "n_tokens": p.meta["n_tokens"],
                   "sample_range": p.meta["sample_range"], "part_json_sha256": sha256_file(p.dir / PART_META)}
                  for p in extraction.parts],
    }
    write_json_atomic(index_path, index)
    return index
