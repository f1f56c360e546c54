"""Format detection, integrity checks and cross-format agreement (the validate stage)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from actstore.casts import bfloat16_bits_to_float32, to_bfloat16_bits
from actstore.config import enabled_stages, import_files
from actstore.errors import FormatError
from actstore.fingerprints import (Fingerprint, StorePasses, Wanted, compared, load_passes, merged,
                                   reference_passes, save_passes, store_passes, wanted_from_json, wanted_json,
                                   wanted_of)
from actstore.formats import FORMAT_STAGES, format_module
from actstore.formats.extract import layer_tensor, open_extraction
from actstore.formats.saev import open_store
from actstore.hashing import stage_dirs
from actstore.integrity import check_share, link_out, read_json, stage_config_problems
from actstore.io_utils import sha256_file, write_json_atomic

log = logging.getLogger(__name__)

DTYPE_CASTS = {"float32": np.float32, "float16": np.float16}


def find_store(directory: Path, name: str) -> Path:
    """The directory holding format `name`, as its reader and verify take it: the stage dir itself
    or one level below it. A saev stage dir points at the store beside it (named by its metadata
    hash): verify given the stage dir checks the store's metadata against the pointer's seal too.
    A link to a directory is never taken for the store: one leading to a good copy elsewhere was
    checked in its place (and read outside the stage) while the stage's own store went unchecked."""
    module = format_module(name)
    for candidate in [directory, *sorted(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink())]:
        if module.detect(candidate):
            return candidate
    raise FormatError(f"{directory}: no {name} store found")


def reference_dtype(dtype: str) -> type:
    if dtype == "bfloat16":
        return lambda x: bfloat16_bits_to_float32(to_bfloat16_bits(x))
    cast = DTYPE_CASTS.get(dtype, np.float32)
    return lambda x: np.asarray(x).astype(cast).astype(np.float32)


def sample_coordinates(extraction, n_coords: int, seed: int) -> list[tuple[int, int, int]]:
    """Seeded (sample_idx, layer, token) triples; each sampled row also gets its last token. The rows
    take the layers in turn (in a seeded order), so every layer is checked once there are as many
    rows as layers: drawn at random, 48 rows missed some of 24 layers at most seeds."""
    rng = np.random.default_rng(seed)
    coords = []
    rows = _sample_rows(extraction, min(n_coords, extraction.n_samples), rng)
    layers = rng.permutation(extraction.info.layers)
    for i, sample_idx in enumerate(rows):
        # The token count the activations hold (offsets.npy, checked as the part opens), not the
        # samples.jsonl row's copy: a wrong copy made the "last token" another, or a token past the end.
        part, local = extraction.locate(int(sample_idx))
        tokens = part.sample_slice(local)
        n_tokens = tokens.stop - tokens.start
        if n_tokens < 1:  # no extraction writes one (offsets.npy edited in place?): numpy's ValueError named nothing
            raise FormatError(f"{part.dir / 'offsets.npy'}: sample_idx {sample_idx} holds no token")
        layer = int(layers[i % len(layers)])
        for token in {int(rng.integers(n_tokens)), n_tokens - 1}:
            coords.append((int(sample_idx), layer, token))
    return coords


def _sample_rows(extraction, n_rows: int, rng: np.random.Generator) -> list[int]:
    """n_rows distinct sample_idx, sorted: a random one of each part holding samples when there are
    as many rows as such parts, the rest at random. Drawn all at random, a few rows of many parts
    left most parts unread, and a store that lacked one part's samples passed."""
    drawn = rng.choice(extraction.n_samples, size=n_rows, replace=False)
    filled = [part for part in extraction.parts if part.info.n_samples]
    if n_rows < len(filled):
        return sorted(int(row) for row in drawn)
    one_each = {part.sample_start + int(rng.integers(part.info.n_samples)) for part in filled}
    rest = [int(row) for row in drawn if int(row) not in one_each][:n_rows - len(one_each)]
    return sorted([*one_each, *rest])


def check_format(name: str, store: Path, extraction, coords,
                 section: dict[str, Any] | None = None) -> dict[str, Any]:
    """verify() + inspect() + what the store holds against what it must (coverage_problems) + every
    coordinate read through the format's reader vs the extraction. `section`: the format's config
    section (None: the defaults, every extracted layer and token). A coordinate the store does not
    hold is a problem, unless the format or section leaves it out by design (`not_stored`, and why
    in `not_stored_why`). A store too broken to open (its metadata unreadable) is a problem too, its
    `inspect` empty and no coordinate read."""
    module = format_module(name)
    problems = module.verify(store)
    section = section or {}
    try:
        info = module.inspect(store)
        problems += coverage_problems(name, store, info, extraction, section)
        dropped = set(open_store(store).dropped_tokens) if name == "saev" else set()
    except FormatError as exc:
        return {"store": str(store), "problems": _stopped(problems, exc), "inspect": {}, "checked": 0,
                "not_stored": 0, "not_stored_why": [], "read_latency_us": []}
    to_stored = reference_dtype(info.get("dtype", "float32"))
    checked, not_stored, why, missing, latencies_us = 0, 0, set(), [], []
    for sample_idx, layer, token in coords:
        started = time.perf_counter()
        try:
            got = _read(module, store, sample_idx, layer, token)
        # A file the reader refused or could not open (a loop of links, a chunk cut short): named with its
        # coordinate, the others still read; raised, it hid every other store's problems.
        except (FormatError, OSError) as exc:
            problems.append(f"{store}: (sample {sample_idx}, layer {layer}, token {token}) not read ({exc})")
            continue
        latencies_us.append((time.perf_counter() - started) * 1e6)
        if got is None:
            if reason := left_out_by_design(name, info, extraction, section, dropped, (sample_idx, layer, token)):
                not_stored, why = not_stored + 1, why | {reason}
            else:
                missing.append(f"(sample {sample_idx}, layer {layer}, token {token})")
            continue
        want = to_stored(extraction.activations(layer_tensor(layer), sample_idx)[token])
        if difference := _difference(np.asarray(got, np.float32), want):
            problems.append(f"{store}: (sample {sample_idx}, layer {layer}, token {token}) differs from "
                            f"the extraction ({difference})")
        checked += 1
    if missing:
        problems.append(f"{store}: does not hold {len(missing)} of the {len(coords)} coordinates read, which the "
                        f"config and the extraction say it holds: {', '.join(missing[:3])}"
                        + (", ..." if len(missing) > 3 else ""))
    return {"store": str(store), "problems": problems, "inspect": info, "checked": checked,
            "not_stored": not_stored, "not_stored_why": sorted(why), "read_latency_us": latencies_us}


def _read(module, store: Path, sample_idx: int, layer: int, token: int) -> np.ndarray | None:
    """The store's vector, None where it holds none: a reader (zarr's) raises IndexError for a
    sample or token past what its store holds, which is then named as missing, not a traceback."""
    try:
        return module.read_vector(store, sample_idx, layer, token)
    except IndexError:
        return None


def _stopped(problems: list[str], exc: FormatError) -> list[str]:
    """A store's problems with the error that stopped its checks (its metadata unreadable), unless verify
    named it already. Raised, it ended validate there: every other store's problems went unreported."""
    return problems if str(exc) in problems else [*problems, str(exc)]


def held_layers(extraction, section: dict[str, Any]) -> list[int]:
    """The layers a format's store must hold: its section's `layers` (saev, lmprobe), else every
    extracted layer."""
    return list(section.get("layers") or extraction.info.layers)


def left_out_by_design(name: str, info: dict[str, Any], extraction, section: dict[str, Any], dropped: set[int],
                       coord: tuple[int, int, int]) -> str | None:
    """Why the format leaves `coord` out of this store by design, None where it must hold it
    (`dropped`: the register tokens a saev store's actstore.json says it leaves out)."""
    sample_idx, layer, token = coord
    if layer not in held_layers(extraction, section):
        return f"layers outside {name}.layers {section.get('layers')}"
    if name == "lmprobe" and section.get("storage") == "pooled" == info.get("storage"):
        part, local = extraction.locate(sample_idx)
        tokens = part.sample_slice(local)
        return "lmprobe.storage pooled holds last tokens only" if token != tokens.stop - tokens.start - 1 else None
    if token in dropped:
        return "register tokens, which saev's upstream layout leaves out (actstore.json dropped_tokens)"
    return None


def coverage_problems(name: str, store: Path, info: dict[str, Any], extraction,
                      section: dict[str, Any]) -> list[str]:
    """What the store's metadata says it holds against what the config and extraction say it must:
    every layer its section lists, every sample of the extraction, every token (where the format
    holds them all). A store written from a subset, or from another config, verifies on its own."""
    if name == "extract":
        return []
    if name == "lmprobe":  # its checks read options the section may leave to the writer's defaults
        from actstore.formats.lmprobe.write import DEFAULTS
        section = {**DEFAULTS, **section}
    missing = [layer for layer in held_layers(extraction, section) if layer not in info["layers"]]
    listed = (f"{name}.layers {section['layers']}" if section.get("layers")
              else f"extract.layers {extraction.info.layers}")
    problems = [f"{store}: holds layers {info['layers']}, lacks layers {missing} the config lists ({listed})"
                ] if missing else []
    tokens = np.concatenate([np.diff(part.offsets) for part in extraction.parts]).astype(np.int64)
    problems += _SAMPLE_CHECKS[name](store, info, tokens, section)
    return problems + (_lmprobe_dtype(store, info, extraction, section) if name == "lmprobe" else [])


def _token_problem(store: Path, what: str, held: np.ndarray, tokens: np.ndarray) -> list[str]:
    """`held`: the tokens the store holds of each of the extraction's samples (by sample_idx)."""
    if np.array_equal(held, tokens):
        return []
    lacking = np.flatnonzero(held != tokens)
    return [f"{store}: {what} of {len(lacking)} of the extraction's {len(tokens)} samples differ from the "
            f"extraction's (first sample_idx {int(lacking[0])}: {int(held[lacking[0]])}, the extraction's "
            f"{int(tokens[lacking[0]])})"]


def _count_problem(store: Path, what: str, held: int, want: int) -> list[str]:
    return [] if held == want else [f"{store}: holds {held} {what}, the extraction {want}"]


def _pickle_samples(store: Path, info: dict[str, Any], tokens: np.ndarray, section: dict[str, Any]) -> list[str]:
    """Every layer's shards together hold every sample (each shard lists its layers and sample count)."""
    from actstore.formats.pickle import load_metadata
    shards = load_metadata(store)["shards"]
    problems = _count_problem(store, "samples (statistics.total_samples)", info["n_examples"], len(tokens))
    if info["n_tokens"] is not None:  # an optional field of the spec's statistics
        problems += _count_problem(store, "tokens (statistics.total_tokens)", info["n_tokens"], int(tokens.sum()))
    for layer in info["layers"]:
        held = sum(shard["num_samples"] for shard in shards if layer in shard["layers"])
        problems += _count_problem(store, f"samples of layer {layer} in its shards", held, len(tokens))
    return problems


def _zarr_samples(store: Path, info: dict[str, Any], tokens: np.ndarray, section: dict[str, Any]) -> list[str]:
    """seq_len of every sample, over the run's stores in order."""
    from actstore.formats.zarr import ZarrRun, open_zarr
    reader = open_zarr(store)
    stores = reader.stores if isinstance(reader, ZarrRun) else [reader]
    held = np.concatenate([s.seq_len for s in stores]).astype(np.int64)
    problems = _count_problem(store, "samples", len(held), len(tokens))
    return problems or _token_problem(store, "seq_len", held, tokens)


def _lmprobe_samples(store: Path, info: dict[str, Any], tokens: np.ndarray, section: dict[str, Any]) -> list[str]:
    """One index row of every sample_idx, in the config's prompt order, its num_tokens the extraction's;
    the storage the config's."""
    from actstore.formats.lmprobe import open_dataset
    dataset = open_dataset(store)
    storage = section["storage"]
    problems = [] if info["storage"] == storage or storage == "pooled" else [
        f"{store}: storage {info['storage']!r} (last tokens only), the config's lmprobe.storage {storage!r}"]
    ids = dataset.sample_idx
    if len(ids) != len(tokens) or not np.array_equal(np.sort(ids), np.arange(len(tokens))):
        return problems + [f"{store}: its index holds {len(ids)} prompts, not one of each sample_idx 0.."
                           f"{len(tokens) - 1} of the extraction"]
    held = np.empty_like(tokens)
    held[ids] = dataset.num_tokens
    return problems + _token_problem(store, "num_tokens", held, tokens) + _lmprobe_order(store, ids, section)


def _lmprobe_order(store: Path, ids: np.ndarray, opts: dict[str, Any]) -> list[str]:
    """The index rows' sample_idx in the order the config's prompt_ordering and seed make. lmprobe's
    verify checks a random order against the seed the store records only: two rows of equal
    num_tokens whose sample_idx were swapped in an "original" store verified, and validate's few
    rows read them (another sample's vectors) at ~1 seed in 5 of 437 samples."""
    from actstore.formats.lmprobe.layout import prompt_order
    order = prompt_order(len(ids), opts["prompt_ordering"], opts["seed"])
    wrong = np.flatnonzero(ids != order)
    if not wrong.size:
        return []
    row = int(wrong[0])
    return [f"{store}: index row {row} holds sample_idx {int(ids[row])}, lmprobe.prompt_ordering "
            f"{opts['prompt_ordering']!r} (seed {opts['seed']}) puts {int(order[row])} there "
            f"({wrong.size} rows differ)"]


def _lmprobe_dtype(store: Path, info: dict[str, Any], extraction, section: dict[str, Any]) -> list[str]:
    """The stored dtype against the config's lmprobe.dtype (auto: the extraction's storage dtype).
    Its vectors are compared rounded to the dtype the store says it holds, so a store written in
    float16 where the config asks float32 matched them."""
    asked = section["dtype"]
    wanted = (extraction.parts[0].tensor(layer_tensor(extraction.info.layers[0])).stored_dtype
              if asked == "auto" else asked)
    return [] if info["dtype"] == wanted else [
        f"{store}: dtype {info['dtype']!r}, the config's lmprobe.dtype {asked!r}"
        + (f" (the extraction's storage dtype {wanted!r})" if asked == "auto" else "")]


def _saev_samples(store: Path, info: dict[str, Any], tokens: np.ndarray, section: dict[str, Any]) -> list[str]:
    """Text: the windows (windows.npy) cover every token of every sample. Images: one example a
    sample, of its tokens but the dropped registers."""
    saev = open_store(store)
    windows = saev.windows
    if windows is None:
        problems = _count_problem(store, "examples", info["n_examples"], len(tokens))
        held = np.full(len(tokens), saev.T + len(saev.dropped_tokens), np.int64)
        return problems or _token_problem(store, "tokens per example", held, tokens)
    inside = (windows[:, 0] >= 0) & (windows[:, 0] < len(tokens))
    held = np.bincount(windows[inside, 0], weights=windows[inside, 2], minlength=len(tokens)).astype(np.int64)
    problems = [] if inside.all() else [f"{store}: windows.npy holds sample_idx outside the extraction's "
                                        f"0..{len(tokens) - 1}"]
    return problems + _token_problem(store, "tokens in windows.npy", held, tokens)


_SAMPLE_CHECKS = {"pickle": _pickle_samples, "zarr": _zarr_samples, "lmprobe": _lmprobe_samples,
                  "saev": _saev_samples}


def _difference(got: np.ndarray, want: np.ndarray) -> str | None:
    """How a store's vector differs from the extraction's, None when it holds the same values. NaN
    equals NaN: a model that overflowed stores NaN, and every faithful copy holds it too."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, the extraction's {list(want.shape)}"
    if np.array_equal(got, want, equal_nan=True):
        return None
    return f"max abs diff {np.max(np.abs(got - want)):.3g}"


def opened(config: dict[str, Any]) -> tuple[Any, list[tuple[int, int, int]]]:
    """The config's extraction, opened, and the coordinates every store is read at (seeded: each
    validate job draws the same)."""
    extraction = open_extraction(stage_dirs(config)["extract"], config["extract"]["parts"])
    return extraction, sample_coordinates(extraction, config["validate"]["n_coords"], config["validate"]["seed"])


def stored_formats(config: dict[str, Any]) -> list[str]:
    """The formats whose stores the config writes, in chain order: a validate job checks each."""
    return [name for name in FORMAT_STAGES if name in enabled_stages(config)]


def check_store(config: dict[str, Any], name: str, extraction, coords,
                share: tuple[int, int] = (0, 1)) -> tuple[dict[str, Any], StorePasses | None]:
    """Format `name`'s store (a validate_store job): check_format's entry and its views' fingerprints
    (None where check_format could not open it: its entry names why). `share`: (share, shares), the part
    of its files and rows this job checks (integrity.check_share); share 0 reads the sampled coordinates."""
    store = find_store(stage_dirs(config)[name], name)
    with check_share(*share):
        entry = check_format(name, store, extraction, coords if share[0] == 0 else [], config.get(name))
        log.info("%s: %d checked, %d not stored, %d problems", name, entry["checked"], entry["not_stored"],
                 len(entry["problems"]))
        if not entry["inspect"]:
            return entry, None
        return entry, store_passes(name, store, entry["inspect"].get("dtype", "float32"), extraction,
                                   config["validate"]["seed"])


def check_extraction(config: dict[str, Any], extraction, coords,
                     share: tuple[int, int] = (0, 1)) -> tuple[dict[str, Any], dict[Wanted, Any] | str]:
    """The extraction (the validate_extract job): check_format's entry, and its fingerprints of the rows
    every store's views must hold, in one pass (reference_passes), or why they were not read; of the
    parts of `share` (as check_store's)."""
    dirs = stage_dirs(config)
    with check_share(*share):
        entry = check_format("extract", dirs["extract"], extraction, coords if share[0] == 0 else [])
        return entry, reference_passes(extraction, _wanted_rows(config, extraction), config["validate"]["seed"],
                                       reference_dtype)


def _wanted_rows(config: dict[str, Any], extraction) -> list[Wanted]:
    """The extraction's rows every view of the config's stores must equal (fingerprints.wanted_of)."""
    dirs = stage_dirs(config)
    stores = {}
    for name in stored_formats(config):
        store = find_store(dirs[name], name)
        try:  # a store too broken to open is its own job's to name; it has no fingerprint
            stores[name] = (store, format_module(name).inspect(store).get("dtype", "float32"))
        except FormatError:
            continue
    return wanted_of(stores, extraction)


def write_report(config: dict[str, Any], n_coords: int, extract_entry: dict[str, Any],
                 reference: dict[Wanted, Any] | str, stores: dict[str, tuple[dict[str, Any], StorePasses | None]],
                 report_path: str | Path) -> dict[str, Any]:
    """The validate_stores job: every store's entry with its fingerprints compared with the extraction's,
    the sae and lut stages' own checks and every stage's seal; report.json written, or FormatError
    raised naming every problem."""
    dirs, stages = stage_dirs(config), enabled_stages(config)
    report: dict[str, Any] = {"coordinates": n_coords, "formats": {"extract": extract_entry}}
    for name, (entry, passes) in stores.items():
        report["formats"][name] = entry
        if passes is not None:
            result = compared(Path(entry["store"]), passes, reference)
            entry["fingerprint"], entry["problems"] = result["views"], entry["problems"] + result["problems"]
            log.info("%s: every vector compared, %s rows read, %d problems", name, result["views"],
                     len(result["problems"]))
    for name in ("sae", "lut"):
        if name in stages:
            report[name] = stage_report(dirs[name])
    if "lut" in stages:  # the sae stage is enabled wherever the lut stage is (enabled_stages)
        report["formats"]["lut"] = check_lut(find_store(dirs["lut"], "lut"), dirs["sae"])
    for entry in report["formats"].values():
        # Paths relative to dump_to, so the report does not depend on where the run lived.
        entry["store"] = os.path.relpath(entry["store"], config["dump_to"])
        entry["inspect"] = {key: _relative(value, config["dump_to"]) for key, value in entry["inspect"].items()}
    problems = [p for entry in report["formats"].values() for p in entry["problems"]]
    problems += sae_import_problems(config, report.get("sae"), dirs["sae"]) if "sae" in stages else []
    problems += [p for stage in stages if stage != "validate"
                 for p in stage_config_problems(dirs[stage], required=True)]
    if problems:
        raise FormatError("validation failed:\n" + "\n".join(problems))
    write_json_atomic(report_path, report)
    return report


def validate_all(config: dict[str, Any], report_path: str | Path) -> dict[str, Any]:
    """Check every format the config produces, in this process (the validate stage's jobs, one at a time);
    write report.json, raise FormatError on any problem."""
    extraction, coords = opened(config)
    stores = {name: check_store(config, name, extraction, coords) for name in stored_formats(config)}
    entry, reference = check_extraction(config, extraction, coords)
    return write_report(config, len(coords), entry, reference, stores, report_path)


# The validate jobs' results, a file each (fingerprints.save_passes): the scattered stage's hand-over.

def save_store_check(path: str | Path, entry: dict[str, Any], passes: StorePasses | None) -> None:
    views = [] if passes is None else passes.views
    meta = {"entry": entry, "opened": passes is not None, "error": passes.error if passes else None,
            "views": [{"label": label, "wanted": wanted_json(wanted), "error": mine if isinstance(mine, str) else None}
                      for label, wanted, mine in views]}
    save_passes(path, meta, {str(i): mine for i, (_, _, mine) in enumerate(views) if not isinstance(mine, str)})


def load_store_checks(paths: list[str | Path]) -> tuple[dict[str, Any], StorePasses | None]:
    """The entry and views' fingerprints of one store from its share jobs' files (in share order), as one job
    would have left them: share 0's entry with every job's problems, each once (a check of the store's
    metadata repeats in every job), and each view's fingerprints merged."""
    checks = [load_store_check(path) for path in paths]
    entry = {**checks[0][0], "problems": _each_once(p for found, _ in checks for p in found["problems"])}
    passes = [found for _, found in checks]
    if any(found is None for found in passes):  # the store unopened: its entry names why
        return entry, None
    if error := next((found.error for found in passes if found.error), None):
        return entry, StorePasses([], error)
    views = [(label, wanted, _merged_or_why([found.views[i][2] for found in passes]))
             for i, (label, wanted, _) in enumerate(passes[0].views)]
    return entry, StorePasses(views)


def _merged_or_why(prints: list[Fingerprint | str]) -> Fingerprint | str:
    """The share jobs' fingerprints of one view merged, or the first job's reason it was not read."""
    return next((found for found in prints if isinstance(found, str)), None) or merged(prints)


def _each_once(problems: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(problems))


def load_store_check(path: str | Path) -> tuple[dict[str, Any], StorePasses | None]:
    meta, prints = load_passes(path)
    if not meta["opened"]:
        return meta["entry"], None
    views = [(view["label"], wanted_from_json(view["wanted"]), view["error"] or prints[str(i)])
             for i, view in enumerate(meta["views"])]
    return meta["entry"], StorePasses(views, meta["error"])


def save_extraction_check(path: str | Path, n_coords: int, entry: dict[str, Any],
                          reference: dict[Wanted, Any] | str) -> None:
    prints = {} if isinstance(reference, str) else reference
    meta = {"coordinates": n_coords, "entry": entry, "error": reference if isinstance(reference, str) else None,
            "wanted": [wanted_json(wanted) for wanted in prints]}
    save_passes(path, meta, {str(i): fingerprint for i, fingerprint in enumerate(prints.values())})


def load_extraction_checks(paths: list[str | Path]) -> tuple[int, dict[str, Any], dict[Wanted, Any] | str]:
    """The extraction's check from its share jobs' files (in share order), as load_store_checks merges a store's."""
    checks = [load_extraction_check(path) for path in paths]
    n_coords, entry, _ = checks[0]
    entry = {**entry, "problems": _each_once(p for _, found, _ in checks for p in found["problems"])}
    references = [reference for _, _, reference in checks]
    if error := next((found for found in references if isinstance(found, str)), None):
        return n_coords, entry, error
    return n_coords, entry, {wanted: merged([found[wanted] for found in references]) for wanted in references[0]}


def load_extraction_check(path: str | Path) -> tuple[int, dict[str, Any], dict[Wanted, Any] | str]:
    meta, prints = load_passes(path)
    reference = meta["error"] or {wanted_from_json(w): prints[str(i)] for i, w in enumerate(meta["wanted"])}
    return meta["coordinates"], meta["entry"], reference


def sae_import_problems(config: dict[str, Any], sae_report: dict[str, Any] | None, sae_dir: Path) -> list[str]:
    """The files the config's sae.import names (config.import_files: read from the config, never from
    a path the report gives) against the sha256 the sae stage recorded of what it read (import_sha256).
    The stage hash names their path only: a file replaced since (outside Snakemake, which reruns the
    stage when it is newer) leaves an SAE and a LUT of other weights that verify. A report written
    before the sha256 was recorded has none to compare (its seal covers it)."""
    imported = config["sae"].get("import")
    recorded = (sae_report or {}).get("import_sha256")
    if not imported or recorded is None:
        return []
    where = sae_dir / "report.json"
    if not isinstance(recorded, dict):
        return [f"{where}: import_sha256 {recorded!r:.60} is not an object of file sha256s"]
    problems = []
    for path in import_files(**imported):
        if str(path) not in recorded:
            problems.append(f"{where}: import_sha256 has no record of {path}, which sae.import reads")
        elif not path.is_file():
            problems.append(f"{path}: missing; the sae stage ({where}) was built from it")
        elif sha256_file(path) != recorded[str(path)]:
            problems.append(f"{path}: not the bytes the sae stage imported (import_sha256 in {where}): the "
                            "SAE and its LUT are of other weights; rerun the sae stage")
    return problems


def check_lut(store: Path, sae_dir: Path) -> dict[str, Any]:
    """verify() + inspect() of the LUT, and the SAE it was built from against the sae stage's
    (lut_sae_problems); `notes`: what could not be checked, which is no failure."""
    module = format_module("lut")
    problems = module.verify(store)
    sae_problems, notes = lut_sae_problems(store, sae_dir)
    for note in notes:
        log.warning("lut: %s", note)
    try:
        info = module.inspect(store)
    except FormatError as exc:
        info, problems = {}, _stopped(problems, exc)
    return {"store": str(store), "problems": problems + sae_problems, "inspect": info, "notes": notes}


def lut_sae_problems(store: Path, sae_dir: Path) -> tuple[list[str], list[str]]:
    """(problems, notes): the sha256 the LUT's creation_info records of the SAE it was built from must
    be that of the sae stage's sae.safetensors. The stage directories are named by config hashes, not
    by output bytes, so a rerun sae stage (GPU training is not bit-reproducible) leaves another SAE
    beside a LUT that verifies. A LUT written before the sha256 was recorded is noted, not failed, as
    verify passes a table whose sha256 another writer did not record."""
    from actstore.formats.lut import META_FILE, lut_dir, read_metadata
    from actstore.lut import SAE_SHA256
    from actstore.sae import SAE_FILE

    meta_path, sae_file = lut_dir(store) / META_FILE, sae_dir / SAE_FILE
    try:
        info = read_metadata(store).get("creation_info", {})
    except FormatError:  # verify names what is wrong with it
        return [], []
    if SAE_SHA256 not in info:
        return [], [f"creation_info.{SAE_SHA256} absent (a LUT written before actstore recorded it): "
                    f"not checked against the sae stage's {SAE_FILE}"]
    if not sae_file.is_file():
        return [f"{sae_file}: missing, so the SAE of the LUT of {meta_path} is not checked"], []
    actual = sha256_file(sae_file)
    if info[SAE_SHA256] != actual:
        return [f"{meta_path}: creation_info.{SAE_SHA256} {info[SAE_SHA256]!r:.70} is not the sha256 of "
                f"{sae_file} ({actual}): the LUT was built from another SAE"], []
    return [], []


def _relative(value: Any, root: str) -> Any:
    """A path string under `root` made relative to it; anything else unchanged."""
    absolute_root = os.path.abspath(root)
    if isinstance(value, str) and os.path.isabs(value) and value.startswith(absolute_root + os.sep):
        return os.path.relpath(value, absolute_root)
    return value


def stage_report(directory: Path) -> dict[str, Any] | None:
    """A stage's own report.json (SAE training curve, LUT errors), if it wrote one; read strictly
    (read_json), and a link out of the stage directory is named, never read (validate copies the
    report into its own, and the stage's seal is checked only after)."""
    path = directory / "report.json"
    if problem := link_out(directory, path):
        raise FormatError(f"{problem}: not read")
    report = read_json(path) if path.is_file() else None
    if report is not None and not isinstance(report, dict):
        raise FormatError(f"{path}: holds {type(report).__name__} {report!r:.40}, not a report's JSON object")
    return report


def validate_summary(directory: Path) -> dict[str, Any]:
    """`actstore inspect` of a validate stage directory, which holds no format's store: what its
    report.json says of the stores it checked (each one's sampled coordinates and problems)."""
    report = stage_report(directory)
    formats = report.get("formats") if report else None
    if not isinstance(formats, dict) or not all(isinstance(entry, dict) for entry in formats.values()):
        raise FormatError(f"{directory / 'report.json'}: no 'formats' object of stores; not a validate stage's report")
    problems = {name: entry.get("problems") or [] for name, entry in formats.items()}
    if not all(isinstance(found, list) for found in problems.values()):
        raise FormatError(f"{directory / 'report.json'}: a store's 'problems' is not a list")
    return {"format": "validate", "stores": ", ".join(formats), "coordinates": report.get("coordinates"),
            "problems": sum(map(len, problems.values())),
            "checked": {name: {"store": entry.get("store"), "checked": entry.get("checked"),
                               "problems": problems[name]} for name, entry in formats.items()}}


def sae_summary(directory: Path) -> dict[str, Any]:
    """`actstore inspect` of an sae stage directory, which holds no format's store: the SAE its
    checkpoint's header and report.json describe (read without torch), and its SAELens copy."""
    from actstore.safetensors_io import read_header_json

    checkpoint = directory / "sae.safetensors"
    if not checkpoint.is_file():
        raise FormatError(f"{directory}: no sae.safetensors; not an sae stage directory")
    with open(checkpoint, "rb") as fh:  # parsed here: the library's SafetensorError was a traceback
        try:
            tensors = read_header_json(fh, checkpoint.stat().st_size)[0]
        except ValueError as exc:
            raise FormatError(f"{checkpoint}: {exc}") from None
    header = tensors.get("__metadata__") if isinstance(tensors, dict) else None
    if not isinstance(header, dict):
        header = {}
    report = stage_report(directory) or {}
    held = report.get("heldout") or {}
    if not isinstance(held, dict):
        raise FormatError(f"{directory / 'report.json'}: heldout {held!r:.40} is not an object of measures")
    saelens = directory / "saelens"
    return {"format": "sae", "model": header.get("model"), "hook": header.get("hook"),
            "d_in": _whole(header.get("d_in")), "num_basis": _whole(header.get("num_basis")),
            "k_active": _whole(header.get("k_active")), "source": header.get("source"),
            "heldout_fvu": held.get("fvu"), "heldout_dead_fraction": held.get("dead_fraction"),
            "saelens": str(saelens) if saelens.is_dir() else None, "bytes": checkpoint.stat().st_size}


def _whole(text: str | None) -> int | str | None:
    """A safetensors header value (always a string) as the count it holds."""
    return int(text) if isinstance(text, str) and text.isdigit() else text
