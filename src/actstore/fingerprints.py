"""Every stored vector against the extraction, in one sequential pass over each: validate's full check.

validate reads a few hundred coordinates exactly; a writer that swapped two samples' vectors, shifted
a sample's tokens by one or wrote one layer's values under another's name, with every identity field
right, passed unless a sampled row landed on it. Here every row a store holds is folded into a
fingerprint, and the extraction's rows (rounded to the store's dtype, of the tokens the store holds by
design) into another; the two must agree.

The fingerprint is order-free (a reader may meet rows in any order): for each layer and range of
samples, the sum over its rows of r(sample) * w(token) * (x . q), with q a seeded random direction and
r, w fixed irregular weights in [1, 2), so a swap of two samples or of two tokens, or a row moved to
another token, changes the sum; plus the row count, and the sum of |x| . |q| as the scale a float64
rounding error is measured against. Its memory is fixed (at most MAX_CELLS sums, whatever the data
size); a difference is located to a layer and a range of samples, which the sampled check then reads.
A single value changed by less than ~1e-9 of its range's scale is below the tolerance: a damaged byte is
the sha256's to find, a misplaced row this check's. A row whose product is NaN or infinite (a value the
model computed) is also folded in apart, as a hash of its sample, token and which of its values are
NaN, +inf or -inf, summed mod 2**64 (exact in any order), and its finite values with the other rows',
so it blinds neither its range's other rows nor itself.
"""
from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterator

import numpy as np
from tqdm import tqdm

from actstore import integrity
from actstore.errors import FormatError
from actstore.formats.extract import layer_tensor
from actstore.io_utils import atomic_path

# (layer, sample_idx (n,), token (n,), vectors (n, d) float32): rows of a store, in any order
Rows = tuple[int, np.ndarray, np.ndarray, np.ndarray]
# Rows of some layers of a view, read lazily: closed, its block let go, once read or failed
Stream = Generator[Rows, None, None]

MAX_CELLS = 1 << 20  # (layer, sample range) sums kept, at most: 24 MB a fingerprint
BLOCK_BYTES = 32 << 20  # float32 rows read at once
TOLERANCE = 1e-9  # of a range's scale: float64 dot products of d <= 65536 terms err < 1.5e-11 of it
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mixed(values: np.ndarray, salt: int) -> np.ndarray:
    """Fixed irregular uint64s, one for each of `values` (non-negative integers)."""
    out = (values.astype(np.uint64) + np.uint64(salt)) * GOLDEN
    return out ^ (out >> np.uint64(29))


def weights(values: np.ndarray, salt: int) -> np.ndarray:
    """Fixed irregular weights in [1, 2), one for each of `values` (non-negative integers)."""
    return 1.0 + (mixed(values, salt) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def nonfinite_codes(rows: np.ndarray) -> np.ndarray:
    """A whole number for each row telling which of its values are NaN, +inf or -inf: the sum of their
    kinds (1, 2, 3) times a fixed irregular integer below 2**32 of their column, exact in float64 (below
    2**53 for rows of fewer than 699,000 values) in any order BLAS sums them. The kind of the row's product
    with q alone was NaN for a NaN beside any inf: a store holding NaN for that inf, or the inf of the
    other sign, passed."""
    codes = np.isnan(rows).astype(np.float64)
    codes[np.isposinf(rows)] = 2
    codes[np.isneginf(rows)] = 3
    columns = (mixed(np.arange(rows.shape[1]), 5) >> np.uint64(32)).astype(np.float64)
    return (codes @ columns).astype(np.uint64)


@dataclass
class Fingerprint:
    """The sums of one store's rows (or the extraction's) for `layers` over `n_samples` samples."""

    n_samples: int
    layers: list[int]
    direction: np.ndarray  # q, float64 (d,)
    scaled: bool = True  # keep the scales (the extraction's: a store's would only repeat them)

    def __post_init__(self) -> None:
        per_layer = max(1, MAX_CELLS // max(1, len(self.layers)))
        self.range_size = max(1, -(-self.n_samples // per_layer))
        n_ranges = max(1, -(-self.n_samples // self.range_size))
        shape = (len(self.layers), n_ranges)
        self.sums, self.scales = np.zeros(shape), np.zeros(shape)
        self.specials = np.zeros(shape, np.uint64)  # exact: a sum mod 2**64, order-free at any row count
        self.counts = np.zeros(shape, np.int64)
        self._position = {layer: i for i, layer in enumerate(self.layers)}

    def add(self, layer: int, samples: np.ndarray, tokens: np.ndarray, vectors: np.ndarray) -> None:
        """Fold rows (sample_idx, token, vector) of `layer` in. A row of a sample outside
        0..n_samples-1 (which no store may hold) counts in the range nearest it, so it is named."""
        if layer not in self._position or not len(samples):
            return
        at, size = self._position[layer], self.sums.shape[1]
        weight = weights(samples, 0) * weights(tokens, 1)
        ranges = np.clip(samples // self.range_size, 0, size - 1)
        with np.errstate(invalid="ignore"):  # inf - inf in a row the model computed: NaN, handled below
            dots = vectors.astype(np.float64) @ self.direction
        special = ~np.isfinite(dots)
        if special.any():  # a NaN or inf the model computed: hashed apart, its row's finite values still summed
            row = mixed(mixed(samples[special], 2) ^ tokens[special].astype(np.uint64), 3)
            np.add.at(self.specials[at], ranges[special], mixed(row ^ nonfinite_codes(vectors[special]), 4))
            vectors = vectors.copy()  # the caller's block left as it is
            vectors[special] = np.nan_to_num(vectors[special], nan=0.0, posinf=0.0, neginf=0.0)
            dots[special] = vectors[special].astype(np.float64) @ self.direction
        self.sums[at] += np.bincount(ranges, weight * dots, size)
        self.counts[at] += np.bincount(ranges, minlength=size)
        if self.scaled:  # float32 is precise enough for a tolerance's scale, and 5x faster
            magnitude = np.abs(vectors, dtype=np.float32) @ np.abs(self.direction).astype(np.float32)
            if not np.isfinite(magnitude).all():  # float32 overflowed: an inf scale would pass any sum
                magnitude = np.abs(vectors.astype(np.float64)) @ np.abs(self.direction)
            self.scales[at] += np.bincount(ranges, weight * magnitude, size)

    def differences(self, other: Fingerprint, where: str) -> list[str]:
        """Where this store's sums (self) differ from the extraction's (other, whose scales measure
        the tolerance), at most 3 ranges a layer named."""
        problems = []
        for at, layer in enumerate(self.layers):
            for index in _differing(self, other, at)[:3]:
                first = int(index) * self.range_size
                span = f"samples {first}..{min(first + self.range_size, self.n_samples) - 1}"
                mine, theirs = self.counts[at, index], other.counts[at, index]
                what = (f"holds {mine} rows, the extraction {theirs}" if mine != theirs else
                        f"holds its NaN or inf rows elsewhere than the extraction (their hash sum "
                        f"{int(self.specials[at, index]):#x}, the extraction's {int(other.specials[at, index]):#x})"
                        if self.specials[at, index] != other.specials[at, index] else
                        f"holds other vectors than the extraction's (weighted sum {self.sums[at, index]:.9g}, "
                        f"the extraction's {other.sums[at, index]:.9g})")
                problems.append(f"{where}: layer {layer}, {span}: {what}")
        return problems


def _differing(mine: Fingerprint, theirs: Fingerprint, at: int) -> np.ndarray:
    """Range indices of layer row `at` whose counts differ, whose sums differ past the tolerance, or
    whose rows of a NaN or inf (which values, sample and token) differ: hashes summed mod 2**64, equal
    in any order."""
    close = np.abs(mine.sums[at] - theirs.sums[at]) <= TOLERANCE * theirs.scales[at]
    same = mine.specials[at] == theirs.specials[at]
    return np.flatnonzero((mine.counts[at] != theirs.counts[at]) | ~(close & same))


@dataclass(frozen=True)
class Wanted:
    """The extraction's rows a store holds: rounded to `dtype`, of `layers`, all tokens or each
    sample's last (`last_only`), none of the positions in `dropped` (saev's register tokens)."""

    dtype: str
    layers: tuple[int, ...]
    last_only: bool = False
    dropped: frozenset[int] = frozenset()

    def keep(self, tokens: np.ndarray, n_tokens: np.ndarray) -> np.ndarray:
        """Mask of rows (token positions, their samples' token counts) the store holds."""
        keep = tokens == n_tokens - 1 if self.last_only else np.ones(len(tokens), bool)
        return keep & ~np.isin(tokens, list(self.dropped)) if self.dropped else keep


def extraction_fingerprints(extraction, wanted: dict[Any, Wanted], seed: int,
                            rounded: Callable[[str], Callable[[np.ndarray], np.ndarray]],
                            on_rows: Callable[[int], Any] = lambda n: None) -> dict[Any, Fingerprint]:
    """One pass over the extraction's rows, folding each into the fingerprint of every entry of
    `wanted` (rounded(dtype): the float32 -> stored dtype -> float32 rounding validate compares by);
    on_rows(n) after each block of n rows."""
    prints = {name: new_fingerprint(extraction, list(w.layers), seed) for name, w in wanted.items()}
    layers = sorted({layer for w in wanted.values() for layer in w.layers})
    for samples, tokens, n_tokens, layer, block in _extraction_rows(extraction, layers):
        by_dtype = {"float32": block}  # each rounding once a block, whatever shares it
        for name, w in wanted.items():
            if layer not in w.layers:
                continue
            if w.dtype not in by_dtype:
                by_dtype[w.dtype] = rounded(w.dtype)(block)
            keep = w.keep(tokens, n_tokens)
            if keep.all():  # a copy of the block saved where every row is held
                prints[name].add(layer, samples, tokens, by_dtype[w.dtype])
            else:
                prints[name].add(layer, samples[keep], tokens[keep], by_dtype[w.dtype][keep])
        on_rows(len(samples))
    return prints


def new_fingerprint(extraction, layers: list[int], seed: int, scaled: bool = True) -> Fingerprint:
    """An empty fingerprint of `layers` over the extraction's samples, q seeded by `seed`."""
    width = extraction.parts[0].tensor(layer_tensor(extraction.info.layers[0])).shape[1]
    return Fingerprint(extraction.n_samples, layers, np.random.default_rng(seed).standard_normal(width), scaled)


def _extraction_rows(extraction, layers: list[int]) -> Iterator[tuple[np.ndarray, ...]]:
    """(sample_idx, token, token count of the row's sample, layer, float32 rows) blocks of every part (of
    the parts of this job's share, integrity.check_share)."""
    shared = (part for position, part in enumerate(extraction.parts) if integrity.in_share(position))
    for part in (part for part in shared if part.info.n_tokens):  # an empty part has no tensor file
        counts = np.diff(part.offsets)
        for layer in layers:
            tensor = part.tensor(layer_tensor(layer))
            step = max(1, BLOCK_BYTES // (4 * tensor.shape[1]))
            for a in range(0, len(tensor), step):
                b = min(a + step, len(tensor))
                rows = np.arange(a, b)
                local = np.searchsorted(part.offsets, rows, side="right") - 1
                block = np.empty((b - a, tensor.shape[1]), np.float32)
                tensor.read_rows(a, b, block)
                yield (part.sample_start + local, rows - part.offsets[local], counts[local], layer, block)


def store_fingerprint(rows: Iterator[Rows], extraction, layers: list[int], seed: int, store: Path,
                      on_rows: Callable[[int], Any] = lambda n: None) -> Fingerprint:
    """The fingerprint of a store's rows (a view's stream, below); on_rows(n) after each block of n rows."""
    fingerprint = new_fingerprint(extraction, layers, seed, scaled=False)
    width = len(fingerprint.direction)
    for layer, samples, tokens, vectors in rows:
        # A store of another model's (or layer kind's) width: numpy's matmul error named no file
        if vectors.shape[1] != width:
            raise FormatError(f"{store}: layer {layer} holds vectors of {vectors.shape[1]} values, "
                              f"the extraction's {width}")
        fingerprint.add(layer, samples, tokens, vectors)
        on_rows(len(samples))
    return fingerprint


@dataclass
class StorePasses:
    """One store's fingerprints, a view's each, as its validate job leaves them: `views` [(label, the
    extraction's rows it must equal, its fingerprint or why none was read)]; `error`: why no view was
    opened (the store's rows unreadable as a whole)."""

    views: list[tuple[str, Wanted, Fingerprint | str]]
    error: str | None = None


def _held_views(name: str, store: Path, dtype: str, extraction) -> list[View]:
    """The store's views, each one's layers those the extraction holds."""
    held = set(extraction.info.layers)
    return [replace(view, wanted=replace(view.wanted, layers=tuple(l for l in view.wanted.layers if l in held)))
            for view in store_views(name, store, dtype)]


def _rows_of(extraction, wanted: Wanted) -> int:
    """About the rows a view holds (saev's dropped registers are fewer), of this job's share: the progress
    bar's total."""
    rows = (extraction.n_samples if wanted.last_only else extraction.n_tokens) * len(wanted.layers)
    return rows // integrity.CHECK_SHARE[1]


def store_passes(name: str, store: Path, dtype: str, extraction, seed: int) -> StorePasses:
    """Every view of format `name`'s store (its vectors stored in `dtype`) read once into its fingerprint:
    every stream of every view read at once, integrity.CHECK_THREADS of them (numpy's casts and products, and
    gzip's decompression, release the GIL; one view read in one thread left a pickle store's validate job on
    one core of its eight); a view's fingerprint its streams' merged."""
    try:
        views = _held_views(name, store, dtype, extraction)
    except FormatError as exc:  # verify names what is wrong with the store; nothing to compare
        return StorePasses([], f"{exc} (no fingerprint read)")
    with ThreadPoolExecutor(integrity.CHECK_THREADS) as pool, \
            tqdm(total=sum(_rows_of(extraction, view.wanted) for view in views), desc=f"{name}: every vector",
                 unit="row", unit_scale=True) as bar:
        passes = [(view, [pool.submit(_stream_fingerprint, stream, extraction, list(view.wanted.layers), seed,
                                      store, bar.update) for stream in view.streams]) for view in views]
        return StorePasses([(view.label, view.wanted, _view_print(done, view.label)) for view, done in passes])


def _stream_fingerprint(stream: Stream, *args: Any) -> Fingerprint:
    """store_fingerprint(stream, *args), the stream closed at its end: one a FormatError left part-read held
    its block (a pickle stream, a whole shard) until the pass ended, beside the other streams' shards."""
    with closing(stream):
        return store_fingerprint(stream, *args)


def _view_print(streams: list[Future], label: str) -> Fingerprint | str:
    """A view's fingerprint, its streams' merged; or why its first stream that failed was not read. Where the
    streams are a layer's each (zarr, lmprobe) their cells are apart and the sums are bit for bit one stream's;
    pickle's streams share cells, whose sums then differ from one stream's in their last bits only, far below
    TOLERANCE, in an order fixed by the streams' count."""
    prints = [_read_or_why(done, label) for done in streams]
    errors = [p for p in prints if isinstance(p, str)]
    return errors[0] if errors else merged(prints)


def _read_or_why(done: Future, label: str) -> Fingerprint | str:
    try:
        return done.result()
    # OSError: a file its reader could not open (a loop of links, an I/O error), named by the error;
    # raised here, it ended validate in a traceback, verify's problems of every store unreported
    except (FormatError, OSError) as exc:
        return f"{exc} ({label} fingerprint not read)"


def wanted_of(stores: dict[str, tuple[Path, str]], extraction) -> list[Wanted]:
    """The extraction's rows each view of `stores` {format: (store, stored dtype)} must equal, each once;
    none of a store whose views cannot be opened (store_passes names why)."""
    wanted: list[Wanted] = []
    for name, (store, dtype) in stores.items():
        try:
            views = _held_views(name, store, dtype, extraction)
        except FormatError:
            continue
        wanted += [view.wanted for view in views if view.wanted not in wanted]
    return wanted


def reference_passes(extraction, wanted: list[Wanted], seed: int,
                     rounded: Callable[[str], Callable[[np.ndarray], np.ndarray]]) -> dict[Wanted, Fingerprint] | str:
    """The extraction's fingerprint of each of `wanted`, in one pass; or why it could not be read."""
    total = extraction.n_tokens * len({l for w in wanted for l in w.layers})
    with tqdm(total=total, desc="extraction: every vector", unit="row", unit_scale=True) as bar:
        try:
            return extraction_fingerprints(extraction, {w: w for w in wanted}, seed, rounded, bar.update)
        except FormatError as exc:  # check_format("extract") names it too; nothing to compare with
            return f"{exc} (the extraction's fingerprint not read)"


def merged(prints: list[Fingerprint]) -> Fingerprint:
    """One fingerprint of the rows of all of `prints` (a view's, each of a share of its rows): their sums,
    scales, hashes (mod 2**64) and counts added."""
    first = prints[0]
    whole = Fingerprint(first.n_samples, first.layers, first.direction, first.scaled)
    for field in _SAVED:
        setattr(whole, field, np.sum([getattr(p, field) for p in prints], axis=0, dtype=getattr(first, field).dtype))
    return whole


def compared(store: Path, passes: StorePasses, reference: dict[Wanted, Fingerprint] | str) -> dict[str, Any]:
    """{"views": {view: rows read}, "problems": [...]}: each view's fingerprint against the extraction's."""
    if passes.error:
        return {"views": {}, "problems": [passes.error]}
    result: dict[str, Any] = {"views": {}, "problems": []}
    for label, wanted, mine in passes.views:
        if isinstance(mine, str) or isinstance(reference, str):  # the view's own error named first
            result["problems"].append(mine if isinstance(mine, str) else reference)
            continue
        result["views"][label] = int(mine.counts.sum())
        result["problems"] += mine.differences(reference[wanted], f"{store} ({label})")
    return result


def fingerprint_problems(stores: dict[str, tuple[Path, str]], extraction, seed: int,
                         rounded: Callable[[str], Callable[[np.ndarray], np.ndarray]]) -> dict[str, dict[str, Any]]:
    """{format: compared(...)} for `stores` {format: (store, stored dtype)}: one pass over the extraction
    and one over each view of each store, in one process (the validate stage's jobs make each apart)."""
    reference = reference_passes(extraction, wanted_of(stores, extraction), seed, rounded)
    return {name: compared(store, store_passes(name, store, dtype, extraction, seed), reference)
            for name, (store, dtype) in stores.items()}


# ---------------------------------------------------------------------------- passes kept in a file
# A validate job's result: its JSON (`meta`) and fingerprints in one .npz, written atomically, read
# without pickle (allow_pickle=False).
META_KEY = "meta.json"


def wanted_json(wanted: Wanted) -> dict[str, Any]:
    return {"dtype": wanted.dtype, "layers": list(wanted.layers), "last_only": wanted.last_only,
            "dropped": sorted(wanted.dropped)}


def wanted_from_json(value: dict[str, Any]) -> Wanted:
    return Wanted(value["dtype"], tuple(value["layers"]), value["last_only"], frozenset(value["dropped"]))


def save_passes(path: str | Path, meta: dict[str, Any], prints: dict[str, Fingerprint]) -> None:
    """Write `meta` (JSON) and `prints` {key: fingerprint} into the .npz at `path`, atomically."""
    arrays = {META_KEY: np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    for key, fingerprint in prints.items():
        arrays.update({f"{key}.{field}": getattr(fingerprint, field) for field in _SAVED})
        arrays[f"{key}.layers"] = np.asarray(fingerprint.layers, np.int64)
        arrays[f"{key}.n_samples"] = np.asarray(fingerprint.n_samples, np.int64)
    with atomic_path(path) as tmp, open(tmp, "wb") as out:
        np.savez(out, **arrays)


def load_passes(path: str | Path) -> tuple[dict[str, Any], dict[str, Fingerprint]]:
    """(meta, {key: fingerprint}) save_passes wrote at `path`; FormatError naming it if it is not one."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            arrays = {name: saved[name] for name in saved.files}
        meta = json.loads(arrays.pop(META_KEY).tobytes())
        prints = {}
        for key in {name.rpartition(".")[0] for name in arrays}:
            layers = [int(l) for l in arrays[f"{key}.layers"]]
            prints[key] = Fingerprint(int(arrays[f"{key}.n_samples"]), layers, np.zeros(0), scaled=False)
            for field in _SAVED:
                value = arrays[f"{key}.{field}"]
                if value.shape != getattr(prints[key], field).shape:
                    raise ValueError(f"{key}.{field} of shape {value.shape}")
                setattr(prints[key], field, value)
    except (OSError, ValueError, KeyError) as exc:
        raise FormatError(f"{path}: not a validate job's fingerprints ({exc})") from None
    return meta, prints


_SAVED = ("sums", "scales", "specials", "counts")


# ---------------------------------------------------------------------------- each format's rows
@dataclass(frozen=True)
class View:
    """A copy of the store's rows, as `streams` (of other layers or files each: read at once, their
    fingerprints merged), and the extraction's rows it must equal. A format whose files hold a vector twice
    (lmprobe's last tokens, zarr's merged store) has a view for each copy."""

    label: str
    streams: list[Stream]
    wanted: Wanted


def store_views(name: str, store: Path, dtype: str) -> list[View]:
    """The views of format `name`'s store at `store`, its vectors stored in `dtype`."""
    return _VIEWS[name](store, dtype)


def _saev_views(store: Path, dtype: str) -> list[View]:
    """Every token a saev store holds: a text store's windows (their n_valid tokens, from
    token_start), an image store's examples (one a sample, its positions past the dropped registers)."""
    from actstore.formats.saev import open_store

    saev = open_store(store)
    dropped = frozenset(saev.dropped_tokens)
    # one stream: a chunk holds every layer of its examples
    return [View("saev", [_saev_rows(saev, dropped)], Wanted(dtype, tuple(saev.layers), dropped=dropped))]


def _saev_rows(saev, dropped: frozenset[int]) -> Stream:
    windows = saev.windows
    positions = np.array([p for p in range(saev.T + len(dropped)) if p not in dropped], np.int64)
    # this job's share of the chunks only: another share's are not read
    for first, chunk in saev.iter_ordered(max(1, BLOCK_BYTES // saev.example_bytes), share=integrity.CHECK_SHARE):
        examples = np.arange(first, first + len(chunk))
        for at, layer in enumerate(saev.layers):
            if windows is None:
                samples = np.repeat(examples, saev.T)
                yield layer, samples, np.tile(positions, len(examples)), chunk[:, at].reshape(-1, saev.D)
                continue
            valid = np.arange(saev.T) < windows[examples, 2, None]  # (n, T): the padding left out
            samples = np.broadcast_to(windows[examples, 0, None], valid.shape)[valid]
            tokens = (windows[examples, 1, None] + np.arange(saev.T))[valid]
            yield layer, samples, tokens, chunk[:, at][valid]


def _pickle_views(store: Path, dtype: str) -> list[View]:
    """Streams of every other shard (of this job's share of them), each inflating a shard once for all its
    layers (a stream a layer inflated each shard once a layer), as many as read at once fit in memory."""
    from actstore.formats.pickle.check import checked_metadata

    meta = checked_metadata(store)
    layers = tuple(meta["extraction_config"]["layers_extracted"])
    first, every = integrity.CHECK_SHARE
    count = max(1, min(integrity.CHECK_THREADS, _pickle_streams_at_once(meta), len(meta["shards"][first::every])))
    # stream k: the places first + every * k, first + every * (k + count), ... (integrity.share_places)
    return [View("pickle", [_pickle_rows(store, list(layers), (first + every * k, every * count))
                            for k in range(count)], Wanted(dtype, layers))]


def _pickle_streams_at_once(meta: dict[str, Any]) -> int:
    """Pickle streams read at once: each holds a decompressed shard (the largest, as verify sizes it:
    largest_shard_bytes), counted twice for the arrays built from it and the blocks gathered from them, and
    together they stay within integrity.memory_budget(), the quarter of the job's memory that
    resources.validate_mem_mb makes one shard fit in: one at least."""
    from actstore.formats.pickle.check import largest_shard_bytes, stated_width

    largest = largest_shard_bytes(meta["shards"], stated_width(meta))
    return max(1, integrity.memory_budget() // max(1, 2 * largest))


def _pickle_rows(store: Path, layers: list[int], share: tuple[int, int]) -> Stream:
    """Every item of `layers` in the shards of `share`: its token_count rows (the spec's padding left out),
    each item held whole (its padding too) until its block is folded in."""
    from actstore.formats.pickle import item_tokens, iter_layer_items

    for layer, items in iter_layer_items(store, layers, share=share):
        yield from _sample_blocks(layer, ((item["sample_idx"], item["activation"][:item_tokens(item)],
                                           item["activation"].nbytes) for item in items), BLOCK_BYTES)
        del items  # let go before the next shard loads


def _zarr_views(store: Path, dtype: str) -> list[View]:
    """The run's stores (or the one store given) and, where the run has one, its merged store."""
    from actstore.formats.zarr import ZarrRun, open_zarr

    reader = open_zarr(store)
    runs = [("zarr", reader)]
    if isinstance(reader, ZarrRun) and reader.manifest.get("merged"):
        runs.append(("zarr merged", ZarrRun(store, merged=True)))
    return [View(label, _zarr_streams(run.stores if isinstance(run, ZarrRun) else [run]),
                 Wanted(dtype, tuple(run.layers))) for label, run in runs]


def _zarr_streams(stores: list) -> list[Stream]:
    """A stream a layer any of `stores` holds (its arrays are a layer's each)."""
    layers = dict.fromkeys(layer for zarr in stores for layer in zarr.layers)
    return [_zarr_rows(stores, layer) for layer in layers]


def _zarr_rows(stores: list, layer: int) -> Stream:
    """Every sample's seq_len tokens of `layer`, store by store."""
    for zarr in (zarr for zarr in stores if layer in zarr.layers):
        start = int(zarr.attrs["global_index_start"])
        yield from _sample_blocks(layer, _zarr_samples(zarr, start, layer), BLOCK_BYTES // 2)


def _zarr_samples(zarr, start: int, layer: int) -> Iterator[tuple[int, np.ndarray, int]]:
    for i in (i for i in range(zarr.n_samples) if integrity.in_share(start + i)):  # this job's samples
        vectors = zarr.read(i, layer)
        yield start + i, vectors, vectors.nbytes


def _sample_blocks(layer: int, samples: Iterator[tuple[int, np.ndarray, int]], limit: int) -> Iterator[Rows]:
    """Whole samples (sample_idx, (tokens, d) rows, bytes they hold) gathered into blocks of `limit` bytes."""
    blocks, held = [], 0
    for sample, vectors, nbytes in samples:
        blocks.append((sample, vectors))
        held += nbytes
        if held >= limit:
            yield _sample_block(layer, blocks)
            blocks, held = [], 0
    if blocks:
        yield _sample_block(layer, blocks)


def _sample_block(layer: int, blocks: list[tuple[int, np.ndarray]]) -> Rows:
    """Rows of whole samples [(sample_idx, (tokens, d) array), ...] as one block."""
    counts = [len(vectors) for _, vectors in blocks]
    samples = np.repeat([int(sample) for sample, _ in blocks], counts).astype(np.int64)
    tokens = np.concatenate([np.arange(n) for n in counts]).astype(np.int64)
    return layer, samples, tokens, np.concatenate([np.asarray(v, np.float32) for _, v in blocks])


def _lmprobe_views(store: Path, dtype: str) -> list[View]:
    """The last-token shards' row of every prompt and, in a full-sequence dataset, every token of the
    sequence shards: a last token is in both, and users read both."""
    from actstore.formats.lmprobe import open_dataset

    dataset = open_dataset(store)
    layers = tuple(dataset.layers)
    last = [_lmprobe_last_rows(dataset, layer) for layer in layers]  # its shards are a layer's each
    views = [View("lmprobe last tokens", last, Wanted(dtype, layers, last_only=True))]
    if dataset.full_sequence:  # one stream: a batch's token addresses, found once, read for every layer
        views.append(View("lmprobe sequences", [_lmprobe_sequence_rows(dataset)], Wanted(dtype, layers)))
    return views


def _lmprobe_last_rows(dataset, layer: int) -> Stream:
    samples = np.asarray(dataset.sample_idx, np.int64)
    last = np.asarray(dataset.num_tokens, np.int64) - 1
    step = _rows_per_block(dataset.dim)
    for first in range(0, dataset.num_prompts, step):
        if not integrity.in_share(first // step):  # another share job's rows
            continue
        rows = np.arange(first, min(first + step, dataset.num_prompts))
        yield layer, samples[rows], last[rows], dataset.last_token_rows(layer, rows)


def _lmprobe_sequence_rows(dataset) -> Stream:
    samples = np.asarray(dataset.sample_idx, np.int64)
    batches = dataset.token_address_batches(_rows_per_block(dataset.dim))
    for prompts, tokens, shards, offsets in (b for i, b in enumerate(batches) if integrity.in_share(i)):
        for layer in dataset.layers:
            yield layer, samples[prompts], tokens, dataset.rows_at(layer, shards, offsets, prompts)


def _rows_per_block(dim: int) -> int:
    return max(1, BLOCK_BYTES // (4 * dim))


_VIEWS = {"saev": _saev_views, "pickle": _pickle_views, "zarr": _zarr_views, "lmprobe": _lmprobe_views}
