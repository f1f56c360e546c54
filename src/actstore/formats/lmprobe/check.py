"""The Format-protocol functions of lmprobe 2.0 (detect, inspect, verify, read_vector) and the
checks of the lmprobe config section against what the extraction holds."""
from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import ConfigError, FormatError
from actstore.formats.lmprobe.layout import (COLUMN_TYPES, CORE_COLUMNS, DESCRIPTOR_TYPES, DTYPES, FORMAT,
                                             FULL_COLUMNS, HIDDEN_KEYS, LOGITS_COLUMNS, LOGITS_DTYPE,
                                             LOGITS_ROW_BYTES_PER_K, STORAGES, SUMS, TOKEN_COLUMNS, prompt_order)
from actstore.formats.lmprobe.read import (LmprobeDataset, dataset_root, find_index, list_column, open_dataset,
                                           pattern_fields, read_info)
from actstore.integrity import (dir_bytes, in_share, inside, links_out, listed_problem, open_regular, problems_of,
                                sorted_files, unlisted, vector_indices, whole_number)


def check_selection(layers: list[int], logits_topk: int | None, have_layers: list[int],
                    have_topk: int | None) -> None:
    """ConfigError (naming the lmprobe key) unless the layers and top-k asked for were extracted, each
    layer once: a layer twice was written twice at once into one file, and stored twice in
    hidden_layers.layers (every reader of its list then took that layer's vectors twice). `have_topk`
    None: no logits were (or will be) extracted, so a top-k asked for is refused (an encoder's or vision
    model's dataset was written without them, silently)."""
    repeated = sorted({layer for layer in layers if layers.count(layer) > 1})
    if repeated:
        raise ConfigError(f"lmprobe.layers: {repeated} given more than once")
    missing = [layer for layer in layers if layer not in have_layers]
    if missing:
        raise ConfigError(f"lmprobe.layers: {missing} not extracted (extract.layers = {have_layers})")
    if logits_topk is not None and have_topk is None:
        raise ConfigError(f"lmprobe.logits_topk: {logits_topk} asked for, but the extraction keeps no logits (only a "
                          "causal LM's are kept); set lmprobe.logits_topk: null")
    if logits_topk and logits_topk > have_topk:
        raise ConfigError(f"lmprobe.logits_topk: {logits_topk} > extract.logits_topk = {have_topk}")


def check_options(config: dict[str, Any], model_config: dict[str, Any]) -> None:
    """Parse-time check of the lmprobe section against the extract section and the model's kind
    (`model_config`: the config.json extraction runs, model_config.run_config; only a causal LM's logits
    are extracted, though extract.logits_topk is the default 20 for any model); ConfigError names the key."""
    from actstore.model_config import model_kind

    opts, ext = config["lmprobe"], config["extract"]
    have_topk = ext["logits_topk"] if model_kind(model_config) == "causal" else None
    check_selection(opts.get("layers") or [], opts.get("logits_topk"), ext["layers"], have_topk)


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
        # prompts cut at the extraction's max_seq_length (column `truncated`); None: not recorded
        "n_truncated_samples": _dataset_info(ds).get("n_truncated_samples"),
    }


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """float32 (dim,) of dataset row `sample_idx`, block `layer_idx`, token `token_idx`; None if not stored."""
    # TypeError for a bool or a float, before the index is read: True read row, layer or token 1
    sample_idx, layer_idx, token_idx = vector_indices(sample_idx, layer_idx, token_idx, Path(path))
    ds = open_dataset(path)
    if layer_idx not in ds.layers or not ds.has_sample(sample_idx):
        return None
    prompt = ds.row_of(sample_idx)
    n = int(ds.num_tokens[prompt])
    if not 0 <= token_idx < n or (token_idx != n - 1 and not ds.full_sequence):
        return None
    return ds.get(prompt, layer_idx, token_idx)


TOKEN_BATCH_ROWS = 4096  # index rows whose token_shard_ids are checked at once, at most
TOKEN_BATCH_TOKENS = 1 << 21  # and their tokens, unless one prompt holds more: ~50 B a token computed (100 MB)


def verify(path: str | Path, checksums: bool = True) -> list[str]:
    """Every problem found (each naming its file); empty = the dataset is intact. Never raises.

    A file lmprobe:files records (the tensor files) is hashed once, against that record, whose sha256
    SHA256SUMS must repeat. checksums=False skips hashing them (what a job that wrote none of them checks):
    each is checked by size and by its header; the index and card are still hashed, the index columns
    still checked."""
    if problems := links_out(Path(path)):
        return problems
    root = dataset_root(path)
    if not root.is_dir():  # named as the other formats name theirs: walked, it was "verification aborted"
        return [f"{root}: {'not a directory' if root.exists() else 'missing'} (an lmprobe dataset is a directory)"]
    try:
        return _verify(root, checksums)
    except FormatError as exc:  # an index column pyarrow cannot decode (read_index): named, and the files checked
        return _verify_sums(root, _listing(root)) + [str(exc)]
    except Exception as exc:  # a damaged store must be reported, not crash the validator
        return [f"{root}: verification aborted: {type(exc).__name__}: {exc}"]


def _verify(root: Path, checksums: bool) -> list[str]:
    listing = _listing(root)
    try:
        ds = open_dataset(root)
    except (FormatError, OSError, ValueError) as exc:
        return _verify_sums(root, listing) + [str(exc)]
    except Exception as exc:  # pyarrow errors on a damaged parquet
        return _verify_sums(root, listing) + [f"{find_index(root)}: unreadable index ({type(exc).__name__}: {exc})"]
    # SHA256SUMS' digest of a file lmprobe:files records is compared with that record, the file hashed
    # once against it (_verify_tensor_files): hashed against each, a terabyte dataset was read twice
    return (_verify_sums(root, listing, ds.info.get("files", {})) + _verify_index(ds)
            + (_named_beyond_files(ds, listing[0]) or _verify_tensor_files(ds, checksums)))


def _listing(root: Path) -> tuple[int, int]:
    """(files under `root`, bytes of their names), one walk: what bounds SHA256SUMS' size and the tensor
    files the descriptors may name."""
    count = name_bytes = 0
    for rel in sorted_files(root):
        count, name_bytes = count + 1, name_bytes + len(os.fsencode(rel))
    return count, name_bytes


def _named_beyond_files(ds: LmprobeDataset, held: int) -> list[str]:
    """One problem when a descriptor names more distinct tensor files than the dataset holds files (all
    but some are missing): a 64 KB index naming 1000 layers x 1000 shards had verify list, check and
    report each of 10^6 names (36 s, 400 MB; 10^8 names in a few hundred KB, hours and gigabytes)."""
    hidden, logits = ds.hidden, ds.logits_desc
    counts = {"hidden_layers": _distinct(hidden["file_pattern"], "layer", len(set(ds.layers)))
              * _distinct(hidden["file_pattern"], "shard", len(hidden["shards"]))}
    if logits:
        counts["logits_topk"] = _distinct(logits["file_pattern"], "shard", len(logits["shards"]))
    return [f"{ds.index_path}: lmprobe:tensors.{name} names {count} tensor files, the dataset holds {held} files; "
            "its files are not checked" for name, count in counts.items() if count > held]


def _distinct(pattern: str, field: str, values: int) -> int:
    """Distinct names `values` distinct whole numbers give `pattern`'s {field} (read_info's patterns
    format a number with a width at most: distinct numbers, distinct names)."""
    return values if field in pattern_fields(pattern) else 1


def _verify_sums(root: Path, listing: tuple[int, int], trusted: dict[str, Any] | None = None) -> list[str]:
    """SHA256SUMS against the files; a file in `trusted` (lmprobe:files) only against that record, and
    by its name: a file there inside the root (a name no descriptor gives is checked nowhere else:
    missing, or leading outside the dataset, it passed). `listing`: _listing(root)."""
    sums = root / SUMS
    try:
        lines = _sums_lines(root, listing)
    except FormatError as exc:
        return [str(exc)]

    def check(line: tuple[str, str]) -> list[str]:
        digest, rel = line
        if isinstance(trusted, dict) and rel in trusted:
            if problem := listed_problem(root, rel, None, SUMS, str(sums), required=False):
                return [problem]
            if not isinstance(trusted[rel], dict) or trusted[rel].get("sha256") != digest:
                return [f"{root / rel}: sha256 in {SUMS} differs from lmprobe:files"]
            return []
        return [problem] if (problem := listed_problem(root, rel, {"sha256": digest}, SUMS, str(sums))) else []

    return problems_of(check, lines, desc=f"verify {SUMS}") + unlisted(root, {SUMS, *(rel for _, rel in lines)}, SUMS)


SUMS_LINE_BYTES = 64 + 2 + 2  # a line's digest, the two spaces before its name, its end (CRLF at most)
SUMS_SLACK_BYTES = 1 << 20  # more, for lines of files missing from the dataset (each named as missing)


def _sums_lines(root: Path, listing: tuple[int, int]) -> list[tuple[str, str]]:
    """(digest, name) of each SHA256SUMS line; FormatError naming the file when it is missing, no
    regular file, or larger than a line for each file of the dataset (`listing`: their count and their
    names' bytes) takes, and SUMS_SLACK_BYTES: it was read whole, and gigabytes in its place took that
    memory twice, and a list entry a line."""
    sums = root / SUMS
    count, name_bytes = listing
    limit = SUMS_SLACK_BYTES + count * SUMS_LINE_BYTES + name_bytes
    with open_regular(sums) as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read(limit + 1)  # a file grown past `limit` since is refused too, never read whole
    if len(data) > limit:
        raise FormatError(f"{sums}: {size} bytes, more than the dataset's files take to list; not a {SUMS} a "
                          "writer made")
    return [line.partition("  ")[::2] for line in data.decode(errors="replace").splitlines()]


def _verify_index(ds: LmprobeDataset) -> list[str]:
    """Columns and descriptor keys first; the addressing is checked only when they are all there."""
    problems = _missing_fields(ds) or _descriptor_values(ds)
    if problems:
        return problems
    return (_column_types(ds) + _descriptor_facts(ds) + _verify_counts(ds) + _verify_order(ds)
            + (_verify_token_addresses(ds) if ds.full_sequence else [])
            + (_verify_logits_addresses(ds) if ds.logits_desc else []) + _verify_truncated(ds)
            + (_verify_token_columns(ds) if in_share(0) else []))  # a pass over the index: one share's


def _column_types(ds: LmprobeDataset) -> list[str]:
    """The addressing columns (and label) of the spec's types: int64 counts or a float label (pandas'
    integers with a null) were read by actstore, not by a reader typed as the spec says."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    problems = []
    for field in pq.read_schema(ds.index_path):
        # a dictionary-encoded column (pandas' categorical) is a column of its values' type in the parquet
        type_ = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
        if field.name in COLUMN_TYPES and str(type_) not in COLUMN_TYPES[field.name]:
            problems.append(f"{ds.index_path}: column {field.name!r} holds {field.type} values, not the spec's "
                            f"{' / '.join(COLUMN_TYPES[field.name])}")
    return problems


def _descriptor_facts(ds: LmprobeDataset) -> list[str]:
    """Each descriptor's `type`, and the logits descriptor's `dtype` and `row_bytes` (where given) against
    what its shards hold (float32 values and int64 indices, k of each a row: the reader refuses any
    other): a reader sizing or typing rows by the descriptor misread them."""
    where, tensors, logits = ds.index_path, ds.info["tensors"], ds.logits_desc
    problems = [f"{where}: lmprobe:tensors.{name}.type {tensors[name]['type']!r:.40} is not {kind!r}"
                for name, kind in DESCRIPTOR_TYPES.items()
                if isinstance(tensors.get(name), dict) and tensors[name].get("type", kind) != kind]
    if not logits:
        return problems
    if logits.get("dtype", LOGITS_DTYPE) != LOGITS_DTYPE:
        problems.append(f"{where}: lmprobe:tensors.logits_topk.dtype {logits['dtype']!r:.40} is not "
                        f"{LOGITS_DTYPE!r}, the dtype of its shards' values")
    row_bytes = logits["k"] * LOGITS_ROW_BYTES_PER_K
    if "row_bytes" in logits and not (whole_number(logits["row_bytes"]) and logits["row_bytes"] == row_bytes):
        problems.append(f"{where}: lmprobe:tensors.logits_topk.row_bytes {logits['row_bytes']!r:.40} is not "
                        f"{row_bytes} (k x {LOGITS_ROW_BYTES_PER_K}: a float32 value and an int64 index a k)")
    return problems


def _verify_token_columns(ds: LmprobeDataset) -> list[str]:
    """Each token-level column (TOKEN_COLUMNS) holds a list of num_tokens entries a prompt: one short
    paired every later token with its neighbour's vector. Read a batch of rows at a time (index_batches);
    the first batch with a problem is the one reported."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    schema = pq.read_schema(ds.index_path)
    present = [name for name in TOKEN_COLUMNS if name in schema.names]
    lists = [name for name in present if pa.types.is_list(schema.field(name).type)
             or pa.types.is_large_list(schema.field(name).type)]
    problems = [f"{ds.index_path}: column {name!r} holds {schema.field(name).type} values, not lists (one entry "
                "a token)" for name in present if name not in lists]
    for start, batch in ds.index_batches(lists, TOKEN_BATCH_ROWS, TOKEN_BATCH_TOKENS) if lists else ():
        rows, num_tokens = np.arange(start, start + batch.num_rows), ds.num_tokens[start:start + batch.num_rows]
        for name in lists:
            lengths = pc.list_value_length(batch.column(name)).fill_null(-1).to_numpy()  # a null list: -1
            bad = lengths != num_tokens
            held = {i: f"{'a null list' if lengths[i] < 0 else f'{lengths[i]} entries'}, num_tokens {num_tokens[i]}"
                    for i in np.flatnonzero(bad)[:NAMED]}
            problems += _named(ds.index_path, f"column {name!r}", "holds a list of another length than num_tokens",
                               rows, held, bad)
        if problems:
            return problems
    return problems


def _missing_fields(ds: LmprobeDataset) -> list[str]:
    need = list(CORE_COLUMNS) + (list(FULL_COLUMNS) if ds.full_sequence else []) + \
        (list(LOGITS_COLUMNS) if ds.logits_desc else [])
    problems = [f"{ds.index_path}: column {c!r} missing" for c in need if c not in ds.column_names]
    return problems + [f"{ds.index_path}: lmprobe:tensors.hidden_layers.{key} missing"
                       for key in HIDDEN_KEYS if key not in ds.hidden]


def _descriptor_values(ds: LmprobeDataset) -> list[str]:
    """hidden_layers values the readers take to be the spec's only ones: any storage but full_sequence
    was read as pooled (a damaged full_sequence dataset verified, its sequence shards unchecked), and
    a pooled vector as the last token's per-layer row whatever pooling or layout said."""
    expected = {"layout": ("per_layer",), "storage": STORAGES}
    if ds.hidden["storage"] == "pooled":
        expected["pooling"] = ("last_token",)
    problems = [f"{ds.index_path}: lmprobe:tensors.hidden_layers.{key} is {ds.hidden.get(key)!r:.80}, "
                f"not one of {list(values)}" for key, values in expected.items() if ds.hidden.get(key) not in values]
    if len(set(ds.layers)) != len(ds.layers):  # each reader of the list (lmprobe's, ProbeDataset) read it twice
        problems.append(f"{ds.index_path}: lmprobe:tensors.hidden_layers.layers {ds.layers!r:.80} names a layer "
                        "more than once")
    return problems


def _verify_counts(ds: LmprobeDataset) -> list[str]:
    """Prompt counts, each prompt's num_tokens, the stored dtype, and the last-token (shard_index,
    row_offset) pairs. A prompt has a token at least (its last is stored): a pooled index's num_tokens
    of 0 or less passed, and read_vector then called the stored last token absent."""
    where, info, hidden = ds.index_path, ds.info, ds.hidden
    problems = _named(where, "num_tokens", "is not a token count (1 or more)", np.arange(len(ds.num_tokens)),
                      ds.num_tokens, ds.num_tokens < 1)
    if info["num_prompts"] != ds.num_prompts:
        problems.append(f"{where}: lmprobe:num_prompts = {info['num_prompts']} but {ds.num_prompts} rows")
    if hidden.get("row_bytes") not in (None, ds.dim * DTYPES[hidden["dtype"]][1].itemsize):
        problems.append(f"{where}: hidden_layers.row_bytes {hidden['row_bytes']} != dim x dtype size")
    last_token = hidden["shards"][:ds.last_token_shards]
    # The spec: a last-token shard's num_tokens, where given (a pooled index's shards have none), always
    # equals its num_prompts (a token a prompt)
    problems += [f"{where}: hidden_layers.shards[{i}] num_tokens {shard['num_tokens']!r:.20} is not its "
                 f"num_prompts {shard['num_prompts']} (a last-token shard holds one token a prompt)"
                 for i, shard in enumerate(last_token)
                 if "num_tokens" in shard and shard["num_tokens"] != shard["num_prompts"]]
    counts = np.array([sh["num_prompts"] for sh in last_token], np.int64)
    if counts.sum() != ds.num_prompts:
        problems.append(f"{where}: last-token shards hold {counts.sum()} prompts, index has {ds.num_prompts}")
    return problems + _address_problems(where, ("shard_index", "row_offset"), ds.shard_index, ds.row_offset,
                                        counts, "last-token shard")


def _address_problems(where: Path, fields: tuple[str, str], shards: np.ndarray, offsets: np.ndarray,
                      counts: np.ndarray, kind: str) -> list[str]:
    """Each index row's (shard, row) pair names a row of one of the shards holding `counts` rows, and
    no two rows name the same: with the counts summing to the prompts, every stored row is one prompt's."""
    rows = np.arange(len(shards))
    bad = (shards < 0) | (shards >= len(counts))
    if bad.any():
        return _named(where, fields[0], f"not a {kind} (0..{len(counts) - 1})", rows, shards, bad)
    problems = _named(where, fields[1], f"not a row of its {kind} (shards[].num_prompts)", rows, offsets,
                      (offsets < 0) | (offsets >= counts[shards]))
    pairs = shards * (1 << 32) + offsets
    order = np.argsort(pairs, kind="stable")
    again = order[1:][pairs[order[1:]] == pairs[order[:-1]]]
    return problems + _named(where, "/".join(fields), "repeats an earlier row's address", again,
                             [f"({shards[i]}, {offsets[i]})" for i in again[:NAMED]], np.ones(len(again), bool))


NAMED = 5  # the bad values a problem names (the count of the others follows)


def _named(where: Path, field: str, fault: str, rows: Any, values: Any, bad: np.ndarray) -> list[str]:
    """One problem naming the index rows and values of the first NAMED entries of `field` where `bad`."""
    at = np.flatnonzero(bad)
    if not len(at):
        return []
    shown = ", ".join(f"row {int(rows[i])}: {values[i]}" for i in at[:NAMED])
    rest = f" and {len(at) - NAMED} more" if len(at) > NAMED else ""
    return [f"{where}: {field} {fault} at {shown}{rest}"]


def _verify_truncated(ds: LmprobeDataset) -> list[str]:
    """The `truncated` column (written since 2026-11-29; a dataset written before has none, and verifies):
    booleans, each prompt flagged cut holding lmprobe:dataset.max_seq_length tokens (where recorded), as
    many flagged as lmprobe:dataset.n_truncated_samples counts (at most, where some flags are null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if "truncated" not in ds.column_names:
        return []
    where, column = ds.index_path, ds._columns("truncated").column("truncated")
    if not pa.types.is_boolean(column.type):
        return [f"{where}: column 'truncated' holds {column.type} values, not booleans"]
    cut = pc.fill_null(column, False).to_numpy()
    limit, count = _dataset_info(ds).get("max_seq_length"), _dataset_info(ds).get("n_truncated_samples")
    problems = _named(where, "truncated", f"marks a prompt cut at max_seq_length {limit} that holds another "
                      "number of tokens", np.arange(len(cut)), ds.num_tokens,
                      cut & (ds.num_tokens >= 1) & (ds.num_tokens != limit)  # below 1: named as no token count
                      ) if whole_number(limit) else []
    flagged = int(cut.sum())
    if whole_number(count) and (flagged > count or (flagged < count and not column.null_count)):
        problems.append(f"{where}: column 'truncated' flags {flagged} prompts, lmprobe:dataset.n_truncated_samples "
                        f"says {count}")
    return problems


def _dataset_info(ds: LmprobeDataset) -> dict[str, Any]:
    """lmprobe:dataset (optional in the spec), {} where absent or not an object."""
    dataset = ds.info.get("dataset")
    return dataset if isinstance(dataset, dict) else {}


def _verify_order(ds: LmprobeDataset) -> list[str]:
    """sample_idx is a permutation, the identity when the ordering is original (two rows that traded
    sample_idx, each reading the other's vectors, verified), and the recorded seed's one when random."""
    where, info = ds.index_path, ds.info
    problems = []
    if not np.array_equal(np.sort(ds.sample_idx), np.arange(ds.num_prompts)):
        problems.append(f"{where}: sample_idx is not a permutation of 0..{ds.num_prompts - 1}")
    elif info["prompt_ordering"] == "original" and (
            wrong := np.flatnonzero(ds.sample_idx != np.arange(ds.num_prompts))).size:
        problems.append(f"{where}: row {int(wrong[0])} holds sample_idx {int(ds.sample_idx[wrong[0]])}, where "
                        f"lmprobe:prompt_ordering 'original' keeps rows in sample order ({wrong.size} rows differ)")
    seed = info.get("prompt_ordering_seed")
    if seed is not None and not whole_number(seed):  # numpy's TypeError or ValueError aborted verify; True was 1
        problems.append(f"{where}: lmprobe:prompt_ordering_seed {seed!r:.80} is not a whole number")
    elif info["prompt_ordering"] == "random" and seed is not None and \
            not np.array_equal(ds.sample_idx, prompt_order(ds.num_prompts, "random", seed)):
        problems.append(f"{where}: sample_idx is not the permutation of lmprobe:prompt_ordering_seed {seed}")
    return problems


def _verify_token_addresses(ds: LmprobeDataset) -> list[str]:
    """Each prompt's token_shard_ids/token_shard_offsets: one per token, each a row of a sequence
    shard, no two naming the same row; token_offset = row_offset. Read a batch of rows at a time, of
    at most TOKEN_BATCH_TOKENS tokens: the lists hold two int64 per token (gigabytes at terabyte scale);
    the rows named so far are one bit a token. The first batch with a problem is the one reported."""
    rows_of_shard = np.array([sh.get("num_tokens", sh["num_prompts"]) for sh in ds.hidden["shards"]], np.int64)
    held, tokens = int(rows_of_shard[ds.last_token_shards:].sum()), int(ds.num_tokens.sum())
    if held != tokens:  # every token has a row of its own; and the bits are sized by the index's tokens
        return [f"{ds.index_path}: sequence shards hold {held} tokens (shards[].num_tokens), index has {tokens}"]
    named = _TokenRowsNamed(rows_of_shard[ds.last_token_shards:], ds.last_token_shards)
    for start, batch in ds.index_batches(list(FULL_COLUMNS), TOKEN_BATCH_ROWS, TOKEN_BATCH_TOKENS):
        if problems := _token_batch_problems(ds, np.arange(start, start + batch.num_rows), rows_of_shard, named,
                                             batch):
            return problems
    # our reading of the spec's "number of prompts (rows) in that shard" for a sequence shard
    # (docs/formats/lmprobe.md): the prompts whose tokens it holds
    return [f"{ds.index_path}: hidden_layers.shards[{s}] num_prompts {shard['num_prompts']} is not the "
            f"{held} prompts whose tokens it holds (token_shard_ids)"
            for s, shard, held in zip(itertools.count(ds.last_token_shards), ds.hidden["shards"][ds.last_token_shards:],
                                      named.prompts.tolist())
            if shard["num_prompts"] != held]


def _token_batch_problems(ds: LmprobeDataset, rows: np.ndarray, rows_of_shard: np.ndarray,
                          named: _TokenRowsNamed, batch: Any) -> list[str]:
    """_verify_token_addresses of one batch of index rows `rows` (their FULL_COLUMNS)."""
    import pyarrow as pa

    where, first, stop = ds.index_path, ds.last_token_shards, len(rows_of_shard)
    legacy, id_lists, offset_lists = (batch.column(name) for name in FULL_COLUMNS)
    table = pa.Table.from_batches([batch])
    try:  # each a list column of integers, or named: a bare AttributeError or IndexError aborted verify
        (id_ends, ids), (offset_ends, offsets) = (list_column(where, table, name) for name in FULL_COLUMNS[1:])
    except FormatError as exc:
        return [str(exc)]
    lengths = np.diff(id_ends)
    if not np.array_equal(lengths, ds.num_tokens[rows]) or id_lists.null_count:
        return [f"{where}: token_shard_ids lengths differ from num_tokens"]
    if not np.array_equal(np.diff(offset_ends), lengths) or offset_lists.null_count:
        return [f"{where}: token_shard_offsets lengths differ from token_shard_ids'"]
    if legacy.null_count:
        return [f"{where}: token_offset has nulls"]
    owner = _EntryRows(rows, lengths)
    bad = (ids < first) | (ids >= stop)
    if bad.any():
        return _named(where, "token_shard_ids", f"point outside the sequence shards ({first}..{stop - 1})",
                      owner, ids, bad)
    named.count_prompts(lengths, ids)
    legacy = legacy.to_numpy()
    problems = _named(where, "token_offset", "differs from row_offset", rows, legacy, legacy != ds.row_offset[rows])
    outside = _named(where, "token_shard_offsets", "not a row of their sequence shard (shards[].num_tokens)", owner,
                     offsets, (offsets < 0) | (offsets >= rows_of_shard[ids]))
    if outside:
        return outside + problems
    again = np.flatnonzero(named.again(ids, offsets))
    return problems + _named(where, "token_shard_ids/token_shard_offsets", "repeats an earlier token's address",
                             owner[again], [f"({ids[i]}, {offsets[i]})" for i in again[:NAMED]],
                             np.ones(len(again), bool))


class _EntryRows:
    """The index rows of entries of a batch's flat token lists, found for the entries a problem names
    (np.repeat of the rows held 8 B a token to name a few)."""

    def __init__(self, rows: np.ndarray, lengths: np.ndarray):
        """`rows`: the batch's index rows; `lengths`: their lists' entries."""
        self.rows, self.ends = rows, np.cumsum(lengths)

    def __getitem__(self, entry: Any) -> Any:
        return self.rows[np.searchsorted(self.ends, entry, side="right")]


class _TokenRowsNamed:
    """The sequence-shard rows token addresses have named so far, one bit a row (62 MB at 500M tokens):
    a token naming another's row read that token's vector, and passed every range check. And the
    prompts whose tokens each sequence shard holds, counted so far (`prompts`)."""

    def __init__(self, rows_of_shard: np.ndarray, first_shard: int):
        """`rows_of_shard`: the rows of each sequence shard, from shard `first_shard` on."""
        self.first_shard = first_shard
        self.first_row = np.concatenate([[0], np.cumsum(rows_of_shard)[:-1]]).astype(np.int64)
        self.bits = np.zeros((int(rows_of_shard.sum()) + 7) // 8, np.uint8)
        self.prompts = np.zeros(len(rows_of_shard), np.int64)

    def count_prompts(self, lengths: np.ndarray, ids: np.ndarray) -> None:
        """Counts each prompt of a batch (whose token_shard_ids lists hold `lengths` entries, flat `ids`,
        each a sequence shard) once in each shard its tokens lie in."""
        shards = len(self.prompts)
        pairs = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths) * shards + (ids - self.first_shard)
        self.prompts += np.bincount(np.unique(pairs) % shards, minlength=shards)

    def again(self, ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Marks these (shard, row) addresses, each a row of a sequence shard, as named; True where one
        was named before (by an earlier batch or earlier in this one)."""
        rows = self.first_row[ids - self.first_shard] + offsets
        order = np.argsort(rows, kind="stable")
        again = np.zeros(len(rows), bool)
        again[order[1:]] = rows[order[1:]] == rows[order[:-1]]
        byte, bit = rows >> 3, (1 << (rows & 7)).astype(np.uint8)
        again |= (self.bits[byte] & bit) != 0
        np.bitwise_or.at(self.bits, byte, bit)
        return again


def _verify_logits_addresses(ds: LmprobeDataset) -> list[str]:
    """shard_index_logits/row_offset_logits: every prompt's own row of a logits shard; each shard's `file`."""
    counts = np.array([sh["num_prompts"] for sh in ds.logits_desc["shards"]], np.int64)
    problems = [] if counts.sum() == ds.num_prompts else [
        f"{ds.index_path}: logits shards hold {counts.sum()} prompts, index has {ds.num_prompts}"]
    return problems + _logits_file_names(ds) + _address_problems(
        ds.index_path, ("shard_index_logits", "row_offset_logits"), *ds.logits_rows(), counts, "logits shard")


def _logits_file_names(ds: LmprobeDataset) -> list[str]:
    """Each logits shard's `file`, where given, is the name its file_pattern gives it: lmprobe's own
    loader opens `shards[i].file`, every other reader (and verify) the pattern's, so a `file` naming
    another shard, a missing file or one outside the dataset passed verify and was read by lmprobe."""
    pattern = ds.logits_desc["file_pattern"]
    return [f"{ds.index_path}: lmprobe:tensors.logits_topk.shards[{s}].file {shard['file']!r:.80} is not "
            f"{pattern.format(shard=s)!r}, the name its file_pattern gives"
            for s, shard in enumerate(ds.logits_desc["shards"])
            if "file" in shard and shard["file"] != pattern.format(shard=s)]


def _verify_tensor_files(ds: LmprobeDataset, checksums: bool) -> list[str]:
    """Each shard the descriptors name, and each other file lmprobe:files names, against lmprobe:files
    (its size only without `checksums`; a file only lmprobe:files named was checked nowhere: missing,
    changed, or named outside the dataset, it passed), then each hidden and logits shard's header
    against its descriptor."""
    recorded = ds.info.get("files", {})
    named_by = dict.fromkeys(tensor_files(ds.info), "lmprobe:tensors")  # where each name comes from
    named_by.update((rel, "lmprobe:files") for rel in recorded if rel not in named_by)

    def check(rel: str) -> list[str]:
        record = recorded.get(rel)
        if not checksums and isinstance(record, dict):
            record = {k: v for k, v in record.items() if k != "sha256"}
        problem = listed_problem(ds.root, rel, record, "lmprobe:files", named_by[rel], digest=checksums)
        return [problem] if problem else []

    problems = problems_of(check, list(named_by), desc="verify lmprobe tensors")
    for layer in ds.hidden["layers"]:
        for s, shard in enumerate(ds.hidden["shards"]):
            rel = ds.hidden["file_pattern"].format(layer=layer, shard=s)
            problems += _verify_shard(ds, rel, lambda: ds.hidden_tensor(layer, s), _shard_rows(ds, s, shard))
    for s, shard in enumerate(ds.logits_desc["shards"] if ds.logits_desc else []):
        rel = ds.logits_desc["file_pattern"].format(shard=s)
        problems += _verify_shard(ds, rel, lambda: ds.logits_tensors(s)[0], shard["num_prompts"])
    return problems


def _shard_rows(ds: LmprobeDataset, index: int, shard: dict[str, Any]) -> int:
    """The rows hidden shard `index` holds: a last-token shard one a prompt (the rows shard_index/row_offset
    address; the spec's num_tokens repeats it), a sequence shard one a token."""
    return shard["num_prompts"] if index < ds.last_token_shards else shard.get("num_tokens", shard["num_prompts"])


def _verify_shard(ds: LmprobeDataset, rel: str, tensor: Any, rows: int) -> list[str]:
    """The header of shard `rel` (the reader's checks: tensors tiling the file, each of the descriptor's
    dtype and width) and the rows of `tensor()`, its tensor, against its descriptor."""
    path = ds.root / rel
    if not path.is_file():
        return []  # already reported against lmprobe:files
    try:
        view = tensor()
    except FormatError as exc:
        return [str(exc)]
    if len(view) != rows:
        return [f"{path}: tensor of {len(view)} rows, descriptor says {rows}"]
    return []
