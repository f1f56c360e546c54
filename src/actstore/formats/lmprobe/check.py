"""The Format-protocol functions of lmprobe 2.0 (detect, inspect, verify, read_vector) and the
checks of the lmprobe config section against what the extraction holds."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import ConfigError, FormatError
from actstore.formats.lmprobe.layout import (CORE_COLUMNS, DTYPES, FORMAT, FULL_COLUMNS, HIDDEN_KEYS,
                                             LOGITS_COLUMNS, SUMS, prompt_order)
from actstore.formats.lmprobe.read import LmprobeDataset, dataset_root, find_index, open_dataset, read_info
from actstore.integrity import dir_bytes, inside, links_out, listed_problem, problems_of, unlisted


def check_selection(layers: list[int], logits_topk: int | None, have_layers: list[int],
                    have_topk: int | None) -> None:
    """ConfigError (naming the lmprobe key) unless the layers and top-k asked for were extracted."""
    missing = [layer for layer in layers if layer not in have_layers]
    if missing:
        raise ConfigError(f"lmprobe.layers: {missing} not extracted (extract.layers = {have_layers})")
    if logits_topk and have_topk is not None and logits_topk > have_topk:
        raise ConfigError(f"lmprobe.logits_topk: {logits_topk} > extract.logits_topk = {have_topk}")


def check_options(config: dict[str, Any]) -> None:
    """Parse-time check of the lmprobe section against the extract section (ConfigError names the key)."""
    opts, ext = config["lmprobe"], config["extract"]
    check_selection(opts.get("layers") or [], opts.get("logits_topk"), ext["layers"], ext["logits_topk"])


def detect(path: str | Path) -> bool:
    """Does `path` hold an lmprobe 2.0 dataset (an index parquet with lmprobe: metadata)? An index
    reached through a link out of `path` is not read (verify names the link)."""
    try:
        index = find_index(path)
        inside(Path(path), index.relative_to(path).as_posix(), str(index))
        read_info(index)
        return True
    except (FormatError, OSError):
        return False


def tensor_files(info: dict[str, Any]) -> list[str]:
    """Every shard file the descriptors of `info` name, relative to the dataset root."""
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
    files = tensor_files(ds.info)
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
    if layer_idx not in ds.layers or not ds.has_sample(sample_idx):
        return None
    prompt = ds.row_of(sample_idx)
    n = int(ds.num_tokens[prompt])
    if not 0 <= token_idx < n or (token_idx != n - 1 and not ds.full_sequence):
        return None
    return ds.get(prompt, layer_idx, token_idx)


TOKEN_BATCH_ROWS = 4096  # index rows whose token_shard_ids are checked at once


def verify(path: str | Path, checksums: bool = True) -> list[str]:
    """Every problem found (each naming its file); empty = the dataset is intact. Never raises.

    checksums=False skips hashing the tensor files (what a job that wrote none of them checks): each is
    checked by size against lmprobe:files, whose sha256 SHA256SUMS must repeat, and by its header;
    the index and card are still hashed, the index columns still checked."""
    if problems := links_out(Path(path)):
        return problems
    root = dataset_root(path)
    try:
        return _verify(root, checksums)
    except Exception as exc:  # a damaged store must be reported, not crash the validator
        return [f"{root}: verification aborted: {type(exc).__name__}: {exc}"]


def _verify(root: Path, checksums: bool) -> list[str]:
    try:
        ds = open_dataset(root)
    except (FormatError, OSError, ValueError) as exc:
        return _verify_sums(root) + [str(exc)]
    except Exception as exc:  # pyarrow errors on a damaged parquet
        return _verify_sums(root) + [f"{find_index(root)}: unreadable index ({type(exc).__name__}: {exc})"]
    trusted = {} if checksums else ds.info.get("files", {})
    return _verify_sums(root, trusted) + _verify_index(ds) + _verify_tensor_files(ds, checksums)


def _verify_sums(root: Path, trusted: dict[str, Any] | None = None) -> list[str]:
    """SHA256SUMS against the files; a file in `trusted` (lmprobe:files) only against that record."""
    sums = root / SUMS
    if not sums.is_file():
        return [f"{sums}: missing"]
    lines = [line.partition("  ")[::2] for line in sums.read_text(errors="replace").splitlines()]

    def check(line: tuple[str, str]) -> list[str]:
        digest, rel = line
        if isinstance(trusted, dict) and rel in trusted:
            if not isinstance(trusted[rel], dict) or trusted[rel].get("sha256") != digest:
                return [f"{root / rel}: sha256 in {SUMS} differs from lmprobe:files"]
            return []
        return [problem] if (problem := listed_problem(root, rel, {"sha256": digest}, SUMS, str(sums))) else []

    return problems_of(check, lines, desc=f"verify {SUMS}") + unlisted(root, {SUMS, *(rel for _, rel in lines)}, SUMS)


def _verify_index(ds: LmprobeDataset) -> list[str]:
    """Columns and descriptor keys first; the addressing is checked only when they are all there."""
    problems = _missing_fields(ds)
    if problems:
        return problems
    return _verify_counts(ds) + _verify_order(ds) + (_verify_token_addresses(ds) if ds.full_sequence else [])


def _missing_fields(ds: LmprobeDataset) -> list[str]:
    need = list(CORE_COLUMNS) + (list(FULL_COLUMNS) if ds.full_sequence else []) + \
        (list(LOGITS_COLUMNS) if ds.logits_desc else [])
    problems = [f"{ds.index_path}: column {c!r} missing" for c in need if c not in ds.column_names]
    return problems + [f"{ds.index_path}: lmprobe:tensors.hidden_layers.{key} missing"
                       for key in HIDDEN_KEYS if key not in ds.hidden]


def _verify_counts(ds: LmprobeDataset) -> list[str]:
    """Prompt counts, the stored dtype, and the last-token (shard_index, row_offset) pairs."""
    where, info, hidden = ds.index_path, ds.info, ds.hidden
    problems = []
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
    return problems


def _verify_order(ds: LmprobeDataset) -> list[str]:
    """sample_idx is a permutation, and the recorded seed's one when the ordering is random."""
    where, info = ds.index_path, ds.info
    problems = []
    if not np.array_equal(np.sort(ds.sample_idx), np.arange(ds.num_prompts)):
        problems.append(f"{where}: sample_idx is not a permutation of 0..{ds.num_prompts - 1}")
    seed = info.get("prompt_ordering_seed")
    if info["prompt_ordering"] == "random" and seed is not None and \
            not np.array_equal(ds.sample_idx, prompt_order(ds.num_prompts, "random", seed)):
        problems.append(f"{where}: sample_idx is not the permutation of lmprobe:prompt_ordering_seed {seed}")
    return problems


def _verify_token_addresses(ds: LmprobeDataset) -> list[str]:
    """Each prompt's token_shard_ids: one per token, each inside the sequence shards. Read a batch of
    rows at a time: the column holds an int64 per token (gigabytes at terabyte scale)."""
    import pyarrow.parquet as pq

    start, first, stop = 0, ds.last_token_shards, len(ds.hidden["shards"])
    for batch in pq.ParquetFile(ds.index_path).iter_batches(columns=["token_shard_ids"], batch_size=TOKEN_BATCH_ROWS):
        column = batch.column(0)
        lengths = np.diff(column.offsets.to_numpy())
        if not np.array_equal(lengths, ds.num_tokens[start:start + len(lengths)]) or column.null_count:
            return [f"{ds.index_path}: token_shard_ids lengths differ from num_tokens"]
        ids = column.flatten().to_numpy()
        if len(ids) and (ids.min() < first or ids.max() >= stop):
            return [f"{ds.index_path}: token_shard_ids point outside the sequence shards"]
        start += len(lengths)
    return []


def _verify_tensor_files(ds: LmprobeDataset, checksums: bool) -> list[str]:
    """Each shard against lmprobe:files (its size only without `checksums`), then each hidden
    shard's header against its descriptor."""
    recorded = ds.info.get("files", {})

    def check(rel: str) -> list[str]:
        record = recorded.get(rel)
        if not checksums and isinstance(record, dict):
            record = {k: v for k, v in record.items() if k != "sha256"}
        problem = listed_problem(ds.root, rel, record, "lmprobe:files", "lmprobe:tensors", digest=checksums)
        return [problem] if problem else []

    problems = problems_of(check, tensor_files(ds.info), desc="verify lmprobe tensors")
    for layer in ds.hidden["layers"]:
        for s, shard in enumerate(ds.hidden["shards"]):
            problems += _verify_hidden_shard(ds, layer, s, shard)
    return problems


def _verify_hidden_shard(ds: LmprobeDataset, layer: int, s: int, shard: dict[str, Any]) -> list[str]:
    path = ds.root / ds.hidden["file_pattern"].format(layer=layer, shard=s)
    if not path.is_file():
        return []  # already reported against lmprobe:files
    try:
        view = ds.hidden_tensor(layer, s)
    except FormatError as exc:
        return [str(exc)]
    rows = shard.get("num_tokens", shard["num_prompts"])
    if view.shape != (rows, ds.dim) or view.dtype != DTYPES[ds.dtype][1]:
        return [f"{path}: tensor shape {list(view.shape)} {view.dtype}, descriptor says "
                f"[{rows}, {ds.dim}] {ds.dtype}"]
    return []
