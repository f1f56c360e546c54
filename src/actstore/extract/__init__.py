"""Extraction: run a model over one part of the dataset, capture its activations, write the part.

Rooms: inputs.py (tokenize, length batches, image decoding in DataLoader workers), capture.py
(forward hooks), logprobs.py (token log-probs in bounded chunks), pipeline.py (staging buffers and
writer threads), run.py (the loop and part.json).
"""
from actstore.extract.capture import capture, parse_hook
from actstore.extract.inputs import image_batch, length_batches, text_batch, tokenize
from actstore.extract.run import check_hooks, preflight, run_part, storage_dtype

__all__ = ["capture", "check_hooks", "image_batch", "length_batches", "parse_hook", "preflight", "run_part",
           "storage_dtype", "text_batch", "tokenize"]
