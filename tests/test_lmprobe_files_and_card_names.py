"""Review 58: a file only lmprobe:files names, which verify checked nowhere, and dataset and model
names written into the lmprobe dataset card as Markdown."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from actstore.formats import lmprobe
from test_lmprobe_verify_addressing import rewrite_index

POOLED = {"storage": "pooled", "token_strings": False}


def record_only_in_files(root: Path, rel: str) -> None:
    """`rel` listed in lmprobe:files alone (no descriptor names it, SHA256SUMS does not list it), the
    index rewritten as a writer would."""
    table = pq.read_table(lmprobe.find_index(root))
    metadata = dict(table.schema.metadata)
    files = json.loads(metadata[b"lmprobe:files"])
    files[rel] = {"bytes": 10, "sha256": "0" * 64}
    metadata[b"lmprobe:files"] = json.dumps(files).encode()
    rewrite_index(root, table.replace_schema_metadata(metadata))


@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("rel, problem", [
    ("tensors/extra.safetensors", "{root}/tensors/extra.safetensors: missing (listed in lmprobe:files)"),
    ("../elsewhere.bin", "lmprobe:files: '../elsewhere.bin' is not a relative path inside {root}"),
    ("/etc/hostname", "lmprobe:files: '/etc/hostname' is not a relative path inside {root}")])
def test_a_file_only_lmprobe_files_names_is_checked_inside_the_dataset(extracted, tmp_path, rel, problem,
                                                                       checksums):
    """verify checked the files the descriptors name and the SHA256SUMS lines: a name only lmprobe:files
    gave was checked nowhere, and the dataset verified with that file missing or named outside it."""
    _, extract_dir = extracted("gpt2")
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, POOLED, progress=False)
    record_only_in_files(root, rel)
    assert lmprobe.verify(root, checksums=checksums) == [problem.format(root=root)]


def card_heading_and_dataset(card: str) -> tuple[list[str], str]:
    """The card's body as CommonMark reads it: the text of each heading, and the first code span of
    the paragraph after the heading (the dataset name). No raw HTML may be in it."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(card.split("---\n", 2)[2])
    assert not [t for t in tokens if t.type.startswith("html")]
    inlines = [t for t in tokens if t.type == "inline"]
    assert not [c for t in inlines for c in t.children if c.type.startswith("html")]
    headings = ["".join(c.content for c in tokens[i + 1].children)
                for i, t in enumerate(tokens) if t.type == "heading_open"]
    dataset = next(c.content for c in inlines[1].children if c.type == "code_inline")
    return headings, dataset


@pytest.mark.parametrize("model, dataset", [
    ("evil\n\n<img src=x onerror=alert(1)>\n# Injected", "d`x`\n---\nlicense: mit"),
    ("*bold* _it_ [a](http://x) &amp; ~~s~~ | a #", "`quoted`"),
])
def test_the_card_shows_the_model_and_dataset_names_as_they_are(extracted, tmp_path, model, dataset):
    """Names went into the card's Markdown as they are: a line break in one ended its line and the
    rest became the card's own headings, raw HTML or paragraphs; a backtick ended the dataset's code
    span; emphasis, links, entities and a heading's closing #s rendered as other text. Now each renders
    as itself on its line (a control character as its escape); the front matter still parses."""
    from huggingface_hub import DatasetCard

    _, extract_dir = extracted("gpt2", model={"name": model}, dataset={"name": dataset})
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, POOLED, progress=False)
    card = (root / "README.md").read_text()
    headings, shown = card_heading_and_dataset(card)
    assert headings == ["lmprobe 2.0 activations of " + model.replace("\n", "\\x0a")]
    assert shown == dataset.replace("\n", "\\x0a")
    assert DatasetCard.load(root / "README.md").data.to_dict()["configs"][0]["config_name"] == "default"
    assert lmprobe.verify(root) == []
