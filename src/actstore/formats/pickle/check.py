"""The Format protocol for pickle-shard stores: detect, inspect, verify, read_vector.

verify checks metadata.json against the spec, every shard's bytes (size, sha256), its safe load and
its content against its metadata entry, and (merged stores) each machine's metadata.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from actstore import integrity
from actstore.errors import FormatError
from actstore.formats.pickle.layout import (CHECKSUM_PREFIX, CONFIG_FIELDS, FORMAT, ITEM_FIELDS, METADATA,
                                            PREVIEW_CHARS, REQUIRED, SHARD_FIELDS, STAT_FIELDS, ends_in_shard_name,
                                            layer_key)
from actstore.formats.pickle.read import item_tokens, load_metadata, load_shard, shard_path, shards_by_id
from actstore.formats.pickle.unpickler import BudgetHeldByOthers, ByteBudget
from actstore.integrity import (file_problem, inside, iso_timestamp, links_out, problems_of, unlisted,
                                vector_indices, version_string, whole_number, whole_numbers)

# Shard bytes verify holds at once (validate_stores' mem_mb leaves room for it): with the default
# 100 MB shards, 3 checked at once; 500 MB shards (the spec's largest) one at a time.
SHARDS_VERIFY_BYTES = 1 << 30
# The item fields a reader needs: the spec calls `metadata` "Optional additional metadata", so an item
# without it is read as one whose metadata is null.
REQUIRED_ITEM_FIELDS = tuple(field for field in ITEM_FIELDS if field != "metadata")


def detect(path: str | Path) -> bool:
    """A directory whose metadata.json has the spec's required fields and shard_*.pkl[.gz] entries."""
    try:
        meta = load_metadata(path)
    except FormatError:
        return False
    return all(k in meta for k in REQUIRED) and all(
        isinstance(s, dict) and ends_in_shard_name(str(s.get("filename", ""))) for s in meta["shards"])


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary from metadata.json alone (no shard is read), its fields checked first, the statistics it
    reports against the shard entries' sums too (a total_samples of 999, or "x", was reported as it was)."""
    meta = checked_metadata(path)
    integrity.refuse(_verify_totals(Path(path), meta))
    ext, stats, cfg = meta.get("actstore", {}), meta["statistics"], meta["extraction_config"]
    shard_bytes = sum(s["size_bytes"] for s in meta["shards"])
    return {
        "format": FORMAT, "version": meta["version"], "model": cfg["model_name"],
        "layers": list(cfg["layers_extracted"]), "n_examples": stats["total_samples"],
        "n_tokens": stats.get("total_tokens"),
        "d_model": ext.get("d_model") or cfg["model_params"].get("hidden_size"),
        "dtype": ext.get("dtype", "float32"), "n_shards": len(meta["shards"]),
        "bytes": shard_bytes + (Path(path) / METADATA).stat().st_size,
        "compressed": sorted({bool(s["compressed"]) for s in meta["shards"]}),
        "machines": meta.get("distributed_config", {}).get("total_machines"),
        "merged": bool(ext.get("merged")),
    }


def checked_metadata(path: str | Path) -> dict[str, Any]:
    """metadata.json, every field a reader computes with checked first (_verify_metadata): FormatError
    naming the file and field, where a mistyped shard entry raised TypeError or KeyError naming nothing."""
    meta = load_metadata(path)
    if problems := _verify_metadata(Path(path), meta):
        raise FormatError(problems[0])
    return meta


def _verify_metadata(path: Path, meta: dict[str, Any]) -> list[str]:
    """The spec's required fields, and the type of every field a reader or verify computes with."""
    where = path / METADATA
    problems = [f"{where}: missing required field {k!r}" for k in REQUIRED if k not in meta]
    if problems:
        return problems
    problems = [f"{where}: {key} must be {want}, got {meta[key]!r:.60}"
                for key, want, ok in (("extraction_config", "an object", isinstance(meta["extraction_config"], dict)),
                                      ("statistics", "an object", isinstance(meta["statistics"], dict)),
                                      ("shards", "a list", isinstance(meta["shards"], list)))
                if not ok]
    if problems:
        return problems
    if not iso_timestamp(meta["created_at"]):
        problems.append(f"{where}: created_at {meta['created_at']!r} is not ISO 8601")
    problems += [f"{where}: extraction_config lacks {k!r}" for k in CONFIG_FIELDS if k not in meta["extraction_config"]]
    problems += [f"{where}: statistics lacks {k!r}" for k in STAT_FIELDS if k not in meta["statistics"]]
    for i, info in enumerate(meta["shards"]):
        missing = [k for k in SHARD_FIELDS if k not in info] if isinstance(info, dict) else list(SHARD_FIELDS)
        problems += [f"{where}: shards[{i}] lacks {k!r}" for k in missing]
        if not missing:
            problems += [f"{where}: shards[{i}].{problem}" for problem in _shard_field_problems(info)]
    if not problems:
        problems += [f"{where}: {problem}" for problem in _run_field_problems(meta)]
    return problems


MODEL_COUNTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _shard_field_problems(info: dict[str, Any]) -> list[str]:
    """A shard entry's fields against the spec's types; `compressed` must agree with the file name."""
    checks = [("shard_id", "a whole number", whole_number(info["shard_id"])),
              ("filename", "a string", isinstance(info["filename"], str)),
              ("size_bytes", "a whole number", whole_number(info["size_bytes"])),
              ("num_samples", "a whole number", whole_number(info["num_samples"])),
              ("num_tokens", "a whole number", whole_number(info.get("num_tokens", 0))),
              ("machine_id", "a whole number", whole_number(info.get("machine_id", 0))),
              ("layers", "a list of distinct layer numbers", _distinct_numbers(info["layers"])),
              ("sample_id_range", "[first, last] sample ids", whole_numbers(info["sample_id_range"])
               and len(info["sample_id_range"]) == 2 and info["sample_id_range"][0] <= info["sample_id_range"][1]),
              ("compressed", f"true or false, as the file name {info['filename']!r:.80} says (.pkl.gz or .pkl)",
               isinstance(info["compressed"], bool) and (not ends_in_shard_name(str(info["filename"]))
                                                          or info["compressed"] == info["filename"].endswith(".gz"))),
              ("checksum", "'sha256:<hex>'", isinstance(info["checksum"], str)
               and info["checksum"].startswith(CHECKSUM_PREFIX))]
    return [f"{key} must be {want}, got {info.get(key)!r:.60}" for key, want, ok in checks if not ok]


def _distinct_numbers(value: Any) -> bool:
    """A list of whole numbers, none twice (a layer listed twice is counted, and reported, twice)."""
    return whole_numbers(value) and len(set(value)) == len(value)


def _run_field_problems(meta: dict[str, Any]) -> list[str]:
    """extraction_config, statistics and our `actstore` section: the fields inspect and the readers use
    (statistics' totals are checked against the shards' sums, by _verify_totals)."""
    cfg, stats, ours, dist = meta["extraction_config"], meta["statistics"], meta.get("actstore", {}), \
        meta.get("distributed_config", {})
    checks = [("extraction_config.layers_extracted", cfg["layers_extracted"],
               _distinct_numbers(cfg["layers_extracted"])),
              ("extraction_config.model_params", cfg["model_params"], isinstance(cfg["model_params"], dict)),
              ("statistics.layers_extracted", stats["layers_extracted"], whole_numbers(stats["layers_extracted"])),
              ("actstore", ours, isinstance(ours, dict)),
              ("distributed_config", dist, isinstance(dist, dict) and isinstance(dist.get("machines") or [], list))]
    checks += [(f"extraction_config.{key}", cfg[key], whole_number(cfg[key]))
               for key in ("max_seq_length", "batch_size")]
    checks += [("version", meta["version"], version_string(meta["version"]))]
    if isinstance(cfg["model_params"], dict):
        checks += [(f"extraction_config.model_params.{key}", value, value is None or whole_number(value))
                   for key, value in cfg["model_params"].items() if key in MODEL_COUNTS]
    layers = sorted({layer for info in meta["shards"] for layer in info["layers"]})
    checks += [("extraction_config.layers_extracted (the shards hold layers "
                f"{layers}; statistics.layers_extracted {stats['layers_extracted']!r:.60})", cfg["layers_extracted"],
                cfg["layers_extracted"] == stats["layers_extracted"] and set(layers) <= set(cfg["layers_extracted"]))]
    if isinstance(ours, dict):
        uncompressed = ("compresslevel", "compression", "compressor")  # null in an uncompressed store
        for keys, ok in ((("d_model", "n_dataset_samples", "compresslevel", "pickle_protocol"), whole_number),
                         (("compression", "compressor", "modality", "model_kind"), lambda v: isinstance(v, str))):
            checks += [(f"actstore.{key}", ours[key], ok(ours[key]) or key in uncompressed and ours[key] is None)
                       for key in keys if key in ours]
        # every shard holds float32 (_verify_items): inspect reports this field, so another value is a lie
        checks += [("actstore.dtype", ours["dtype"], ours["dtype"] == "float32")] if "dtype" in ours else []
        checks += [("actstore.merged", ours["merged"], isinstance(ours["merged"], bool))] if "merged" in ours else []
    return [f"{name} is malformed: {value!r:.60}" for name, value, ok in checks if not ok]


def _verify_totals(path: Path, meta: dict[str, Any]) -> list[str]:
    """Unique shard ids (as ActivationDataset finds shards by them: the repeated id and both its files
    named); statistics equal to the sums over shards."""
    where, problems = path / METADATA, []
    try:
        shards_by_id(path, meta["shards"])
    except FormatError as exc:
        problems.append(str(exc))
    stats, totals = meta["statistics"], [("total_shards", len(meta["shards"])),
                                          ("total_samples", sum(s["num_samples"] for s in meta["shards"])),
                                          ("total_size_bytes", sum(s["size_bytes"] for s in meta["shards"]))]
    if "total_tokens" in stats:  # our extension, with each shard's num_tokens (which _verify_shard counts)
        totals.append(("total_tokens", sum(s.get("num_tokens", 0) for s in meta["shards"])))
    for key, want in totals:
        if stats[key] != want:
            problems.append(f"{where}: statistics.{key} = {stats[key]} but the shards sum to {want}")
    machines = meta.get("distributed_config", {}).get("machines")
    if machines and meta["distributed_config"].get("total_machines") != len(machines):
        problems.append(f"{where}: distributed_config.total_machines = "
                        f"{meta['distributed_config'].get('total_machines')} but {len(machines)} machines are listed")
    return problems


def _unlisted_files(path: Path, meta: dict[str, Any]) -> list[str]:
    """Every file is metadata.json, a listed shard, or (merged) a listed machine's metadata.json."""
    machines = meta.get("distributed_config", {}).get("machines") or []
    listed = {METADATA, *(str(s.get("filename")) for s in meta["shards"]),
              *(f"{m.get('dir')}/{METADATA}" for m in machines if isinstance(m, dict))}
    return unlisted(path, listed, str(path / METADATA))


def _verify_machines(path: Path, meta: dict[str, Any]) -> list[str]:
    """A merged store records each machine's metadata.json sha256: check them."""
    problems = []
    for k, m in enumerate(meta.get("distributed_config", {}).get("machines") or []):
        where = f"{path / METADATA}: distributed_config.machines[{k}]"
        if not isinstance(m, dict) or not isinstance(m.get("metadata_sha256"), str):
            problems.append(f"{where}: needs a dir and a metadata_sha256")
            continue
        try:
            mpath = inside(path, m.get("dir"), where) / METADATA
        except FormatError as exc:
            problems.append(str(exc))
            continue
        if problem := file_problem(mpath, {"sha256": m["metadata_sha256"]}, "the merged metadata.json"):
            problems.append(problem)
    return problems


def layer_item_problems(name: Path, key: str, items: Any, num_samples: int, meta: dict[str, Any]) -> list[str]:
    """verify's check of one layer's items in shard `name` (the readers run it on each shard they load)."""
    return _verify_items(name, key, items, num_samples, stated_width(meta), _unpadded(meta))


def _verify_items(name: Path, key: str, items: Any, num_samples: int, width: Any, unpadded: bool) -> list[str]:
    """One layer's item list: its length, each item's fields, activation dtype/shape (`width` columns:
    the d_model metadata.json states), token_count (_token_count_fits) and preview."""
    if not isinstance(items, list) or len(items) != num_samples:
        return [f"{name}: {key} holds {len(items) if isinstance(items, list) else '?'} items, "
                f"num_samples={num_samples}"]
    problems = []
    for position, item in enumerate(items):
        if problem := _item_fields_problem(item):
            problems.append(f"{name}: {key} item {problem} (item {position} of {len(items)})")
            break
        if not whole_number(item["sample_idx"]):  # min/max and the store's id set compare them
            problems.append(f"{name}: {key} sample_idx {item['sample_idx']!r:.40} is not a whole number")
            break
        act = item["activation"]
        if not _activation_fits(act, item["shape"], width):
            found = f"{act.dtype} {act.shape}" if isinstance(act, np.ndarray) else f"a {type(act).__name__}"
            problems.append(f"{name}: {key} sample {item['sample_idx']}: activation {found} "
                            f"vs shape {item['shape']!r:.40}, d_model {width!r} in {METADATA}")
            break  # one bad item names the layer; every other one is likely the same
        if not _token_count_fits(item.get("metadata"), act.shape[0], unpadded):
            problems.append(f"{name}: {key} sample {item['sample_idx']}: metadata.token_count "
                            f"{item['metadata']['token_count']!r:.40} {'!=' if unpadded else '>'} its "
                            f"{act.shape[0]} activation rows")
            break
        if not isinstance(item["text_preview"], str) or len(item["text_preview"]) > PREVIEW_CHARS:
            problems.append(f"{name}: {key} sample {item['sample_idx']}: bad text_preview")
    return problems


def _item_fields_problem(item: Any) -> str | None:
    """What keeps `item` from being a spec item: not a dict, or a required field missing (named: "lacks
    one of" five fields left a reader to find which); None when it has them all."""
    if not isinstance(item, dict):
        return f"is a {type(item).__name__}, not a dict of {', '.join(REQUIRED_ITEM_FIELDS)}"
    if missing := [field for field in REQUIRED_ITEM_FIELDS if field not in item]:
        return f"lacks the required field{'s' * (len(missing) > 1)} {', '.join(missing)}"
    return None


def _activation_fits(act: Any, shape: Any, width: Any) -> bool:
    """A float32 (tokens, width) array that its item's `shape` describes. Checked as types first: an
    activation that is no array, or a shape that is no list, was an AttributeError or TypeError that
    verify blamed on metadata.json."""
    return (isinstance(act, np.ndarray) and act.dtype == np.float32 and act.ndim == 2
            and isinstance(shape, (list, tuple)) and tuple(shape) == act.shape
            and (width is None or act.shape[1] == width))


def _token_count_fits(metadata: Any, rows: int, unpadded: bool) -> bool:
    """An item's optional metadata.token_count, when it has one, counts its real tokens: all its rows
    in an unpadded store, at most its rows in the spec's (padded to max_seq_length: 487 of 512). A
    reader that cuts the padding by it got other rows than the shard holds, and verify passed it."""
    if not isinstance(metadata, dict) or "token_count" not in metadata:
        return True
    count = metadata["token_count"]
    return whole_number(count) and (count == rows if unpadded else count <= rows)


def _verify_shard(path: Path, info: dict[str, Any], width: Any, unpadded: bool, budget: ByteBudget) -> list[str]:
    """One shard's problems: bytes, safe load (its decompressed bytes held in `budget` until it is checked),
    and content against its metadata entry (activations `width` wide, as many token rows in each layer as
    its num_tokens when recorded, its ids within its sample_id_range, which verify checks against the
    other shards')."""
    with budget.share() as take:
        try:
            name = shard_path(path, info)
            shard = load_shard(path, info, take)
        except FormatError as exc:
            return [str(exc)]
        return _shard_content_problems(name, shard, info, width, unpadded)


def _shard_content_problems(name: Path, shard: dict, info: dict[str, Any], width: Any, unpadded: bool) -> list[str]:
    """_verify_shard's check of a loaded shard's content."""
    want_keys = {layer_key(layer) for layer in info["layers"]}
    if set(shard) != want_keys:
        return [f"{name}: layer keys {sorted(map(str, shard))} != metadata layers {sorted(want_keys)}"]
    problems, ids_by_layer = [], []
    for key, items in shard.items():
        problems += _verify_items(name, key, items, info["num_samples"], width, unpadded)
        if isinstance(items, list) and len(items) == info["num_samples"]:
            ids_by_layer.append([item.get("sample_idx") for item in items if isinstance(item, dict)])
    if problems:
        return problems
    rows = {sum(item["activation"].shape[0] for item in items) for items in shard.values()}
    if "num_tokens" in info and rows != {info["num_tokens"]}:
        return [f"{name}: {sorted(rows)} token rows per layer, {METADATA} says num_tokens={info['num_tokens']!r}"]
    ids = ids_by_layer[0] if ids_by_layer else []
    lo, hi = info["sample_id_range"]
    if any(other != ids for other in ids_by_layer) or (ids and (min(ids) != lo or max(ids) != hi)):
        return [f"{name}: sample ids {ids[:1]}..{ids[-1:]} disagree across layers or with "
                f"sample_id_range {info['sample_id_range']}"]
    if len(set(ids)) != len(ids):
        return [f"{name}: duplicate sample_idx within the store"]
    return []


def _verify_shards(path: Path, meta: dict[str, Any]) -> list[str]:
    """Every shard (_verify_shard), as many at once as SHARDS_VERIFY_BYTES holds by their metadata and
    one shared memory_budget() holds by what they decompress to (a shard that finds it held by others
    is checked again alone), then the sample ids of all of them: each once in the store."""
    shards = meta["shards"]
    width = stated_width(meta)
    budget = ByteBudget(integrity.memory_budget())  # the threads' shards together: metadata may understate them
    found_of: dict[int, list[str]] = {}

    def check(i: int) -> list[str]:
        try:
            found_of[i] = _verify_shard(path, shards[i], width, _unpadded(meta), budget)
        except BudgetHeldByOthers:  # checked again below, alone
            pass
        return []

    problems_of(check, range(len(shards)), threads=_shard_threads(shards, width), desc="verify pickle shards")
    mine = [i for i in range(len(shards)) if integrity.in_share(i)]  # every shard, but in a validate share job
    for i in mine:
        if i not in found_of:
            check(i)  # the budget is all its own now: loaded, or refused for passing it alone
    problems = [problem for i in mine for problem in found_of[i]]
    # The ranges the metadata records (each shard's ids were checked against its own above), of every
    # shard: a share job has read its own shards only, and a repeated id may lie in another's.
    held = [(info, info["sample_id_range"]) for info in shards if info["num_samples"]]
    return problems + _shared_id_problems(path, held)


def _shared_id_problems(path: Path, held: list[tuple[dict[str, Any], list[int]]]) -> list[str]:
    """A sample id in two shards, found as (shard, sample_id_range) pairs whose ranges overlap, each
    range checked against its shard's ids (a set of every id held ~1 GB at 10M samples). Shards hold
    contiguous samples (docs/formats/pickle.md; the merge refuses overlapping ranges too), so an
    overlap is a repeated id. Named in the shard whose range starts later."""
    problems, reach = [], -1  # the highest id of the ranges before (ids are whole numbers)
    for info, (lo, hi) in sorted(held, key=lambda pair: pair[1][0]):
        if lo <= reach:
            problems.append(f"{shard_path(path, info)}: duplicate sample_idx within the store")
        reach = max(reach, hi)
    return problems


def stated_width(meta: dict[str, Any]) -> Any:
    """The activations' width metadata.json states: actstore.d_model, else model_params.hidden_size."""
    return meta.get("actstore", {}).get("d_model") or meta["extraction_config"]["model_params"].get("hidden_size")


def _unpadded(meta: dict[str, Any]) -> bool:
    """Whether each activation holds only its sample's tokens: so in a store with our `actstore` block
    (docs/formats/pickle.md), where the spec's example pads them to max_seq_length."""
    return "actstore" in meta


def _shard_threads(shards: list[dict[str, Any]], width: Any) -> int:
    """Shards checked at once: each check holds the file and the arrays (the decompressed pickle streams
    between them), counted as 3x the shard's raw bytes (its recorded rows x width when known, else its
    size), and together they stay within SHARDS_VERIFY_BYTES: one at a time at least, CHECK_THREADS at
    most."""
    return max(1, min(integrity.CHECK_THREADS, SHARDS_VERIFY_BYTES // max(1, 3 * largest_shard_bytes(shards, width))))


def largest_shard_bytes(shards: list[dict[str, Any]], width: Any) -> int:
    """The raw bytes of the largest of `shards`, as metadata.json states them: its recorded rows x `width` x 4
    bytes x its layers where the width is known, or its file's size if more (0: no shard)."""
    return max((max(s["size_bytes"], s.get("num_tokens", 0) * (width or 0) * 4 * len(s["layers"])) for s in shards),
               default=0)


def verify(path: str | Path) -> list[str]:
    """Full integrity check; every problem names its file. Never raises on a bad store."""
    path = Path(path)
    if problems := links_out(path):
        return problems
    try:
        meta = load_metadata(path)
        problems = _verify_metadata(path, meta)
        if problems:  # required fields missing: nothing further can be trusted
            return problems
        problems = _verify_totals(path, meta) + _verify_shards(path, meta)
        return problems + _verify_machines(path, meta) + _unlisted_files(path, meta)
    except FormatError as exc:  # already names its file
        return [str(exc)]
    except Exception as exc:  # a malformed store must yield a report, not a crash
        return [f"{path / METADATA}: {type(exc).__name__}: {exc}"]


# read_vector's last shard read, its content checked, kept while the file is unchanged.
_LAST_SHARD: integrity.LastBuilt[dict] = integrity.LastBuilt()


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """float32 (d,) activation of one token, or None when the store does not hold that coordinate.
    The last shard read stays loaded while its file and recorded checksum are unchanged (_shard). Each
    index must be an integer (vector_indices): True read sample 1 and token True the whole activation."""
    sample_idx, layer_idx, token_idx = vector_indices(sample_idx, layer_idx, token_idx, Path(path))
    meta = checked_metadata(path)
    for info in meta["shards"]:
        lo, hi = info["sample_id_range"]
        if lo <= sample_idx <= hi and layer_idx in info["layers"]:
            shard = _shard(path, meta, info)
            for item in shard[layer_key(layer_idx)]:
                if item["sample_idx"] == sample_idx:
                    # a copy: a view of the shard kept loaded let a caller's change reach every later read
                    act = item["activation"]
                    return np.array(act[token_idx], dtype=np.float32) if 0 <= token_idx < item_tokens(item) else None
    return None


def _shard(path: str | Path, meta: dict[str, Any], info: dict[str, Any]) -> dict:
    """The shard `info` lists, loaded and its content checked as verify checks it (a layer it lacked
    was a bare KeyError, and `actstore validate` crashed on it; a 1-D activation returned a scalar as
    the vector); loaded again only when the file or its recorded checksum changed."""
    file = shard_path(path, info)
    if not file.is_file():
        raise FormatError(f"{file}: shard missing")

    def load() -> dict:
        shard = load_shard(path, info)
        integrity.refuse(_shard_content_problems(file, shard, info, stated_width(meta), _unpadded(meta)))
        return shard

    return _LAST_SHARD.get([file], load, extra=info["checksum"])
