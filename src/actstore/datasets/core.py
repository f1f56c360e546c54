"""What every dataset reader produces: samples in sample_idx order, and the fields it reads them from."""
from __future__ import annotations

import functools
import json
import math
import multiprocessing
import string
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from actstore.errors import ConfigError

# dataset.* keys that choose how rows are read (path, limit and split are passed on their own).
FIELD_KEYS = ("format", "text_field", "label_field", "image_field", "messages_field", "tokens_field", "prompt_template",
              "keep_fields", "add_generation_prompt", "encoding")


@dataclass
class Sample:
    """One dataset row. `text` is the text (a chat sample: the rendered prompt), or the image's name:
    its path relative to the dataset root, for a table the image's own path or `<shard>#<row>`, for
    tar shards `<shard>/<key>`."""

    sample_idx: int
    text: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    ref: tuple[int, int, int] | None = None  # image tables: (shard, block, row in block); tars: (shard, offset, size)
    tokens: Any = None  # dataset.tokens_field: the row's token ids (int64 array); text is "" until decoded


@dataclass(frozen=True)
class Fields:
    """The columns a reader takes. keep=None: JSONL keeps every other field (as it always has), a
    table none. render: the tokenizer's chat template, set when messages are read."""

    text: str = "text"
    label: str = "label"
    label_required: bool = False  # dataset.label_field set: the column must exist
    image: str | None = None
    messages: str | None = None
    tokens: str | None = None  # token ids, run as given (pre-tokenized data)
    template: str | None = None  # dataset.prompt_template: the prompt made of the row's fields
    encoding: str = "utf-8"  # dataset.encoding: a text folder's files' (JSON is UTF-8)
    keep: tuple[str, ...] | None = None
    render: Callable[[Any, str], str] | None = None
    vocab: int | None = None  # the model's vocab_size: the scan refuses a token id at or past it
    # The label field's ClassLabel names (Hugging Face features: tables.with_classes): a label is read as its
    # class id or name (class_name), label_id = its id in every split, whichever classes a split holds
    classes: tuple[str, ...] | None = None
    classes_from: str = ""  # where `classes` were read, for errors

    @functools.cached_property  # asked of every row's label (class_name)
    def class_ids(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.classes or ())}

    @property
    def prompt(self) -> str:
        """The field the prompt comes from: its token ids, its chat messages or its text."""
        return self.tokens or self.messages or self.text

    @functools.cached_property  # asked of every row: parsing the template each time tripled a JSONL scan
    def prompts(self) -> tuple[str, ...]:
        """The fields a prompt is made of: a template's placeholders, else the one prompt field."""
        return template_fields(self.template) if self.template else (self.prompt,)

    @functools.cached_property  # asked of every JSON line (refuse_repeated)
    def json_names(self) -> tuple[tuple[str, str], ...]:
        """(name, its spelling in JSON) of each field the config reads: a name of non-ASCII characters
        twice, as Python's json escapes them and as UTF-8 (ensure_ascii=False)."""
        return tuple((name, spelled) for name in sorted({*self.own(), *(self.keep or ())})
                     for spelled in json_spellings(name))

    def own(self) -> set[str]:
        return {*self.prompts, self.label, *([self.image] if self.image else [])}


def template_fields(template: str) -> tuple[str, ...]:
    """The fields `{name}` placeholders of a prompt template name, in order, each once; ConfigError
    for any other placeholder (a position, an attribute or item, a conversion or format spec: the
    template is filled from a row's fields and nothing else)."""
    names: dict[str, None] = {}
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"dataset.prompt_template: {exc} (write {{{{ and }}}} for braces)") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name or name.isdigit() or any(c in name for c in ".[]") or spec or conversion:
            raise ConfigError(f"dataset.prompt_template: placeholder {{{name}{'!' + conversion if conversion else ''}"
                              f"{':' + spec if spec else ''}}} is not a field's name alone, e.g. {{text}}")
        names[name] = None
    if not names:
        raise ConfigError("dataset.prompt_template: names no field, e.g. 'Review: {text}'")
    return tuple(names)


@dataclass
class Dataset:
    """The rows one job reads (every row, or one part's) and what describes the whole dataset."""

    root: Path
    modality: str  # "text" | "image"
    samples: list[Sample]  # the rows read, in sample_idx order
    n_samples: int  # rows in the whole dataset (after dataset.limit)
    labels: list  # label names over the whole dataset: label_id = position in this list
    chat: bool = False  # texts are rendered chat templates: they carry their own special tokens
    pretokenized: bool = False  # samples carry token ids (dataset.tokens_field), run as given
    opener: Any = None  # images.ImageOpener for image datasets


def forked_pool(processes: int, **options: Any) -> ProcessPoolExecutor:
    """A pool of `processes` forked processes (options: ProcessPoolExecutor's). Fork: spawn and
    forkserver would import a Snakemake script's unguarded body again in each process; a fork's
    initializer arguments are inherited, not pickled."""
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"), **options)


def in_order(futures: list[Future]) -> Iterator[Any]:
    """The futures' results in their order, so the first error in that order is the one raised;
    the futures not yet run are cancelled when the caller stops."""
    try:
        for future in futures:
            yield future.result()
    finally:
        for future in futures:
            future.cancel()


def check_unicode(text: Any, where: str, what: str) -> None:
    """ConfigError naming `what` if a string holds an unpaired surrogate: JSON's \\ud800 escapes parse
    to one (scraped dumps hold them), which no tokenizer can encode (a TypeError naming nothing)."""
    if isinstance(text, str) and not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"{where}: {what} holds an unpaired surrogate ({text[exc.start]!r} at character "
                              f"{exc.start}), which is not Unicode text") from None


def label_list(labels: Iterable[Any]) -> list:
    """The distinct labels (None left out): numbers first, in numeric order, so that class ids 0..N-1
    (a webdataset's cls, a table's integer column, a JSONL file's 0.0..N-1.0 as pandas writes a float
    column) are their own label_id; then every other label by its text (folder and class names, as
    torchvision's ImageFolder numbers them). Labels with the same text and kind keep the order they
    first appear in, so every job numbers them alike."""
    return sorted(dict.fromkeys(label for label in labels if label is not None), key=_label_order)


@functools.lru_cache(maxsize=1024)
def json_spellings(name: str) -> tuple[str, ...]:
    """A field name as JSON may write it, quoted: escaped as Python's json writes it, and as UTF-8."""
    return tuple(dict.fromkeys(json.dumps(name, ensure_ascii=escaped) for escaped in (True, False)))


def refuse_repeated(text: str, spelled: Iterable[tuple[str, str]], where: str, noun: str) -> None:
    """ConfigError naming a field of `spelled` ((name, json_spellings' spelling) pairs) that the JSON
    object `text` names twice: json keeps the last value, so a row was read with its second value without
    a word (Hugging Face's json loader refuses it). `text` is parsed again, as pairs, only where such a
    spelling is in it twice (once more in a nested object is no duplicate)."""
    found = list(dict.fromkeys(name for name, quoted in spelled if text.count(quoted) > 1))
    if found:
        keys = [key for key, _ in json.loads(text, object_pairs_hook=list)]
        if twice := [name for name in found if keys.count(name) > 1]:
            raise ConfigError(f"{where}: field {twice[0]!r} appears twice in the {noun}; a row's fields are "
                              f"distinct (which value is meant?)")


def refuse_past_vocab(largest: int, vocab: int | None, where: str) -> None:
    """ConfigError naming the row (`where`) whose largest token id is at or past `vocab` (the model's
    vocab_size, when the scan knows it): the embedding's lookup of it faults, on a GPU node."""
    if vocab is not None and largest >= vocab:
        raise ConfigError(f"{where}: token id {largest} is outside the model's vocabulary of {vocab} "
                          f"(config.json vocab_size; dataset.tokens_field)")


def checked_label(label: Any, field: str, where: str) -> Any:
    """A JSON label as read (a string, number, boolean or null); ConfigError naming `where` for a list
    or object, for NaN or infinity (Python's json reads them: each NaN would be a class of its own),
    and for a string holding an unpaired surrogate (check_unicode)."""
    if isinstance(label, (list, dict)):
        raise ConfigError(f"{where}: field {field!r} is a JSON {type(label).__name__}; a label is a string, "
                          f"number, boolean or null")
    if isinstance(label, float) and not math.isfinite(label):
        raise ConfigError(f"{where}: field {field!r} is {label}; a row without a label has null there")
    check_unicode(label, where, f"field {field!r}")  # a label name every format stores as UTF-8 text
    return label


def class_label_names(features: dict[str, Any], label: str, where: str) -> list[str] | None:
    """The ClassLabel names Hugging Face `features` (by column) give column `label`, or None when
    it is no ClassLabel; ConfigError naming `where` when the names are not distinct strings (a
    string was read as a list of its letters, each a class, without a word)."""
    feature = features.get(label)
    if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel" or "names" not in feature:
        return None
    names = feature["names"]
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names) or len(set(names)) < len(names):
        raise ConfigError(f"{where}: {label!r} ClassLabel's names must be a list of distinct strings, got "
                          f"{json.dumps(names):.80}")
    return names


def class_name(label: Any, fields: Fields, where: str) -> str | None:
    """A JSON label (checked_label's) under the ClassLabel `fields.classes`, as its name; None for a
    row without one (null, or id -1). A number is a class id (a whole float too: pandas writes an
    integer column with a missing value as floats), a string a name as Hugging Face's
    ClassLabel.str2int reads it (as written, stripped, else a whole number that is an id).
    ConfigError naming `where` for an id past the names, an unknown name or a boolean (datasets
    loads an id past the names, which no name labels, and true as id 1)."""
    if label is None or (isinstance(label, float) and math.isnan(label)):  # a table's float column: NaN is none
        return None
    names, field = fields.classes or (), fields.label
    if isinstance(label, str):
        number = fields.class_ids.get(label, fields.class_ids.get(label.strip()))
        if number is not None:
            return names[number]
        try:
            label = int(label)
        except ValueError:
            raise ConfigError(f"{where}: field {field!r}: {json.dumps(label):.60} is none of its ClassLabel's "
                              f"{len(names)} names ({fields.classes_from}: {', '.join(names):.120})") from None
    if isinstance(label, bool) or (isinstance(label, float) and not label.is_integer()):
        raise ConfigError(f"{where}: field {field!r}: {json.dumps(label)} is no class id or name of its "
                          f"ClassLabel ({fields.classes_from})")
    if not -1 <= label < len(names):
        raise ConfigError(f"{where}: field {field!r}: class id {json.dumps(label)} names no class (its ClassLabel has "
                          f"{len(names)} names: ids 0 to {len(names) - 1}; -1 is no label; {fields.classes_from})")
    return names[int(label)] if label >= 0 else None


Labelled = tuple[Any, str]  # a label, and where it was read (for errors)


def one_kind(first: Labelled | None, label: Any, where: str) -> Labelled | None:
    """`first` (the first label read, and where), or (label, where) when this is the first; ConfigError
    naming both when one is a boolean and the other not: true == 1 in Python, so true and 1 were one
    class (false and 0 another), named and numbered by whichever came first, without a word."""
    if label is None:
        return first
    if first is None:
        return label, where
    if isinstance(label, bool) != isinstance(first[0], bool):
        raise ConfigError(f"{where}: label {json.dumps(label):.60}, but {first[1]}: label {json.dumps(first[0]):.60}; "
                          f"a dataset's labels are all booleans or none (true and 1 would be one class)")
    return first


def _label_order(label: Any) -> tuple:
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        return (0, label, "")
    return (1, 0, str(label))


def part_range(n_samples: int, parts: int, part: int) -> range:
    """Contiguous slice of ceil(N/P) samples for part `part` (the last may be shorter or empty)."""
    per_part = math.ceil(n_samples / parts)
    return range(min(n_samples, part * per_part), min(n_samples, (part + 1) * per_part))
