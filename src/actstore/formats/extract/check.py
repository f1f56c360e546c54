"""Check an extraction (the Format interface): every part extract.json lists, every file each
part.json lists with its size and sha256, nothing unlisted, no name leading outside a part."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import numpy as np

from actstore.errors import FormatError
from actstore.formats.extract.layout import COUNT_KEYS, CUT_FIELD, INDEX, PART_META, layer_tensor, part_dirs
from actstore.formats.extract.read import Part, open_extraction, open_part
from actstore.formats.extract.write import index_of
from actstore.integrity import file_problem, in_share, inside, links_out, read_json, vector_indices, whole_number
from actstore.model_identity import INDEX_FIELDS, MODEL_FILES_KEY, PART_FIELDS, moved_files, well_formed


def detect(path: str | Path) -> bool:
    """An extraction stage directory (part-NNNN/part.json: any part, as the parts of a running
    extraction finish in any order) or a single part directory."""
    path = Path(path)
    return (path / PART_META).is_file() or any((part / PART_META).is_file() for part in part_dirs(path))


def _part_dirs(path: Path) -> list[Path]:
    return [path] if (path / PART_META).is_file() else part_dirs(path)


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary of an extraction (all parts) for `actstore inspect`; `unfinished` says how many parts
    an extraction without extract.json (running, or cut short) holds of how many."""
    path = Path(path)
    parts = [open_part(p) for p in _part_dirs(path)]
    info = parts[0].info
    # Read through Part.tensor, which checks the record and header are (tokens, width) in a storage dtype
    # (a 1-D record crashed this with a bare IndexError), from a part holding tokens (an empty one has no files)
    first_layer = next((p.tensor(layer_tensor(info.layers[0])) for p in parts if p.info.n_tokens), None)
    unfinished = not (path / PART_META).is_file() and not (path / INDEX).is_file()
    return {
        "format": "actstore-extract", "model": info.model.name, "layers": info.layers,
        "hooks": info.hooks, "n_examples": sum(p.info.n_samples for p in parts),
        "n_tokens": sum(p.info.n_tokens for p in parts),
        "d_model": first_layer.shape[1] if first_layer is not None else None,
        "dtype": first_layer.stored_dtype if first_layer is not None else "float32",
        "n_shards": len(parts),
        "bytes": sum(info["bytes"] for p in parts for info in p.meta["files"].values()),
        # part.json's counts, when any: the float16 overflows, the model's own NaN and +-inf
        **{key: sum(p.meta.get(key) or 0 for p in parts) for key in COUNT_KEYS},
        # texts cut at max_seq_length (part.json; None where a part does not know: images, older parts)
        "n_truncated_samples": _total(p.meta.get("n_truncated_samples") for p in parts),
        **({"unfinished": f"{len(parts)} of {info.parts} parts, no {INDEX}: still running or cut short, "
                          "the counts above are those parts'"} if unfinished else {}),
    }


def _total(counts: Iterable[int | None]) -> int | None:
    counts = list(counts)
    return None if None in counts else sum(counts)


def verify(path: str | Path) -> list[str]:
    """Every part extract.json lists present with its part.json (a stage directory without
    extract.json is a problem), every part's files present with the recorded size and sha256 and
    nothing unlisted, each samples.jsonl line the row and token count its part's sample_range and
    offsets give (a row marked truncated holding max_seq_length tokens, as many marked as part.json counts),
    the parts covering the dataset's rows in order; problems name the file."""
    path = Path(path)
    if problems := links_out(path):
        return problems
    single = (path / PART_META).is_file()
    problems = [] if single else _index_problems(path) if (path / INDEX).is_file() else [
        f"{path / INDEX}: missing (it lists the parts, so that a deleted part is named)"]
    for position, part_dir in enumerate(_part_dirs(path)):
        if not in_share(position):  # another validate share job's part
            continue
        try:
            part = open_part(part_dir)
            part.verify()
            problems += _sample_row_problems(part)
        except (FormatError, OSError, ValueError) as exc:
            problems.append(str(exc))
    return problems or ([] if single or not in_share(0) else _summary_problems(path))


def _sample_row_problems(part: Part) -> list[str]:
    """samples.jsonl's line i against what the readers use: dataset row sample_range[0] + i, of
    offsets[i + 1] - offsets[i] tokens. The readers find a sample by sample_range and offsets.npy, while
    the Zarr and pickle writers copy each line's sample_idx and num_tokens: a line that disagrees
    (hashed as written, so its sha256 passes) would be stored as another row's id or length."""
    lengths = np.diff(part.offsets)
    label_ids = {label: i for i, label in enumerate(part.info.dataset.labels)}
    cut = 0
    for local, row in enumerate(part.samples):
        want, n_tokens = part.sample_start + local, row.get("num_tokens")
        if row["sample_idx"] != want or not (whole_number(n_tokens) and n_tokens == lengths[local]):
            return [f"{part.samples.path}: line {local + 1} says sample_idx {row['sample_idx']} of "
                    f"{n_tokens!r:.40} tokens, where {PART_META}'s sample_range and offsets.npy say sample_idx "
                    f"{want} of {lengths[local]} tokens"]
        if not _label_id_fits(row, label_ids):
            return [f"{part.samples.path}: line {local + 1} says label_id {row.get('label_id')!r:.40} for label "
                    f"{row.get('label')!r:.60}, which is not its position in {PART_META}'s dataset.labels"]
        if CUT_FIELD in row and n_tokens != part.info.max_seq_length:
            return [f"{part.samples.path}: line {local + 1} says {CUT_FIELD} (cut at max_seq_length "
                    f"{part.info.max_seq_length}), but holds {n_tokens} tokens"]
        cut += CUT_FIELD in row
    return _cut_count_problems(part, cut)


def _cut_count_problems(part: Part, cut: int) -> list[str]:
    """The rows marked cut (`cut`) against part.json's n_truncated_samples: equal, or none marked in a
    part that counts some (written before rows were marked: lmprobe then leaves those rows' flag null).
    A part that cannot tell (images, a slow tokenizer) marks none."""
    recorded = part.info.n_truncated_samples
    if not cut or cut == recorded:
        return []
    return [f"{part.samples.path}: {cut} rows say {CUT_FIELD}, where {PART_META}'s n_truncated_samples says "
            f"{recorded}"]


def _label_id_fits(row: dict, label_ids: dict) -> bool:
    """A row's label_id as the extraction writes it: its label's position in dataset.labels, -1 for no
    label (or one not listed), null also for no label (synthetic_extraction's rows). Zarr, pickle and
    lmprobe copy it, where a label_id naming another label would file the sample under that label."""
    label, label_id = row.get("label"), row.get("label_id")
    want = label_ids.get(label, -1) if isinstance(label, (str, int, float)) else -1
    return (type(label_id) is int and label_id == want) or (label is None and label_id is None)


def _summary_problems(extract_dir: Path) -> list[str]:
    """extract.json's totals, tensors, model, dataset and model files against what its (whole) parts
    say. A key the parts give and the file lacks (written by an earlier release) is not a problem."""
    have = read_json(extract_dir / INDEX)
    try:
        extraction = open_extraction(extract_dir)
        want = index_of(extraction)
    except FormatError as exc:
        return [str(exc)]
    pairs = [(key, have.get(key), value) for key, value in want.items() if key != "parts" and key in have]
    listed = have.get("parts") if isinstance(have.get("parts"), list) else []
    pairs += [(f"parts[{i}].{key}", entry.get(key) if isinstance(entry, dict) else None, value)
              for i, (entry, part) in enumerate(zip(listed, want["parts"])) for key, value in part.items()]
    return [f"{extract_dir / INDEX}: {key} = {stored!r:.100} but the parts say {value!r:.100}"
            for key, stored, value in pairs if stored != value] + _model_files_problems(
        extract_dir / INDEX, have.get(MODEL_FILES_KEY), extraction.parts)


def _model_files_problems(index: Path, stored: Any, parts: list[Part]) -> list[str]:
    """extract.json's model_files (write_index: the record the parts agree on, each file with its
    sha256) against the parts' record; the model folder is not read. Every Snakefile parse compares
    the folder with it, and outside a workflow stage directory (an extraction the library wrote) no
    seal vouches for it. None: an earlier release's, or written without the model folder."""
    if stored is None:
        return []
    if not well_formed(stored, INDEX_FIELDS):
        return [f"{index}: {MODEL_FILES_KEY} is not a map of file names to their bytes, mtime_ns and sha256 "
                f"(64 hex digits)"]
    recorded = [part.meta.get(MODEL_FILES_KEY) for part in parts]
    if None in recorded:  # write_index records the files only when every part did
        return [f"{index}: {MODEL_FILES_KEY} recorded, but {parts[recorded.index(None)].dir / PART_META} records none"]
    loaded = recorded[0]  # all equal (open_extraction)
    stats = {name: {field: entry[field] for field in PART_FIELDS} for name, entry in stored.items()}
    return [f"{index}: {MODEL_FILES_KEY}[{name!r}] " + (
        "missing, but the parts loaded it" if name not in stats else "listed, but no part loaded it"
        if name not in loaded else f"= {stats[name]} but the parts say {loaded[name]}")
        for name in moved_files(stats, loaded)]


def _index_problems(extract_dir: Path) -> list[str]:
    try:
        parts = read_json(extract_dir / INDEX)["parts"]
        listed = {entry["dir"]: entry["part_json_sha256"] for entry in parts}
        records = {inside(extract_dir, d, str(extract_dir / INDEX)) / PART_META: {"sha256": sha}
                   for d, sha in listed.items()}
    except (FormatError, KeyError, TypeError) as exc:
        return [f"{extract_dir / INDEX}: unreadable ({exc})"]
    problems = [p for meta, record in records.items() if (p := file_problem(meta, record, INDEX))]
    unlisted = sorted(d.name for d in _part_dirs(extract_dir) if d.name not in listed)
    return problems + [f"{extract_dir / d}: not listed in {INDEX}" for d in unlisted]


def read_vector(path: str | Path, sample_idx: int, layer_idx: int, token_idx: int) -> np.ndarray | None:
    """The stored float32 vector of (dataset row, block output, token); None for a token the sample
    lacks (a negative index too: Python's would give a token counted from the end). `path` is an
    extraction or, as detect, verify and inspect take, one part directory. TypeError for an index that is
    no integer: token True read the sample's every token, under a new axis, as the vector."""
    path = Path(path)
    sample_idx, layer_idx, token_idx = vector_indices(sample_idx, layer_idx, token_idx, path)
    part, local = _locate(path, sample_idx)
    if layer_idx not in part.info.layers:
        return None
    rows = part.activations(layer_tensor(layer_idx), local)
    return np.array(rows[token_idx]) if 0 <= token_idx < len(rows) else None


def _locate(path: Path, sample_idx: int) -> tuple[Part, int]:
    """The part holding dataset row `sample_idx` and its index there; IndexError for a row that is
    not in the extraction, or not in the one part `path` is."""
    if not (path / PART_META).is_file():
        return open_extraction(path).locate(sample_idx)
    part = open_part(path)
    if not 0 <= sample_idx - part.sample_start < part.info.n_samples:
        raise IndexError(f"{path}: sample_idx {sample_idx} is not in this part's sample_range "
                         f"{list(part.info.sample_range)}")
    return part, sample_idx - part.sample_start
