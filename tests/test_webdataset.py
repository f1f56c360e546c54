"""WebDataset tar shards (LAION, DataComp, ImageNet-wds): samples are the members sharing a key, in
shard then member order; a part's job reads its rows from the scan's marks, never the shards
before them, and decodes exactly the images written; shards cut short, samples without an image
and data changed since the scan are named; and they extract exactly as the same image folder."""
from __future__ import annotations

import io
import itertools
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import tiny
from actstore.datasets import load_dataset, read_scan, scan_dataset, write_scan
from actstore.datasets import tar, webdataset
from actstore.datasets.source import resolve_source
from actstore.errors import ConfigError
from actstore.hashing import stage_hash, stage_payload
from test_datasets import part_files, refused_once_changed

SHARDS = (5, 7, 4)  # samples per shard
LONG = "long/" + "x" * 120  # a member name over tar's 100 characters: a pax header (GNU: a long-name member)


def encoded(pixels: np.ndarray, kind: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=kind)
    return buf.getvalue()


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(root: Path, shards: tuple[int, ...] = SHARDS) -> list[dict]:
    """Shards shard-0000N.tar of real PNG and JPEG images (seeded random pixels, sizes varied), with
    cls, txt and json members (every third sample without cls), a sample with a long name in each
    shard; the middle shard in GNU format, the others pax. Returns the samples in order: text,
    label, the pixels written (PNG) or the image bytes (JPEG)."""
    rng = np.random.default_rng(7)
    root.mkdir(parents=True, exist_ok=True)
    expected = []
    for shard, count in enumerate(shards):
        name = f"shard-{shard:05d}.tar"
        tar_format = tarfile.GNU_FORMAT if shard == 1 else tarfile.PAX_FORMAT
        with tarfile.open(root / name, "w", format=tar_format) as tar:
            for i in range(count):
                key = f"{LONG}{shard}{i}" if i == 2 else f"d{shard}/{shard:02d}{i:04d}"
                pixels = rng.integers(0, 256, (int(rng.integers(8, 40)), int(rng.integers(8, 40)), 3), dtype=np.uint8)
                kind = "jpeg" if i % 2 else "png"
                image = encoded(pixels, kind)
                label = None if i % 3 == 1 else (shard * 10 + i) % 4
                add(tar, f"{key}.{'jpg' if kind == 'jpeg' else 'png'}", image)
                if label is not None:
                    add(tar, f"{key}.cls", f"{label}\n".encode())
                add(tar, f"{key}.txt", f"caption {shard}-{i}".encode())
                add(tar, f"{key}.json", json.dumps({"i": i}).encode())
                expected.append({"text": f"{name}/{key}", "label": label, "caption": f"caption {shard}-{i}",
                                 "json": {"i": i},
                                 "pixels": pixels if kind == "png" else None, "bytes": image})
    return expected


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds") / "shards"
    return root, write_shards(root)


def test_tar_shards_scan_to_their_samples_in_shard_then_member_order(shards):
    root, expected = shards
    for path, fmt in [(root, "auto"), (root, "webdataset"), (f"{root}/shard-*.tar", "auto")]:
        assert resolve_source(str(path), fmt).format == "webdataset"
        scan = scan_dataset(path, format=fmt)
        assert scan.n_samples == sum(SHARDS) and scan.labels == [0, 1, 2, 3]
        dataset = load_dataset(path, format=fmt)
        assert dataset.modality == "image"
        assert [(s.sample_idx, s.text, s.label) for s in dataset.samples] == \
               [(i, e["text"], e["label"]) for i, e in enumerate(expected)]
    one = load_dataset(root / "shard-00001.tar")  # one file: named by its own name
    assert [s.text for s in one.samples] == [e["text"] for e in expected[5:12]]
    assert len(expected[7]["text"]) > 100 and expected[7]["text"] in [s.text for s in one.samples]


def test_a_part_seeks_to_its_rows_and_decodes_the_images_written(shards, tmp_path, monkeypatch):
    """Marks every 3 samples: a part in the middle of the second shard starts at the mark before
    it, opens no shard before it, and every image it reads is the one written (PNG: the same
    pixels; JPEG: its bytes' decoding). Every part together is the whole dataset."""
    root, expected = shards
    monkeypatch.setattr(webdataset, "MARK_SAMPLES", 3)
    write_scan(scan_dataset(root), tmp_path / "scan.json")
    scan = read_scan(tmp_path / "scan.json")
    assert [(m.row, m.file) for m in scan.marks] == [(0, 0), (3, 0), (5, 1), (6, 1), (9, 1), (12, 2), (15, 2)]
    opened, real_open = [], Path.open
    monkeypatch.setattr(Path, "open", lambda path, *a, **kw: opened.append(path.name) or real_open(path, *a, **kw))
    part = load_dataset(root, parts=(4, 2), scan=scan)  # rows 8-11: inside shard 1, from the mark at row 6
    assert [s.sample_idx for s in part.samples] == [8, 9, 10, 11]
    assert set(opened) == {"shard-00001.tar"}
    for sample in part.samples:
        want = expected[sample.sample_idx]
        image = part.opener(sample)
        part.opener.check(sample)
        if want["pixels"] is not None:
            assert np.array_equal(np.asarray(image), want["pixels"])
        else:
            assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(want["bytes"])).convert("RGB")))
    monkeypatch.setattr(Path, "open", real_open)
    whole = load_dataset(root)
    at_once = scan_dataset(root, workers=2)  # each shard in its own process, as the workflow's scan takes them
    assert (at_once.n_samples, at_once.labels) == (scan.n_samples, scan.labels) and at_once.marks != scan.marks
    for parts, joined in itertools.product((2, 3, 5, 16), (scan, at_once)):
        read = [s for p in range(parts) for s in load_dataset(root, parts=(parts, p), scan=joined).samples]
        assert [(s.sample_idx, s.text, s.label, s.ref) for s in read] == \
               [(s.sample_idx, s.text, s.label, s.ref) for s in whole.samples]


def test_a_glob_and_a_folder_give_the_same_rows(shards, tmp_path):
    root, _ = shards
    (tmp_path / "notes.txt").write_text("not a shard")
    for name in ("shard-00000.tar", "shard-00002.tar"):
        shutil.copy(root / name, tmp_path / name)
    folder = load_dataset(tmp_path, parts=(2, 1))
    glob = load_dataset(f"{tmp_path}/shard-*.tar", parts=(2, 1))
    assert [(s.sample_idx, s.text, s.label, s.ref) for s in folder.samples] == \
           [(s.sample_idx, s.text, s.label, s.ref) for s in glob.samples]
    assert folder.samples[-1].text.startswith("shard-00002.tar/") and folder.n_samples == 9


def test_a_shard_cut_short_is_named_with_its_member(shards, tmp_path):
    """Cut inside a member's data, or inside a header: the scan names the shard (and the member);
    a part reading from a scan taken before the cut refuses the changed shard."""
    root, _ = shards
    cut = shutil.copytree(root, tmp_path / "cut")
    data = (cut / "shard-00001.tar").read_bytes()
    scan = scan_dataset(cut)
    with tarfile.open(cut / "shard-00001.tar") as tar:
        member = tar.getmembers()[5]
    (cut / "shard-00001.tar").write_bytes(data[:member.offset_data + member.size // 2])
    with pytest.raises(ConfigError, match=rf"shard-00001\.tar: member '{member.name}' ends after the end of the file"):
        scan_dataset(cut)
    with pytest.raises(ConfigError, match=r"shard-00001\.tar: changed since the dataset was scanned"):
        load_dataset(cut, parts=(3, 1), scan=scan)
    (cut / "shard-00001.tar").write_bytes(data[:member.offset + 100])
    with pytest.raises(ConfigError, match=rf"shard-00001\.tar: damaged tar header at byte {member.offset}"):
        scan_dataset(cut)
    (cut / "shard-00001.tar").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"shard-00001\.tar: not an uncompressed tar file"):
        scan_dataset(cut)


def test_a_shard_cut_where_a_member_starts_is_named_not_read_as_fewer_samples(shards, tmp_path):
    """A shard ending where a member's header starts, without tar's end-of-archive blocks (a copy
    or a quota stopped at a block boundary): tarfile and tar list the members before, and so did
    the scan, the last sample lost without a word. The scan names the shard and the byte; a shard
    ending after one of its end blocks has lost nothing and reads whole."""
    root, expected = shards
    cut = shutil.copytree(root, tmp_path / "cut")
    data = (cut / "shard-00001.tar").read_bytes()
    with tarfile.open(cut / "shard-00001.tar") as archive:
        last = archive.getmembers()[-4:]  # the last sample's png, cls, txt and json
    assert {m.name.split(".")[0] for m in last} == {"d1/010006"}
    (cut / "shard-00001.tar").write_bytes(data[:last[0].offset])
    with pytest.raises(ConfigError, match=rf"shard-00001\.tar: ends at byte {last[0].offset}, a member's header, "
                                          r"without the end-of-archive blocks: the shard is cut short"):
        scan_dataset(cut)
    end = last[-1].offset_data + -(-last[-1].size // 512) * 512
    (cut / "shard-00001.tar").write_bytes(data[:end + 512])
    assert scan_dataset(cut).n_samples == len(expected)


def test_a_sample_without_one_image_is_refused_naming_its_key(tmp_path):
    """No image or two images is named by the scan, with the shard and key, unless dataset.limit
    stops before it (a link in place of one: test_a_link_to_no_member_before_it_is_named...);
    dataset.image_field picks one of two images by extension."""
    png = encoded(np.zeros((4, 4, 3), np.uint8), "png")
    cases = {"none": ([("k1.cls", b"1"), ("k1.json", b"{}")], "no images"),
             "two": ([("k1.jpg", encoded(np.ones((4, 4, 3), np.uint8), "jpeg")), ("k1.png", png)], "2 images")}
    for case, (members, message) in cases.items():
        path = tmp_path / f"{case}.tar"
        with tarfile.open(path, "w") as tar:
            add(tar, "k0.png", png)
            for name, data in members:
                add(tar, name, data)
        with pytest.raises(ConfigError, match=rf"{case}\.tar: sample 'k1' \(members: .*\): {message}"):
            scan_dataset(path)
        assert scan_dataset(path, limit=1).n_samples == 1  # past the limit: not read
    picked = load_dataset(tmp_path / "two.tar", image_field="png")
    assert [(s.text, s.ref[2]) for s in picked.samples] == [("two.tar/k0", len(png)), ("two.tar/k1", len(png))]


@pytest.mark.parametrize("extension", ["cls", "png"])
def test_a_sample_with_two_members_of_one_extension_is_refused_naming_it(extension, tmp_path):
    """Two members of one extension in a sample (a.png, a.cls, a.cls) leave its label, or its image,
    ambiguous: refused naming the shard, key and extension, as webdataset refuses them (before, the
    first `cls` was its label without a word, and two `png` with dataset.image_field png were named
    as no png member)."""
    png = encoded(np.zeros((4, 4, 3), np.uint8), "png")
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in [("k0.png", png), ("k0.cls", b"0"), ("k1.png", png), ("k1.cls", b"0"),
                           (f"k1.{extension}", png if extension == "png" else b"1")]:
            add(tar, name, data)
    with pytest.raises(ConfigError, match=rf"dup\.tar: sample 'k1' \(members: .*\): two '{extension}' members"):
        load_dataset(path, image_field="png")
    assert scan_dataset(path, limit=1).n_samples == 1


def test_a_member_name_that_is_not_utf8_is_named_by_the_scan(tmp_path):
    """A member name written in another encoding (latin-1 café) is read with a surrogate, which no
    writer stores as UTF-8 text (pyarrow refused the sample's text after the model ran): the scan
    names the shard and sample."""
    png = encoded(np.zeros((4, 4, 3), np.uint8), "png")
    path = tmp_path / "latin.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        add(tar, "k0.png", png)
        add(tar, "caf\xe9.png", png)
    with pytest.raises(ConfigError, match=r"latin\.tar: sample 'caf\\udce9' \(members: png\): its member name \(not "
                                          r"UTF-8 in the tar\) holds an unpaired surrogate"):
        scan_dataset(path)
    assert scan_dataset(path, limit=1).n_samples == 1


def test_member_names_are_names_not_paths(tmp_path):
    """An absolute name or one with `..` is the sample's key; its image is read from the tar by
    offset, so a file of that name outside the tar is never read."""
    outside = tmp_path / "outside"
    outside.mkdir()
    written = {"/abs/k0": np.full((6, 6, 3), 10, np.uint8), "../outside/k1": np.full((6, 6, 3), 200, np.uint8)}
    (outside / "k1.png").write_bytes(encoded(np.zeros((6, 6, 3), np.uint8), "png"))  # not what is read
    with tarfile.open(tmp_path / "names.tar", "w") as tar:
        for key, pixels in written.items():
            add(tar, f"{key}.png", encoded(pixels, "png"))
    dataset = load_dataset(tmp_path / "names.tar")
    assert [s.text for s in dataset.samples] == ["names.tar//abs/k0", "names.tar/../outside/k1"]
    for sample, pixels in zip(dataset.samples, written.values()):
        assert np.array_equal(np.asarray(dataset.opener(sample)), pixels)


def test_label_field_names_the_label_member(shards, tmp_path):
    """Unset: the cls member's integer when present; set: that member's text, which every sample
    must have. A cls member that is not an integer is named."""
    root, expected = shards
    captions = load_dataset(root, label_field="txt")
    assert [s.label for s in captions.samples] == [e["caption"] for e in expected]
    with pytest.raises(ConfigError, match=r"shard-00000\.tar: sample 'd0/000001' \(members: jpg, txt, json\): "
                                          r"no 'cls' member \(dataset.label_field\)"):
        scan_dataset(root, label_field="cls")
    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        add(tar, "k.png", encoded(np.zeros((4, 4, 3), np.uint8), "png"))
        add(tar, "k.cls", b"cat")
    with pytest.raises(ConfigError, match=r"bad\.tar: sample 'k' .*its 'cls' member is not an integer"):
        scan_dataset(tmp_path / "bad.tar")


def test_keep_fields_carry_members_as_each_samples_metadata(shards, tmp_path):
    """dataset.keep_fields names member extensions: a caption's text as written, a json member's
    value, read for a part's rows from the mark before them; a sample without one, or a json
    member that is not JSON, is named by the scan, before any part's job."""
    root, expected = shards
    scan = scan_dataset(root, keep_fields=["txt", "json"])
    part = load_dataset(root, parts=(3, 1), scan=scan, keep_fields=["txt", "json"])
    assert [s.sample_idx for s in part.samples] == list(range(6, 12))
    assert [s.metadata for s in part.samples] == \
           [{"txt": expected[s.sample_idx]["caption"], "json": expected[s.sample_idx]["json"]} for s in part.samples]
    with pytest.raises(ConfigError, match=r"shard-00000\.tar: sample 'd0/000000' .*no 'seg' member \(dataset.keep_fields\)"):
        scan_dataset(root, keep_fields=["seg"])
    with tarfile.open(tmp_path / "bad.tar", "w") as tar:
        add(tar, "k.png", encoded(np.zeros((4, 4, 3), np.uint8), "png"))
        add(tar, "k.json", b"{not json")
    with pytest.raises(ConfigError, match=r"bad\.tar: sample 'k' .*its 'json' member is not JSON"):
        scan_dataset(tmp_path / "bad.tar", keep_fields=["json"])


def test_data_changed_since_the_scan_is_refused_by_a_part(shards, tmp_path):
    root, _ = shards
    copy = shutil.copytree(root, tmp_path / "copy")
    for change, message in [(lambda: os.utime(copy / "shard-00001.tar", ns=(1, 1)), r"shard-00001\.tar: changed since"),
                            (lambda: shutil.copy(copy / "shard-00000.tar", copy / "shard-00003.tar"),
                             r"holds 4 data files, 3 when the dataset was scanned")]:
        refused_once_changed(copy, change, message)


def test_the_extract_hash_and_the_sizing_follow_the_shards(shards, model_dir, tmp_path):
    from actstore import resources
    root = shutil.copytree(shards[0], tmp_path / "shards")
    config = tiny.make_config(tmp_path, model_dir("dinov2"), root)
    assert "data_stat" in stage_payload(config, "extract")["config"]["dataset"]
    assert resources.workload(config).rows == pytest.approx(sum(SHARDS), rel=0.5)
    before = stage_hash(config, "extract")
    os.utime(root / "shard-00002.tar", ns=(1, 1))
    assert stage_hash(config, "extract") != before
    assert resources.workload(tiny.make_config(tmp_path, model_dir("dinov2"), root / "shard-00000.tar")).rows == 5


def test_tar_shards_extract_the_image_folder_bytes(model_dir, image_folder, tmp_path):
    """The image folder's files in its order, as two tar shards (label: a txt member holding the
    folder name) extract to the same activations, token rows and labels; only the sample names
    differ. Decoded in two DataLoader workers; the parts' boundary falls inside a shard."""
    files = sorted(p for p in image_folder.rglob("*.png"))
    root = tmp_path / "shards"
    root.mkdir()
    for shard, chunk in enumerate((files[:3], files[3:])):
        with tarfile.open(root / f"train-{shard}.tar", "w") as tar:
            for path in chunk:
                key = path.relative_to(image_folder).with_suffix("").as_posix()
                add(tar, f"{key}.png", path.read_bytes())
                add(tar, f"{key}.txt", path.parent.name.encode())
    folder = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder, extract={"batch_size": 3})
    config = tiny.make_config(tmp_path, model_dir("dinov2"), root, dataset={"label_field": "txt"},
                              extract={"batch_size": 3, "num_workers": 2})
    expected, got = part_files(folder, tmp_path / "folder"), part_files(config, tmp_path / "tar")
    rows = [[json.loads(line) for line in p.pop("samples.jsonl").splitlines()] for p in (*expected, *got)]
    half = len(rows) // 2
    names = [r.pop("text") for part in rows[half:] for r in part]
    assert names[:4] == ["train-0.tar/animal/img_00", "train-0.tar/animal/img_01", "train-0.tar/animal/img_02",
                         "train-1.tar/animal/img_03"]
    assert [r.pop("text") for part in rows[:half] for r in part] == [n.split("/", 1)[1] + ".png" for n in names]
    assert rows[half:] == rows[:half] and got == expected


# --- Tar headers (datasets/tar.py): the members tarfile lists, at a fraction of its cost. ---

def listed(path: Path) -> tuple[list, list]:
    """(tar.members', tarfile's) regular members of `path` as (name, offset, offset_data, size); a
    link's data is an earlier member's, before its header (extracted compares those)."""
    with path.open("rb") as fh:
        fast = [tuple(m) for m in tar.members(fh, 0, path.stat().st_size) if m.offset_data > m.offset]
    with tarfile.open(path) as archive:
        return fast, [(m.name, m.offset, m.offset_data, m.size) for m in archive.getmembers() if m.isreg()]


def extracted(path: Path) -> tuple[list, list]:
    """(tar.members', tarfile's) file and link members of `path` as (name, offset, data): a link's
    data as tarfile's extractfile reads it, the member's it names."""
    with path.open("rb") as fh:
        fast = [(m.name, m.offset, os.pread(fh.fileno(), m.size, m.offset_data))
                for m in tar.members(fh, 0, path.stat().st_size)]
    with tarfile.open(path) as archive:
        return fast, [(m.name, m.offset, archive.extractfile(m).read()) for m in archive.getmembers()
                      if m.isreg() or m.islnk() or m.issym()]


def write_tree(root: Path, long_names: bool) -> Path:
    """Files (empty, a block and a byte, unicode, nested, long names), a folder, symbolic links (one
    to its folder's parent) and a hard link (long names: and links whose target is over 100
    characters, a GNU long-link member or a pax linkpath)."""
    names = ["a.png", "a.txt", "b.cls", "ünï/cödé.json", "deep/" * 22 + "n.png"]
    names += ["x" * 140 + ".jpg", "dir/" + "y" * 110 + ".json"] if long_names else []
    for i, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(bytes(range(256)) * i * 2 + b"z" * i)
    (root / "folder").mkdir()
    (root / "link.png").symlink_to("a.png")
    (root / "ünï" / "up.cls").symlink_to("../b.cls")
    if long_names:
        (root / "z-long-link.png").symlink_to("x" * 140 + ".jpg")  # after it: tar.members looks back
        os.link(root / "dir" / ("y" * 110 + ".json"), root / "dir" / ("z" * 110 + ".json"))
    os.link(root / "a.txt", root / "hard.txt")
    return root


def files_in(tree: Path) -> int:
    """Regular files, a hard link's twin counted once (the tar holds it as a link member)."""
    return len({p.stat().st_ino for p in tree.rglob("*") if p.is_file() and not p.is_symlink()})


def links_in(tree: Path) -> int:
    return sum(1 for p in tree.rglob("*") if p.is_symlink()) + sum(p.is_file() and not p.is_symlink()
                                                                   for p in tree.rglob("*")) - files_in(tree)


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_headers_list_what_tarfile_lists_from_pythons_tars(tar_format, tmp_path):
    tree = write_tree(tmp_path / "tree", long_names=tar_format != tarfile.USTAR_FORMAT)
    with tarfile.open(tmp_path / "t.tar", "w", format=tar_format) as archive:
        for path in sorted(tree.rglob("*")):
            archive.add(path, path.relative_to(tree).as_posix(), recursive=False)
    fast, reference = listed(tmp_path / "t.tar")
    assert fast == reference and len(reference) == files_in(tree)
    fast, reference = extracted(tmp_path / "t.tar")
    assert fast == reference and len(reference) == files_in(tree) + links_in(tree)


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar is not installed")
@pytest.mark.parametrize("tar_format", ["gnu", "posix", "ustar", "v7"])
def test_tar_headers_list_what_tarfile_lists_from_gnu_tars(tar_format, tmp_path):
    """The tars of the `tar` tool, as most shards are made (v7: short names only, its folders are
    files named with a slash)."""
    tree = write_tree(tmp_path / "tree", long_names=tar_format in ("gnu", "posix"))
    if tar_format == "v7":
        shutil.rmtree(tree / "deep")
    subprocess.run(["tar", "--sort=name", f"--format={tar_format}", "-cf", str(tmp_path / "t.tar"),
                    "-C", str(tree), "."], check=True)
    fast, reference = listed(tmp_path / "t.tar")
    assert fast == reference and len(reference) == files_in(tree)
    fast, reference = extracted(tmp_path / "t.tar")
    assert fast == reference and len(reference) == files_in(tree) + links_in(tree)


@pytest.mark.parametrize("tar_format", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_a_member_past_8_gib_has_its_size_from_base_256_or_pax(tar_format, tmp_path):
    """A size past ustar's 11 octal digits: GNU writes it in base 256, pax in a size record. The
    file is sparse: its 8 GiB member is a hole."""
    big = tarfile.TarInfo("big.bin")
    big.size = (1 << 33) + 3
    small = tarfile.TarInfo("next.txt")
    small.size = 5
    path = tmp_path / "big.tar"
    with path.open("wb") as fh:
        fh.write(big.tobuf(tar_format))
        fh.seek(-(-big.size // 512) * 512, os.SEEK_CUR)
        fh.write(small.tobuf(tar_format) + b"hello".ljust(512, b"\0") + bytes(1024))
    fast, reference = listed(path)
    assert fast == reference and [m[3] for m in fast] == [(1 << 33) + 3, 5]


def test_a_checksum_summed_over_signed_bytes_is_accepted_as_tarfile_accepts_it(tmp_path):
    """Old tars (Sun tar, early GNU) summed the header's bytes as signed chars: a name with bytes
    past 127 then gives another checksum."""
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as archive:
        add(archive, "ünï.png", encoded(np.zeros((4, 4, 3), np.uint8), "png"))
    data = bytearray(path.read_bytes())
    header = bytes(data[:148]) + b" " * 8 + bytes(data[156:512])
    signed = sum(b - 256 if b > 127 else b for b in header)
    assert signed != sum(header)
    data[148:156] = b"%06o\0 " % signed
    path.write_bytes(data)
    fast, reference = listed(path)
    assert fast == reference == [("ünï.png", 0, 512, reference[0][3])]


def test_a_damaged_header_a_sparse_member_or_a_global_path_is_named(tmp_path):
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w") as archive:
        for name in ("k0.png", "k0.cls", "k1.png"):
            add(archive, name, encoded(np.zeros((4, 4, 3), np.uint8), "png") if name.endswith("png") else b"1")
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as archive:
        second = archive.getmembers()[1].offset
    data[second + 3] ^= 1
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=rf"t\.tar: damaged tar header at byte {second} \(bad checksum\)"):
        scan_dataset(path)
    for records, refused in (({"comment": "made by a test"}, False), ({"path": "elsewhere"}, True)):
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, pax_headers=records) as archive:
            add(archive, "k0.png", encoded(np.zeros((4, 4, 3), np.uint8), "png"))
        if refused:
            with pytest.raises(ConfigError, match=r"t\.tar: the global pax header at byte 0 sets path"):
                scan_dataset(path)
        else:
            assert scan_dataset(path).n_samples == 1
    sparse = tarfile.TarInfo("k0.png")
    sparse.type = tarfile.GNUTYPE_SPARSE
    path.write_bytes(sparse.tobuf(tarfile.GNU_FORMAT) + bytes(1024))
    with pytest.raises(ConfigError, match=r"member 'k0\.png' at byte 0 is a sparse file"):
        scan_dataset(path)


def with_size(header: bytes, size: bytes) -> bytes:
    """A header block with its 12-byte size field replaced, its checksum made right again."""
    block = bytearray(header[:512])
    block[124:136] = size
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def test_a_negative_member_size_is_named_not_read_forever(tmp_path):
    """A base-256 size field holds negative numbers, and a pax size record any integer: a negative
    size is refused naming the shard and the header's byte. Before, a header of size -512 named
    itself as the next header (the scan never ended), and a pax size of -1 gave a member of size -1,
    whose read takes the rest of the file."""
    image = encoded(np.zeros((4, 4, 3), np.uint8), "png")
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        add(archive, "k0.png", image)
    end = 512 + -(-len(image) // 512) * 512
    negative = b"\xff" + ((-512) % (1 << 88)).to_bytes(11, "big")  # -512 in base 256, as tarfile writes it
    path.write_bytes(path.read_bytes()[:end] + with_size(tarfile.TarInfo("k1.png").tobuf(), negative) + bytes(1024))
    damaged = rf"damaged tar header at byte {end} \(negative size -512\)"
    with path.open("rb") as fh, pytest.raises(tar.TarError, match=damaged):
        list(itertools.islice(tar.members(fh, 0, path.stat().st_size), 10))  # at most 10: the loop it was
    with pytest.raises(ConfigError, match=rf"t\.tar: {damaged}"):
        scan_dataset(path)
    member = tarfile.TarInfo("k0.png")
    member.size, member.pax_headers = len(image), {"size": "-1"}
    path.write_bytes(member.tobuf(tarfile.PAX_FORMAT) + image.ljust(end - 512, b"\0") + bytes(1024))
    with pytest.raises(ConfigError, match=r"t\.tar: damaged pax header at byte 0 \(negative size -1\)"):
        scan_dataset(path)


def test_a_gnu_long_link_target_names_the_member_read(tmp_path):
    """A symbolic link whose target is over 100 characters: GNU tar and tarfile write its target as a
    long-link (`K`) member before it, its data skipped and its text the target read; before, the
    target was read as the next header and the valid shard refused as damaged."""
    images = [encoded(np.full((4, 4, 3), 50 * i, np.uint8), "png") for i in range(3)]
    path = tmp_path / "shard-00000.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as archive:
        add(archive, "s/" + "x" * 150 + ".png", images[0])
        add(archive, "s/0001.png", images[1])
        link = tarfile.TarInfo("s/0002.png")
        link.type, link.linkname = tarfile.SYMTYPE, "x" * 150 + ".png"
        archive.addfile(link)
    fast, reference = listed(path)
    assert fast == reference and [m[0] for m in fast] == ["s/" + "x" * 150 + ".png", "s/0001.png"]
    fast, reference = extracted(path)
    assert fast == reference and [m[0] for m in fast][2:] == ["s/0002.png"]
    dataset = load_dataset(path)
    assert [s.text for s in dataset.samples] == [f"shard-00000.tar/s/{n}" for n in ("x" * 150, "0001", "0002")]
    assert [dataset.opener(s).getpixel((0, 0)) for s in dataset.samples] == [(0,) * 3, (50,) * 3, (0,) * 3]


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar is not installed")
def test_a_member_stored_as_a_link_reads_as_the_member_it_names(tmp_path, monkeypatch):
    """GNU tar stores a file hard-linked on disk (labels or captions deduplicated, a repeated image)
    as a link member naming its first copy, and a symbolic link as one naming its target. Each was
    skipped: the sample's label read as none, its caption missing, its image refused as absent. Each
    reads as tarfile's extractfile reads it, by a part starting at a mark after the member named too."""
    tree = tmp_path / "tree"
    (tree / "s").mkdir(parents=True)
    images = [encoded(np.full((4, 4, 3), 60 * i, np.uint8), "png") for i in range(3)]
    files = {"0000.png": images[0], "0000.cls": b"1\n", "0000.txt": b"same", "0002.png": images[1],
             "0003.cls": b"2\n", "0003.txt": b"other", "0005.png": images[2], "0005.cls": b"0\n"}
    for name, data in files.items():
        (tree / "s" / name).write_bytes(data)
    for link, target in {"0001.png": "0000.png", "0001.cls": "0000.cls", "0001.txt": "0000.txt",
                         "0004.png": "0002.png", "0004.cls": "0003.cls", "0004.txt": "0001.txt",
                         "0005.txt": "0003.txt"}.items():
        os.link(tree / "s" / target, tree / "s" / link)
    for link, target in {"0002.cls": "0000.cls", "0002.txt": "../s/0000.txt", "0003.png": "0002.png"}.items():
        (tree / "s" / link).symlink_to(target)
    path = tmp_path / "shard-00000.tar"
    subprocess.run(["tar", "--sort=name", "-cf", str(path), "-C", str(tree), "s"], check=True)
    with tarfile.open(path) as archive:
        assert sum(m.islnk() or m.issym() for m in archive.getmembers()) == 10
        read = {m.name: archive.extractfile(m).read() for m in archive.getmembers() if not m.isdir()}
    fast, reference = extracted(path)
    assert fast == reference
    whole = load_dataset(path, keep_fields=["txt"])
    assert [(s.text, s.label, s.metadata) for s in whole.samples] == \
           [(f"shard-00000.tar/s/000{i}", int(read[f"s/000{i}.cls"]), {"txt": read[f"s/000{i}.txt"].decode()})
            for i in range(6)]
    for sample in whole.samples:
        key = sample.text.removeprefix("shard-00000.tar/")
        assert np.array_equal(np.asarray(whole.opener(sample)),
                              np.asarray(Image.open(io.BytesIO(read[f"{key}.png"])).convert("RGB")))
    monkeypatch.setattr(webdataset, "MARK_SAMPLES", 2)
    scan = scan_dataset(path, keep_fields=["txt"])
    assert [m.row for m in scan.marks] == [0, 2, 4]
    part = load_dataset(path, parts=(3, 2), scan=scan, keep_fields=["txt"])  # rows 4-5, from the mark at row 4
    assert [(s.text, s.label, s.metadata, s.ref) for s in part.samples] == \
           [(s.text, s.label, s.metadata, s.ref) for s in whole.samples[4:]]


@pytest.mark.parametrize("target", ["/etc/hostname", "../../../etc/hostname", "0001.cls", "../s"])
def test_a_link_to_no_member_before_it_is_named_and_nothing_outside_read(target, tmp_path):
    """A link's target is looked up among the archive's members before it, never on disk: one naming
    a file outside the archive, or a member after it (which tarfile would find), is refused naming
    the link; before, it was skipped and the sample read without its label."""
    path = tmp_path / "shard-00000.tar"
    with tarfile.open(path, "w") as archive:
        add(archive, "s/0000.png", encoded(np.zeros((4, 4, 3), np.uint8), "png"))
        link = tarfile.TarInfo("s/0000.cls")
        link.type, link.linkname = tarfile.SYMTYPE, target
        archive.addfile(link)
        add(archive, "s/0001.png", encoded(np.zeros((4, 4, 3), np.uint8), "png"))
        add(archive, "s/0001.cls", b"1")
    with pytest.raises(ConfigError, match=rf"shard-00000\.tar: member 's/0000\.cls' at byte \d+ is a link to "
                                          rf"'{re.escape(target)}', which no member before it is"):
        scan_dataset(path)
