"""lmprobe 2.0 datasets (specs/lmprobe-format-2.0.md): a parquet index + per-layer safetensors shards.

Layout of a dataset root (the lmprobe stage directory):
  index/{split}-00000-of-00001.parquet   one row per prompt; all metadata in schema metadata `lmprobe:*`
  tensors/hidden_layer{L:03d}_shard{S:03d}.safetensors   key `hidden.layer_{L}`, (rows, dim)
  tensors/logits_topk_{S:03d}.safetensors               `topk_values` f32 / `topk_indices` i64, (rows, k)
  README.md        dataset card            SHA256SUMS   `sha256sum -c` list of every other file
actstore's choices (see README.md, "lmprobe 2.0"): shards 0..last_token_shards-1 hold the last-token
vector of every prompt; a sequence shard holds *all* tokens of each of its prompts contiguously (the
last token is duplicated there, so one slice returns a whole prompt); a prompt never spans two shards.
Extensions (optional keys): info `prompt_ordering_seed`, `dataset`, `files` {path: {bytes, sha256}};
columns `sample_idx`, `label_id`, `token_logprob`.
The safetensors files are written and read here directly (header JSON + raw little-endian data) so
1 GiB shards stream to disk and memory-map back without a copy; `safetensors.safe_open` reads them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from actstore.errors import ConfigError, FormatError
from actstore.integrity import dir_bytes, file_problem, inside, unlisted
from actstore.io_utils import atomic_path, sha256_file, utc_now

log = logging.getLogger(__name__)

FORMAT = "lmprobe"
FORMAT_VERSION = "2.0"
PREFIX = "lmprobe:"
HIDDEN_FILE_PATTERN = "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors"
HIDDEN_KEY_PATTERN = "hidden.layer_{layer}"
LOGITS_FILE_PATTERN = "tensors/logits_topk_{shard:03d}.safetensors"
SUMS = "SHA256SUMS"
DATASET_DIR = "dataset"  # the dataset root inside an actstore lmprobe stage directory
REQUIRED_INFO = ("format_version", "model", "num_prompts", "prompt_ordering", "tensors", "provenance")
CORE_COLUMNS = ("text", "label", "num_tokens", "shard_index", "row_offset")
FULL_COLUMNS = ("token_offset", "token_shard_ids", "token_shard_offsets")
LOGITS_COLUMNS = ("shard_index_logits", "row_offset_logits")
# dtype name -> (safetensors dtype, numpy storage dtype); bfloat16 is stored as raw uint16 bits.
DTYPES = {"float32": ("F32", np.dtype("<f4")), "float16": ("F16", np.dtype("<f2")),
          "bfloat16": ("BF16", np.dtype("<u2"))}
ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"),
             "I32": np.dtype("<i4")}
MAX_HEADER = 100 << 20
LOGITS_ROW_BYTES_PER_K = 4 + 8  # float32 value + int64 index
COPY_BYTES = 64 << 20  # rows copied per write while streaming a shard


# ---------------------------------------------------------------- safetensors, byte level

def _st_header(specs: list[tuple[str, str, list[int]]], metadata: dict[str, str] | None = None) -> bytes:
    """Header bytes (u64 length + JSON padded with spaces to 8 bytes) for tensors laid out in order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, st_dtype, shape in specs:
        nbytes = ST_DTYPES[st_dtype].itemsize * math.prod(shape)
        header[key] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_safetensors(path: Path, specs: list[tuple[str, str, list[int]]], chunks: Iterable[np.ndarray],
                       metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Stream `chunks` (in spec order) into a safetensors file; return its {bytes, sha256}."""
    digest = hashlib.sha256()
    header = _st_header(specs, metadata)
    expected = sum(ST_DTYPES[d].itemsize * math.prod(s) for _, d, s in specs)
    written = 0
    with open(path, "wb") as fh:
        for block in (header, *(np.ascontiguousarray(c).view(np.uint8).reshape(-1) for c in chunks)):
            fh.write(block)
            digest.update(block)
            written += len(block)
        os.fsync(fh.fileno())
    if written != len(header) + expected:
        raise FormatError(f"{path}: wrote {written - len(header)} data bytes, header declares {expected}")
    return {"bytes": written, "sha256": digest.hexdigest()}


def read_safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """(header dict, data start) of a safetensors file, checked for sane sizes; never executes content."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: shard file missing")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise FormatError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER, size - 8):
            raise FormatError(f"{path}: safetensors header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{path}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


def _tensor_entry(path: Path, header: dict[str, Any], start: int, key: str) -> tuple[np.dtype, tuple[int, ...], int]:
    """(numpy dtype, shape, absolute byte offset) of `key`, validated against the file size."""
    entry = header.get(key)
    if not isinstance(entry, dict):
        have = sorted(k for k in header if k != "__metadata__")
        raise FormatError(f"{path}: no tensor {key!r} in this shard (has {have})")
    try:
        dtype = ST_DTYPES[entry["dtype"]]
        shape = tuple(int(x) for x in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{path}: tensor {key!r} has a bad header entry {entry!r}") from None
    if end - begin != dtype.itemsize * math.prod(shape) or start + end > path.stat().st_size:
        raise FormatError(f"{path}: tensor {key!r} data_offsets {entry['data_offsets']} do not fit "
                          f"shape {list(shape)} {entry['dtype']} in {path.stat().st_size} bytes")
    return dtype, shape, start + begin


def open_tensor(path: str | Path, key: str) -> np.ndarray:
    """Read-only memmap of one tensor of a safetensors file (raw storage dtype; bf16 as uint16)."""
    path = Path(path)
    header, start = read_safetensors_header(path)
    dtype, shape, offset = _tensor_entry(path, header, start, key)
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """Stored rows -> float32 (bfloat16 bits are the top half of a float32)."""
    if dtype == "bfloat16":
        return (np.asarray(array, dtype=np.uint32) << 16).view(np.float32)
    return np.asarray(array, dtype=np.float32)


def from_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """float32 rows -> storage dtype (bfloat16 rounded to nearest even by torch)."""
    if dtype == "bfloat16":
        import torch
        return torch.from_numpy(np.array(array, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return np.asarray(array, dtype=DTYPES[dtype][1])


# ---------------------------------------------------------------- writer

def prompt_order(n: int, ordering: str, seed: int | None) -> np.ndarray:
    """sample_idx of each index row: `np.random.default_rng(seed).permutation(n)` or identity."""
    if ordering == "random":
        return np.random.default_rng(seed).permutation(n).astype(np.int64)
    if ordering == "original":
        return np.arange(n, dtype=np.int64)
    raise ConfigError(f"lmprobe.prompt_ordering: unknown value {ordering!r} (random or original)")


def pack_shards(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Shard of each item packed in order; a shard takes items until `capacity` rows, items never split."""
    shard = np.zeros(len(sizes), dtype=np.int64)
    current, used = 0, 0
    for i, size in enumerate(sizes.tolist()):
        if used and used + size > capacity:
            current, used = current + 1, 0
        shard[i] = current
        used += size
    return shard


class _Source:
    """Global token addressing over an extraction: sample_idx -> (part, global token rows)."""

    def __init__(self, extraction):
        self.extraction = extraction
        self.parts = extraction.parts
        self.sample_part = np.concatenate([np.full(p.meta["n_samples"], i, np.int64) for i, p in enumerate(self.parts)])
        self.start = np.concatenate([p.offsets[:-1] for p in self.parts]).astype(np.int64)
        self.stop = np.concatenate([p.offsets[1:] for p in self.parts]).astype(np.int64)

    def runs(self, samples: np.ndarray, last_only: bool) -> Iterator[tuple[int, int, int]]:
        """(part, start, stop) token-row runs for `samples` in order, adjacent runs merged."""
        run = None
        for s in samples.tolist():
            p, a, b = int(self.sample_part[s]), int(self.start[s]), int(self.stop[s])
            if last_only:
                a = b - 1
            if run and run[0] == p and run[2] == a:
                run[2] = b
            else:
                if run:
                    yield tuple(run)
                run = [p, a, b]
        if run:
            yield tuple(run)

    def chunks(self, name: str, samples: np.ndarray, last_only: bool, dtype: str) -> Iterator[np.ndarray]:
        for p, a, b in self.runs(samples, last_only):
            tensor = self.parts[p].tensor(name)
            step = max(1, COPY_BYTES // (tensor.shape[1] * 4))  # bounded memory per copy
            for lo in range(a, b, step):
                yield from_float32(tensor[lo:min(b, lo + step)], dtype)


def check_options(config: dict[str, Any]) -> None:
    """Parse-time check of the lmprobe section against the extract section (ConfigError names the key)."""
    opts, ext = config["lmprobe"], config["extract"]
    missing = [layer for layer in opts.get("layers") or [] if layer not in ext["layers"]]
    if missing:
        raise ConfigError(f"lmprobe.layers: {missing} not extracted (extract.layers = {ext['layers']})")
    if (opts.get("logits_topk") or 0) > ext["logits_topk"]:
        raise ConfigError(f"lmprobe.logits_topk: {opts['logits_topk']} > extract.logits_topk = {ext['logits_topk']}")


def _options(options: dict[str, Any], extraction) -> dict[str, Any]:
    """Resolved writer options, checked against the extraction; ConfigError names the key at fault."""
    meta = extraction.meta
    opts = {"storage": "full_sequence", "prompt_ordering": "random", "seed": 0, "dtype": "float32",
            "shard_bytes": 1 << 30, "logits_topk": None, "layers": None, "token_strings": True, **options}
    opts.pop("enabled", None)
    if opts["storage"] not in ("pooled", "full_sequence"):
        raise ConfigError(f"lmprobe.storage: unknown value {opts['storage']!r} (pooled or full_sequence)")
    if opts["dtype"] not in DTYPES:
        raise ConfigError(f"lmprobe.dtype: unknown value {opts['dtype']!r} ({', '.join(DTYPES)})")
    layers = opts["layers"] if opts["layers"] is not None else meta["layers"]
    missing = [layer for layer in layers if layer not in meta["layers"]]
    if missing:
        raise ConfigError(f"lmprobe.layers: {missing} not extracted (extract.layers = {meta['layers']})")
    opts["layers"] = sorted(layers)
    k_have = meta.get("logits_topk")
    if opts["logits_topk"] is not None and k_have is not None and opts["logits_topk"] > k_have:
        raise ConfigError(f"lmprobe.logits_topk: {opts['logits_topk']} > extract.logits_topk = {k_have}")
    opts["logits_topk"] = (opts["logits_topk"] or k_have) if k_have is not None else None
    return opts


def _hidden_files(out: Path, src: _Source, order: np.ndarray, lt_shard: np.ndarray, seq_shard: np.ndarray | None,
                  opts: dict[str, Any], dim: int, progress: bool) -> tuple[list[dict], dict[str, dict]]:
    """Write every hidden-layer shard; return the shard descriptors and {file: {bytes, sha256}}."""
    from tqdm import tqdm

    num_tokens = src.stop[order] - src.start[order]
    groups = [(np.flatnonzero(lt_shard == s), True) for s in range(int(lt_shard.max()) + 1)]
    if seq_shard is not None:
        groups += [(np.flatnonzero(seq_shard == s), False) for s in range(int(seq_shard.max()) + 1)]
    shards = [{"num_prompts": len(rows), "num_tokens": len(rows) if last else int(num_tokens[rows].sum())}
              for rows, last in groups]
    files: dict[str, dict] = {}
    st_dtype = DTYPES[opts["dtype"]][0]
    jobs = [(layer, s) for layer in opts["layers"] for s in range(len(groups))]
    for layer, s in tqdm(jobs, desc="lmprobe hidden shards", unit="shard", disable=not progress):
        rows, last = groups[s]
        rel = HIDDEN_FILE_PATTERN.format(layer=layer, shard=s)
        spec = [(HIDDEN_KEY_PATTERN.format(layer=layer), st_dtype, [shards[s]["num_tokens"], dim])]
        chunks = src.chunks(f"layer_{layer}", order[rows], last, opts["dtype"])
        files[rel] = _write_safetensors(out / rel, spec, chunks, {"format": "pt"})
    if seq_shard is None:
        for shard in shards:
            shard.pop("num_tokens")  # the spec's pooled descriptor lists num_prompts only
    return shards, files


def _logits_files(out: Path, src: _Source, order: np.ndarray, k: int, shard_bytes: int,
                  ) -> tuple[dict[str, Any], np.ndarray, np.ndarray, dict[str, dict]]:
    """Write top-k logits shards; return the descriptor, per-row (shard, offset) and file checksums."""
    row_bytes = k * LOGITS_ROW_BYTES_PER_K
    per_shard = max(1, min(shard_bytes // row_bytes, 2**31 - 1))
    shard, offset = np.arange(len(order)) // per_shard, np.arange(len(order)) % per_shard
    values, indices = np.empty((len(order), k), np.float32), np.empty((len(order), k), np.int64)
    for r, s in enumerate(order.tolist()):
        part, local = src.extraction.locate(s)
        v, i = part.topk(local)
        values[r], indices[r] = v[:k], i[:k]
    shards, files = [], {}
    for s in range(int(shard.max()) + 1):
        rows = np.flatnonzero(shard == s)
        rel = LOGITS_FILE_PATTERN.format(shard=s)
        spec = [("topk_values", "F32", [len(rows), k]), ("topk_indices", "I64", [len(rows), k])]
        files[rel] = _write_safetensors(out / rel, spec, [values[rows], indices[rows]], {"format": "pt"})
        shards.append({"file": rel, "num_prompts": len(rows)})
    desc = {"type": "logits_topk", "k": k, "dtype": "float32", "pooling": "last_token",
            "file_pattern": LOGITS_FILE_PATTERN, "row_bytes": row_bytes, "shards": shards}
    return desc, shard, offset, files


def _token_columns(src: _Source, order: np.ndarray, want_strings: bool) -> dict[str, Any]:
    """token_ids / token_perplexity / token_logprob / token_strings / perplexity_* columns, when available."""
    import pyarrow as pa

    ext = src.extraction
    cols: dict[str, Any] = {}
    located = [ext.locate(s) for s in order.tolist()]
    ids = [part.token_ids(local) for part, local in located]
    if any(x is None for x in ids):
        return cols
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    list_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat_ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64)
    cols["token_ids"] = pa.ListArray.from_arrays(list_offsets, pa.array(flat_ids, pa.int64()))
    logprobs = [part.token_logprob(local) for part, local in located]
    if all(x is not None for x in logprobs):
        flat_lp = np.concatenate(logprobs).astype(np.float32)
        ppl = np.exp(-flat_lp.astype(np.float64))  # NaN at token 0: nothing predicts the first token
        stats = {"perplexity_mean": [], "perplexity_min": [], "perplexity_max": []}
        for a, b in zip(list_offsets[:-1], list_offsets[1:]):
            body = ppl[a + 1:b]
            for name, fn in (("perplexity_mean", np.mean), ("perplexity_min", np.min), ("perplexity_max", np.max)):
                stats[name].append(float(fn(body)) if len(body) else None)
        cols.update({name: pa.array(v, pa.float64()) for name, v in stats.items()})
        cols["token_perplexity"] = pa.ListArray.from_arrays(list_offsets, pa.array(ppl, pa.float64()))
        cols["token_logprob"] = pa.ListArray.from_arrays(list_offsets, pa.array(flat_lp, pa.float32()))
    if want_strings:
        cols["token_strings"] = pa.ListArray.from_arrays(list_offsets, pa.array(_decode(ext, flat_ids), pa.string()))
    return cols


def _decode(extraction, flat_ids: np.ndarray) -> list[str]:
    """Each token decoded on its own with the model's tokenizer (special tokens kept)."""
    from transformers import AutoTokenizer

    path = extraction.meta["model"]["path"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"lmprobe.token_strings: cannot load the tokenizer from {path} ({exc}); "
                          "set lmprobe.token_strings: false") from None
    uniq, inverse = np.unique(flat_ids, return_inverse=True)
    strings = np.array(tokenizer.batch_decode([[int(i)] for i in uniq]), dtype=object)
    return strings[inverse].tolist()


def _metadata_columns(samples: list[dict], taken: set[str]) -> dict[str, list]:
    """User metadata fields as columns (auto-typed by pyarrow); a clash with a spec column gets `meta_`."""
    keys: list[str] = []
    for row in samples:
        keys += [k for k in row["metadata"] if k not in keys]
    return {(f"meta_{k}" if k in taken else k): [row["metadata"].get(k) for row in samples] for k in keys}


def _provenance(extraction) -> dict[str, Any]:
    import pyarrow
    import safetensors

    import actstore
    versions = extraction.meta.get("versions", {})
    return {"lmprobe_version": None, "actstore_version": actstore.__version__, "extraction_backend": "local",
            "nnsight_version": None, "torch_version": versions.get("torch"),
            "transformers_version": versions.get("transformers"), "python_version": versions.get("python"),
            "numpy_version": versions.get("numpy"), "pyarrow_version": pyarrow.__version__,
            "safetensors_version": safetensors.__version__, "extracted_at": extraction.meta.get("created_at"),
            "created_at": utc_now().isoformat(timespec="seconds"),
            "platform": platform.platform()}


def index_name(split: str) -> str:
    return f"index/{split}-00000-of-00001.parquet"


def write_dataset(extract_dir: str | Path, out_dir: str | Path, options: dict[str, Any],
                  progress: bool = True) -> dict[str, Any]:
    """Write an lmprobe 2.0 dataset of an extraction into `out_dir` (atomically); return its info dict.

    `options` = the `lmprobe` config section (defaults as in the schema).
    """
    from actstore.formats.parts import open_extraction

    extraction = open_extraction(extract_dir)
    opts = _options(options, extraction)
    src = _Source(extraction)
    n = extraction.n_samples
    if n == 0:
        raise FormatError(f"{extract_dir}: extraction has no samples")
    order = prompt_order(n, opts["prompt_ordering"], opts["seed"])
    dim = extraction.parts[0].tensor(f"layer_{opts['layers'][0]}").shape[1]
    row_bytes = dim * DTYPES[opts["dtype"]][1].itemsize
    per_shard = max(1, min(opts["shard_bytes"] // row_bytes, 2**31 - 1))
    lt_shard = np.arange(n) // per_shard
    row_offset = np.arange(n) % per_shard
    num_tokens = src.stop[order] - src.start[order]
    with atomic_path(out_dir) as tmp:
        (tmp / "tensors").mkdir(parents=True)
        (tmp / "index").mkdir()
        seq_shard = None
        if opts["storage"] == "full_sequence":
            seq_shard = pack_shards(num_tokens, per_shard)
        shards, files = _hidden_files(tmp, src, order, lt_shard, seq_shard, opts, dim, progress)
        hidden = {"type": "hidden", "layers": opts["layers"], "dim": int(dim), "dtype": opts["dtype"],
                  "layout": "per_layer", "file_pattern": HIDDEN_FILE_PATTERN, "key_pattern": HIDDEN_KEY_PATTERN}
        if seq_shard is None:
            hidden.update(storage="pooled", pooling="last_token", row_bytes=int(row_bytes), shards=shards)
        else:
            hidden.update(storage="full_sequence", last_token_shards=int(lt_shard.max()) + 1,
                          row_bytes=int(row_bytes), sequence_includes_last_token=True, shards=shards)
        tensors: dict[str, Any] = {"hidden_layers": hidden}
        columns = _base_columns(extraction, order, num_tokens, lt_shard, row_offset)
        if seq_shard is not None:
            columns.update(_sequence_columns(num_tokens, row_offset, seq_shard + hidden["last_token_shards"], per_shard))
        if opts["logits_topk"]:
            desc, l_shard, l_offset, l_files = _logits_files(tmp, src, order, opts["logits_topk"], opts["shard_bytes"])
            tensors["logits_topk"] = desc
            files.update(l_files)
            columns.update(shard_index_logits=l_shard.astype(np.int32), row_offset_logits=l_offset.astype(np.int32))
        columns.update(_token_columns(src, order, opts["token_strings"]))
        columns["sample_idx"] = order
        columns["label_id"] = [None if r["label"] is None else r["label_id"] for r in _rows(extraction, order)]
        columns.update(_metadata_columns(_rows(extraction, order), set(columns)))
        info = {
            "format_version": FORMAT_VERSION,
            "model": {"name": extraction.meta["model"]["name"], "revision": extraction.meta["model"]["revision"]},
            "num_prompts": n, "prompt_ordering": opts["prompt_ordering"],
            "prompt_ordering_seed": opts["seed"] if opts["prompt_ordering"] == "random" else None,
            "tensors": tensors, "provenance": _provenance(extraction),
            "dataset": {k: extraction.meta["dataset"][k] for k in ("name", "split", "labels")},
            "files": files,
        }
        index_rel = index_name(extraction.meta["dataset"]["split"])
        _write_index(tmp / index_rel, columns, info)
        (tmp / "README.md").write_text(dataset_card(info, index_rel))
        write_sums(tmp)
    log.info("lmprobe: %d prompts, layers %s, %s -> %s", n, opts["layers"], opts["storage"], out_dir)
    return info


def _rows(extraction, order: np.ndarray) -> list[dict]:
    return [extraction.sample(s) for s in order.tolist()]


def _base_columns(extraction, order, num_tokens, lt_shard, row_offset) -> dict[str, Any]:
    rows = _rows(extraction, order)
    return {"text": [r["text"] for r in rows], "label": [r["label"] for r in rows],
            "num_tokens": num_tokens.astype(np.int32), "shard_index": lt_shard.astype(np.int32),
            "row_offset": row_offset.astype(np.int32)}


def _sequence_columns(num_tokens: np.ndarray, row_offset: np.ndarray, seq_shard: np.ndarray,
                      per_shard: int) -> dict[str, Any]:
    """token_offset (= row_offset) and per-token shard ids/offsets into the packed sequence shards."""
    import pyarrow as pa

    list_offsets = np.concatenate([[0], np.cumsum(num_tokens)]).astype(np.int64)
    # first token of each prompt within its shard: running sum of the tokens before it in that shard
    first = np.zeros(len(num_tokens), np.int64)
    for s in np.unique(seq_shard):
        rows = np.flatnonzero(seq_shard == s)
        first[rows] = np.concatenate([[0], np.cumsum(num_tokens[rows])[:-1]])
    ids = np.repeat(seq_shard.astype(np.int64), num_tokens)
    within = np.arange(list_offsets[-1]) - np.repeat(list_offsets[:-1], num_tokens)
    offsets = np.repeat(first, num_tokens) + within
    return {"token_offset": row_offset.astype(np.int64),
            "token_shard_ids": pa.LargeListArray.from_arrays(list_offsets, pa.array(ids, pa.int64())).cast(pa.list_(pa.int64())),
            "token_shard_offsets": pa.LargeListArray.from_arrays(list_offsets, pa.array(offsets, pa.int64())).cast(pa.list_(pa.int64()))}


def _write_index(path: Path, columns: dict[str, Any], info: dict[str, Any]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"text": pa.string(), "label": pa.string(), "label_id": pa.int32(), "sample_idx": pa.int64()}
    arrays = {k: v if isinstance(v, (pa.Array, pa.ChunkedArray)) else pa.array(v, types.get(k))
              for k, v in columns.items()}
    metadata = {f"{PREFIX}{k}".encode(): json.dumps(v).encode() for k, v in info.items()}
    table = pa.table(arrays).replace_schema_metadata(metadata)
    pq.write_table(table, path, write_page_checksum=True)


def dataset_card(info: dict[str, Any], index_rel: str) -> str:
    """A short README.md (Hugging Face dataset card) describing the dataset and how to read it."""
    hidden = info["tensors"]["hidden_layers"]
    split = info["dataset"]["split"]
    return f"""---
configs:
- config_name: default
  data_files:
  - split: {split}
    path: {index_rel}
---
# lmprobe {info['format_version']} activations of {info['model']['name']}

{info['num_prompts']} prompts from `{info['dataset']['name']}`, layers {hidden['layers']} (dim {hidden['dim']},
{hidden['dtype']}, {hidden['storage']} storage), prompt ordering `{info['prompt_ordering']}`
(seed {info.get('prompt_ordering_seed')}). Written by actstore {info['provenance']['actstore_version']}.

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


def write_sums(root: Path) -> None:
    """SHA256SUMS (sha256sum format) for every file under root except itself, sorted by path."""
    lines = [f"{sha256_file(p)}  {p.relative_to(root).as_posix()}\n"
             for p in sorted(root.rglob("*")) if p.is_file() and p.name != SUMS]
    (root / SUMS).write_text("".join(lines))


# ---------------------------------------------------------------- reader

def dataset_root(path: str | Path) -> Path:
    """The dataset root: `path` itself, or `path/dataset` for an actstore lmprobe stage directory."""
    path = Path(path)
    if not (path / "index").is_dir() and (path / DATASET_DIR / "index").is_dir():
        return path / DATASET_DIR
    return path


def find_index(root: str | Path, split: str | None = None) -> Path:
    """The index parquet of a dataset root: index/{split}-00000-of-00001.parquet (the only one, or train)."""
    root = dataset_root(root)
    if split is not None:
        path = root / index_name(split)
        if not path.is_file():
            raise FormatError(f"{path}: index parquet missing")
        return path
    found = sorted((root / "index").glob("*.parquet")) if (root / "index").is_dir() else []
    if len(found) == 1:
        return found[0]
    if (root / index_name("train")).is_file():
        return root / index_name("train")
    if not found:
        raise FormatError(f"{root}: no index/*.parquet; not an lmprobe dataset")
    raise FormatError(f"{root}: several index parquets {[p.name for p in found]}; pass split=")


def read_info(index_path: str | Path) -> dict[str, Any]:
    """The `lmprobe:` schema metadata of an index parquet, JSON-decoded, checked for the format version."""
    import pyarrow.parquet as pq

    index_path = Path(index_path)
    try:
        metadata = pq.read_schema(index_path).metadata or {}
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise FormatError(f"{index_path}: not a readable parquet file ({exc})") from None
    info = {}
    for k, v in metadata.items():
        if k.decode(errors="replace").startswith(PREFIX):
            key = k.decode().removeprefix(PREFIX)
            try:
                info[key] = json.loads(v)
            except json.JSONDecodeError:
                raise FormatError(f"{index_path}: schema metadata {k.decode()!r} is not JSON") from None
    if not info:
        raise FormatError(f"{index_path}: parquet has no 'lmprobe:' schema metadata; not an lmprobe index")
    if info.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"{index_path}: lmprobe:format_version {info.get('format_version')!r} unknown "
                          f"(this reader knows {FORMAT_VERSION!r})")
    missing = [k for k in REQUIRED_INFO if k not in info]
    if missing:
        raise FormatError(f"{index_path}: schema metadata lacks lmprobe:{', lmprobe:'.join(missing)}")
    if "hidden_layers" not in info["tensors"]:
        raise FormatError(f"{index_path}: lmprobe:tensors has no 'hidden_layers' descriptor")
    return info


def _list_column(table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, flat values) of a list<int64> column as numpy, without per-row Python objects."""
    import pyarrow as pa

    column = table.column(name).combine_chunks()
    column = column.cast(pa.large_list(column.type.value_type))
    offsets = column.offsets.to_numpy() - column.offsets[0].as_py()
    return offsets.astype(np.int64), column.flatten().to_numpy(zero_copy_only=False)


class LmprobeDataset:
    """An lmprobe 2.0 dataset opened by its root directory. Prompts are index rows (df.iloc order)."""

    def __init__(self, root: str | Path, split: str | None = None):
        import pyarrow.parquet as pq

        self.root = dataset_root(root)
        self.index_path = find_index(self.root, split)
        self.info = read_info(self.index_path)
        self.hidden = self.info["tensors"]["hidden_layers"]
        self.logits_desc = self.info["tensors"].get("logits_topk")
        self.column_names = pq.read_schema(self.index_path).names
        missing = [c for c in CORE_COLUMNS if c not in self.column_names]
        if missing:
            raise FormatError(f"{self.index_path}: core columns missing: {missing}")
        # Only the addressing columns are read up front; text/token lists load on first use of .table.
        wanted = ["num_tokens", "shard_index", "row_offset"] + [c for c in ("sample_idx",) if c in self.column_names]
        address = pq.read_table(self.index_path, columns=wanted)
        self.num_tokens = address.column("num_tokens").to_numpy().astype(np.int64)
        self.shard_index = address.column("shard_index").to_numpy().astype(np.int64)
        self.row_offset = address.column("row_offset").to_numpy().astype(np.int64)
        self.sample_idx = (address.column("sample_idx").to_numpy().astype(np.int64)
                           if "sample_idx" in self.column_names else np.arange(address.num_rows))
        self._row_of_map: dict[int, int] | None = None
        self._table = None
        self._tok_cache: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._views: dict[tuple[str, str], np.ndarray] = {}

    @property
    def table(self):
        """The whole index as a pyarrow Table (read on first use)."""
        import pyarrow.parquet as pq

        if self._table is None:
            self._table = pq.read_table(self.index_path)
        return self._table

    @property
    def _row_of(self) -> dict[int, int]:
        if self._row_of_map is None:
            self._row_of_map = {int(s): r for r, s in enumerate(self.sample_idx.tolist())}
        return self._row_of_map

    @property
    def _tok(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(list offsets, flat token_shard_ids) of a full-sequence index."""
        return self._token_addresses()[:2] if self.full_sequence else None

    @property
    def _tok_off(self) -> np.ndarray | None:
        return self._token_addresses()[2] if self.full_sequence else None

    def _token_addresses(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._tok_cache is None:
            import pyarrow.parquet as pq

            table = self._table or pq.read_table(self.index_path, columns=["token_shard_ids", "token_shard_offsets"])
            offsets, ids = _list_column(table, "token_shard_ids")
            self._tok_cache = (offsets, ids, _list_column(table, "token_shard_offsets")[1])
        return self._tok_cache

    # -- descriptor
    @property
    def num_prompts(self) -> int:
        return len(self.shard_index)

    @property
    def layers(self) -> list[int]:
        return list(self.hidden["layers"])

    @property
    def dim(self) -> int:
        return int(self.hidden["dim"])

    @property
    def dtype(self) -> str:
        return self.hidden["dtype"]

    @property
    def full_sequence(self) -> bool:
        return self.hidden.get("storage") == "full_sequence"

    @property
    def last_token_shards(self) -> int:
        return int(self.hidden.get("last_token_shards", len(self.hidden["shards"])))

    @property
    def labels(self) -> np.ndarray:
        """Integer label per prompt (label_id column, else position in sorted label names; -1 = none)."""
        if "label_id" in self.column_names:
            return self.table.column("label_id").fill_null(-1).to_numpy().astype(np.int64)
        names = self.table.column("label").to_pylist()
        classes = {v: i for i, v in enumerate(sorted({x for x in names if x is not None}))}
        return np.array([classes.get(x, -1) for x in names], dtype=np.int64)

    def row_of(self, sample_idx: int) -> int:
        """Index row of a source dataset row."""
        try:
            return self._row_of[int(sample_idx)]
        except KeyError:
            raise IndexError(f"{self.index_path}: no prompt with sample_idx {sample_idx}") from None

    # -- tensors
    def _check_layer(self, layer: int) -> None:
        if layer not in self.hidden["layers"]:
            raise KeyError(f"{self.index_path}: layer {layer} not stored (layers {self.hidden['layers']})")

    def hidden_tensor(self, layer: int, shard: int) -> np.ndarray:
        """Memmap (rows, dim) of one hidden shard, raw storage dtype."""
        self._check_layer(layer)
        rel = self.hidden["file_pattern"].format(layer=layer, shard=shard)
        return self._view(rel, self.hidden["key_pattern"].format(layer=layer))

    def _view(self, rel: str, key: str) -> np.ndarray:
        if (rel, key) not in self._views:
            view = open_tensor(inside(self.root, rel, f"{self.index_path} (lmprobe:tensors file_pattern)"), key)
            if view.ndim != 2:
                raise FormatError(f"{self.root / rel}: tensor {key!r} has shape {list(view.shape)}, expected 2-D")
            self._views[(rel, key)] = view
        return self._views[(rel, key)]

    def _rows(self, layer: int, shards: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """float32 rows at (shard, offset) pairs of a layer, one fancy read per shard."""
        out = np.empty((len(shards), self.dim), np.float32)
        for s in np.unique(shards):
            mask = shards == s
            view = self.hidden_tensor(layer, int(s))
            wanted = offsets[mask]
            if wanted.size and (wanted.min() < 0 or wanted.max() >= view.shape[0]):
                raise FormatError(f"{self.root}: layer {layer} shard {s} has {view.shape[0]} rows, "
                                  f"index asks for row {int(wanted.max())}")
            out[mask] = to_float32(view[wanted], self.dtype)
        return out

    def get(self, prompt: int, layer: int, token: int | None = None) -> np.ndarray:
        """float32 (dim,) activation of index row `prompt` at `layer`: the last token, or token `token`."""
        n = int(self.num_tokens[prompt])
        if token is None or token == n - 1 or token == -1:
            return self._rows(layer, self.shard_index[[prompt]], self.row_offset[[prompt]])[0]
        if not -n <= token < n:
            raise IndexError(f"token {token} out of range for prompt {prompt} with {n} tokens")
        return self.tokens(prompt, layer)[token]

    def tokens(self, prompt: int, layer: int) -> np.ndarray:
        """float32 (num_tokens, dim) activations of every token of a prompt (full_sequence only)."""
        if not self.full_sequence:
            raise FormatError(f"{self.index_path}: pooled dataset stores only the last token of each prompt")
        offsets, ids = self._tok
        a, b = offsets[prompt], offsets[prompt + 1]
        return self._rows(layer, ids[a:b], self._tok_off[a:b])

    def last_tokens(self, layer: int) -> np.ndarray:
        """float32 (num_prompts, dim): every prompt's last-token vector in index order; reads only
        last-token shards, with one sequential read per shard when the shard's rows are in order."""
        self._check_layer(layer)
        out = np.empty((self.num_prompts, self.dim), np.float32)
        for s in range(self.last_token_shards):
            rows = np.flatnonzero(self.shard_index == s)
            if not len(rows):
                continue
            view = self.hidden_tensor(layer, s)
            a = int(rows[0])
            contiguous = (rows[-1] - a + 1 == len(rows) and
                          np.array_equal(self.row_offset[rows], np.arange(len(rows))) and view.shape[0] == len(rows))
            if contiguous and self.dtype == "float32":
                with open(view.filename, "rb") as fh:  # straight into the output buffer
                    fh.seek(view.offset)
                    fh.readinto(memoryview(out[a:a + len(rows)]).cast("B"))
            elif contiguous:
                out[a:a + len(rows)] = to_float32(view, self.dtype)
            else:
                out[rows] = to_float32(view[self.row_offset[rows]], self.dtype)
        return out

    def logits(self, prompt: int) -> tuple[np.ndarray, np.ndarray]:
        """(topk_values float32 (k,), topk_indices int64 (k,)) at the last token of a prompt."""
        if self.logits_desc is None:
            raise FormatError(f"{self.index_path}: no logits_topk tensors in this dataset")
        shard = int(self.table.column("shard_index_logits")[prompt].as_py())
        offset = int(self.table.column("row_offset_logits")[prompt].as_py())
        rel = self.logits_desc["file_pattern"].format(shard=shard)
        return (np.asarray(self._view(rel, "topk_values")[offset]),
                np.asarray(self._view(rel, "topk_indices")[offset]))

    def torch_dataset(self, layers: list[int] | None = None):
        """A torch Dataset over (prompt, layer) pairs yielding {activation, label, layer, prompt, sample_idx}."""
        return ProbeDataset(self, layers)


class ProbeDataset:
    """torch.utils.data.Dataset over (prompt, layer), layer-major; last-token activations + labels."""

    def __init__(self, dataset: LmprobeDataset, layers: list[int] | None = None):
        import torch  # noqa: F401  (fail early when torch is absent)

        self.dataset = dataset
        self.layers = list(layers) if layers is not None else dataset.layers
        for layer in self.layers:
            dataset._check_layer(layer)
        self.labels = dataset.labels

    def __len__(self) -> int:
        return len(self.layers) * self.dataset.num_prompts

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        if not 0 <= i < len(self):
            raise IndexError(i)
        layer, prompt = self.layers[i // self.dataset.num_prompts], i % self.dataset.num_prompts
        return {"activation": torch.from_numpy(self.dataset.get(prompt, layer)), "label": int(self.labels[prompt]),
                "layer": layer, "prompt": prompt, "sample_idx": int(self.dataset.sample_idx[prompt])}


def open_dataset(root: str | Path, split: str | None = None) -> LmprobeDataset:
    """Open an lmprobe 2.0 dataset by its root directory."""
    return LmprobeDataset(root, split)


# ---------------------------------------------------------------- CLI / validate hooks

def detect(path: str | Path) -> bool:
    """Does `path` hold an lmprobe 2.0 dataset (an index parquet with lmprobe: metadata)?"""
    try:
        read_info(find_index(path))
        return True
    except (FormatError, OSError):
        return False


def _tensor_files(info: dict[str, Any]) -> list[str]:
    hidden = info["tensors"]["hidden_layers"]
    files = [hidden["file_pattern"].format(layer=layer, shard=s)
             for layer in hidden["layers"] for s in range(len(hidden["shards"]))]
    logits = info["tensors"].get("logits_topk")
    if logits:
        files += [logits["file_pattern"].format(shard=s) for s in range(len(logits["shards"]))]
    return files


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary: format, model, layers, n_examples, n_tokens, d_model, dtype, n_shards, bytes, and more."""
    ds = open_dataset(path)
    hidden, root = ds.hidden, ds.root
    files = _tensor_files(ds.info)
    return {
        "format": FORMAT, "format_version": ds.info["format_version"], "model": ds.info["model"]["name"],
        "layers": ds.layers, "n_examples": ds.num_prompts,
        "n_tokens": int(ds.num_tokens.sum()) if ds.full_sequence else None,
        "d_model": ds.dim, "dtype": ds.dtype, "n_shards": len(files),
        "bytes": dir_bytes(root),
        "storage": hidden.get("storage"), "last_token_shards": ds.last_token_shards,
        "shards_per_layer": len(hidden["shards"]), "prompt_ordering": ds.info["prompt_ordering"],
        "prompt_ordering_seed": ds.info.get("prompt_ordering_seed"),
        "logits_topk": ds.logits_desc["k"] if ds.logits_desc else None,
        "root": str(root), "index": str(ds.index_path.relative_to(root)), "columns": ds.column_names,
    }


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """float32 (dim,) of dataset row `sample_idx`, block `layer_idx`, token `token_idx`; None if not stored."""
    ds = open_dataset(path)
    if layer_idx not in ds.layers or sample_idx not in ds._row_of:
        return None
    prompt = ds.row_of(sample_idx)
    n = int(ds.num_tokens[prompt])
    if not 0 <= token_idx < n or (token_idx != n - 1 and not ds.full_sequence):
        return None
    return ds.get(prompt, layer_idx, token_idx)


def verify(path: str | Path) -> list[str]:
    """Every problem found (each naming its file); empty = the dataset is intact. Never raises."""
    root = dataset_root(path)
    try:
        return _verify(root)
    except Exception as exc:  # a damaged store must be reported, not crash the validator
        return [f"{root}: verification aborted: {type(exc).__name__}: {exc}"]


def _verify(root: Path) -> list[str]:
    problems = _verify_sums(root)
    try:
        ds = open_dataset(root)
    except (FormatError, OSError, ValueError) as exc:
        return problems + [str(exc)]
    except Exception as exc:  # pyarrow errors on a damaged parquet
        return problems + [f"{find_index(root)}: unreadable index ({type(exc).__name__}: {exc})"]
    problems += _verify_index(ds)
    problems += _verify_tensor_files(ds)
    return problems


def _verify_sums(root: Path) -> list[str]:
    sums = root / SUMS
    if not sums.is_file():
        return [f"{sums}: missing"]
    problems, listed = [], {SUMS}
    for line in sums.read_text(errors="replace").splitlines():
        digest, _, rel = line.partition("  ")
        listed.add(rel)
        try:
            target = inside(root, rel, str(sums))
        except FormatError as exc:
            problems.append(str(exc))
            continue
        if not target.is_file():
            problems.append(f"{target}: missing (listed in {SUMS})")
        elif sha256_file(target) != digest:
            problems.append(f"{target}: sha256 differs from {SUMS}")
    return problems + unlisted(root, listed, SUMS)


def _verify_index(ds: LmprobeDataset) -> list[str]:
    where, info, hidden, cols = ds.index_path, ds.info, ds.hidden, ds.column_names
    problems = []
    need = list(CORE_COLUMNS) + (list(FULL_COLUMNS) if ds.full_sequence else []) + \
        (list(LOGITS_COLUMNS) if ds.logits_desc else [])
    problems += [f"{where}: column {c!r} missing" for c in need if c not in cols]
    for key in ("layers", "dim", "dtype", "layout", "file_pattern", "key_pattern", "storage", "shards"):
        if key not in hidden:
            problems.append(f"{where}: lmprobe:tensors.hidden_layers.{key} missing")
    if problems:
        return problems
    if info["num_prompts"] != ds.num_prompts:
        problems.append(f"{where}: lmprobe:num_prompts = {info['num_prompts']} but {ds.num_prompts} rows")
    if hidden["dtype"] not in DTYPES:
        problems.append(f"{where}: hidden_layers.dtype {hidden['dtype']!r} unknown")
    elif hidden.get("row_bytes") not in (None, ds.dim * DTYPES[hidden["dtype"]][1].itemsize):
        problems.append(f"{where}: hidden_layers.row_bytes {hidden['row_bytes']} != dim x dtype size")
    lt = ds.last_token_shards
    counts = [sh["num_prompts"] for sh in hidden["shards"][:lt]]
    if sum(counts) != ds.num_prompts:
        problems.append(f"{where}: last-token shards hold {sum(counts)} prompts, index has {ds.num_prompts}")
    pairs = ds.shard_index * (1 << 32) + ds.row_offset
    bad = (ds.shard_index < 0) | (ds.shard_index >= lt) | (ds.row_offset < 0)
    if bad.any() or len(np.unique(pairs)) != len(pairs):
        problems.append(f"{where}: shard_index/row_offset out of the last-token shards or not unique")
    if not np.array_equal(np.sort(ds.sample_idx), np.arange(ds.num_prompts)):
        problems.append(f"{where}: sample_idx is not a permutation of 0..{ds.num_prompts - 1}")
    seed = info.get("prompt_ordering_seed")
    if info["prompt_ordering"] == "random" and seed is not None and \
            not np.array_equal(ds.sample_idx, prompt_order(ds.num_prompts, "random", seed)):
        problems.append(f"{where}: sample_idx is not the permutation of lmprobe:prompt_ordering_seed {seed}")
    if ds.full_sequence:
        offsets, ids = ds._tok
        if not np.array_equal(np.diff(offsets), ds.num_tokens):
            problems.append(f"{where}: token_shard_ids lengths differ from num_tokens")
        elif len(ids) and (ids.min() < lt or ids.max() >= len(hidden["shards"])):
            problems.append(f"{where}: token_shard_ids point outside the sequence shards")
    return problems


def _verify_tensor_files(ds: LmprobeDataset) -> list[str]:
    problems = []
    recorded = ds.info.get("files", {})
    hidden = ds.hidden
    for rel in _tensor_files(ds.info):
        try:
            problem = file_problem(inside(ds.root, rel, "lmprobe:tensors"), recorded.get(rel), "lmprobe:files")
        except FormatError as exc:
            problem = str(exc)
        if problem:
            problems.append(problem)
    for layer in hidden["layers"]:
        for s, shard in enumerate(hidden["shards"]):
            path = ds.root / hidden["file_pattern"].format(layer=layer, shard=s)
            if not path.is_file():
                continue
            try:
                view = ds.hidden_tensor(layer, s)
            except FormatError as exc:
                problems.append(str(exc))
                continue
            rows = shard.get("num_tokens", shard["num_prompts"])
            if view.shape != (rows, ds.dim) or view.dtype != DTYPES[ds.dtype][1]:
                problems.append(f"{path}: tensor shape {list(view.shape)} {view.dtype}, descriptor says "
                                f"[{rows}, {ds.dim}] {ds.dtype}")
    return problems
