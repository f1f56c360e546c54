"""Check a LUT (the Format interface): metadata fields, every table's size, sha256, keys, shapes,
dtypes and values (no inf or NaN), files the metadata does not list, names that would lead outside the
lut/ directory, and each layer's file named after its layer (the spec's `{layer_path}.lut.safetensors`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from actstore.errors import FormatError
from actstore.formats.lut.layout import (BIAS_KEY, META_FILE, REQUIRED_KEYS, SAFETENSORS_DTYPES, SUFFIX, VERSION,
                                         expected_shapes, layer_index, lut_dir, lut_file)
from actstore.integrity import (DIGESTS, inside, iso_timestamp, links_out, listed_problem, open_regular, problems_of,
                                read_json, version_string, whole_number)
from actstore.safetensors_io import read_header_json

# Bits of a float16 / bfloat16 value with every exponent bit set: +-inf or NaN.
SPECIAL_BITS = {"F16": 0x7C00, "BF16": 0x7F80}
SCAN_VALUES = 1 << 22  # values verify reads of a table at a time (8 MiB): a table can be GBs


def _positive(value: Any) -> bool:
    return whole_number(value) and value > 0


# The spec's optional objects: the fields our writer and other tools put there, and their types.
OPTIONAL_FIELDS: dict[str, list[tuple[str, str, Callable[[Any], bool]]]] = {
    "model_config": [("model_type", "a string", lambda v: isinstance(v, str)),
                     *((key, "a positive whole number", _positive)
                       for key in ("num_layers", "num_attention_heads", "hidden_size"))],
    "creation_info": [("created_at", "an ISO 8601 time", iso_timestamp),
                      *((key, "a string", lambda v: isinstance(v, str))
                        for key in ("source_model", "sae_model", "hook", "format_writer"))],
}


def metadata_problems(meta: Any, meta_path: Path) -> list[str]:
    if not isinstance(meta, dict):
        return [f"{meta_path}: top level is not an object"]
    problems = []
    if not version_string(meta.get("version")):
        problems.append(f"{meta_path}: field 'version' missing or not a version string like \"1.0\", "
                        f"got {meta.get('version')!r:.60}")
    elif meta["version"].partition(".")[0] != VERSION.partition(".")[0]:  # another major may change meanings
        problems.append(f"{meta_path}: field 'version' {meta['version']!r:.60} is not a {VERSION.partition('.')[0]}.x "
                        f"LUT: this reader knows version {VERSION}")
    sae_config = meta.get("sae_config")
    for key in ("num_basis", "k_active"):
        if not isinstance(sae_config, dict) or not whole_number(sae_config.get(key)) or sae_config[key] < 1:
            problems.append(f"{meta_path}: field 'sae_config.{key}' missing or not a positive int")
    if not problems and meta["sae_config"]["k_active"] > meta["sae_config"]["num_basis"]:
        problems.append(f"{meta_path}: sae_config.k_active > sae_config.num_basis")
    problems += optional_field_problems(meta, meta_path)
    layers = meta.get("layers")
    if not isinstance(layers, dict) or not layers:
        return problems + [f"{meta_path}: field 'layers' missing, empty or not an object"]
    for name, entry in layers.items():
        for key in ("input_dim", "output_dim"):
            if not isinstance(entry, dict) or not whole_number(entry.get(key)) or entry[key] < 1:
                problems.append(f"{meta_path}: field 'layers.{name}.{key}' missing or not a positive int")
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            problems.append(f"{meta_path}: field 'layers.{name}.file' missing or not a string")
        elif Path(entry["file"]).name != entry["file"] or not entry["file"].endswith(SUFFIX):
            problems.append(f"{meta_path}: layers.{name}.file {entry['file']!r} must be a bare '*{SUFFIX}' name")
        elif entry["file"] != lut_file(name):  # its own: a swapped or shared entry serves a layer another's table
            problems.append(f"{meta_path}: layers.{name}.file {entry['file']!r} is not {lut_file(name)!r}: the spec "
                            f"names each layer's table after its path ('{{layer_path}}{SUFFIX}')")
        if isinstance(entry, dict) and entry.get("dtype", "float16") not in SAFETENSORS_DTYPES.values():
            problems.append(f"{meta_path}: field 'layers.{name}.dtype' must be one of "
                            f"{sorted(SAFETENSORS_DTYPES.values())}, got {entry['dtype']!r:.60}")
        if isinstance(entry, dict) and not isinstance(entry.get("has_bias", False), bool):
            problems.append(f"{meta_path}: field 'layers.{name}.has_bias' must be true or false, "
                            f"got {entry['has_bias']!r:.60}")
    return problems


def optional_field_problems(meta: dict[str, Any], meta_path: Path) -> list[str]:
    """model_config and creation_info (optional in the spec): each an object, where a field is given of
    its type (OPTIONAL_FIELDS). write_lut checks its caller's before any table is made."""
    problems = []
    for key in ("model_config", "creation_info"):
        if key in meta and not isinstance(meta[key], dict):
            problems.append(f"{meta_path}: field '{key}' is not an object")
        elif key in meta:
            problems += [f"{meta_path}: field '{key}.{field}' must be {want}, got {meta[key][field]!r:.60}"
                         for field, want, ok in OPTIONAL_FIELDS[key] if field in meta[key] and not ok(meta[key][field])]
    return problems


def header_infos(file_path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, safetensors dtype)} from a file's safetensors header (no tensor data); FormatError
    naming the file when it cannot be read."""
    from safetensors import safe_open

    if not file_path.is_file():  # opening a FIFO put in its place would wait for a writer
        raise FormatError(f"{file_path}: missing or not a regular file")
    try:
        with safe_open(str(file_path), framework="numpy") as fh:  # the header alone: no torch needed
            return {key: (tuple(fh.get_slice(key).get_shape()), fh.get_slice(key).get_dtype()) for key in fh.keys()}
    except Exception as exc:  # a truncated or garbled header: safetensors raises its own errors
        raise FormatError(f"{file_path}: unreadable safetensors ({exc})") from None


def table_dtype(file_path: Path) -> str | None:
    """The tables' dtype by its torch name, from the file's header: metadata.json's dtype is our
    extension, which other writers' stores lack. None where the file or its products cannot be read
    or are of another dtype (verify names why)."""
    try:
        infos = header_infos(file_path)
    except FormatError:
        return None
    _, dtype = infos.get("precomputed_products", ((), None))
    return SAFETENSORS_DTYPES.get(dtype)


def table_problems(file_path: Path, meta: dict[str, Any], entry: dict[str, Any]) -> list[str]:
    """Keys, shapes and dtypes of one LUT file, read from its safetensors header (no tensor data)."""
    try:
        infos = header_infos(file_path)
    except FormatError as exc:
        return [str(exc)]
    shapes = expected_shapes(meta["sae_config"]["num_basis"], entry["input_dim"], entry["output_dim"])
    problems = [f"{file_path}: missing key {key!r}" for key in REQUIRED_KEYS if key not in infos]
    dtypes = set()
    for key, (shape, dtype) in infos.items():
        if key not in shapes:
            continue  # unknown extra keys are allowed, never interpreted
        if shape != shapes[key]:
            problems.append(f"{file_path}: key {key!r} has shape {list(shape)}, expected {list(shapes[key])}")
        if dtype not in SAFETENSORS_DTYPES:
            problems.append(f"{file_path}: key {key!r} has dtype {dtype}, expected F16 or BF16")
        dtypes.add(dtype)
    if len(dtypes) > 1:
        problems.append(f"{file_path}: mixed dtypes {sorted(dtypes)}")
    elif "dtype" in entry and dtypes and SAFETENSORS_DTYPES.get(stored := next(iter(dtypes))) != entry["dtype"]:
        problems.append(f"{file_path}: tables are {stored}, metadata.json says dtype {entry['dtype']!r}")
    if "has_bias" in entry and entry["has_bias"] != (BIAS_KEY in infos):
        problems.append(f"{file_path}: {'no ' if entry['has_bias'] else ''}{BIAS_KEY!r} key, metadata.json says "
                        f"has_bias {entry['has_bias']}")
    return problems


def non_finite_problems(file_path: Path) -> list[str]:
    """A problem for each spec key (or target_bias) holding inf or NaN, from the file's bytes read
    SCAN_VALUES at a time (a table can be GBs; no torch): products of a finite SAE and layer weight never
    hold one (precompute refuses an overflow), and one such row makes every token that selects it NaN,
    even at weight 0. verify runs it (a store with no sha256 recorded, as the spec records none, passed
    with such a table), and LutStore.load before a table loads. For a file table_problems passed (F16 or
    BF16 keys); one naming it when it is missing or not a regular file (a FIFO put in its place since)."""
    problems = []
    try:
        fh = open_regular(file_path)
    except FormatError as exc:
        return [str(exc)]
    with fh:
        try:
            header, header_size = read_header_json(fh, os.fstat(fh.fileno()).st_size)
        except ValueError as exc:
            return [f"{file_path}: unreadable safetensors ({exc})"]
        for key in (*REQUIRED_KEYS, BIAS_KEY):
            if key not in header:
                continue
            begin, end = header[key]["data_offsets"]
            fh.seek(8 + header_size + begin)
            mask, count = SPECIAL_BITS[header[key]["dtype"]], 0
            for start in range(0, (end - begin) // 2, SCAN_VALUES):
                bits = np.fromfile(fh, "<u2", min(SCAN_VALUES, (end - begin) // 2 - start))
                count += int(np.count_nonzero(bits & mask == mask))
            if count:
                problems.append(f"{file_path}: key {key!r} holds {count} inf or NaN values")
    return problems


def read_metadata(path: str | Path) -> dict[str, Any]:
    """metadata.json with every spec-required field checked; FormatError names the file and field."""
    meta_path = lut_dir(path) / META_FILE
    meta = read_json(meta_path)
    problems = metadata_problems(meta, meta_path)
    if problems:
        raise FormatError(problems[0])
    return meta


def detect(path: str | Path) -> bool:
    """A lut/ directory (or its parent) with a metadata.json naming sae_config and layers."""
    try:
        meta = read_json(lut_dir(path) / META_FILE)
    except FormatError:
        return False
    return isinstance(meta, dict) and "sae_config" in meta and "layers" in meta


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary for `actstore inspect`: a LUT stores tables, not activations (n_examples is None)."""
    root = lut_dir(path)
    meta = read_metadata(root)
    layers = meta["layers"]
    files = [inside(root, entry["file"], f"{root / META_FILE} layers.{name}.file") for name, entry in layers.items()]
    indices = sorted({i for i in (layer_index(p) for p in layers) if i is not None})
    first = next(iter(layers.values()))
    return {
        "format": "lut", "version": meta["version"],
        "model": meta.get("creation_info", {}).get("source_model"),
        "layers": indices, "targets": sorted(layers), "n_examples": None, "n_tokens": None,
        "d_model": meta.get("model_config", {}).get("hidden_size", first["input_dim"]),
        "dtype": table_dtype(files[0]), "n_shards": len(files),
        "bytes": sum(f.stat().st_size for f in files if f.is_file()) + (root / META_FILE).stat().st_size,
        "num_basis": meta["sae_config"]["num_basis"], "k_active": meta["sae_config"]["k_active"],
        "input_dims": {p: e["input_dim"] for p, e in layers.items()},
        "output_dims": {p: e["output_dim"] for p, e in layers.items()},
    }


def verify(path: str | Path) -> list[str]:
    """Every required field; every listed file inside lut/, not a link out, with its recorded size and
    sha256 (when recorded: other writers may omit them), keys, shapes and dtypes, no inf or NaN value;
    no unlisted table."""
    if problems := links_out(Path(path)):
        return problems
    root = lut_dir(path)
    meta_path = root / META_FILE
    try:
        meta = read_json(meta_path)
    except FormatError as exc:
        return [str(exc)]
    problems = metadata_problems(meta, meta_path)
    if problems:
        return problems

    # The spec records neither size nor sha256 (our writer adds both): presence, keys and shapes then;
    # but where one table has them, every table must (a record removed would switch its check off).
    recorded = any({"bytes", *DIGESTS} & set(entry) for entry in meta["layers"].values())

    def check(layer: tuple[str, dict[str, Any]]) -> list[str]:
        name, entry = layer
        problem = listed_problem(root, entry["file"], entry, f"metadata.json layers.{name}",
                                 f"{meta_path} layers.{name}.file", required=recorded)
        if problem:
            return [problem]
        return table_problems(root / entry["file"], meta, entry) or non_finite_problems(root / entry["file"])

    problems += problems_of(check, meta["layers"].items(), desc="verify LUT tables")
    listed = {entry["file"] for entry in meta["layers"].values()}
    problems += [f"{f}: LUT file not listed in metadata.json" for f in sorted(root.glob(f"*{SUFFIX}"))
                 if f.name not in listed]
    return problems


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """A LUT holds lookup tables, not activations: no (sample, layer, token) vector is stored."""
    return None
