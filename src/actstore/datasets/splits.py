"""Which data files of a folder hold `dataset.split`, by the rules Hugging Face `datasets` follows
for a Hub repository or a local folder (datasets/data_files.py), so that a downloaded snapshot
(`data/train-00000-of-00002.parquet` beside `data/test-00000-of-00001.parquet`) is read as its
split, not whole:

1. README.md's YAML `configs`: the `data_files` of the default config (`default: true`, else the one
   named `default`, else the only one), or its `data_dir` read by the rules below;
2. files named `data/{split}-NNNNN-of-NNNNN*.*`, any split name;
3. split keywords in a folder name, then in a file name: train/training, validation/valid/dev/val,
   test/testing/eval/evaluation, alone or between `-._ 0-9` characters;
4. otherwise the folder names no split: every file is read, and `dataset.split` is only recorded.

An image folder (label = first-level folder) takes rule 3 only where a first-level folder's whole
name is a split keyword (`train/cat/1.jpg`, `validation/dog/2.jpg`, as Hugging Face's imagefolder
datasets are laid out): that folder is the one read, its subfolders the labels. A class folder that
merely contains a keyword (`test_tube/`) stays a class.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any

import yaml

from actstore.errors import ConfigError, FormatError
from actstore.integrity import inside

README = "README.md"
SHARDED = re.compile(r"^data/(?P<split>[^/]+)-\d{5}-of-\d{5}[^/]*\.[^/]*$")
SPLIT_NAME = re.compile(r"^\w+(\.\w+)*$")  # datasets' own rule for a split name
KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
            "test": ("test", "testing", "eval", "evaluation")}
SEP = "[-._ 0-9]"


def split_files(root: Path, files: list[Path], split: str) -> list[Path]:
    """The files of `files` (data files under the folder `root`, in read order) that hold `split`;
    all of them when the folder names no split. ConfigError when it names splits and not this one."""
    readme = root / README
    configured = _default_config(_front_matter(root).get("configs"), readme)
    # data_dir: the folder the config's files are in, its data_files too relative to it, as datasets
    # resolves them (BuilderConfig._resolve_data_files)
    if configured is not None and configured.get("data_dir"):
        root = _data_dir(root, configured["data_dir"])
        files = [f for f in files if f.is_relative_to(root)]
    if configured is not None and "data_files" in configured:
        patterns = _patterns(configured["data_files"])
        splits = {name: _matching(root, globs, files, readme) for name, globs in patterns.items()}
        how = f"{readme}'s configs"
        if split in splits and not splits[split]:  # a misspelt pattern: "holds no samples" named none
            raise ConfigError(f"{readme}: configs data_files of split {split!r} "
                              f"({', '.join(map(str, patterns[split]))}) match no data file under {root}")
    else:
        splits, how = _named_splits(root, files)
    if not splits:
        return files
    if split not in splits:
        raise ConfigError(f"dataset.split {split!r} is not a split of {root} (its splits, by {how}: "
                          f"{', '.join(splits)})")
    return splits[split]


def split_folder(root: Path, split: str) -> Path:
    """An image folder's folder for `split`: `root/<keyword>` when a first-level folder is named by a
    split keyword; `root` when none is. ConfigError when some are and not this split."""
    by_split: dict[str, list[Path]] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        named = [name for name, keywords in KEYWORDS.items() if folder.name in keywords]
        if named:
            by_split.setdefault(named[0], []).append(folder)
    if not by_split:
        return root
    if split not in by_split:
        raise ConfigError(f"dataset.split {split!r} is not a split of the image folder {root} (its split folders: "
                          f"{', '.join(f.name for folders in by_split.values() for f in folders)})")
    if len(by_split[split]) > 1:
        raise ConfigError(f"dataset.path {root}: {' and '.join(f.name for f in by_split[split])} both name the "
                          f"split {split!r}; set dataset.path to one of them")
    return by_split[split][0]


def _named_splits(root: Path, files: list[Path]) -> tuple[dict[str, list[Path]], str]:
    """Rules 2 and 3: {split: its files} and how they were named; {} when no file names a split."""
    relative = {f: f.relative_to(root).as_posix() for f in files}
    sharded = {f: match["split"] for f, rel in relative.items() if (match := SHARDED.match(rel))}
    if sharded:
        bad = sorted({s for s in sharded.values() if not SPLIT_NAME.match(s)})
        if bad:
            raise ConfigError(f"dataset.path {root}: data/{bad[0]}-NNNNN-of-NNNNN names the split {bad[0]!r}, "
                              "which is not a split name (letters, digits, _ and .)")
        found = set(sharded.values())
        names = [s for s in KEYWORDS if s in found] + sorted(found - set(KEYWORDS))  # datasets' order
        return {s: [f for f in files if sharded.get(f) == s] for s in names}, "data/{split}-NNNNN-of-NNNNN names"
    for where, named in (("folder names", _in_folder), ("file names", _in_file_name)):
        splits = {s: [f for f in files if any(named(relative[f], k) for k in keywords)]
                  for s, keywords in KEYWORDS.items()}
        splits = {s: found for s, found in splits.items() if found}
        if splits:
            return splits, f"split keywords in {where}"
    return {}, ""


def _in_folder(rel: str, keyword: str) -> bool:
    return any(_named(folder, keyword) or folder == keyword or re.search(f"{SEP}{keyword}$", folder)
               for folder in rel.split("/")[:-1])


def _in_file_name(rel: str, keyword: str) -> bool:
    return _named(rel.rsplit("/", 1)[-1], keyword)


def _named(name: str, keyword: str) -> bool:
    """`keyword` at the start of `name` or between separators, as datasets' patterns put it."""
    return bool(re.match(f"{keyword}{SEP}", name) or re.search(f"{SEP}{keyword}{SEP}", name))


def _front_matter(root: Path) -> dict[str, Any]:
    """README.md's YAML front matter (the Hub's dataset card metadata), or {} without one."""
    readme = root / README
    if not readme.is_file():
        return {}
    text = readme.read_text(errors="replace")
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not match:
        return {}
    try:
        front = yaml.safe_load(match[1]) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{readme}: its YAML header does not parse: {exc}") from None
    return front if isinstance(front, dict) else {}


def _default_config(configs: Any, readme: Path) -> dict[str, Any] | None:
    """The default config of `configs` (README.md's YAML front matter's, `readme` for errors), or None."""
    if not isinstance(configs, list) or not configs:
        return None
    chosen = ([c for c in configs if isinstance(c, dict) and c.get("default") is True]
              or [c for c in configs if isinstance(c, dict) and c.get("config_name") == "default"]
              or (configs if len(configs) == 1 else []))
    if not chosen or not isinstance(chosen[0], dict):
        names = [c.get("config_name") for c in configs if isinstance(c, dict)]
        raise ConfigError(f"{readme} lists the configs {', '.join(map(str, names))} and none is the default: "
                          "set dataset.path to one config's files (a folder or a glob)")
    return chosen[0]


def readme_class_labels(root: Path) -> dict[str, dict[str, Any]]:
    """The ClassLabel features README.md's YAML `dataset_info` declares for the config read, as
    dataset_info.json spells them ({column: {"_type": "ClassLabel", "names": [...]}}); {} when it
    declares none. `datasets.load_dataset` casts a Hub repository's data files to these features:
    Parquet written by pandas or polars carries no features of its own, and its label ids were
    numbered by rank, a split missing a class numbered unlike the others, without a word."""
    readme = root / README
    front = _front_matter(root)
    info = _config_info(front.get("dataset_info"), front.get("configs"), readme)
    features = info.get("features") if isinstance(info, dict) else None
    if features is None:
        return {}
    if not isinstance(features, list) or not all(isinstance(f, dict) and "name" in f for f in features):
        raise ConfigError(f"{readme}: dataset_info features must be a list of {{name, dtype}} entries, got "
                          f"{features!r:.80}")
    labels = {}
    for feature in features:
        spec = feature.get("dtype", feature)  # `dtype: {class_label: ...}`, or `class_label:` beside the name
        if isinstance(spec, dict) and isinstance(spec.get("class_label"), dict):
            names = _class_names(spec["class_label"].get("names"), f"{readme}: dataset_info feature "
                                                                   f"{feature['name']!r} class_label names")
            labels[str(feature["name"])] = {"_type": "ClassLabel", "names": names}
    return labels


def _config_info(dataset_info: Any, configs: Any, readme: Path) -> Any:
    """The entry of README.md's `dataset_info` (one entry, or a list of one a config) of the config
    read, chosen as datasets chooses it: the default config's name (`default` when it names none),
    or with no `configs` the only entry, else the one named `default`."""
    if isinstance(dataset_info, dict):
        dataset_info = [dataset_info]
    if not isinstance(dataset_info, list):
        return None
    by_name = {entry.get("config_name", "default"): entry for entry in dataset_info if isinstance(entry, dict)}
    if isinstance(configs, list) and configs:
        return by_name.get((_default_config(configs, readme) or {}).get("config_name", "default"))
    return next(iter(by_name.values())) if len(by_name) == 1 else by_name.get("default")


def _class_names(names: Any, where: str) -> Any:
    """A class_label's names as a list: the YAML's {'0': name, ...} by id, as datasets reads it;
    ConfigError naming `where` for ids that are not 0..N-1. A list is as written (tables.class_names
    checks its names)."""
    if not isinstance(names, dict):
        return names
    try:
        ids = sorted(names, key=int)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: ids {', '.join(map(repr, names))} are not whole numbers") from None
    if [int(i) for i in ids] != list(range(len(ids))):
        raise ConfigError(f"{where}: ids {', '.join(map(str, ids))} are not 0 to {len(ids) - 1}, each once")
    return [names[i] for i in ids]


def _patterns(data_files: Any) -> dict[str, list[str]]:
    """data_files as datasets reads it: a pattern or list of them (the train split), {split: ...},
    or a list of {split, path}."""
    if isinstance(data_files, str):
        return {"train": [data_files]}
    if isinstance(data_files, dict):
        return {str(k): v if isinstance(v, list) else [v] for k, v in data_files.items()}
    if isinstance(data_files, list) and all(isinstance(entry, dict) for entry in data_files):
        return {str(e.get("split")): e.get("path") if isinstance(e.get("path"), list) else [e.get("path")]
                for e in data_files}
    if isinstance(data_files, list):
        return {"train": data_files}
    raise ConfigError(f"README.md configs data_files {data_files!r} is not a pattern, a list or a mapping of splits")


def _data_dir(root: Path, data_dir: Any) -> Path:
    """README.md's configs data_dir as a folder inside `root`; ConfigError naming it unless it is one
    (`../other`, an absolute path or a link out would read another dataset's files, or none)."""
    try:
        return inside(root, data_dir, f"{root / README}: configs data_dir")
    except FormatError as exc:
        raise ConfigError(str(exc)) from None


def _matching(root: Path, patterns: list[Any], files: list[Path], readme: Path) -> list[Path]:
    """The files (in their read order) that a split's patterns, relative to `root`, match."""
    matched = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or Path(pattern).is_absolute() or ".." in Path(pattern).parts:
            raise ConfigError(f"{readme}: data_files pattern {pattern!r} is not a path inside {root}")
        # root escaped: a snapshot saved under data[v2]/ is a folder, its brackets no character class
        matched.update(Path(p) for p in glob.glob(str(Path(glob.escape(str(root))) / pattern), recursive=True))
    return [f for f in files if f in matched]
