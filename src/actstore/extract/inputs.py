"""Model inputs batch by batch: texts tokenized up front and grouped by length; images (files, or
bytes read from a table) decoded and run through the model's own image processor in DataLoader
worker processes."""
from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Generator, Iterator, Sequence

import numpy as np
import torch

from actstore.datasets import Dataset, Sample
from actstore.datasets.images import ImageOpener
from actstore.errors import ActstoreError, ConfigError
from actstore.io_utils import lower_priority
from actstore.model_config import PADDING_SENSITIVE_TYPES
from actstore.models import LoadedModel, host_to_device
from actstore.resources import IMAGES_PER_ITEM, items_ahead

log = logging.getLogger(__name__)

TOKENIZE_TOKENS = 1 << 20  # tokens the tokenizer encodes at once, at most: its Python lists take ~230 B a token
# Characters the tokenizer encodes at once beyond a single text: it encodes each text whole before
# cutting it to max_seq_length (the test tokenizer, 40 texts of 1M characters cut to 16 tokens: 4.1 GB
# of host memory in one call, 1.3 GB in calls of TOKENIZE_CHARS), so books ran a part out of memory.
TOKENIZE_CHARS = 1 << 22
# Seconds the model's side waits for one DataLoader item (IMAGES_PER_ITEM images) before naming its rows:
# a worker blocked on a file that never comes (a stalled network file system) otherwise held the job, and
# its GPU, to Slurm's time limit. Far past any item's decoding (16 of PIL's largest images take seconds).
ITEM_TIMEOUT_S = 1800


class TokenIds:
    """Every sample's token ids in one flat int64 array and its offsets: 8 B a token, where the
    tokenizer's lists for a whole part held ~230 B a token (measured on the demo tokenizer)."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray, cut: np.ndarray | None):
        self.flat, self.offsets = flat, offsets
        self.cut = cut  # bool per sample: cut at max_seq_length (None: the tokenizer cannot tell)

    @property
    def truncated(self) -> int | None:
        """How many samples were cut at max_seq_length (None: the tokenizer cannot tell)."""
        return None if self.cut is None else int(self.cut.sum())

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self) -> list[int]:
        return np.diff(self.offsets).tolist()


def tokenize(tokenizer: Any, samples: list[Sample], max_seq_length: int,
             add_special_tokens: bool = True) -> TokenIds:
    """Token ids per sample; add_special_tokens=False for rendered chat templates (they hold their own).
    Encoded a run of texts at a time (text_runs; each text is encoded alone: the ids are the same as
    one call's). The texts cut at max_seq_length are marked: a fast tokenizer keeps what it cut as
    each encoding's `overflowing` (a slow one keeps nothing: None)."""
    chunks, lengths = [], [0]
    cut: list[bool] | None = []
    empty: list[int] = []  # rows with no token: every one of the part is named at once
    for rows in text_runs(samples, max(1, TOKENIZE_TOKENS // max_seq_length)):
        batch = tokenizer([s.text for s in rows], truncation=True, max_length=max_seq_length,
                          add_special_tokens=add_special_tokens)
        encoded = batch["input_ids"]
        if cut is None or batch.encodings is None:
            cut = None
        else:
            cut += [bool(e.overflowing) for e in batch.encodings]
        empty += [sample.sample_idx for sample, ids in zip(rows, encoded) if not ids]
        lengths += [len(ids) for ids in encoded]
        chunks.append(np.fromiter(itertools.chain.from_iterable(encoded), np.int64, sum(lengths[-len(rows):])))
    if empty:
        raise ConfigError(zero_token_rows(empty))
    flat = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    return TokenIds(flat, np.cumsum(lengths, dtype=np.int64), None if cut is None else np.array(cut, bool))


def text_runs(samples: list[Sample], max_texts: int) -> Iterator[list[Sample]]:
    """Consecutive samples, at most `max_texts` and TOKENIZE_CHARS characters a run (a longer text
    alone)."""
    run: list[Sample] = []
    chars = 0
    for sample in samples:
        if run and (len(run) == max_texts or chars + len(sample.text) > TOKENIZE_CHARS):
            yield run
            run, chars = [], 0
        run.append(sample)
        chars += len(sample.text)
    if run:
        yield run


def check_vocabulary(token_ids: TokenIds, samples: list[Sample], vocab: int | None, source: str) -> None:
    """ConfigError naming the first row holding an id at or past `vocab` (config.json's vocab_size), and
    where its ids came from (`source`): the embedding's lookup of such an id faults (IndexError on a
    CPU, a device-side assert on a GPU), after the weights load."""
    if vocab is None or not len(token_ids.flat) or token_ids.flat.max() < vocab:
        return
    at = int(np.argmax(token_ids.flat >= vocab))
    row = int(np.searchsorted(token_ids.offsets, at, side="right")) - 1
    raise ConfigError(f"dataset row {samples[row].sample_idx}: token id {token_ids.flat[at]} is outside the model's "
                      f"vocabulary of {vocab} ({source})")


def zero_token_rows(rows: list[int]) -> str:
    """The error for texts with no token to store (a tokenizer that adds no special token, as GPT-2's,
    on an empty text: wikitext's blank lines)."""
    shown = ", ".join(map(str, rows[:10])) + (f" and {len(rows) - 10} more" if len(rows) > 10 else "")
    return (f"dataset row{'s' if len(rows) > 1 else ''} {shown}: text tokenizes to zero tokens, so no activation "
            "is there to store (this tokenizer adds no special token): drop empty texts from the dataset")


def given_token_ids(tokenizer: Any, vocab: int | None, samples: list[Sample], max_seq_length: int) -> TokenIds:
    """dataset.tokens_field: each row's ids run as given (no special token added: a pre-tokenized
    dataset carries its own BOS), cut to max_seq_length as the tokenizer's truncation cuts a text.
    An id at or past `vocab` (config.json's vocab_size) is named before the weights load (on a GPU it
    would fault the device). Each sample's text becomes its ids decoded, so records show what ran; the stored
    token_ids, not that text, are the input."""
    cut = np.array([len(s.tokens) > max_seq_length for s in samples], bool)
    kept = [s.tokens[:max_seq_length] for s in samples]
    lengths = np.array([len(ids) for ids in kept], np.int64)
    flat = np.concatenate(kept) if kept else np.zeros(0, np.int64)
    token_ids = TokenIds(flat, np.concatenate([[0], np.cumsum(lengths)]), cut)
    check_vocabulary(token_ids, samples, vocab, "dataset.tokens_field")
    step = max(1, TOKENIZE_TOKENS // max_seq_length)
    for start in range(0, len(samples), step):
        texts = tokenizer.batch_decode([ids.tolist() for ids in kept[start:start + step]])
        for sample, text in zip(samples[start:start + step], texts):
            sample.text, sample.tokens = text, None  # the ids live on in the flat array only
    return token_ids


def length_batches(lengths: list[int], batch_size: int, model_type: str | None = None) -> list[list[int]]:
    """Local indices grouped by length over the whole part (longest first) so batches carry little
    padding. The grouping fixes each sample's batch companions, hence its exact float bits. A
    PADDING_SENSITIVE_TYPES model's batches each hold one length, so none is padded (`model_type`:
    config.json's)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    one_length = model_type in PADDING_SENSITIVE_TYPES
    if one_length:
        log.info("model_type %s: padding changes its real tokens' outputs, so each batch holds texts of one "
                 "token length", model_type)
    runs = [list(run) for _, run in itertools.groupby(order, key=lambda i: lengths[i] if one_length else 0)]
    return [run[i:i + batch_size] for run in runs for i in range(0, len(run), batch_size)]


def text_batch(loaded: LoadedModel, ids: Sequence[Sequence[int]], last_logits_only: bool = False
               ) -> dict[str, torch.Tensor]:
    """Right-padded input_ids and attention_mask on the model's device (pad positions are never
    stored), and no generation cache. last_logits_only: a causal LM that takes `logits_to_keep` runs
    its head at the rows' last positions only (sorted, distinct; run.last_token_head then hands the
    head each row's own, for the top-k; token log-probs rerun the head on the final hidden states,
    extract/logprobs.py)."""
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    real = np.arange(window_width(loaded.model.config, int(lengths.max()))) < lengths[:, None]
    # Filled in one numpy call (row-major, so each row's ids in order): per-row tensor assignments
    # cost ~0.3 ms of the host's time a batch, which a launch-bound forward waits for.
    input_ids = np.full(real.shape, pad_id(loaded), dtype=np.int64)
    input_ids[real] = np.concatenate([np.asarray(seq, dtype=np.int64) for seq in ids])
    inputs = {"input_ids": host_to_device(torch.from_numpy(input_ids), loaded.device),
              "attention_mask": host_to_device(torch.from_numpy(real.astype(np.int64)), loaded.device)}
    # A causal LM keeps every block's keys and values for generation unless told not to: at Llama-8B,
    # 32 texts x 2,048 tokens, 8.6 GB held to the end of each forward that nothing reads.
    if loaded.kind != "causal":
        return inputs
    inputs["use_cache"] = False
    if last_logits_only and loaded.takes_logits_to_keep:
        inputs["logits_to_keep"] = host_to_device(torch.from_numpy(np.unique(lengths - 1)), loaded.device)
    return inputs


def pad_id(loaded: LoadedModel) -> int:
    """The tokenizer's pad id, or 0 where the model's vocabulary ends before it (a pad token added to the
    tokenizer, the embedding not resized): pad positions are masked and never stored, but an id past the
    embedding faults its lookup (IndexError on a CPU, a device-side assert on a GPU)."""
    pad = loaded.preprocessor.pad_token_id
    vocab = getattr(loaded.model.config.get_text_config(), "vocab_size", None)
    return 0 if isinstance(vocab, int) and pad >= vocab else pad


def window_width(config: Any, width: int) -> int:
    """The batch's width padded up to a multiple of the model's `attention_window` (Longformer, LED) or,
    where its block-sparse attention runs (sparse_block), of its `block_size` (BigBird): such a model
    pads its inputs so inside its forward, with attention mask 0 as here, and its blocks would return
    more tokens than the batch holds. Any other model: `width`."""
    window = getattr(config, "attention_window", None)
    window = max(window) if isinstance(window, (list, tuple)) else (window or sparse_block(config, width))
    return -(-width // window) * window if isinstance(window, int) and window > 0 else width


def sparse_block(config: Any, width: int) -> int | None:
    """BigBird's `block_size` when its block-sparse attention runs on a batch `width` tokens wide: wider
    than its 2 global, 3 sliding and 2 x num_random_blocks random blocks (on a narrower batch its forward
    runs full attention, unpadded); None for any other model."""
    if getattr(config, "attention_type", None) != "block_sparse":
        return None
    return config.block_size if width > (5 + 2 * config.num_random_blocks) * config.block_size else None


def load_pixels(processor: Any, opener: ImageOpener, samples: list[Sample]) -> torch.Tensor:
    """Decode images (ImageOpener names the file or table row it cannot decode) and run the image
    processor over each as it is decoded: (n, 3, H, W) pixel_values. One call an image, so a worker
    holds one full-size image at a time (16 16-megapixel photos decoded at once peaked at 1.7 GB a
    worker). Each processor actstore runs treats images one by one, so the bits are one call's for all;
    one that pads a batch to its largest image would make pixels of two shapes here: named."""
    pixels = [processor(images=[opener(sample)], return_tensors="pt")["pixel_values"] for sample in samples]
    check_one_shape(processor, pixels, samples)
    return torch.cat(pixels)


def check_one_shape(processor: Any, pixels: list[torch.Tensor], samples: list[Sample]) -> None:
    """ConfigError naming two rows whose processed pixels differ in shape: a store holds one patch
    count for every image, and torch.cat's error would name neither row nor the processor."""
    for sample, image in zip(samples, pixels):
        if image.shape != pixels[0].shape:
            raise ConfigError(f"dataset rows {samples[0].sample_idx} ({samples[0].text}) and {sample.sample_idx} "
                              f"({sample.text}): the model's image processor ({type(processor).__name__}) makes "
                              f"pixels of shape {tuple(pixels[0].shape[1:])} and {tuple(image.shape[1:])}; a store "
                              "needs one patch count for every image (a processor that resizes each image to one "
                              "size)")


def image_batch(loaded: LoadedModel, dataset: Dataset, samples: list[Sample], pipeline: str
                ) -> dict[str, torch.Tensor]:
    """Model inputs of `samples`' images, decoded in this process by extract.image_pipeline `pipeline`
    (the lut stage's held-out batches see the pixels the extraction's model saw)."""
    if pipeline == "gpu":
        from actstore.extract.device_images import device_pixels, worker_image

        images = [worker_image(dataset.opener, loaded.preprocessor, sample) for sample in samples]
        pixels = device_pixels(loaded.preprocessor, images, loaded.device)
    else:
        pixels = load_pixels(loaded.preprocessor, dataset.opener, samples)
    return {"pixel_values": pixels.to(loaded.device, loaded.model.dtype)}


class ImageItems(torch.utils.data.Dataset):
    """Item = a few images of one batch (a list of local indices), decoded and processed an image at
    a time (load_pixels). Items are smaller than batches so that every worker decodes the batch the model
    needs next: batches arrive one by one while the model and the writers work, instead of in bursts
    of one per worker, and the decoded images waiting in shared memory are workers x items ahead x
    IMAGES_PER_ITEM (resources.items_ahead), not x batch_size. The split depends on the batch size
    alone, never on the worker count, so the bytes do not either (and each image processor tested
    treats images one by one, so they equal a whole-batch call's: tests/test_images_worker_memory_patch_labels.py).

    Items are cast to the model's dtype in the worker: the cast rounds the same on either side
    (round to nearest even, c10's one conversion on CPU and CUDA), and every later step of an item
    (shared memory, the main process's pinning and host-to-device copy) then moves half the bytes
    of float32 for a 16-bit model. Those steps are serial in the main process."""

    def __init__(self, processor: Any, opener: ImageOpener, samples: list[Sample], dtype: torch.dtype):
        self.processor = processor
        self.opener = opener
        self.samples = samples
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: list[int]) -> torch.Tensor:
        return load_pixels(self.processor, self.opener, [self.samples[i] for i in item]).to(self.dtype)


def default_workers(threads: int | None) -> int:  # also sizes the writer threads (run.writer_threads)
    """The CPUs the job was given: Snakemake's threads, else this process's CPU affinity."""
    return threads if threads is not None else len(os.sched_getaffinity(0))


def image_batches(processor: Any, opener: ImageOpener, samples: list[Sample], batches: list[list[int]],
                  num_workers: int, pin_memory: bool, dtype: torch.dtype) -> Generator[list[torch.Tensor], None, None]:
    """Processed pixels in the model's `dtype` batch by batch, as the batch's items in order
    (to_model joins them on the device), decoded ahead by `num_workers` processes (0 = in this
    process). The workers start at once, so call it before loading the model: they decode the first
    batches while the weights load; closing it ends them."""
    items, loader = item_loader(ImageItems(processor, opener, samples, dtype), batches, num_workers, pin_memory)
    return ([next(loader) for _ in batch] for batch in items)


def item_loader(dataset: torch.utils.data.Dataset, batches: list[list[int]], num_workers: int,
                pin_memory: bool) -> tuple[list[list[list[int]]], Iterator[Any]]:
    """Each batch cut into items of IMAGES_PER_ITEM (ImageItems says why), and an iterator over
    `dataset`'s items in that order, made by `num_workers` processes (0 = in this process) that start
    at once and keep resources.items_ahead items ready, at nice +10 (io_utils.lower_priority). A worker's
    ActstoreError is raised as the worker raised it (Refusals); an item not handed over in ITEM_TIMEOUT_S
    is a ConfigError naming its rows. `dataset` holds the part's `samples` (ImageItems, WorkerImages)."""
    items = [[batch[i:i + IMAGES_PER_ITEM] for i in range(0, len(batch), IMAGES_PER_ITEM)] for batch in batches]
    order = [item for batch in items for item in batch]
    ahead = items_ahead(max(map(len, batches), default=1), num_workers) if num_workers else None
    return items, _raised(iter(torch.utils.data.DataLoader(
        Refusals(dataset), sampler=order, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
        prefetch_factor=ahead, timeout=ITEM_TIMEOUT_S if num_workers else 0,
        worker_init_fn=lower_priority if num_workers else None)), order, dataset.samples)


class Refusals(torch.utils.data.Dataset):
    """`dataset`'s items, or the ActstoreError making one (naming its file) as the item: torch re-raises
    a worker's exception as a new one whose message is "Caught ConfigError in DataLoader worker process
    1. Original Traceback ...", the file named on the traceback's last line only."""

    def __init__(self, dataset: torch.utils.data.Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: list[int]) -> Any:
        try:
            return self.dataset[item]
        except ActstoreError as exc:
            return exc


def _raised(loader: Iterator[Any], order: list[list[int]], samples: list[Sample]) -> Iterator[Any]:
    """The loader's items (`order`'s, of local indices into `samples`), an ActstoreError among them
    raised (Refusals), and the loader's timeout raised naming the awaited item's rows."""
    for rows in order:
        try:
            item = next(loader)
        except RuntimeError as exc:  # torch's "DataLoader timed out after N seconds" names no file
            if "timed out" not in str(exc):
                raise
            del loader  # as below: its workers are shut down now, the stuck one ended
            raise ConfigError(stalled_item([samples[i] for i in rows])) from None
        if isinstance(item, ActstoreError):
            # The error's traceback holds this frame, and the frame the error: a cycle, which the garbage
            # collector ended with the workers' shutdown waiting 5 s on each worker (torch's join timeout).
            del loader
            raise item
        yield item


def stalled_item(samples: list[Sample]) -> str:
    """The error for an item its worker did not hand over in ITEM_TIMEOUT_S: items arrive in order and
    each worker makes its own in order, so that worker is still on this item (one of its images)."""
    shown = ", ".join(f"{s.sample_idx} ({s.text})" for s in samples)
    return (f"dataset rows {shown}: the image-decoding worker making them has not handed them over in "
            f"{ITEM_TIMEOUT_S} s: one of these files cannot be read (a stalled network file system, a FIFO) "
            "or its decoding does not return")


def to_model(loaded: LoadedModel, pixels: Iterator[list[torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """Model inputs from image_batches (items already in the model's dtype): each item copied to the
    model's device (from pinned memory, asynchronously, on a GPU), then joined there."""
    for items in pixels:
        on_device = [item.to(loaded.device, non_blocking=True) for item in items]
        yield {"pixel_values": on_device[0] if len(on_device) == 1 else torch.cat(on_device)}


def text_batches(loaded: LoadedModel, token_ids: TokenIds, batches: list[list[int]],
                 last_logits_only: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    for batch in batches:
        yield text_batch(loaded, [token_ids[i] for i in batch], last_logits_only)
