"""Review of the table readers (tables.py, splits.py): faults a user's real tables hit."""
from __future__ import annotations

import io
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tiny
from actstore.datasets import check_dataset, load_dataset
from actstore.datasets.tables import blocks
from actstore.errors import ConfigError


def _texts(path, split="train"):
    return [s.text for s in load_dataset(path, split=split).samples]


def _languages(root):
    """A Hub repository of one folder per language, each with its train and test shards."""
    for lang in ("en", "fr"):
        (root / lang).mkdir(parents=True)
        for split in ("train", "test"):
            pq.write_table(pa.table({"text": [f"{lang} {split} {i}" for i in range(2)]}),
                           root / lang / f"{split}-00000.parquet")
    return root


def test_readme_data_files_are_relative_to_the_configs_data_dir(tmp_path):
    """datasets resolves a config's data_files inside its data_dir (BuilderConfig._resolve_data_files):
    the `en` config's `**/train-*` is en's train shards. Before, data_dir was ignored beside data_files:
    the French rows were read too, without a word (or `train-*` matched nothing: 'holds no samples')."""
    root = _languages(tmp_path / "repo")
    for pattern in ("'**/train-*.parquet'", "train-*.parquet"):
        (root / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_dir: en\n  data_files:\n"
                                        f"  - split: train\n    path: {pattern}\n"
                                        "  - split: test\n    path: test-*\n---\n")
        assert _texts(root, "train") == ["en train 0", "en train 1"]
        assert _texts(root, "test") == ["en test 0", "en test 1"]


@pytest.mark.parametrize("data_dir", ["..", "../other", "/etc"])
def test_a_readme_data_dir_outside_the_repository_is_named(data_dir, tmp_path):
    """A data_dir read from README.md is resolved inside the repository; before, one outside it
    read as 'holds no samples', naming neither the README nor its data_dir."""
    root = _languages(tmp_path / "repo")
    (root / "README.md").write_text(f"---\nconfigs:\n- config_name: default\n  data_dir: {data_dir}\n---\n")
    with pytest.raises(ConfigError, match=re.escape(f"{root / 'README.md'}: configs data_dir: {data_dir!r} is not a "
                                                    f"relative path inside {root}")):
        check_dataset({"path": str(root)})


def _png(value: int) -> bytes:
    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), value, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_an_arrow_image_tables_names_are_read_without_its_image_bytes(tmp_path):
    """An Arrow block's `image.path` is that struct child alone, as a Parquet row group's read is:
    before, the whole {bytes, path} column was selected and converted to Python, so a part's job
    paged in and copied every image of its rows only to name them (500 MB of images: 734 MB peak)."""
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": _png(i), "path": f"{i}.png"} for i in range(4)] + [{"bytes": _png(9), "path": None},
                                                                                    None], kind)
    table = pa.table({"image": images, "label": [0, 1, 0, 1, 0, 1]})
    (tmp_path / "arrow").mkdir()
    stream = tiny.write_arrow_stream(tmp_path / "arrow" / "data-00000-of-00001.arrow", table, batch_rows=4)
    parquet = tiny.write_parquet(tmp_path / "parquet", table, row_group_size=4) / "train-00000-of-00001.parquet"
    for fmt, path in (("arrow", stream), ("parquet", parquet)):
        read = [read() for _, read in blocks(fmt, path, ["image.path", "label"])]
        assert [block.schema.field("image").type for block in read] == [pa.struct([("path", pa.string())])] * 2, fmt
        assert pa.concat_tables(read).column("image").to_pylist() == [
            {"path": f"{i}.png"} for i in range(4)] + [{"path": None}, None]
    dataset = load_dataset(stream.parent, image_field="image")
    assert [s.text for s in dataset.samples] == ["0.png", "1.png", "2.png", "3.png", "data-00000-of-00001.arrow#4",
                                                 "data-00000-of-00001.arrow#5"]
    assert [dataset.opener(s).getpixel((0, 0)) for s in dataset.samples[3:5]] == [(3, 3, 3), (9, 9, 9)]
    with pytest.raises(ConfigError, match="holds no image"):
        dataset.opener(dataset.samples[5])


@pytest.mark.parametrize("first, second", [
    (pa.array([0, 1]), pa.array(["0", "1"])),          # CSV shards: one inferred int64, one string
    (pa.array([0, 1]), pa.array([True, False])),       # True was class 1
    (pa.array(["a", "b"]), pa.array([0, 1], pa.int8()))])
def test_label_columns_of_different_kinds_across_shards_are_refused(first, second, tmp_path):
    """Label 1 in one shard and "1" in the next were two classes (labels 0, 1, '0', '1'), and True
    the class of 1, without a word; now named at parse time, with both files."""
    root = tmp_path / "mixed"
    root.mkdir()
    for i, labels in enumerate((first, second)):
        pq.write_table(pa.table({"text": ["x", "y"], "label": labels}), root / f"train-{i:05d}-of-00002.parquet")
    with pytest.raises(ConfigError, match=re.escape(f"{root / 'train-00001-of-00002.parquet'}: column 'label' "
                                                    f"(dataset.label_field) is {second.type}, but "
                                                    f"{root / 'train-00000-of-00002.parquet'}'s is {first.type}")):
        check_dataset({"path": str(root)})


def test_label_columns_of_one_kind_in_other_types_are_read(tmp_path):
    """Integers of two widths, strings plain and dictionary-encoded, and a shard of null labels
    (no kind) are one kind: read as before."""
    root = tmp_path / "kinds"
    root.mkdir()
    shards = [pa.array([0, 1], pa.int64()), pa.array([1, 2], pa.int32()), pa.array([None, None], pa.null())]
    for i, labels in enumerate(shards):
        pq.write_table(pa.table({"text": ["x", "y"], "label": labels}), root / f"train-{i:05d}-of-00003.parquet")
    assert load_dataset(root).labels == [0, 1, 2]
    words = tmp_path / "words"
    words.mkdir()
    for i, labels in enumerate([pa.array(["b", "a"]), pa.array(["a", "c"]).dictionary_encode()]):
        pq.write_table(pa.table({"text": ["x", "y"], "label": labels}), words / f"train-{i:05d}-of-00002.parquet")
    assert [s.label for s in load_dataset(words).samples] == ["b", "a", "a", "c"]
