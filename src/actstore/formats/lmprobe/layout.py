"""The bytes of an lmprobe 2.0 dataset: file and key names, dtypes, the safetensors header codec,
the stored-dtype conversions and the prompt permutation. Pure, apart from reading a shard's header.

The safetensors files are encoded and decoded here directly (u64 length + JSON header + raw
little-endian data) so 1 GiB shards stream to disk and memory-map back without a copy;
`safetensors.safe_open` reads them.
"""
from __future__ import annotations

import math
import re
import reprlib
from pathlib import Path
from typing import Any

import numpy as np

from actstore.casts import BLOCK, to_bfloat16_bits, to_float16
from actstore.errors import ConfigError, FormatError
from actstore.integrity import whole_numbers
from actstore.safetensors_io import header_bytes, read_header_json

FORMAT = "lmprobe"
FORMAT_VERSION = "2.0"
PREFIX = "lmprobe:"  # schema-metadata key prefix of the index parquet
HIDDEN_FILE_PATTERN = "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"
HIDDEN_KEY_PATTERN = "hidden.layer_{layer}"
LOGITS_FILE_PATTERN = "tensors/logits_topk_{shard:03d}.safetensors"
LOGITS_VALUES_KEY = "topk_values"
LOGITS_INDICES_KEY = "topk_indices"
SUMS = "SHA256SUMS"
CARD = "README.md"
DATASET_DIR = "dataset"  # the dataset root inside an actstore lmprobe stage directory
REQUIRED_INFO = ("format_version", "model", "num_prompts", "prompt_ordering", "tensors", "provenance")
CORE_COLUMNS = ("text", "label", "num_tokens", "shard_index", "row_offset")
FULL_COLUMNS = ("token_offset", "token_shard_ids", "token_shard_offsets")
LOGITS_COLUMNS = ("shard_index_logits", "row_offset_logits")
OPTIONAL_COLUMNS = ("perplexity_mean", "perplexity_min", "perplexity_max", "token_ids", "token_perplexity",
                    "token_strings")
# actstore's (docs/formats/lmprobe.md)
EXTENSION_COLUMNS = ("sample_idx", "label_id", "token_logprob", "truncated")
# Every column the spec or actstore gives a meaning, whether a dataset has it or not: a sample
# metadata field of one of these names is stored as meta_<name>, never in the column's place.
INDEX_COLUMNS = CORE_COLUMNS + FULL_COLUMNS + LOGITS_COLUMNS + OPTIONAL_COLUMNS + EXTENSION_COLUMNS
HIDDEN_KEYS = ("layers", "dim", "dtype", "layout", "file_pattern", "key_pattern", "storage", "shards")
STORAGES = ("pooled", "full_sequence")  # hidden_layers.storage: the spec's two
# dtype name -> (safetensors dtype, numpy storage dtype); bfloat16 is stored as raw uint16 bits.
DTYPES = {"float32": ("F32", np.dtype("<f4")), "float16": ("F16", np.dtype("<f2")),
          "bfloat16": ("BF16", np.dtype("<u2"))}
ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"),
             "I32": np.dtype("<i4")}
ST_METADATA = {"format": "pt"}  # the __metadata__ of every shard
LOGITS_ROW_BYTES_PER_K = 4 + 8  # float32 value + int64 index
LOGITS_DTYPE = "float32"  # logits_topk.dtype: its values' (topk_indices are int64)
DESCRIPTOR_TYPES = {"hidden_layers": "hidden", "logits_topk": "logits_topk"}  # each descriptor's `type`
# The spec's types of the addressing columns (arrow type names); label "int32 or string", a column of
# nulls alone (every label null, which the spec allows) included.
COLUMN_TYPES = {"label": ("int32", "string", "large_string", "null"), "num_tokens": ("int32",),
                "shard_index": ("int32",), "row_offset": ("int32",), "shard_index_logits": ("int32",),
                "row_offset_logits": ("int32",)}
# Token-level columns holding one entry per token of their prompt (num_tokens): the spec's, and actstore's
# token_logprob
TOKEN_COLUMNS = ("token_ids", "token_perplexity", "token_strings", "token_logprob")
MAX_SHARD_ROWS = 2**31 - 1  # shard_index/row_offset columns are int32

TensorSpec = tuple[str, str, list[int]]  # (key, safetensors dtype, shape)


# The index parquet, relative to the dataset root, whatever `dataset.split` is: the only index path
# the spec names (every snippet and its file layout read it) and the one path lmprobe's own readers
# (lmprobe.sharing.PARQUET_PATH, 0.10.3) fetch. The split is recorded in lmprobe:dataset.split and
# the dataset card. (Before, a split other than train was written as index/{split}-..., which
# neither the spec's snippets nor lmprobe could find.)
INDEX = "index/train-00000-of-00001.parquet"


def split_index_name(split: str) -> str:
    """Where actstore wrote the index of a split other than train before INDEX (read, never written)."""
    return f"index/{split}-00000-of-00001.parquet"


def rows_per_shard(shard_bytes: int, row_bytes: int) -> int:
    """Rows a shard of `shard_bytes` target size holds (at least one, at most int32)."""
    return max(1, min(shard_bytes // row_bytes, MAX_SHARD_ROWS))


def prompt_order(n: int, ordering: str, seed: int | None) -> np.ndarray:
    """sample_idx of each index row: `np.random.default_rng(seed).permutation(n)` or identity."""
    if ordering == "random":
        return np.random.default_rng(seed).permutation(n).astype(np.int64)
    if ordering == "original":
        return np.arange(n, dtype=np.int64)
    raise ConfigError(f"lmprobe.prompt_ordering: unknown value {ordering!r} (random or original)")


# ---------------------------------------------------------------- stored dtypes

def from_float32(array: np.ndarray, dtype: str) -> tuple[np.ndarray, int]:
    """float32 rows -> (rows in the storage dtype, how many finite values it turned into +-inf; 0 for
    float32): bfloat16 and float16 rounded to nearest even, the bits torch and numpy give (actstore.casts)."""
    if dtype == "bfloat16":
        bits = to_bfloat16_bits(array)
        return bits, _bfloat16_overflow(array, bits)
    if dtype == "float16":
        out = np.empty(np.shape(array), np.float16)
        return out, to_float16(array, out)
    return np.asarray(array, dtype=DTYPES[dtype][1]), 0


BF16_INF = 0x7F80  # bfloat16 bits of +inf; -inf has the sign bit too
LARGEST = {"float16": "+-65504", "bfloat16": "+-3.3895e38"}  # each narrow dtype's finite range, as logged


def _bfloat16_overflow(array: np.ndarray, bits: np.ndarray) -> int:
    """How many finite values of `array` (float32) are +-inf in `bits` (their bfloat16 cast): a float32
    past bfloat16's largest finite value (3.3895e38) by half its step or more rounds to inf, as torch's
    cast does, and was stored so uncounted. Looked at a block at a time (temporaries stay ~casts.BLOCK)."""
    flat, out = np.asarray(array, np.float32).reshape(-1), bits.reshape(-1)
    overflowed = 0
    for lo in range(0, len(out), BLOCK):
        inf = np.flatnonzero(out[lo:lo + BLOCK] & np.uint16(0x7FFF) == BF16_INF)
        overflowed += len(inf) - int(np.isinf(flat[lo:lo + BLOCK][inf]).sum())
    return overflowed


# ---------------------------------------------------------------- safetensors header codec

def tensor_bytes(st_dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    return ST_DTYPES[st_dtype].itemsize * math.prod(shape)


def encode_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """Header bytes (u64 length + JSON padded with spaces to 8 bytes) for tensors laid out in order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, st_dtype, shape in specs:
        nbytes = tensor_bytes(st_dtype, shape)
        header[key] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return header_bytes(header)


def read_safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """(header dict, data start) of a safetensors file, checked for sane sizes and parsed as strictly
    as the safetensors library (the spec's reader): UTF-8, no key twice, no NaN, `__metadata__` null
    or str -> str, every other member a tensor entry (_entry_problem); never executes content."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: shard file missing")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        try:
            header, n = read_header_json(fh, size)
        except ValueError as exc:
            raise FormatError(f"{path}: {exc}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    for key, value in header.items():
        problem = _metadata_problem(value) if key == "__metadata__" else _entry_problem(value)
        if problem:
            raise FormatError(f"{path}: safetensors header key {key!r}: {problem}")
    return header, 8 + n


def _metadata_problem(metadata: Any) -> str | None:
    """Why `__metadata__` is not what the library reads (an optional str -> str map), or None."""
    if metadata is None or (isinstance(metadata, dict)
                            and all(isinstance(value, str) for value in metadata.values())):
        return None
    return f"{reprlib.repr(metadata)} is not an object of strings"


def _entry_problem(entry: Any) -> str | None:
    """Why `entry` is not a tensor entry actstore reads, or None: a known dtype, a shape of counts and
    two data_offsets, every count below 2**64 (the library's u64/usize); other members are ignored,
    as the library does."""
    if not isinstance(entry, dict):
        return f"{reprlib.repr(entry)} is not a tensor entry object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        return f"dtype {reprlib.repr(dtype)} is not one of {sorted(ST_DTYPES)}"
    if not _u64s(shape):
        return f"shape {reprlib.repr(shape)} is not a list of whole numbers"
    if not (_u64s(offsets) and len(offsets) == 2):
        return f"data_offsets {reprlib.repr(offsets)} is not two whole numbers"
    return None


def _u64s(values: Any) -> bool:
    """A JSON list of counts (integrity.whole_numbers: a bool is none) that fit the library's u64."""
    return whole_numbers(values) and all(value < 1 << 64 for value in values)


def tensor_entry(path: Path, header: dict[str, Any], start: int, key: str) -> tuple[np.dtype, tuple[int, ...], int]:
    """(numpy dtype, shape, absolute byte offset) of `key` in a header read_safetensors_header
    checked, validated against the file size."""
    if key == "__metadata__" or key not in header:
        have = sorted(k for k in header if k != "__metadata__")
        raise FormatError(f"{path}: no tensor {key!r} in this shard (has {have})")
    entry = header[key]
    dtype, shape = ST_DTYPES[entry["dtype"]], tuple(entry["shape"])
    begin, end = entry["data_offsets"]
    if (not begin <= end or end - begin != dtype.itemsize * math.prod(shape)
            or start + end > path.stat().st_size):
        raise FormatError(f"{path}: tensor {key!r} data_offsets {entry['data_offsets']} do not fit "
                          f"shape {list(shape)} {entry['dtype']} in {path.stat().st_size} bytes")
    return dtype, shape, start + begin


def check_tiling(path: Path, header: dict[str, Any], start: int) -> None:
    """FormatError unless the tensors' data tile the bytes after the header, with no gap, overlap or
    trailing byte: what the safetensors library (the spec's reader) demands, and an overlap would
    read one tensor's bytes as another's."""
    spans = sorted((offset, offset + dtype.itemsize * math.prod(shape), key)
                   for key in header if key != "__metadata__"
                   for dtype, shape, offset in [tensor_entry(path, header, start, key)])
    at = start
    for begin, end, key in spans:
        if begin != at:
            raise FormatError(f"{path}: tensor {key!r} data starts at byte {begin}, the previous tensor's "
                              f"ends at {at} (safetensors data must not overlap or leave gaps)")
        at = end
    size = path.stat().st_size
    if at != size:
        raise FormatError(f"{path}: tensor data ends at byte {at} of {size} (trailing bytes)")


def card_configs(split: str, index_rel: str) -> str:
    """The card's `configs:` front matter, dumped as YAML: a split written into it as it is was read
    back by a YAML reader (huggingface_hub's card, `datasets`) as another value (`yes` as True, `1` as
    1, `x #y` as `x`) or failed the card (`a: b`); a plain name is written as before."""
    import yaml

    configs = [{"config_name": "default", "data_files": [{"split": split, "path": index_rel}]}]
    return yaml.safe_dump({"configs": configs}, sort_keys=False, allow_unicode=True, width=math.inf)


# Characters of a name no card line may hold as they are: a line break (or any control character)
# ended the line, and the rest of the name was read as the card's own Markdown (a heading, raw HTML).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# ASCII punctuation Markdown (or HTML) reads mid-line: emphasis, links, raw HTML, entities, a heading's
# closing #s, GFM strikethrough and tables; each is backslash-escaped, which CommonMark renders as itself.
_MARKDOWN_PUNCTUATION = re.compile(r"[\\`*_\[\]<>&#!|~]")


def _visible_controls(text: str) -> str:
    """`text` with each control character written as its escape (\\x0a), which renders as those letters."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 256 else f"\\u{ord(m[0]):04x}", text)


def markdown_text(text: str) -> str:
    """`text` (a model name) as Markdown inline text that renders as itself, on one line."""
    return _visible_controls(_MARKDOWN_PUNCTUATION.sub(lambda m: "\\" + m[0], text))


def code_span(text: str) -> str:
    """`text` (a dataset name) as a Markdown code span that renders as itself on one line: delimited by
    one backtick more than its longest run of them (a name's backtick closed a one-backtick span), with
    a space inside each delimiter when it starts or ends with one."""
    text = _visible_controls(text)
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def truncation_line(info: dict[str, Any], unknown_rows: int) -> str:
    """The card's line on the prompts cut at max_seq_length (lmprobe:dataset's count; `unknown_rows`: the
    rows whose `truncated` flag is null)."""
    n, limit = info["dataset"]["n_truncated_samples"], info["dataset"]["max_seq_length"]
    if n is None:
        line = f"How many prompts were longer than max_seq_length ({limit} tokens) was not recorded."
    elif n:
        line = (f"{n} of {info['num_prompts']} prompts were longer than max_seq_length ({limit} tokens) and keep "
                f"their first {limit}: `text` is whole, `num_tokens` and the vectors end there (column `truncated`).")
    else:
        line = f"No prompt was longer than max_seq_length ({limit} tokens)."
    return line + (f" `truncated` is null for the {unknown_rows} prompts of {limit} tokens whose extraction did not "
                   "record whether it cut them." if unknown_rows else "")


def dataset_card(info: dict[str, Any], index_rel: str, unknown_rows: int) -> str:
    """README.md: a short Hugging Face dataset card describing the dataset and how to read it. Its
    snippet resolves the first prompt's last-token vector and runs as written (the tests exec it).
    `unknown_rows`: prompts whose `truncated` flag is null (truncation_line)."""
    hidden = info["tensors"]["hidden_layers"]
    seed = info.get("prompt_ordering_seed")
    seeded = "" if seed is None else f" (seed {seed})"  # null in original order: no "(seed None)"
    return f"""---
{card_configs(info["dataset"]["split"], index_rel)}---
# lmprobe {info['format_version']} activations of {markdown_text(info['model']['name'])}

{info['num_prompts']} prompts from {code_span(info['dataset']['name'])}, layers {hidden['layers']} (dim {hidden['dim']},
{hidden['dtype']}, {hidden['storage']} storage), prompt ordering `{info['prompt_ordering']}`{seeded}.
Written by actstore {info['provenance']['actstore_version']}. {truncation_line(info, unknown_rows)}

Everything is described in the schema metadata (`lmprobe:*` keys) of `{index_rel}`; see the lmprobe
2.0 format specification. `shard_index`/`row_offset` resolve to the last-token vector of a prompt:

```python
import json, pyarrow.parquet as pq
from safetensors import safe_open
table = pq.read_table("{index_rel}")
hidden = json.loads(table.schema.metadata[b"lmprobe:tensors"])["hidden_layers"]
row = table.slice(0, 1).to_pylist()[0]
layer = hidden["layers"][0]
with safe_open(hidden["file_pattern"].format(layer=layer, shard=row["shard_index"]), framework="pt") as f:
    vector = f.get_tensor(hidden["key_pattern"].format(layer=layer))[row["row_offset"]]
```

`sample_idx` is the source dataset row. `sha256sum -c {SUMS}` checks every file.
"""
