"""Writing an lmprobe 2.0 dataset from an extraction: hidden and top-k logits shards streamed
straight from the parts, the index parquet with the `lmprobe:` metadata, README.md and SHA256SUMS."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from actstore.errors import ConfigError, FormatError
from actstore.formats.lmprobe.check import check_selection
from actstore.formats.lmprobe.layout import (CARD, DTYPES, FORMAT_VERSION, HIDDEN_FILE_PATTERN, HIDDEN_KEY_PATTERN,
                                             LOGITS_FILE_PATTERN, LOGITS_INDICES_KEY, LOGITS_ROW_BYTES_PER_K,
                                             LOGITS_VALUES_KEY, PREFIX, ST_METADATA, SUMS, TensorSpec, dataset_card,
                                             encode_header, from_float32, index_name, prompt_order, rows_per_shard,
                                             tensor_bytes)
from actstore.io_utils import atomic_path, sha256_file, utc_now

log = logging.getLogger(__name__)

COPY_BYTES = 64 << 20  # rows copied per write while streaming a shard
DEFAULTS = {"storage": "full_sequence", "prompt_ordering": "random", "seed": 0, "dtype": "float32",
            "shard_bytes": 1 << 30, "logits_topk": None, "layers": None, "token_strings": True}


def write_safetensors(path: Path, specs: list[TensorSpec], chunks: Iterable[np.ndarray],
                      metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Stream `chunks` (in spec order) into a safetensors file; return its {bytes, sha256}."""
    digest = hashlib.sha256()
    header = encode_header(specs, metadata)
    expected = sum(tensor_bytes(d, s) for _, d, s in specs)
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


class _TokenRows:
    """Global token addressing over an extraction: sample_idx -> (part, global token rows)."""

    def __init__(self, extraction):
        self.extraction = extraction
        self.parts = extraction.parts
        self.sample_part = np.concatenate([np.full(p.info.n_samples, i, np.int64) for i, p in enumerate(self.parts)])
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
        """Rows of tensor `name` for `samples` (or their last tokens), converted to `dtype`, in bounded copies."""
        for p, a, b in self.runs(samples, last_only):
            tensor = self.parts[p].tensor(name)
            step = max(1, COPY_BYTES // (tensor.shape[1] * 4))  # bounded memory per copy
            for lo in range(a, b, step):
                yield from_float32(tensor[lo:min(b, lo + step)], dtype)


def _options(options: dict[str, Any], extraction) -> dict[str, Any]:
    """Resolved writer options, checked against the extraction; ConfigError names the key at fault."""
    info = extraction.info
    opts = {**DEFAULTS, **options}
    opts.pop("enabled", None)
    if opts["storage"] not in ("pooled", "full_sequence"):
        raise ConfigError(f"lmprobe.storage: unknown value {opts['storage']!r} (pooled or full_sequence)")
    if opts["dtype"] not in DTYPES:
        raise ConfigError(f"lmprobe.dtype: unknown value {opts['dtype']!r} ({', '.join(DTYPES)})")
    layers = opts["layers"] if opts["layers"] is not None else info.layers
    k_have = info.logits_topk
    check_selection(layers, opts["logits_topk"], info.layers, k_have)
    opts["layers"] = sorted(layers)
    opts["logits_topk"] = (opts["logits_topk"] or k_have) if k_have is not None else None
    return opts


def _hidden_files(out: Path, src: _TokenRows, order: np.ndarray, lt_shard: np.ndarray, seq_shard: np.ndarray | None,
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
        files[rel] = write_safetensors(out / rel, spec, chunks, ST_METADATA)
    if seq_shard is None:
        for shard in shards:
            shard.pop("num_tokens")  # the spec's pooled descriptor lists num_prompts only
    return shards, files


def _hidden_descriptor(opts: dict[str, Any], dim: int, row_bytes: int, lt_shard: np.ndarray,
                       seq_shard: np.ndarray | None, shards: list[dict]) -> dict[str, Any]:
    """lmprobe:tensors.hidden_layers (key order is part of the index bytes)."""
    hidden = {"type": "hidden", "layers": opts["layers"], "dim": int(dim), "dtype": opts["dtype"],
              "layout": "per_layer", "file_pattern": HIDDEN_FILE_PATTERN, "key_pattern": HIDDEN_KEY_PATTERN}
    if seq_shard is None:
        hidden.update(storage="pooled", pooling="last_token", row_bytes=int(row_bytes), shards=shards)
    else:
        hidden.update(storage="full_sequence", last_token_shards=int(lt_shard.max()) + 1,
                      row_bytes=int(row_bytes), sequence_includes_last_token=True, shards=shards)
    return hidden


def _logits_files(out: Path, src: _TokenRows, order: np.ndarray, k: int, shard_bytes: int,
                  ) -> tuple[dict[str, Any], np.ndarray, np.ndarray, dict[str, dict]]:
    """Write top-k logits shards; return the descriptor, per-row (shard, offset) and file checksums."""
    row_bytes = k * LOGITS_ROW_BYTES_PER_K
    per_shard = rows_per_shard(shard_bytes, row_bytes)
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
        spec = [(LOGITS_VALUES_KEY, "F32", [len(rows), k]), (LOGITS_INDICES_KEY, "I64", [len(rows), k])]
        files[rel] = write_safetensors(out / rel, spec, [values[rows], indices[rows]], ST_METADATA)
        shards.append({"file": rel, "num_prompts": len(rows)})
    desc = {"type": "logits_topk", "k": k, "dtype": "float32", "pooling": "last_token",
            "file_pattern": LOGITS_FILE_PATTERN, "row_bytes": row_bytes, "shards": shards}
    return desc, shard, offset, files


def _provenance(extraction) -> dict[str, Any]:
    import pyarrow
    import safetensors

    import actstore
    versions = extraction.info.versions
    return {"lmprobe_version": None, "actstore_version": actstore.__version__, "extraction_backend": "local",
            "nnsight_version": None, "torch_version": versions.get("torch"),
            "transformers_version": versions.get("transformers"), "python_version": versions.get("python"),
            "numpy_version": versions.get("numpy"), "pyarrow_version": pyarrow.__version__,
            "safetensors_version": safetensors.__version__, "extracted_at": extraction.info.created_at,
            "created_at": utc_now().isoformat(timespec="seconds"),
            "platform": platform.platform()}


def write_dataset(extract_dir: str | Path, out_dir: str | Path, options: dict[str, Any],
                  progress: bool = True) -> dict[str, Any]:
    """Write an lmprobe 2.0 dataset of an extraction into `out_dir` (atomically); return its info dict.

    `options` = the `lmprobe` config section (defaults as in the schema).
    """
    from actstore.formats.extract import open_extraction

    extraction = open_extraction(extract_dir)
    opts = _options(options, extraction)
    src = _TokenRows(extraction)
    n = extraction.n_samples
    if n == 0:
        raise FormatError(f"{extract_dir}: extraction has no samples")
    order = prompt_order(n, opts["prompt_ordering"], opts["seed"])
    dim = extraction.parts[0].tensor(f"layer_{opts['layers'][0]}").shape[1]
    row_bytes = dim * DTYPES[opts["dtype"]][1].itemsize
    per_shard = rows_per_shard(opts["shard_bytes"], row_bytes)
    lt_shard = np.arange(n) // per_shard
    row_offset = np.arange(n) % per_shard
    num_tokens = src.stop[order] - src.start[order]
    with atomic_path(out_dir) as tmp:
        (tmp / "tensors").mkdir(parents=True)
        (tmp / "index").mkdir()
        seq_shard = pack_shards(num_tokens, per_shard) if opts["storage"] == "full_sequence" else None
        shards, files = _hidden_files(tmp, src, order, lt_shard, seq_shard, opts, dim, progress)
        hidden = _hidden_descriptor(opts, dim, row_bytes, lt_shard, seq_shard, shards)
        tensors: dict[str, Any] = {"hidden_layers": hidden}
        columns = _base_columns(extraction, order, num_tokens, lt_shard, row_offset)
        if seq_shard is not None:
            columns.update(_sequence_columns(num_tokens, row_offset, seq_shard + hidden["last_token_shards"]))
        if opts["logits_topk"]:
            desc, l_shard, l_offset, l_files = _logits_files(tmp, src, order, opts["logits_topk"], opts["shard_bytes"])
            tensors["logits_topk"] = desc
            files.update(l_files)
            columns.update(shard_index_logits=l_shard.astype(np.int32), row_offset_logits=l_offset.astype(np.int32))
        columns.update(_token_columns(src, order, opts["token_strings"]))
        columns.update(_sample_columns(extraction, order, set(columns)))
        info = _info(extraction, opts, tensors, files)
        index_rel = index_name(extraction.info.dataset.split)
        _write_index(tmp / index_rel, columns, info)
        (tmp / CARD).write_text(dataset_card(info, index_rel))
        write_sums(tmp)
    log.info("lmprobe: %d prompts, layers %s, %s -> %s", n, opts["layers"], opts["storage"], out_dir)
    return info


def _info(extraction, opts: dict[str, Any], tensors: dict[str, Any], files: dict[str, dict]) -> dict[str, Any]:
    """The lmprobe:* schema metadata (key order is part of the index bytes)."""
    return {
        "format_version": FORMAT_VERSION,
        "model": {"name": extraction.info.model.name, "revision": extraction.info.model.revision},
        "num_prompts": extraction.n_samples, "prompt_ordering": opts["prompt_ordering"],
        "prompt_ordering_seed": opts["seed"] if opts["prompt_ordering"] == "random" else None,
        "tensors": tensors, "provenance": _provenance(extraction),
        "dataset": {"name": extraction.info.dataset.name, "split": extraction.info.dataset.split,
                    "labels": extraction.info.dataset.labels},
        "files": files,
    }


# ---------------------------------------------------------------- index columns

def _rows(extraction, order: np.ndarray) -> list[dict]:
    return [extraction.sample(s) for s in order.tolist()]


def _base_columns(extraction, order: np.ndarray, num_tokens: np.ndarray, lt_shard: np.ndarray,
                  row_offset: np.ndarray) -> dict[str, Any]:
    rows = _rows(extraction, order)
    return {"text": [r["text"] for r in rows], "label": [r["label"] for r in rows],
            "num_tokens": num_tokens.astype(np.int32), "shard_index": lt_shard.astype(np.int32),
            "row_offset": row_offset.astype(np.int32)}


def _sequence_columns(num_tokens: np.ndarray, row_offset: np.ndarray, seq_shard: np.ndarray) -> dict[str, Any]:
    """token_offset (= row_offset) and per-token shard ids/offsets into the packed sequence shards."""
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
            "token_shard_ids": _int64_lists(list_offsets, ids),
            "token_shard_offsets": _int64_lists(list_offsets, offsets)}


def _int64_lists(list_offsets: np.ndarray, values: np.ndarray):
    """A list<int64> column from int64 offsets (built as a large list, so any length fits)."""
    import pyarrow as pa

    return pa.LargeListArray.from_arrays(list_offsets, pa.array(values, pa.int64())).cast(pa.list_(pa.int64()))


def _token_columns(src: _TokenRows, order: np.ndarray, want_strings: bool) -> dict[str, Any]:
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
        cols.update(_perplexity_columns(list_offsets, np.concatenate(logprobs).astype(np.float32)))
    if want_strings:
        cols["token_strings"] = pa.ListArray.from_arrays(list_offsets, pa.array(_decode(ext, flat_ids), pa.string()))
    return cols


def _perplexity_columns(list_offsets: np.ndarray, flat_lp: np.ndarray) -> dict[str, Any]:
    """perplexity_mean/min/max per prompt (over tokens 1..), token_perplexity and token_logprob lists."""
    import pyarrow as pa

    ppl = np.exp(-flat_lp.astype(np.float64))  # NaN at token 0: nothing predicts the first token
    stats: dict[str, list] = {"perplexity_mean": [], "perplexity_min": [], "perplexity_max": []}
    for a, b in zip(list_offsets[:-1], list_offsets[1:]):
        body = ppl[a + 1:b]
        for name, fn in (("perplexity_mean", np.mean), ("perplexity_min", np.min), ("perplexity_max", np.max)):
            stats[name].append(float(fn(body)) if len(body) else None)
    cols: dict[str, Any] = {name: pa.array(v, pa.float64()) for name, v in stats.items()}
    cols["token_perplexity"] = pa.ListArray.from_arrays(list_offsets, pa.array(ppl, pa.float64()))
    cols["token_logprob"] = pa.ListArray.from_arrays(list_offsets, pa.array(flat_lp, pa.float32()))
    return cols


def _decode(extraction, flat_ids: np.ndarray) -> list[str]:
    """Each token decoded on its own with the model's tokenizer (special tokens kept)."""
    from transformers import AutoTokenizer

    path = extraction.info.model.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"lmprobe.token_strings: cannot load the tokenizer from {path} ({exc}); "
                          "set lmprobe.token_strings: false") from None
    uniq, inverse = np.unique(flat_ids, return_inverse=True)
    strings = np.array(tokenizer.batch_decode([[int(i)] for i in uniq]), dtype=object)
    return strings[inverse].tolist()


def _sample_columns(extraction, order: np.ndarray, taken: set[str]) -> dict[str, Any]:
    """sample_idx, label_id, then the user metadata fields (auto-typed by pyarrow); a clash with a
    column already taken gets `meta_`."""
    rows = _rows(extraction, order)
    columns: dict[str, Any] = {"sample_idx": order,
                               "label_id": [None if r["label"] is None else r["label_id"] for r in rows]}
    taken = taken | set(columns)
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row["metadata"] if k not in keys]
    columns.update({(f"meta_{k}" if k in taken else k): [row["metadata"].get(k) for row in rows] for k in keys})
    return columns


def _write_index(path: Path, columns: dict[str, Any], info: dict[str, Any]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"text": pa.string(), "label": pa.string(), "label_id": pa.int32(), "sample_idx": pa.int64()}
    arrays = {k: v if isinstance(v, (pa.Array, pa.ChunkedArray)) else pa.array(v, types.get(k))
              for k, v in columns.items()}
    metadata = {f"{PREFIX}{k}".encode(): json.dumps(v).encode() for k, v in info.items()}
    table = pa.table(arrays).replace_schema_metadata(metadata)
    pq.write_table(table, path, write_page_checksum=True)


def write_sums(root: Path) -> None:
    """SHA256SUMS (sha256sum format) for every file under root except itself, sorted by path."""
    lines = [f"{sha256_file(p)}  {p.relative_to(root).as_posix()}\n"
             for p in sorted(root.rglob("*")) if p.is_file() and p.name != SUMS]
    (root / SUMS).write_text("".join(lines))
