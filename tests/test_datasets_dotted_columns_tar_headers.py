"""Datasets, review 62: an Arrow column named with a dot is read as itself; an image folder's
metadata line Python cannot parse, a folder of .json files and a tar's huge extended header are
each named (file and line, or byte)."""
from __future__ import annotations

import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from actstore.datasets import load_dataset, scan_dataset
from actstore.errors import ConfigError


def flattened_table() -> pa.Table:
    """SQuAD after Dataset.flatten(): its answers struct's fields are columns named `answers.text`."""
    return pa.table({"question": ["q0", "q1", "q2"], "answers.text": ["a0", "a1", "a2"], "label": [0, 1, 0]})


def write(table: pa.Table, path, fmt: str) -> None:
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
@pytest.mark.parametrize("options, texts, kept", [
    ({"text_field": "answers.text"}, ["a0", "a1", "a2"], [{}, {}, {}]),
    ({"text_field": "question", "keep_fields": ["answers.text"]}, ["q0", "q1", "q2"],
     [{"answers.text": "a0"}, {"answers.text": "a1"}, {"answers.text": "a2"}]),
])
def test_a_column_named_with_a_dot_is_read_as_itself(fmt, options, texts, kept, tmp_path):
    """A flattened dataset's `answers.text` (save_to_disk: Arrow) was taken for the child `text` of a struct
    `answers`: the scan failed with a bare KeyError; Parquet read it as the column."""
    path = tmp_path / f"squad.{fmt}"
    write(flattened_table(), path, fmt)
    scan = scan_dataset(path, **options)
    parts = [load_dataset(path, parts=(2, part), scan=scan, **options).samples for part in range(2)]
    samples = parts[0] + parts[1]
    assert [s.sample_idx for s in samples] == [0, 1, 2]
    assert [s.text for s in samples] == texts
    assert [s.metadata for s in samples] == kept
    assert [s.label for s in samples] == [0, 1, 0]


@pytest.mark.parametrize("value, error", [
    ("[" * 100_000 + "]" * 100_000, r"not valid JSON \(nested too deeply to parse\)"),
    ("9" * 5000, r"cannot be read \(Exceeds the limit"),
])
def test_an_image_folders_metadata_line_python_cannot_read_is_named(value, error, image_folder, tmp_path):
    """A metadata.jsonl line nested too deeply or holding a whole number of over 4,300 digits failed the
    scan with a bare RecursionError or ValueError, naming no file or line."""
    import shutil

    folder = tmp_path / "photos"
    shutil.copytree(image_folder, folder)
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png"))
    lines = [json.dumps({"file_name": name, "caption": name}) for name in names]
    lines[1] = '{"file_name": %s, "caption": %s}' % (json.dumps(names[1]), value)
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"metadata\.jsonl:2: " + error):
        scan_dataset(folder)


@pytest.mark.parametrize("fmt", ["auto", "jsonl"])
def test_a_folder_of_json_files_is_named_not_sent_to_text_folder(fmt, tmp_path):
    """A Hub snapshot's data/train.json and data/test.json (one JSON array each) are not a folder's shards;
    the error said the folder held no data files and pointed to dataset.format text_folder, which
    reads each file whole as one sample's text."""
    (tmp_path / "data").mkdir()
    for split in ("test", "train"):
        (tmp_path / "data" / f"{split}.json").write_text(json.dumps([{"text": split}]))
    with pytest.raises(ConfigError, match=r"holds no samples \(its \.json files, such as data/test\.json, are not read "
                                          r"as a folder's shards: set dataset\.path to one, or to a glob of them\)$"):
        scan_dataset(tmp_path, format=fmt)


@pytest.mark.parametrize("header", ["pax", "gnu"])
def test_a_tar_header_of_more_than_names_take_is_refused_not_read_into_memory(header, tmp_path):
    """A pax or GNU long-name header's text was read whole into memory, whatever its size (a damaged or
    hostile shard's header of gigabytes: the scan, and every Snakemake parse's estimate, ran out of
    memory); past tar.MAX_EXTENSION_BYTES it is named with its byte."""
    from actstore.datasets import tar, webdataset

    path = tmp_path / "shard-000.tar"
    image = io.BytesIO()
    Image.new("RGB", (4, 4)).save(image, "PNG")
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT if header == "pax" else tarfile.GNU_FORMAT) as shard:
        for name, data in (("000.png", image.getvalue()), ("000.cls", b"1")):
            huge = name == "000.png"  # the first member's header alone
            long_name = "d" * (tar.MAX_EXTENSION_BYTES + 1) + "/" + name
            info = tarfile.TarInfo(long_name if huge and header == "gnu" else name)
            info.size = len(data)
            if huge and header == "pax":
                info.pax_headers = {"comment": "c" * (tar.MAX_EXTENSION_BYTES + 1)}
            shard.addfile(info, io.BytesIO(data))
    error = r"shard-000\.tar: the extended header at byte 0 holds \d+ bytes, more than a name and pax records take"
    with pytest.raises(ConfigError, match=error):
        scan_dataset(path)
    with pytest.raises(ConfigError, match=error):
        webdataset.estimate_samples((path,))
