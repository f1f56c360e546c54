"""The extraction intermediate's layout: the only place that knows its names and bytes.

`part-NNNN/`:
  part.json        metadata: sample range, files {name: {bytes, sha256_tree[, shape, dtype]}}, model, ...
                   (version 1 recorded plain sha256; the tree hash, 1 MiB leaves, lets a file filled
                   out of order be hashed as it fills: integrity.DIGESTS checks either)
  samples.jsonl    one row per sample: sample_idx, text (or image path), label, label_id,
                   num_tokens, truncated (only on a text cut at max_seq_length: true), metadata
                   (extra dataset fields)
  offsets.npy      int64 (n+1,): tokens of local sample i are rows offsets[i]:offsets[i+1]
  token_ids.npy    int64 (n_tokens,)                        text models
  token_logprob.npy float32 (n_tokens,), NaN at each sample's first token   causal LMs
  topk_values.npy / topk_indices.npy  float32 / int64 (n, k) last-token top-k logits   causal LMs
  <tensor>.npy     (n_tokens, d) per captured tensor in the storage dtype (float32, float16, or
                   bfloat16 as its uint16 bits), samples in sample_idx order, no padding
                   ("layer_3" -> layer_003.npy; hook "m.path:input" -> hook-m.path-input.npy)
The directory is built under a temp name and renamed into place last, so a killed job leaves
nothing that looks complete.
"""
from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np

from actstore.casts import to_bfloat16_bits

PART_META = "part.json"
INDEX = "extract.json"  # beside the parts: every part's directory and part.json sha256
FORMAT_NAME = "actstore-part"
FORMAT_VERSION = 2
# part.json counts, present only where not zero (a part with none keeps the bytes it had before them)
OVERFLOW_KEY = "float16_overflow_count"  # finite activations a float16 storage dtype turned into +-inf
NON_FINITE_KEY = "non_finite_count"  # activations the model itself computed as NaN or +-inf
# top-k logits the model computed as NaN or +inf, token log-probs NaN past each text's first token
# (-inf is a token the model masks, as it computed it)
NON_FINITE_LOGITS_KEY = "non_finite_logits_count"
COUNT_KEYS = (OVERFLOW_KEY, NON_FINITE_KEY, NON_FINITE_LOGITS_KEY)
# samples.jsonl's field on a text cut at max_seq_length, and only there: true (extract.run.sample_rows); every
# other row keeps the bytes it had before the field
CUT_FIELD = "truncated"


def layer_tensor(layer_idx: int) -> str:
    """Tensor name of block `layer_idx`'s output."""
    return f"layer_{layer_idx}"


def tensor_file(name: str) -> str:
    """File name of a captured tensor inside a part directory: layer_<i> is block i's output, any
    other name a hook spec, whose module path may itself start with "layer_" (a `layer_norm`). The
    spec is split at its last ':' as extract.capture.parse_hook splits it: a module path may hold a
    ':' (a ModuleDict key), and hook "m.a:b:output" is module "m.a:b"'s output."""
    if re.fullmatch(r"layer_[0-9]+", name):
        return f"layer_{int(name[6:]):03d}.npy"
    module_path, _, io = name.rpartition(":")
    return f"hook-{module_path}-{io}.npy"


# Files of one row per sample (the last token's top-k); every other data file has one per token.
PER_SAMPLE_FILES = ("topk_values.npy", "topk_indices.npy")


def part_dirname(part: int) -> str:
    return f"part-{part:04d}"


def part_dirs(extract_dir: Path) -> list[Path]:
    """The part directories in `extract_dir`, in part order: every name part_dirname gives, which
    has five digits from part 10000 on (a four-digit pattern left those parts unverified)."""
    found = [(int(m[1]), path) for path in extract_dir.glob("part-*")
             if (m := re.fullmatch(r"part-([0-9]+)", path.name)) and path.name == part_dirname(int(m[1]))]
    return [path for _, path in sorted(found)]


# Storage dtypes of captured tensors and their .npy descr. numpy has no bfloat16: it is kept as its
# uint16 bit pattern (part.json says "bfloat16"); every reader widens it to float32, which is exact.
STORAGE_DESCR = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


def npy_header(shape: tuple[int, ...], descr: str) -> bytes:
    """The .npy 1.0 header numpy itself writes for a C-order array (np.save / open_memmap)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as storage dtype `dtype` stores them (bfloat16 as its uint16 bits), rounded to
    nearest even as torch's casts round."""
    if dtype == "bfloat16":
        return to_bfloat16_bits(values)
    return np.asarray(values, dtype=STORAGE_DESCR[dtype])


# The longest samples.jsonl line (its newline counted) written or read; a longer one is named, never read (a
# hostile store's 5 GB line, its checksums rewritten to match, held 5 GB and then its text). A row is one
# dataset row's text and fields as json.dumps writes them (ensure_ascii=False), bounded by the inputs' own
# bounds: a JSON line or element of at most datasets' MAX_ELEMENT_CHARS (2**28) characters comes out at most 4.5 bytes a
# character (1e15 as 1000000000000000.0; an astral character 4), a text file of at most MAX_ELEMENT_CHARS
# bytes at most 6 a byte (a control character as \u00XX) beside its metadata file's row (4.5), plus ~150
# bytes of fixed fields: 10.5 times MAX_ELEMENT_CHARS at most. Table cells, webdataset members, chat templates
# and prompt templates naming a field twice have no input bound: PartWriter refuses to write a row of them
# past this (naming its sample_idx, before it makes anything), as every reader (read.SampleRows) refuses it.
MAX_ROW_BYTES = 1 << 32  # 16 x MAX_ELEMENT_CHARS (datasets imports this module: a number here)
