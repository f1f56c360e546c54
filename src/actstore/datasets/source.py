"""Where a dataset's rows live: `dataset.path` (a file, a folder of shards, a glob, a Hugging Face
`save_to_disk` folder or a folder of images) resolved to a format and its files in read order.
WebDataset tar shards are shards like the others.

Shards are read in sorted path order (a save_to_disk folder: the order its state.json lists), so
sample_idx = row index over the shards in that order.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from actstore.datasets.splits import README, readme_class_labels, split_files, split_folder
from actstore.errors import ConfigError, FormatError
from actstore.integrity import inside, read_json

# The image files of a folder (and a WebDataset sample's image member): Hugging Face datasets'
# ImageFolder suffixes (Pillow's registered ones) whose images Pillow decodes by itself, and AVIF.
# Left out: formats it needs a handler or program for (BUFR, GRIB, HDF5, FITS, EPS/PS, WMF/EMF), MPEG
# video, and IM (deprecated, gone in Pillow 15). A folder's other files (README, annotations) are not samples.
IMAGE_SUFFIXES = {
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".apng", ".gif", ".webp", ".avif", ".avifs", ".bmp", ".dib",
    ".tif", ".tiff", ".pbm", ".pgm", ".ppm", ".pnm", ".jp2", ".j2k", ".jpc", ".jpf", ".jpx", ".j2c",
    ".tga", ".icb", ".vda", ".vst", ".ico", ".icns", ".cur", ".pcx", ".dcx", ".sgi", ".rgb", ".rgba", ".bw",
    ".dds", ".blp", ".psd", ".msp", ".pcd", ".pxr", ".ras", ".xbm", ".xpm", ".gbr", ".iim",
    ".ftc", ".ftu", ".fli", ".flc",
}
# .tsv: CSV of tabs (tables.csv_delimiter), as Hugging Face's csv loader reads it (GLUE, MTEB, TREC dumps);
# before, a .tsv file was read as JSON lines and refused at its first line, a folder of them as holding none.
SHARD_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".tsv": "csv",
                  ".tar": "webdataset"}
# Compressed JSON lines (.jsonl.gz, .json.zst: the Pile, C4, Dolma), decompressed as read (datasets.jsonl),
# and compressed CSV (pyarrow decompresses by the name).
COMPRESSED_SUFFIXES = (".gz", ".zst")
COMPRESSED_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "csv"}
HF_MARKERS = ("dataset_dict.json", "dataset_info.json", "state.json")
FORMATS = ("auto", "jsonl", "parquet", "arrow", "csv", "hf_disk", "image_folder", "image_table", "webdataset",
           "text_folder")
IMAGE_TABLE_FORMATS = ("parquet", "arrow", "hf_disk")
TABLE_FORMATS = ("parquet", "arrow", "csv", "hf_disk")  # read by datasets/tables.py
FOLDER_FORMATS = ("image_folder", "text_folder")  # a sample a file (datasets/folders.py)
METADATA_NAMES = ("metadata.jsonl", "metadata.csv")  # an image folder's metadata file (datasets/folder_metadata.py)
# The Hub names a JSON lines shard train-00000-of-00001.json (as its Parquet ones): the folder held no samples.
HUB_JSON_SHARD = re.compile(r"^[^/]+-\d{5}-of-\d{5}\.json$", re.IGNORECASE)


@dataclass(frozen=True)
class Source:
    """A resolved dataset path. `format` is how the files are read (image_table resolves to the
    table format holding the images, with `image_table` set)."""

    format: str  # jsonl | parquet | arrow | csv | hf_disk | image_folder | webdataset | text_folder
    root: Path  # the file, the folder, or a glob's folder: image paths and shard names are relative to it
    files: tuple[Path, ...]  # data files in read order (image_folder: the images; text_folder: the texts)
    features: dict[str, Any] = field(default_factory=dict)  # Hugging Face features, by column
    image_table: bool = False
    metadata: Path | None = None  # an image folder's metadata file (METADATA_NAMES), at its root
    features_file: Path | None = None  # where `features` were read: dataset_info.json, or a README.md's YAML

    @property
    def table(self) -> bool:
        return self.format in TABLE_FORMATS

    def name(self, path: Path) -> str:
        """A file's name relative to the root, as errors and image-table sample texts give it."""
        return path.relative_to(self.root).as_posix() if path != self.root else path.name


# (path, format, split) -> Source, once remember_sources() is called; None: every call resolves.
_REMEMBERED: dict[tuple[str, str, str], Source] | None = None


def remember_sources() -> None:
    """From now on in this process, resolve each (path, format, split) once: a Snakefile parse (every
    Slurm job parses) resolves the dataset for the hashes, the checks and the resource requests,
    each a listing of an image folder (1.28M images: seconds on a local disk, a metadata storm on
    a shared one). Never where rows are read: a part's job resolves afresh, to see data changed
    since the scan (rule scripts run in processes of their own)."""
    global _REMEMBERED
    _REMEMBERED = {} if _REMEMBERED is None else _REMEMBERED


def resolve_source(path: str, fmt: str = "auto", split: str = "train") -> Source:
    """Resolve `dataset.path` for `dataset.format`; ConfigError naming the path if it cannot be read."""
    key = (str(path), fmt, split)
    if _REMEMBERED is None:
        return _resolve(*key)
    if key not in _REMEMBERED:
        _REMEMBERED[key] = _resolve(*key)
    return _REMEMBERED[key]


def _resolve(path: str, fmt: str, split: str) -> Source:
    if fmt == "image_table":
        source = resolve_source(path, "auto", split)
        if source.format not in IMAGE_TABLE_FORMATS:
            raise ConfigError(f"dataset.format image_table: {path} is {source.format}; image tables "
                              f"are {', '.join(IMAGE_TABLE_FORMATS)}")
        return replace(source, image_table=True)
    if glob.has_magic(path) and not Path(path).exists():  # a folder named corpus[v2] is itself, no glob
        return _glob_source(path, fmt)
    root = Path(path)
    if root.is_file():
        return Source(fmt if fmt != "auto" else shard_format(root) or "jsonl", root, (root,))
    if not root.is_dir():
        raise ConfigError(f"dataset.path does not exist: {root}")
    if fmt == "hf_disk" or (fmt == "auto" and any((root / m).is_file() for m in HF_MARKERS)):
        return _hf_disk_source(root, split)
    return _folder_source(root, fmt, split)


def _glob_source(pattern: str, fmt: str) -> Source:
    files = tuple(sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()))
    if not files:
        raise ConfigError(f"dataset.path {pattern} matches no file")
    if fmt == "auto":
        fmt = _one_format(pattern, {shard_format(p) or "jsonl" for p in files})
    root = Path(pattern.split("*")[0].split("?")[0].split("[")[0])
    return Source(fmt, root if root.is_dir() else root.parent, files)


def hidden(name: str, folder: bool = False) -> bool:
    """A file or folder Hugging Face datasets leaves out of a folder's data files, and so does the
    listing here: hidden (.DS_Store, macOS's ._ copies, .ipynb_checkpoints/, .cache/), or a folder
    named with __ (__MACOSX/, __pycache__/). Jupyter makes .ipynb_checkpoints in any folder it
    browses: as an image folder's first-level folder it was a class of copies."""
    return name.startswith(".") or (folder and name.startswith("__"))


def folder_file(name: str, fmt: str) -> bool:
    """Whether a file of this name is a sample of a folder of format `fmt`: every file of a text
    folder, an image of an image folder, neither hidden. The one rule for the whole listing and a
    part's folders."""
    return not hidden(name) and (fmt == "text_folder" or Path(name).suffix.lower() in IMAGE_SUFFIXES)


def _folder_source(root: Path, fmt: str, split: str) -> Source:
    files = files_under(root)
    if fmt == "text_folder":  # never chosen by auto, as any folder holds files
        return Source(fmt, root, tuple(files))
    images = tuple(p for p in files if folder_file(p.name, "image_folder"))
    if fmt == "auto" and images:
        _check_no_data_files(root, images, files)
    if fmt == "image_folder" or (fmt == "auto" and images):
        if (chosen := split_folder(root, split)) != root:  # train/<label>/..., validation/<label>/...
            _check_no_metadata_above(root, chosen, files)
            root = chosen
            files = [p for p in files if p.is_relative_to(root)]
            images = tuple(p for p in images if p.is_relative_to(root))
        return Source("image_folder", root, images, metadata=_metadata_file(root, files))
    shards = {p: kind for p in files if (kind := shard_format(p))}
    shards = {p: shards[p] for p in split_files(root, list(shards), split)}  # a Hub snapshot's split
    if fmt == "auto":
        if not shards:
            return Source("image_folder", root, ())  # empty: load_dataset names it
        fmt = _one_format(str(root), set(shards.values()))
    files = tuple(p for p, kind in shards.items() if kind == fmt)
    labels = readme_class_labels(root) if fmt in (*TABLE_FORMATS, "jsonl") else {}
    return Source(fmt, root, files, labels, features_file=root / README if labels else None)


def _check_no_data_files(root: Path, images: tuple[Path, ...], files: list[Path]) -> None:
    """ConfigError naming an image and a data file (Parquet, Arrow, CSV, JSONL, tar; an image folder's
    metadata file aside) when the folder holds both: a Hub snapshot of data/train-*.parquet whose
    README shows a banner.png was read as an image folder of that one image, its rows left out
    without a word. Which is the dataset is the config's to say."""
    data = next((p for p in files if shard_format(p) and p.name not in METADATA_NAMES), None)
    if data is not None:
        raise ConfigError(f"dataset.path {root} holds images ({images[0].relative_to(root)}, {len(images)} in all) "
                          f"and data files ({data.relative_to(root)}): set dataset.format to image_folder, or to "
                          f"the data files' format ({shard_format(data)})")


def _check_no_metadata_above(root: Path, chosen: Path, files: list[Path]) -> None:
    """ConfigError naming a metadata file at the root of split folders (Hugging Face's imagefolder
    reads it for every split, its file_name `train/cat/1.png`): the split's folder `chosen` is read,
    and its images were read without their fields, without a word (or, with dataset.label_field,
    refused as having no metadata file)."""
    above = next((p for p in files if p.parent == root and p.name in METADATA_NAMES), None)
    if above is not None:
        raise ConfigError(f"dataset.path {root}: {above.name} at the root of its split folders is not read (the "
                          f"split's images are read from {chosen.name}/): put one {above.name} in each split's "
                          f"folder, its file_name relative to that folder")


def _metadata_file(root: Path, files: list[Path]) -> Path | None:
    """An image folder's metadata file: one of METADATA_NAMES at its root, or none. ConfigError for
    two, or for one below the root (Hugging Face reads those too, for the folders below them; here
    they would be left out without a word)."""
    found = [p for p in files if p.name in METADATA_NAMES]
    below = [p for p in found if p.parent != root]
    if below:
        raise ConfigError(f"dataset.path {root}: {below[0]} is a metadata file below the folder's root; only "
                          f"{' or '.join(METADATA_NAMES)} at the root is read (set dataset.path to its folder)")
    if len(found) > 1:
        raise ConfigError(f"dataset.path {root}: holds both {found[0].name} and {found[1].name}; keep one")
    return found[0] if found else None


def shard_format(path: Path) -> str | None:
    """The format a data file's name gives: its suffix's (SHARD_SUFFIXES), or for a compressed
    file the suffix's before it (COMPRESSED_FORMATS); JSON lines for a Hub shard's name ending .json
    (HUB_JSON_SHARD); None for any other file (a folder's other .json files are no rows: an image
    folder's annotations, a Hub snapshot's dataset_infos.json)."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        return COMPRESSED_FORMATS.get(suffixes[-2]) if len(suffixes) > 1 else None
    return "jsonl" if HUB_JSON_SHARD.match(path.name) else SHARD_SUFFIXES.get(path.suffix.lower())


def files_under(root: Path) -> list[Path]:
    """Every file under `root` in path order, as `sorted(p for p in root.rglob("*") if p.is_file())`
    lists them (links to files kept; linked folders not entered; broken links left out), from the
    directory entries' own types: no stat per file, which on Lustre is a server round trip per image;
    hidden files and folders below `root` left out (hidden()).
    A folder it cannot read is a ConfigError naming it (rglob left its images out without a word)."""
    found, folders = [], [str(root)]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    is_folder = entry.is_dir(follow_symlinks=False)
                    if hidden(entry.name, is_folder):
                        continue
                    if is_folder:
                        folders.append(entry.path)
                    elif entry.is_file():
                        found.append(entry.path)
        except OSError as exc:
            raise ConfigError(f"dataset.path {root}: cannot list {folder} ({exc.strerror})") from None
    found.sort(key=lambda path: path.split(os.sep))  # component by component, as Path orders them
    return [Path(path) for path in found]


def _one_format(where: str, formats: set[str]) -> str:
    if len(formats) > 1:
        raise ConfigError(f"dataset.path {where} holds {' and '.join(sorted(formats))} files: "
                          f"set dataset.format, or narrow the path with a glob")
    return formats.pop()


def _hf_disk_source(root: Path, split: str) -> Source:
    """A save_to_disk folder: a Dataset (state.json, dataset_info.json, data-*.arrow) or a
    DatasetDict (dataset_dict.json naming one such folder per split)."""
    if (root / "dataset_dict.json").is_file():
        root = _split_folder(root, split)
    state = _read_json(root / "state.json") if (root / "state.json").is_file() else {}
    info = _read_json(root / "dataset_info.json") if (root / "dataset_info.json").is_file() else {}
    files = _state_files(root, state) or _cache_files(root, info, split)
    missing = [p for p in files if not p.is_file()]
    if missing or not files:
        raise ConfigError(f"{root}: save_to_disk folder lacks its data file {missing[0] if missing else '*.arrow'}")
    features = info.get("features") or {}
    return Source("hf_disk", root, files, features, features_file=root / "dataset_info.json" if features else None)


def _split_folder(root: Path, split: str) -> Path:
    """A DatasetDict's folder of `split`: listed in dataset_dict.json's splits, resolved inside
    `root` (a split named `../x`, an absolute path, or a link out read another dataset's rows)."""
    where = root / "dataset_dict.json"
    splits = _read_json(where).get("splits")
    if not isinstance(splits, list) or not all(isinstance(name, str) for name in splits):
        raise ConfigError(f"{where}: splits must be a list of split names, got {splits!r:.80}")
    if split not in splits:
        raise ConfigError(f"{where}: dataset.split {split!r} is not a split of this dataset "
                          f"(splits: {', '.join(splits)})")
    try:
        return inside(root, split, f"{where}: splits")
    except FormatError as exc:
        raise ConfigError(str(exc)) from None


def _state_files(root: Path, state: dict[str, Any]) -> tuple[Path, ...]:
    """The data files state.json lists, each name resolved inside `root` (_data_file): a state.json
    naming a file elsewhere (`../`, an absolute path, a folder linked out) would read rows from
    outside the dataset."""
    where = root / "state.json"
    try:
        return tuple(_data_file(root, entry.get("filename") if isinstance(entry, dict) else None,
                                f"{where}: _data_files[{i}].filename")
                     for i, entry in enumerate(state.get("_data_files", [])))
    except FormatError as exc:
        raise ConfigError(str(exc)) from None


def _data_file(root: Path, name: Any, where: str) -> Path:
    """`name` as a path inside `root` (integrity.inside), but the file itself may be a link to a file,
    as every other layout's listing keeps one (files_under): a save_to_disk folder downloaded from the
    Hub (huggingface_hub's cache) is links into the cache's blobs/, and every one was refused as
    leading outside. The folders on its way are checked as inside() checks them."""
    rel = PurePosixPath(name) if isinstance(name, str) else None
    if rel is None or rel.name in ("", "..") or not (root / rel).is_symlink():
        return inside(root, name, where)
    folder = root if rel.parent == PurePosixPath(".") else inside(root, rel.parent.as_posix(), where)
    return folder / rel.name


def _cache_files(root: Path, info: dict[str, Any], split: str) -> tuple[Path, ...]:
    """The Arrow files of a folder without state.json: `load_dataset`'s cache folder, whose
    dataset_info.json lists its splits and whose files are `{name}-{split}.arrow` or
    `{name}-{split}-NNNNN-of-NNNNN.arrow`, takes the split's (before: every split's, test rows before
    train); any other folder, every *.arrow file."""
    files = sorted(root.glob("*.arrow"))
    splits = info.get("splits") if isinstance(info.get("splits"), dict) else {}
    if not splits:
        return tuple(files)
    if split not in splits:
        raise ConfigError(f"{root / 'dataset_info.json'}: dataset.split {split!r} is not a split of this dataset "
                          f"(splits: {', '.join(splits)})")
    named = re.compile(rf"-{re.escape(split)}(-\d{{5}}-of-\d{{5}})?\.arrow$")
    return tuple(p for p in files if named.search(p.name))


def _read_json(path: Path) -> dict[str, Any]:
    """A save_to_disk metadata file's object; ConfigError naming the file when it is not one."""
    try:
        data = read_json(path)
    except FormatError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def identity_files(source: Source) -> list[Path]:
    """Every file whose bytes decide the samples (the data files, and the features that name labels:
    a README.md only where it declares a ClassLabel, so a Hub snapshot whose README declares none
    keeps its hash)."""
    extra = [source.root / "dataset_info.json"] if source.format == "hf_disk" else [source.metadata,
                                                                                    source.features_file]
    return [*source.files, *(p for p in extra if p and p.is_file())]
