"""The Format protocol for saev stores (detect / inspect / verify / read_vector) and the full
integrity check behind `actstore verify`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from actstore.errors import FormatError
from actstore.formats.saev.layout import (FAMILIES, LABELS, METADATA, POINTER, SEALED, SHARDS, SIDECAR,
                                          UPSTREAM_FIELDS, UPSTREAM_SHARD_FIELDS, WINDOWS, decode_data,
                                          protocol_problem, store_name)
from actstore.formats.saev.read import SaevStore, open_store, resolve
from actstore.integrity import (SEAL_KEY, LastBuilt, dir_bytes, file_problem, links_out, listed_problem, problems_of,
                                read_json, refuse, seal_problems, unlisted)


def detect(path: str | Path) -> bool:
    """Does `path` hold a saev store (or point at one)?"""
    try:
        store_dir = resolve(path)
    except FormatError:
        return False
    return (store_dir / METADATA).is_file() and (store_dir / SHARDS).is_file()


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary of a store for `actstore inspect`; FormatError naming each link out of the store (the
    one a stage dir's pointer leads to included): nothing outside it is read."""
    refuse(links_out(resolve(path)))
    store = SaevStore(path, check_sizes=False)
    md = store.metadata
    windows = store.windows
    return {
        "format": "saev", "flavor": store.flavor, "protocol": md["protocol"], "path": str(store.dir), "hash": store.dir.name,
        "model": md["ckpt"], "family": md["family"], "layers": md["layers"], "n_examples": md["n_examples"],
        "n_tokens": int(windows[:, 2].sum()) if windows is not None else md["n_examples"] * store.T,
        "d_model": md["d_model"], "dtype": md["dtype"], "n_shards": len(store.shards),
        "bytes": dir_bytes(store.dir), "patches_per_ex": md["patches_per_ex"], "cls_token": md["cls_token"],
        "tokens_per_ex": store.T, "examples_per_shard": store.examples_per_shard,
        "patches_per_shard": md["patches_per_shard"], "dataset": md["dataset"],
        "has_labels": (store.dir / LABELS).is_file(), "text_windows": windows is not None,
    }


def verify(path: str | Path) -> list[str]:
    """Full integrity check; a list of problems each naming its file (empty = clean). Never raises."""
    if problems := links_out(Path(path)):
        return problems
    try:
        store_dir = resolve(path)  # reads saev.json alone, inside `path`
        if store_dir.resolve() != Path(path).resolve() and (problems := links_out(store_dir)):
            return problems  # the store saev.json points at, checked before any of it is read
        store = SaevStore(path, check_sizes=False)
    except (FormatError, OSError) as exc:
        return [str(exc)]
    problems = _verify_name(store) + _verify_upstream_keys(store) + _verify_protocol(store)
    problems += _verify_pointer_seal(Path(path), store.dir)
    try:
        description = _data_description(store)
    except FormatError as exc:
        description = None
        problems.append(f"{store.dir / METADATA}: {exc}")
    if _planned(description) and not store.sidecar:
        problems.append(_missing_sidecar(store))
    elif store.sidecar:
        problems += _verify_provenance(store, description)
    problems += store.size_problems() + _verify_shard_checksums(store) + _verify_sidecar_files(store, description)
    problems += _verify_labels_size(store)
    # labels.bin is the spec's (§1): a store saev wrote holds it with no record
    listed = {METADATA, SHARDS, SIDECAR, LABELS, *(s["name"] for s in store.shards), *_recorded(store)}
    return problems + unlisted(store.dir, listed, f"{SHARDS} or {SIDECAR}")


def _verify_name(store: SaevStore) -> list[str]:
    """The directory is named by the metadata hash of its flavor (config drift otherwise)."""
    want = store_name(store.file_metadata)
    have = "/".join(store.dir.parts[-len(Path(want).parts):])
    if have == want:
        return []
    return [f"{store.dir / METADATA}: its hash {want!r} does not match the directory name {have!r} (config drift)"]


def _verify_upstream_keys(store: SaevStore) -> list[str]:
    """Each key of an upstream store that saev's Metadata(**dct) or Shard(**entry) raises TypeError on: the
    directory name hashes saev's fields alone and our readers skip other keys, so nothing else notices."""
    if store.flavor != "upstream":
        return []  # a spec store's shards.json held sha256 before the checksums moved to actstore.json
    refused = [f"{store.dir / METADATA}: key {key!r} is not one of saev's Metadata fields "
               f"(saev's Metadata.load raises TypeError on it)" for key in store.file_metadata
               if key not in UPSTREAM_FIELDS]
    return refused + [f"{store.dir / SHARDS}: entry {i} ({shard['name']}) key {key!r} is not one of saev's Shard "
                      f"fields {', '.join(UPSTREAM_SHARD_FIELDS)} (saev's ShardInfo.load raises TypeError on it)"
                      for i, shard in enumerate(store.shards) for key in shard if key not in UPSTREAM_SHARD_FIELDS]


def _verify_protocol(store: SaevStore) -> list[str]:
    """A major protocol version this reader does not know: opening only warns (spec §5), but every
    vector is then found by this version's arithmetic, which such a store may not follow."""
    problem = protocol_problem(store.metadata["protocol"])
    return [f"{store.dir / METADATA}: {problem}"] if problem else []


def _verify_pointer_seal(path: Path, store_dir: Path) -> list[str]:
    """The store's metadata files against the seal of the workflow pointer `path` led through
    (write_pointer), each listed and each of the bytes recorded; a store given by its own path, or
    a pointer written before pointers sealed, has none to check."""
    pointer = path / POINTER if path.is_dir() else path
    if pointer.name != POINTER or not pointer.is_file() or store_dir.resolve() == path.resolve():
        return []
    record = read_json(pointer)
    if SEAL_KEY not in record:
        return []
    sealed = record[SEAL_KEY]
    problems = [f"{pointer} ({SEAL_KEY}): {name!r} is not one of the store's metadata files {', '.join(SEALED)}"
                for name in (sealed if isinstance(sealed, dict) else ()) if name not in SEALED]
    present = [name for name in SEALED if (store_dir / name).is_file()]
    return problems + seal_problems(store_dir, sealed, pointer, present)


def _data_description(store: SaevStore) -> Any:
    """metadata.json's `data` decoded, or None for a store saev wrote (no sidecar: its `data` pickles
    saev's dataset classes, never unpickled here). FormatError where a store with a sidecar holds a
    `data` that does not decode (ours pickle a plain dict)."""
    try:
        return decode_data(store.metadata["data"])
    except FormatError:
        if store.sidecar:
            raise
        return None


def _planned(description: Any) -> bool:
    """Whether `data` says the store was planned from an extraction (write.plan_store: "source":
    "actstore"), so its writer recorded every file's size and sha256 in actstore.json."""
    return isinstance(description, dict) and description.get("source") == "actstore"


def _missing_sidecar(store: SaevStore) -> str:
    """The problem of a store planned from an extraction without its file records: without them no
    shard's sha256 is checked, and any byte could change (saev's own stores have none to check)."""
    path = store.dir / SIDECAR
    return (f"{path}: {'empty' if path.is_file() else 'missing'}, but {store.dir / METADATA} data says the "
            f"store was planned from an extraction (source 'actstore'), whose writer records every shard's "
            f"sha256 there: no shard can be checked")


def _verify_provenance(store: SaevStore, description: Any) -> list[str]:
    """actstore.json's source_extraction and model_type against metadata.json, which the store's name
    hashes, where the store was planned from an extraction (write.plan_store: `data` from
    "source": "actstore", written with both): `data` holds the extraction's hash, and the family was
    named from the model_type (a text store keeps it; an image store maps it through FAMILIES, or kept
    it before its mapping was added). The pointer's seal is their only other record, and a store given
    by its own path has none."""
    if not _planned(description):
        return []  # a raw store (write_raw_store): its sidecar is the caller's
    sidecar, where = store.sidecar, store.dir / SIDECAR
    problems = [f"{where}: field {key!r} missing (written with every store planned from an extraction)"
                for key in ("source_extraction", "model_type") if key not in sidecar]
    if problems:
        return problems
    if sidecar["source_extraction"] != description.get("extract_hash"):
        problems.append(f"{where}: source_extraction {sidecar['source_extraction']!r:.80} is not the extraction "
                        f"{store.dir / METADATA} names in data ({description.get('extract_hash')!r:.80})")
    model_type, family = sidecar["model_type"], store.metadata["family"]
    image = description.get("modality") == "image"
    if not isinstance(model_type, str) or family not in {model_type, FAMILIES.get(model_type) if image else None}:
        problems.append(f"{where}: model_type {model_type!r:.80} does not name family {family!r} "
                        f"of {store.dir / METADATA}")
    return problems


def _recorded(store: SaevStore) -> dict[str, Any]:
    """actstore.json's {file: {bytes, sha256}}; a store saev wrote has none."""
    return store.sidecar.get("files", {})


def _verify_shard_checksums(store: SaevStore) -> list[str]:
    """Each shard of the right size against its sha256: in actstore.json, or in shards.json for stores
    written before the checksums moved. Stores without actstore.json (saev's) have none to check."""
    files = _recorded(store)

    def check(i: int) -> list[str]:
        shard = store.shards[i]
        path, record = store.dir / shard["name"], files.get(shard["name"])
        source = SIDECAR if record else SHARDS
        record = record or ({"sha256": shard["sha256"]} if "sha256" in shard else None)
        if record is None:
            return [f"{store.dir / SIDECAR}: {shard['name']} has no sha256"] if store.sidecar else []
        if path.is_file() and path.stat().st_size in store.allowed_bytes(i):
            return [problem] if (problem := file_problem(path, record, source)) else []
        return []  # missing or of the wrong size: _verify_sizes names it

    return problems_of(check, range(len(store.shards)), desc="verify saev shards")


def _verify_sidecar_files(store: SaevStore, description: Any) -> list[str]:
    """windows.npy / labels.bin against actstore.json (the shards are _verify_shard_checksums'). A text
    store is one `data` says was planned from a text extraction: a family outside our image lists is
    also a store saev wrote of a family it added since, or an image model FAMILIES does not map."""
    problems = []
    shards = {shard["name"] for shard in store.shards}
    files = {name: info for name, info in _recorded(store).items() if name not in shards}
    for name, info in files.items():
        if problem := listed_problem(store.dir, name, info, SIDECAR, str(store.dir / SIDECAR)):
            problems.append(problem)
    if store.sidecar and (store.dir / LABELS).is_file() and LABELS not in files:
        problems.append(f"{store.dir / LABELS}: no sha256 recorded in {SIDECAR}")
    if _planned(description) and description.get("modality") == "text" and WINDOWS not in files:
        problems.append(f"{store.dir / WINDOWS}: text store without a recorded windows.npy")
    if (store.dir / WINDOWS).is_file() and not problems:  # read as the text store's index whether recorded or not
        try:
            store.windows  # read and checked (SaevStore.windows)
        except FormatError as exc:
            return [str(exc)]
    return problems


def _verify_labels_size(store: SaevStore) -> list[str]:
    """labels.bin against n_examples x patches_per_ex uint8: a store saev wrote records no size, and
    actstore.json's record only says the file is unchanged since it was written."""
    path = store.dir / LABELS
    want = store.n_examples * store.patches_per_ex
    if not path.is_file() or path.stat().st_size == want:
        return []
    return [f"{path}: {path.stat().st_size} bytes, expected {want} (uint8 n_examples {store.n_examples} "
            f"x patches_per_ex {store.patches_per_ex} of {store.dir / METADATA})"]


# read_vector's last opened store, kept while the files opening it reads are unchanged. Validation
# reads many coordinates of one store, and opening it stats every shard (size_problems): tens of
# millions of stats for 10,000 shards on a cluster file system.
_OPENED: LastBuilt[SaevStore] = LastBuilt()
_KEY_FILES = (METADATA, SHARDS, SIDECAR, WINDOWS)  # what opening a store reads


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """(d,) float32 activation of dataset row sample_idx, block layer_idx, token token_idx, or None.
    The last store opened stays open while its metadata files are unchanged (_opened); the shard read is
    checked on each call, as opening checks every shard."""
    store = _opened(path)
    if layer_idx not in store.layers:
        return None
    where = store.find(sample_idx, token_idx)
    if where is None:
        return None
    if problem := store.shard_problem(where[0] // store.examples_per_shard):
        raise FormatError(problem)  # missing, resized or linked out since the store was opened
    return store.vector(where[0], layer_idx, where[1])


def _opened(path: str | Path) -> SaevStore:
    """The store at `path`, opened again only when one of the files opening it reads changed."""
    store_dir = resolve(path)
    return _OPENED.get([store_dir / name for name in _KEY_FILES], lambda: open_store(path))
