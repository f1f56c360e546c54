"""Reading an lmprobe 2.0 dataset: the index parquet and its `lmprobe:` metadata, memory-mapped
shards, LmprobeDataset (prompts are index rows, in df.iloc order) and the torch ProbeDataset."""
from __future__ import annotations

import json
import math
import os
import re
import string
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from actstore.casts import to_float32
from actstore.errors import FormatError
from actstore.formats.lmprobe.layout import (CORE_COLUMNS, DATASET_DIR, DTYPES, FORMAT_VERSION, INDEX,
                                             LOGITS_INDICES_KEY, LOGITS_VALUES_KEY, PREFIX, REQUIRED_INFO, ST_DTYPES,
                                             check_tiling, read_safetensors_header, split_index_name, tensor_entry)
from actstore.integrity import inside, refuse, whole_number, whole_numbers
from actstore.integrity import read_index as index_argument  # this module's read_index reads the parquet
from actstore.io_utils import pread_into


def dataset_root(path: str | Path) -> Path:
    """The dataset root: `path` itself, or `path/dataset` for an actstore lmprobe stage directory."""
    path = Path(path)
    if not (path / "index").is_dir() and (path / DATASET_DIR / "index").is_dir():
        return path / DATASET_DIR
    return path


def find_index(root: str | Path, split: str | None = None) -> Path:
    """The index parquet of a dataset root: index/train-00000-of-00001.parquet (layout.INDEX, whatever
    the split), else the only index/*.parquet (actstore wrote a split other than train as
    index/{split}-... before). With `split`, the index recording that split (lmprobe:dataset.split;
    an index without it counts as the split its file name says). Only a regular file is an index:
    pyarrow opening a FIFO in its place waited for a writer forever (verify, detect and inspect hung)."""
    root = dataset_root(root)
    if split is not None:
        for path in (root / INDEX, root / split_index_name(split)):
            if path.is_file() and _split_of(path) == split:
                return path
        raise FormatError(f"{root}: no index parquet of split {split!r} "
                          f"({INDEX} records another split or is missing)")
    if (root / INDEX).is_file():
        return root / INDEX
    listed = (root / "index").glob("*.parquet") if (root / "index").is_dir() else []
    found = sorted(path for path in listed if path.is_file())
    if len(found) == 1:
        return found[0]
    if not found:
        raise FormatError(f"{root}: no index/*.parquet; not an lmprobe dataset")
    raise FormatError(f"{root}: several index parquets {[p.name for p in found]}; pass split=")


def _split_of(index_path: Path) -> str:
    """The split an index parquet holds: lmprobe:dataset.split, else the one its file name says."""
    dataset = _prefixed_metadata(index_path).get("dataset")
    if isinstance(dataset, dict) and isinstance(dataset.get("split"), str):
        return dataset["split"]
    return index_path.name.partition("-00000-of-")[0]


def read_info(index_path: str | Path) -> dict[str, Any]:
    """The `lmprobe:` schema metadata of an index parquet, JSON-decoded, checked for the format version."""
    index_path = Path(index_path)
    info = _prefixed_metadata(index_path)
    if not info:
        raise FormatError(f"{index_path}: parquet has no 'lmprobe:' schema metadata; not an lmprobe index")
    if info.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"{index_path}: lmprobe:format_version {info.get('format_version')!r} unknown "
                          f"(this reader knows {FORMAT_VERSION!r})")
    missing = [k for k in REQUIRED_INFO if k not in info]
    if missing:
        raise FormatError(f"{index_path}: schema metadata lacks lmprobe:{', lmprobe:'.join(missing)}")
    if not isinstance(info["tensors"], dict) or "hidden_layers" not in info["tensors"]:
        raise FormatError(f"{index_path}: lmprobe:tensors has no 'hidden_layers' descriptor")
    refuse([f"{index_path}: {problem}" for problem in descriptor_problems(info)])
    return info


def _pattern(value: Any, fields: set[str]) -> bool:
    """A file or key pattern: a string whose only replacement fields are `fields`, each at most a
    width and an integer format (no attribute or index access, no width that builds a huge name)."""
    if not isinstance(value, str):
        return False
    try:
        parsed = list(string.Formatter().parse(value))
    except ValueError:
        return False
    return all(name is None or name in fields and not conversion and re.fullmatch(r"0?\d{0,2}d?", spec or "")
               for _, name, spec, conversion in parsed)


def _shards(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(shard, dict) and whole_number(shard.get("num_prompts")) and whole_number(shard.get("num_tokens", 0))
        for shard in value)


READ_KEYS = ("layers", "dim", "dtype", "file_pattern", "key_pattern", "shards")  # hidden_layers' the readers use


def descriptor_problems(info: dict[str, Any]) -> list[str]:
    """The types of the lmprobe: fields a reader computes with: counts, the tensor descriptors'
    layers, dim, patterns and shard lists (a pattern builds file names and tensor keys)."""
    hidden, logits = info["tensors"]["hidden_layers"], info["tensors"].get("logits_topk")
    if not isinstance(hidden, dict) or logits is not None and not isinstance(logits, dict):
        return ["lmprobe:tensors descriptors must be objects"]
    checks = [("lmprobe:num_prompts", info["num_prompts"], whole_number(info["num_prompts"])),
              ("lmprobe:model", info["model"], isinstance(info["model"], dict)
               and isinstance(info["model"].get("name"), str)),
              ("lmprobe:prompt_ordering", info["prompt_ordering"], isinstance(info["prompt_ordering"], str)),
              ("lmprobe:files", info.get("files"), isinstance(info.get("files", {}), dict))]
    # What a reader computes with must be there (verify names every key the spec lists: HIDDEN_KEYS).
    checks += [(f"hidden_layers.{key}", None, False) for key in READ_KEYS if key not in hidden]
    checks += [(f"hidden_layers.{key}", hidden[key], ok(hidden[key])) for key, ok in (
        ("layers", whole_numbers),
        ("dim", lambda v: whole_number(v) and v > 0),
        ("dtype", lambda v: isinstance(v, str) and v in DTYPES),
        ("file_pattern", lambda v: _pattern(v, {"layer", "shard"})),
        # The spec's reader formats a key with the layer alone: a {shard} in it raised KeyError: 'shard'.
        ("key_pattern", lambda v: _pattern(v, {"layer"})),
        ("shards", _shards), ("last_token_shards", whole_number), ("row_bytes", whole_number)) if key in hidden]
    if logits is not None:  # a reader of the logits needs all three (None: absent)
        checks += [(f"logits_topk.{key}", logits.get(key), ok(logits.get(key))) for key, ok in (
            ("k", lambda v: whole_number(v) and v > 0), ("file_pattern", lambda v: _pattern(v, {"shard"})),
            ("shards", _shards))]
    problems = [f"{name} is malformed: {value!r:.80}" for name, value, ok in checks if not ok]
    return problems or (_shared_files(hidden, "hidden_layers") + _shared_tensors(hidden)
                        + (_shared_files(logits, "logits_topk") if logits else []))


def pattern_fields(pattern: str) -> set[str | None]:
    """The replacement field names of a file or key pattern."""
    return {field for _, field, _, _ in string.Formatter().parse(pattern)}


def _shared_files(descriptor: dict[str, Any], name: str) -> list[str]:
    """A file_pattern without {shard} over several shards names one file for all of them: every shard's
    rows would be read from the first's (only verify's row count would notice)."""
    if "shard" in pattern_fields(descriptor["file_pattern"]) or len(descriptor["shards"]) < 2:
        return []
    return [f"{name}.file_pattern {descriptor['file_pattern']!r:.80} has no {{shard}} field for its "
            f"{len(descriptor['shards'])} shards: they would all be one file"]


def _shared_tensors(hidden: dict[str, Any]) -> list[str]:
    """hidden_layers patterns, neither with {layer}, over several layers name one tensor for all of them:
    every layer's vectors were the first's, and verify passed (each file listed and intact)."""
    fields = pattern_fields(hidden["file_pattern"]) | pattern_fields(hidden["key_pattern"])
    if len(hidden["layers"]) < 2 or "layer" in fields:
        return []
    return [f"hidden_layers.file_pattern {hidden['file_pattern']!r:.80} and key_pattern {hidden['key_pattern']!r:.80} "
            f"have no {{layer}} field for its {len(hidden['layers'])} layers: they would all be one tensor"]


def _prefixed_metadata(index_path: Path) -> dict[str, Any]:
    """Every `lmprobe:` schema-metadata entry, JSON-decoded, keyed without the prefix."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_schema(index_path).metadata or {}
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise FormatError(f"{index_path}: not a readable parquet file ({exc})") from None
    info = {}
    for k, v in metadata.items():
        name = k.decode(errors="replace")
        if name.startswith(PREFIX):
            try:
                info[name.removeprefix(PREFIX)] = json.loads(v)
            # ValueError: JSONDecodeError, and UnicodeDecodeError for bytes not UTF-8; RecursionError:
            # nested too deeply to parse
            except (ValueError, RecursionError):
                raise FormatError(f"{index_path}: schema metadata {name!r} is not JSON") from None
    return info


def open_tensor(path: str | Path, key: str) -> np.ndarray:
    """Read-only memmap of one tensor of a safetensors file (raw storage dtype; bf16 as uint16)."""
    path = Path(path)
    header, start = read_safetensors_header(path)
    check_tiling(path, header, start)
    dtype, shape, offset = tensor_entry(path, header, start, key)
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


@contextmanager
def _decoded(index_path: Path, columns: list[str] | None) -> Iterator[None]:
    """FormatError naming the index when pyarrow cannot decode its `columns` (None: all): a damaged
    page raised its bare OSError ("Corrupt snappy compressed data") or ArrowInvalid, naming no file."""
    import pyarrow as pa

    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        raise FormatError(f"{index_path}: index columns {columns or 'all'} cannot be read ({exc})") from None


def read_index(index_path: Path, columns: list[str] | None = None):
    """Those columns of the index (None: all) as a pyarrow Table."""
    import pyarrow.parquet as pq

    with _decoded(index_path, columns):
        return pq.read_table(index_path, columns=columns)


def list_column(index_path: Path, table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, flat values as int64) of a list<int64> column as numpy, without per-row Python objects;
    FormatError naming the column when it holds no lists (its missing `value_type` was a bare AttributeError)."""
    import pyarrow as pa

    column = table.column(name).combine_chunks()
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise FormatError(f"{index_path}: column {name!r} holds {column.type} values, not lists of integers")
    column = column.cast(pa.large_list(column.type.value_type))
    offsets = column.offsets.to_numpy() - column.offsets[0].as_py()
    return offsets.astype(np.int64), integers(index_path, name, column.flatten())


def integers(index_path: Path, name: str, values) -> np.ndarray:
    """`values` of index column `name` (the column, or a list column's flat values) as int64;
    FormatError naming the column when they are of no integer type or hold a null: a float or string
    column was cast (row_offset 2.7 read as row 2, and verified) where the spec's reader indexes a
    tensor with it and fails, a null in a token list read as NaN and failed as a bare numpy IndexError."""
    import pyarrow as pa

    if not pa.types.is_integer(values.type):
        raise FormatError(f"{index_path}: column {name!r} holds {values.type} values, not integers")
    if values.null_count:
        raise FormatError(f"{index_path}: column {name!r} holds {values.null_count} null value(s)")
    return values.to_numpy().astype(np.int64)


def _int_column(index_path: Path, table, name: str) -> np.ndarray:
    """Index column `name` of `table` as int64; FormatError naming the column and its first null row
    when it holds a null (only label may be null): to_numpy made a null NaN and astype then -2**63, a
    pooled index's num_tokens so passed verify and made read_vector call the stored last token absent."""
    column = table.column(name)
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy())[0])
        raise FormatError(f"{index_path}: column {name!r} has {column.null_count} null(s), the first at row {row}")
    return integers(index_path, name, column)


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
        address = read_index(self.index_path, wanted)
        self.num_tokens = _int_column(self.index_path, address, "num_tokens")
        self.shard_index = _int_column(self.index_path, address, "shard_index")
        self.row_offset = _int_column(self.index_path, address, "row_offset")
        self.sample_idx = (_int_column(self.index_path, address, "sample_idx")
                           if "sample_idx" in self.column_names else np.arange(address.num_rows))
        self._sample_order: np.ndarray | None = None  # argsort of sample_idx: 8 B a prompt
        self._table = None
        self._group_starts: np.ndarray | None = None  # first index row of each row group: 8 B a group
        # The last row group's token addresses read, as (group, list offsets, flat ids, flat offsets).
        self._token_group: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._logits_rows: tuple[np.ndarray, np.ndarray] | None = None
        self._views: dict[tuple[str, str], np.ndarray] = {}

    @property
    def table(self):
        """The whole index as a pyarrow Table (read on first use)."""
        if self._table is None:
            self._table = read_index(self.index_path)
        return self._table

    def _columns(self, *names: str):
        """Those index columns as a pyarrow Table: from the whole index once it is loaded, else read
        alone (a label or logits lookup need not load every prompt's text and token lists)."""
        return self._table.select(list(names)) if self._table is not None else read_index(self.index_path, list(names))

    def has_sample(self, sample_idx: int) -> bool:
        """Is source dataset row `sample_idx` in the index?"""
        return self._find_row(index_argument(sample_idx, "sample_idx", self.index_path)) is not None

    def _find_row(self, sample_idx: int) -> int | None:
        """Index row of source row `sample_idx`, None when no row holds it: a binary search through the
        argsort of the column (8 B a prompt; a dict of every prompt held 112 B a prompt, 11 GB at 100M)."""
        order = self._sample_order_of_rows()
        at = int(np.searchsorted(self.sample_idx, sample_idx, sorter=order))
        if at < len(order) and self.sample_idx[order[at]] == sample_idx:
            return int(order[at])
        return None

    def _sample_order_of_rows(self) -> np.ndarray:
        """The index rows in sample_idx order; FormatError when a value repeats (a lookup would return
        one of its rows, silently)."""
        if self._sample_order is None:
            order = np.argsort(self.sample_idx, kind="stable")
            ranked = self.sample_idx[order]
            repeated = np.flatnonzero(ranked[1:] == ranked[:-1])
            if len(repeated):
                raise FormatError(f"{self.index_path}: column sample_idx holds {int(ranked[repeated[0]])} "
                                  "more than once")
            self._sample_order = order
        return self._sample_order

    def token_addresses(self, prompt: int) -> tuple[np.ndarray, np.ndarray]:
        """(token_shard_ids, token_shard_offsets) of index row `prompt` (a negative one counted from the
        end) of a full-sequence index. Only the row group holding it is read and kept: the whole index's
        lists hold 16 B a token (8 GB at 500M tokens), one group's about write.ROW_GROUP_TOKENS tokens' (16 MiB)."""
        if not self.full_sequence:
            raise FormatError(f"{self.index_path}: pooled dataset stores only the last token of each prompt")
        # A row past the last one fell in the last row group (a bare numpy IndexError), a negative one
        # in group -1 (an error calling the index columns unreadable).
        prompt = self._prompt(prompt)
        starts = self._row_group_starts()
        group = int(np.searchsorted(starts, prompt, side="right")) - 1
        if self._token_group is None or self._token_group[0] != group:
            self._token_group = (group, *self._read_token_group(group, starts))
        _, offsets, ids, token_offsets = self._token_group
        a, b = offsets[prompt - starts[group]], offsets[prompt - starts[group] + 1]
        return ids[a:b], token_offsets[a:b]

    def _row_group_starts(self) -> np.ndarray:
        """First index row of each row group of the index (from its footer)."""
        import pyarrow.parquet as pq

        if self._group_starts is None:  # the footer __init__ read the columns through
            metadata = pq.ParquetFile(self.index_path).metadata
            rows = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            self._group_starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        return self._group_starts

    def _read_token_group(self, group: int, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(list offsets, flat token_shard_ids, flat token_shard_offsets) of row group `group`, checked
        against num_tokens."""
        import pyarrow.parquet as pq

        columns = ["token_shard_ids", "token_shard_offsets"]
        missing = [c for c in columns if c not in self.column_names]
        if missing:  # read_row_group leaves out a column it does not find, without an error
            raise FormatError(f"{self.index_path}: full_sequence index lacks column(s) {missing}")
        with _decoded(self.index_path, columns):
            table = pq.ParquetFile(self.index_path).read_row_group(group, columns=columns)
        offsets, ids = list_column(self.index_path, table, "token_shard_ids")
        row_offsets, token_offsets = list_column(self.index_path, table, "token_shard_offsets")
        first = int(starts[group])
        self._check_token_lists(first, np.diff(offsets), np.diff(row_offsets))
        for kept in (offsets, ids, token_offsets):  # token_addresses returns views of them: a caller's
            kept.flags.writeable = False  # change to one would move every later lookup of the group
        return offsets, ids, token_offsets

    def index_batches(self, columns: list[str], max_rows: int, max_tokens: int) -> Iterator[tuple[int, Any]]:
        """(first index row, those index columns of the rows from it as a pyarrow RecordBatch), batch
        by batch: at most `max_rows` rows and, unless one prompt holds more, `max_tokens` tokens, each
        row group's batches sized by its longest prompt (a count of rows alone let the lists of 4096
        long prompts, and what is computed a token from them, take gigabytes)."""
        import pyarrow.parquet as pq

        with _decoded(self.index_path, columns):
            parquet = pq.ParquetFile(self.index_path)
            first = 0
            for group in range(parquet.metadata.num_row_groups):
                stop = first + parquet.metadata.row_group(group).num_rows
                longest = int(self.num_tokens[first:stop].max(initial=1))
                rows = max(1, min(max_rows, max_tokens // longest))
                for batch in parquet.iter_batches(rows, row_groups=[group], columns=columns):
                    yield first, batch
                    first += batch.num_rows

    def token_address_batches(self, max_tokens: int) -> Iterator[tuple[np.ndarray, ...]]:
        """(index row, token position, token_shard_id, token_shard_offset) of every token of a
        full-sequence index, flat, batch by batch (index_batches: at most `max_tokens` tokens unless
        one prompt holds more), each row's lists checked against its num_tokens."""
        import pyarrow as pa

        columns = ["token_shard_ids", "token_shard_offsets"]
        if not self.full_sequence or any(c not in self.column_names for c in columns):
            raise FormatError(f"{self.index_path}: not a full_sequence index with columns {columns}")
        for first, batch in self.index_batches(columns, max_tokens, max_tokens):
            table = pa.Table.from_batches([batch])
            offsets, ids = list_column(self.index_path, table, "token_shard_ids")
            row_offsets, token_offsets = list_column(self.index_path, table, "token_shard_offsets")
            counts = np.diff(offsets)
            self._check_token_lists(first, counts, np.diff(row_offsets))
            prompts = np.repeat(np.arange(first, first + len(counts)), counts)
            tokens = np.arange(len(ids)) - np.repeat(offsets[:-1], counts)
            yield prompts, tokens, ids.astype(np.int64), token_offsets.astype(np.int64)

    def _check_token_lists(self, first: int, ids: np.ndarray, offsets: np.ndarray) -> None:
        """FormatError naming the first index row (from row `first` on) whose token_shard_ids or
        token_shard_offsets list (of `ids` and `offsets` entries) is not one entry per token (num_tokens):
        the flat lists are sliced by the first's bounds, so one short list made token t of a prompt read
        token t+1's vector, without an error."""
        num_tokens = self.num_tokens[first:first + len(ids)]
        bad = np.flatnonzero((ids != num_tokens) | (offsets != num_tokens))
        if len(bad):
            i = int(bad[0])
            raise FormatError(f"{self.index_path}: row {first + i} token_shard_ids/token_shard_offsets hold "
                              f"{int(ids[i])}/{int(offsets[i])} entries, num_tokens says {int(num_tokens[i])}")

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
        """Integer label per prompt: the label_id column, else an integer label column as it is, else
        position in sorted label names; -1 = none. FormatError for labels of another type: a float
        column (pandas' ints with a null: 1.0, 3.0, NaN) was numbered 0, 1 by position, silently; and for
        an integer label column (no label_id: another writer's) holding both a null and the label -1,
        which would be one value (the -1/1 classes of a binary task with unlabelled rows)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        name = "label_id" if "label_id" in self.column_names else "label"
        column = self._columns(name).column(name)
        if pa.types.is_integer(column.type):  # the class itself (the spec's int32 label), never renumbered
            if column.null_count and pc.any(pc.equal(column, -1)).as_py():
                raise FormatError(f"{self.index_path}: column {name!r} holds both nulls and the label -1, which "
                                  "labels gives to a row without a label; read the column itself")
            return column.fill_null(-1).to_numpy().astype(np.int64)
        if pa.types.is_dictionary(column.type):  # a pandas categorical: its names are the labels
            column = column.cast(column.type.value_type)
        # null: a column of None alone; booleans: False 0, True 1, as their order numbers them
        names = (pa.types.is_string, pa.types.is_large_string, pa.types.is_null, pa.types.is_boolean)
        if name == "label_id" or not any(is_kind(column.type) for is_kind in names):
            raise FormatError(f"{self.index_path}: column {name!r} holds {column.type} values, not the "
                              f"{'integers' if name == 'label_id' else 'integers, strings or booleans'} labels are")
        # Numbered by arrow (int32, then int64): every prompt's name as a Python string took ~75 B a prompt.
        classes = pc.unique(column).drop_null()
        classes = classes.take(pc.sort_indices(classes))  # UTF-8 byte order: Python's sorted order of str
        return pc.index_in(column, value_set=classes).fill_null(-1).to_numpy().astype(np.int64)

    def _prompt(self, prompt: int) -> int:
        """Index row `prompt`, a negative one counted from the end (as get's last token always was);
        IndexError naming the index when there is none. A prompt's tokens lie between offsets[prompt]
        and offsets[prompt + 1], one list longer than the rows: a negative prompt there read the next
        row's tokens (prompt -2 the last prompt's), or none (-1). TypeError for a bool or a float (True
        and 1.0 read row 1, 1.5 row 1)."""
        prompt = index_argument(prompt, "prompt", self.index_path)
        if not -self.num_prompts <= prompt < self.num_prompts:
            raise IndexError(f"{self.index_path}: prompt {prompt} out of range ({self.num_prompts} prompts)")
        return prompt % self.num_prompts

    def row_of(self, sample_idx: int) -> int:
        """Index row of a source dataset row."""
        row = self._find_row(index_argument(sample_idx, "sample_idx", self.index_path))
        if row is None:
            raise IndexError(f"{self.index_path}: no prompt with sample_idx {sample_idx}")
        return row

    # -- tensors
    def check_layer(self, layer: int) -> None:
        """FormatError naming the stored layers unless `layer` is one, as the saev, zarr and pickle readers
        (a bare KeyError here was the one reader's other error); TypeError for a bool or a float (True and
        1.0 are 1 to `in`)."""
        if index_argument(layer, "layer", self.index_path) not in self.hidden["layers"]:
            raise FormatError(f"{self.index_path}: layer {layer} not stored; layers are {self.hidden['layers']}")

    def hidden_tensor(self, layer: int, shard: int) -> np.ndarray:
        """Memmap (rows, dim) of one hidden shard, raw storage dtype; FormatError naming the shard when
        its tensor is not of the descriptor's dim and dtype (its bytes would be read as other values)."""
        self.check_layer(layer)
        count = len(self.hidden["shards"])
        if not 0 <= shard < count:  # its file, if one is there, is no part of the dataset
            raise FormatError(f"{self.index_path}: shard {shard} is not one of the {count} hidden_layers shards")
        rel = self.hidden["file_pattern"].format(layer=layer, shard=shard)
        view = self._view(rel, self.hidden["key_pattern"].format(layer=layer))
        if view.shape[1] != self.dim or view.dtype != DTYPES[self.dtype][1]:
            raise FormatError(f"{self.root / rel}: tensor shape {list(view.shape)} {view.dtype}, descriptor says "
                              f"[rows, {self.dim}] {self.dtype}")
        return view

    def _view(self, rel: str, key: str) -> np.ndarray:
        if (rel, key) not in self._views:
            view = open_tensor(inside(self.root, rel, f"{self.index_path} (lmprobe:tensors file_pattern)"), key)
            if view.ndim != 2:
                raise FormatError(f"{self.root / rel}: tensor {key!r} has shape {list(view.shape)}, expected 2-D")
            self._views[(rel, key)] = view
        return self._views[(rel, key)]

    def _check_offsets(self, field: str, prompts: np.ndarray, offsets: np.ndarray, rel: str, rows: int) -> None:
        """FormatError naming the first index row whose `field` value is not a row of the shard `rel`
        holds: numpy would read a negative one as a row counted from the end, another prompt's."""
        self._check_range(field, prompts, offsets, rows, f"a row of {self.root / rel} ({rows} rows)")

    def _check_last_token_shards(self, prompts: np.ndarray) -> None:
        """FormatError naming the first of `prompts` whose shard_index is not a last-token shard: the
        universal address of a last token (a sequence shard's row is another token's)."""
        count = self.last_token_shards
        self._check_range("shard_index", prompts, self.shard_index[prompts], count,
                          f"a last-token shard (0..{count - 1})")

    def _check_range(self, field: str, prompts: np.ndarray, values: np.ndarray, stop: int, what: str) -> None:
        bad = np.flatnonzero((values < 0) | (values >= stop))
        if len(bad):
            raise FormatError(f"{self.index_path}: row {int(prompts[bad[0]])} {field} {int(values[bad[0]])} "
                              f"is not {what}")

    def rows_at(self, layer: int, shards: np.ndarray, offsets: np.ndarray, prompts: np.ndarray,
                field: str = "token_shard_offsets") -> np.ndarray:
        """float32 rows at (shard, offset) pairs of a layer, one fancy read per shard; `prompts`: the
        index row whose `field` gave each pair, named when its offset is not a row of its shard."""
        out = np.empty((len(shards), self.dim), np.float32)
        for s in np.unique(shards):
            mask = shards == s
            view = self.hidden_tensor(layer, int(s))
            wanted = offsets[mask]
            self._check_offsets(field, prompts[mask], wanted,
                                self.hidden["file_pattern"].format(layer=layer, shard=int(s)), view.shape[0])
            out[mask] = to_float32(view[wanted], self.dtype)
        return out

    def last_token_rows(self, layer: int, prompts: np.ndarray) -> np.ndarray:
        """float32 (len(prompts), dim): the last-token vectors of those index rows."""
        self._check_last_token_shards(prompts)
        return self.rows_at(layer, self.shard_index[prompts], self.row_offset[prompts], prompts, "row_offset")

    def get(self, prompt: int, layer: int, token: int | None = None) -> np.ndarray:
        """float32 (dim,) activation of index row `prompt` at `layer`: the last token, or token `token`."""
        prompt = self._prompt(prompt)
        n = int(self.num_tokens[prompt])
        token = None if token is None else index_argument(token, "token", self.index_path)
        if token is None or token == n - 1 or token == -1:
            return self.last_token_rows(layer, np.array([prompt]))[0]
        if not -n <= token < n:
            raise IndexError(f"{self.index_path}: token {token} out of range for prompt {prompt} with {n} tokens")
        token %= n
        return self._token_rows(prompt, layer, token, token + 1)[0]  # that row alone, not the prompt's all

    def tokens(self, prompt: int, layer: int) -> np.ndarray:
        """float32 (num_tokens, dim) activations of every token of a prompt (full_sequence only)."""
        prompt = self._prompt(prompt)
        return self._token_rows(prompt, layer, 0, int(self.num_tokens[prompt]))

    def _token_rows(self, prompt: int, layer: int, first: int, stop: int) -> np.ndarray:
        """float32 (stop - first, dim): tokens [first, stop) of index row `prompt` (not negative)."""
        ids, offsets = self.token_addresses(prompt)
        return self.rows_at(layer, ids[first:stop], offsets[first:stop], np.full(stop - first, prompt))

    def last_tokens(self, layer: int) -> np.ndarray:
        """float32 (num_prompts, dim): every prompt's last-token vector in index order; reads only
        last-token shards, with one sequential read per shard when the shard's rows are in order."""
        self.check_layer(layer)
        self._check_last_token_shards(np.arange(self.num_prompts))  # a row no shard fills would stay np.empty's
        out = np.empty((self.num_prompts, self.dim), np.float32)
        for s in range(self.last_token_shards):
            rows = np.flatnonzero(self.shard_index == s)
            if len(rows):
                self._read_last_token_shard(layer, s, rows, out)
        return out

    def _read_last_token_shard(self, layer: int, shard: int, rows: np.ndarray, out: np.ndarray) -> None:
        view = self.hidden_tensor(layer, shard)
        a = int(rows[0])
        contiguous = (rows[-1] - a + 1 == len(rows) and
                      np.array_equal(self.row_offset[rows], np.arange(len(rows))) and view.shape[0] == len(rows))
        if contiguous and self.dtype == "float32":  # straight into the output buffer
            target = out[a:a + len(rows)]
            fd = os.open(view.filename, os.O_RDONLY)
            try:
                done = pread_into(fd, target, view.offset)
            finally:
                os.close(fd)
            if done < target.nbytes:
                raise FormatError(f"{view.filename}: ends before byte {view.offset + target.nbytes}; truncated?")
        elif contiguous:
            to_float32(view, self.dtype, out[a:a + len(rows)])
        else:
            self._check_offsets("row_offset", rows, self.row_offset[rows],
                                self.hidden["file_pattern"].format(layer=layer, shard=shard), view.shape[0])
            out[rows] = to_float32(view[self.row_offset[rows]], self.dtype)

    def logits(self, prompt: int) -> tuple[np.ndarray, np.ndarray]:
        """(topk_values float32 (k,), topk_indices int64 (k,)) at the last token of a prompt."""
        if self.logits_desc is None:
            raise FormatError(f"{self.index_path}: no logits_topk tensors in this dataset")
        prompt = self._prompt(prompt)
        shard, offset = (int(column[prompt]) for column in self.logits_rows())
        values, indices = self.logits_tensors(shard)
        self._check_offsets("row_offset_logits", np.array([prompt]), np.array([offset]),
                            self.logits_desc["file_pattern"].format(shard=shard), len(values))
        return np.asarray(values[offset]), np.asarray(indices[offset])

    def logits_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(shard_index_logits, row_offset_logits) of every prompt, int64."""
        if self._logits_rows is None:  # both columns, once: a lookup per prompt then reads no index
            table = self._columns("shard_index_logits", "row_offset_logits")
            self._logits_rows = tuple(_int_column(self.index_path, table, c) for c in table.column_names)
        return self._logits_rows

    def logits_tensors(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """Memmaps (topk_values f32, topk_indices i64), each (rows, k), of one logits shard; FormatError
        naming the shard when they differ from that (the descriptor's shard list bounds `shard`)."""
        count = len(self.logits_desc["shards"])
        if not 0 <= shard < count:
            raise FormatError(f"{self.index_path}: shard_index_logits {shard} is not one of the {count} logits shards")
        rel = self.logits_desc["file_pattern"].format(shard=shard)
        values, indices = self._view(rel, LOGITS_VALUES_KEY), self._view(rel, LOGITS_INDICES_KEY)
        k = self.logits_desc["k"]
        if (values.shape != indices.shape or values.shape[1] != k or values.dtype != ST_DTYPES["F32"]
                or indices.dtype != ST_DTYPES["I64"]):
            raise FormatError(f"{self.root / rel}: {LOGITS_VALUES_KEY} {list(values.shape)} {values.dtype} and "
                              f"{LOGITS_INDICES_KEY} {list(indices.shape)} {indices.dtype}, expected "
                              f"[rows, {k}] float32 and int64")
        return values, indices

    def torch_dataset(self, layers: list[int] | None = None) -> ProbeDataset:
        """A torch Dataset over (prompt, layer) pairs yielding {activation, label, layer, prompt, sample_idx}."""
        return ProbeDataset(self, layers)


class ProbeDataset:
    """torch.utils.data.Dataset over (prompt, layer), layer-major; last-token activations + labels."""

    def __init__(self, dataset: LmprobeDataset, layers: list[int] | None = None):
        import torch  # noqa: F401  (fail early when torch is absent)

        self.dataset = dataset
        self.layers = list(layers) if layers is not None else dataset.layers
        for layer in self.layers:
            dataset.check_layer(layer)
        self.labels = dataset.labels

    def __len__(self) -> int:
        return len(self.layers) * self.dataset.num_prompts

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        i = index_argument(i, "item", self.dataset.index_path)  # True was item 1
        if not 0 <= i < len(self):
            raise IndexError(i)
        layer, prompt = self.layers[i // self.dataset.num_prompts], i % self.dataset.num_prompts
        return {"activation": torch.from_numpy(self.dataset.get(prompt, layer)), "label": int(self.labels[prompt]),
                "layer": layer, "prompt": prompt, "sample_idx": int(self.dataset.sample_idx[prompt])}


def open_dataset(root: str | Path, split: str | None = None, verify: bool = False) -> LmprobeDataset:
    """Open an lmprobe 2.0 dataset by its root directory. verify=True first checks every file
    against SHA256SUMS, the index columns and every shard's header (reads each file once)."""
    if verify:
        from actstore.formats.lmprobe.check import verify as problems
        from actstore.hashing import stage_problems
        refuse(problems(root) + stage_problems(root))
    return LmprobeDataset(root, split)
