"""One table of damage for every format: each corruption is named by the format's verify, and the
reader either refuses it (FormatError) or returns exactly the undamaged data, never wrong data.
Format-specific attacks (names planted in metadata, hostile pickles, saev's pointer) are in each
format's own tests."""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from actstore.errors import FormatError
from actstore.formats import format_module
from actstore.formats import lmprobe
from actstore.formats import pickle as pickle_format
from actstore.formats import saev
from actstore.formats import zarr as zarr_format
from actstore.formats.extract import open_extraction
from actstore.formats.lut import open_lut, precompute, write_lut
from actstore.hashing import stage_hash
from actstore.integrity import file_problem, file_record, problems_of
from actstore.model_config import model_params, read_model_config

DAMAGES = ("flip", "truncate", "delete", "swap", "garbage metadata", "mistyped record", "extra file", "symlink out",
           "metadata linked out", "linked directory", "directory moved out", "traversal name", "absolute name",
           "symlink loop")


@dataclass
class Store:
    root: Path
    data: str      # a data file (relative to root) the damage hits
    other: str     # a second data file, of the same kind (swapped with `data`)
    meta: str      # the top metadata file
    extra: str     # an unlisted file that looks like data
    read: Callable[[Path], bytes]  # everything the reader returns, as bytes (verify=True where offered)
    plant: Callable[[Path, str], None]  # make the metadata list one of its files by another name
    mistype: Callable[[Path], Path]  # give one file's record in the metadata a wrong type; that metadata file


def read_extraction(root: Path) -> bytes:
    extraction = open_extraction(root, verify=True)
    return b"".join(np.ascontiguousarray(extraction.activations("layer_0", i)).tobytes()
                    for i in range(extraction.n_samples))


def read_lmprobe(root: Path) -> bytes:
    dataset = lmprobe.open_dataset(root, verify=True)
    return b"".join(np.ascontiguousarray(dataset.tokens(i, 0)).tobytes() for i in range(dataset.num_prompts))


def read_zarr(root: Path) -> bytes:
    run = zarr_format.open_zarr(root, verify=True)
    return b"".join(np.ascontiguousarray(run.read(i, 0)).tobytes() for i in range(run.n_samples))


def read_pickle(root: Path) -> bytes:  # no verify option: every shard's checksum is checked as it loads
    return b"".join(np.ascontiguousarray(item["activation"]).tobytes()
                    for item in pickle_format.iter_activations(root, 0))


def read_saev(root: Path) -> bytes:
    store = saev.open_store(root, verify=True)
    return b"".join(store.vector(ex, layer, tok).tobytes() for ex in range(store.n_examples)
                    for layer in store.layers for tok in range(store.T))


def read_lut(root: Path) -> bytes:
    store = open_lut(root, verify=True)
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes()
                    for path in sorted(store.layers) for t in store.load(path).values())


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def rename_key(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


def plant_sums(root: Path, name: str) -> None:
    lines = (root / "SHA256SUMS").read_text().splitlines()
    digest, _, _ = lines[0].partition("  ")
    (root / "SHA256SUMS").write_text("\n".join([f"{digest}  {name}", *lines[1:]]) + "\n")


def mistyped(path: Path, edit: Callable[[dict], None]) -> Path:
    edit_json(path, edit)
    return path


def mistype_sums(root: Path) -> Path:
    """A SHA256SUMS line that is not `<64 hex>  <name>`."""
    lines = (root / "SHA256SUMS").read_text().splitlines()
    (root / "SHA256SUMS").write_text("\n".join(["-1", *lines[1:]]) + "\n")
    return root / "SHA256SUMS"


def build_lut(root: Path) -> Path:
    torch.manual_seed(0)
    sae = {"encoder_weight": torch.randn(16, 8), "encoder_bias": torch.randn(16),
           "decoder_weight": torch.randn(16, 8), "decoder_bias": torch.randn(8)}
    tables = {f"encoder.layer.1.{name}": precompute(sae, torch.randn(8, 4), torch.randn(4)) for name in ("q", "k")}
    return write_lut(root, tables, 4)


@pytest.fixture(scope="module")
def stores(extracted, tmp_path_factory) -> dict[str, Store]:
    config, extract_dir = extracted("bert")
    out = tmp_path_factory.mktemp("stores")
    extraction = open_extraction(extract_dir)
    lmprobe.write_dataset(extract_dir, out / "lmprobe", {}, progress=False)
    shards = [out / "zarr" / "shards" / zarr_format.shard_name(k) for k in range(len(extraction.parts))]
    for part, shard in zip(extraction.parts, shards):
        zarr_format.write_shard(part.dir, shard, None, git_commit="0" * 40, progress=False)
    zarr_format.write_manifest(out / "zarr", shards, None)
    params = model_params(read_model_config(extraction.meta["model"]["path"]))
    machines = [out / "pickle" / pickle_format.machine_dirname(k) for k in range(len(extraction.parts))]
    for part, machine in zip(extraction.parts, machines):
        pickle_format.write_machine(part.dir, machine, model_params=params, shard_size_mb=0.02, progress=False)
    pickle_format.merge_machines(machines, out / "pickle")
    lut_dir = build_lut(out / "lut")
    saev_dir = saev.write_store(extraction, {**config["saev"], "patches_per_shard": 100}, out / "saev",
                                stage_hash(config, "extract"), model_config=None, progress=False)
    shards = [p.name for p in sorted((out / "pickle" / "machine-0000").iterdir()) if p.name.startswith("shard_")]
    return {
        "extract": Store(extract_dir, "part-0000/layer_000.npy", "part-0000/layer_002.npy", "part-0000/part.json",
                         "part-0000/layer_009.npy", read_extraction,
                         lambda r, n: edit_json(r / "part-0000/part.json",
                                                lambda m: rename_key(m["files"], "layer_000.npy", n)),
                         lambda r: mistyped(r / "part-0000/part.json", lambda m: m["files"].update({"layer_000.npy": -1}))),
        "saev": Store(saev_dir, "acts000000.bin", "acts000001.bin", "metadata.json", "acts000099.bin", read_saev,
                      lambda r, n: edit_json(r / "actstore.json", lambda m: rename_key(m["files"], "windows.npy", n)),
                      lambda r: mistyped(r / "actstore.json", lambda m: m["files"]["acts000000.bin"].update(bytes="x"))),
        "lmprobe": Store(out / "lmprobe", "tensors/hidden_layer000_shard000.safetensors",
                         "tensors/hidden_layer002_shard000.safetensors", "index/train-00000-of-00001.parquet",
                         "tensors/hidden_layer000_shard009.safetensors", read_lmprobe, plant_sums, mistype_sums),
        "zarr": Store(out / "zarr", "shards/shard-0000.zarr/arrays/activations/0/0/0/0",
                      "shards/shard-0000.zarr/arrays/activations/0/1/0/0", "manifest.json",
                      "shards/shard-0000.zarr/arrays/activations/9/0/0/0", read_zarr,
                      lambda r, n: edit_json(r / "manifest.json", lambda m: m["shards"][0].update(path=n)),
                      lambda r: mistyped(r / "manifest.json", lambda m: m["shards"].__setitem__(0, -1))),
        "pickle": Store(out / "pickle", f"machine-0000/{shards[0]}", f"machine-0000/{shards[1]}", "metadata.json",
                        "machine-0000/shard_0099.pkl.gz", read_pickle,
                        lambda r, n: edit_json(r / "metadata.json", lambda m: m["shards"][0].update(filename=n)),
                        lambda r: mistyped(r / "metadata.json", lambda m: m["shards"][0].update(size_bytes="x"))),
        "lut": Store(lut_dir, "encoder.layer.1.q.lut.safetensors", "encoder.layer.1.k.lut.safetensors",
                     "metadata.json", "encoder.layer.1.v.lut.safetensors", read_lut,
                     lambda r, n: edit_json(r / "metadata.json",
                                            lambda m: m["layers"]["encoder.layer.1.q"].update(file=n)),
                     lambda r: mistyped(r / "metadata.json", lambda m: m["layers"].update({"encoder.layer.1.q": -1}))),
    }


def damage(kind: str, root: Path, store: Store, outside: Path) -> Path:
    """Apply `kind` to a copy of the store; return the file a verify problem must name."""
    data, meta = root / store.data, root / store.meta
    if kind == "flip":
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0x01
        data.write_bytes(bytes(raw))
    elif kind == "truncate":
        data.write_bytes(data.read_bytes()[:-1])
    elif kind == "delete":
        data.unlink()
    elif kind == "swap":  # two listed files trade places: each is whole, neither is where it belongs
        other = root / store.other
        first = data.read_bytes()
        data.write_bytes(other.read_bytes())
        other.write_bytes(first)
    elif kind == "garbage metadata":
        meta.write_bytes(b"{not json, not parquet")
        return meta
    elif kind == "mistyped record":
        return store.mistype(root)
    elif kind == "extra file":
        (root / store.extra).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data, root / store.extra)
        return root / store.extra
    elif kind == "symlink out":  # the same bytes, but living outside the store
        shutil.copyfile(data, outside)
        data.unlink()
        data.symlink_to(outside)
    elif kind == "metadata linked out":  # the same metadata, read from outside: nothing outside is read
        shutil.copyfile(meta, outside)
        meta.unlink()
        meta.symlink_to(outside)
        return meta
    elif kind == "linked directory":  # an unlisted link, named like data, to a directory outside the store
        outside.mkdir()
        shutil.copyfile(data, outside / data.name)
        link = (root / store.extra).with_name("linked-directory-" + Path(store.extra).name)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(outside, target_is_directory=True)
        return link
    elif kind == "directory moved out":  # the data file's directory lives outside, linked back in
        folder = data.parent
        if folder == root:
            pytest.skip("this format keeps its data files at the store's root")
        shutil.move(folder, outside)
        folder.symlink_to(outside, target_is_directory=True)
        return folder
    elif kind == "symlink loop":  # an unlisted link to itself: it cannot be resolved (a crash of verify before)
        link = (root / store.extra).with_name("looped-" + Path(store.extra).name)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(link.name)
        return link
    elif kind in ("traversal name", "absolute name"):  # the metadata points at a file outside
        shutil.copyfile(data, outside)
        name = f"../../../../../../..{outside}" if kind == "traversal name" else str(outside)
        store.plant(root, name)
        return outside
    return data


@pytest.mark.parametrize("kind", DAMAGES)
@pytest.mark.parametrize("name", ["extract", "saev", "lmprobe", "zarr", "pickle", "lut"])
def test_damage_is_named_by_verify_and_never_read_as_data(stores, name, kind, tmp_path):
    store = stores[name]
    root = tmp_path / store.root.name  # the same name: a saev store's directory is its metadata's hash
    shutil.copytree(store.root, root, symlinks=True)
    expected = store.read(root)
    named = damage(kind, root, store, tmp_path / "outside.bin")
    problems = format_module(name).verify(root)
    assert any(named.name in p for p in problems), problems
    try:
        served = store.read(root)
    except FormatError:
        served = None  # refused
    assert served in (None, expected)  # the reader may serve what it still can, exactly
    try:  # inspect summarises what it can, or refuses naming the fault: never another exception
        format_module(name).inspect(root)
    except FormatError:
        pass


UNRECORD = {  # the data file's checksum taken out of its record (the metadata file, the edit)
    "extract": ("part-0000/part.json", lambda m: m["files"]["layer_000.npy"].pop("sha256_tree")),
    "saev": ("actstore.json", lambda m: m["files"]["acts000000.bin"].pop("sha256_tree")),
    "zarr": ("shards/shard-0000.zarr/meta/files.json", lambda m: m["files"]["arrays/activations/0/0/0/0"].pop("sha256")),
    "pickle": ("machine-0000/metadata.json", lambda m: m["shards"][0].pop("checksum")),
    "lut": ("metadata.json", lambda m: m["layers"]["encoder.layer.1.q"].pop("sha256")),
}


# The metadata files of each store a reader parses, and values no writer puts in any field.
METADATA_FILES = {"extract": ["extract.json", "part-0000/part.json"],
                  "saev": ["metadata.json", "shards.json", "actstore.json"], "zarr": ["manifest.json"],
                  "pickle": ["metadata.json", "machine-0000/metadata.json"], "lut": ["metadata.json"]}
HOSTILE = [None, -1, 2 ** 63, 1e308, "../../../etc/passwd", "", [], {}, True, [1, 2], {"a": 1}, 1.5]


def mutate_one_value(document: object, rng: np.random.Generator) -> str:
    """Replace (or delete) one value anywhere in a JSON document, in place; say which."""
    places = []

    def walk(node: object, path: tuple) -> None:
        children = node.items() if isinstance(node, dict) else enumerate(node[:20]) if isinstance(node, list) else ()
        for key, child in children:
            places.append((node, key, path + (key,)))
            walk(child, path + (key,))
    walk(document, ())
    parent, key, path = places[rng.integers(len(places))]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[key]
        return f"del {path}"
    parent[key] = HOSTILE[rng.integers(len(HOSTILE))]
    return f"{path} = {parent[key]!r}"


@pytest.mark.parametrize("name", sorted(METADATA_FILES))
def test_a_metadata_value_of_any_type_is_a_problem_or_a_format_error_never_a_crash(stores, name, tmp_path):
    """One value of a metadata file changed to another type or a hostile value, 40 times (seeded):
    verify returns its problems and inspect reads or raises FormatError, never another exception
    (before session 34: ValueError, TypeError and KeyError from inspect on part.json, the pickle and
    the zarr metadata)."""
    store, module, rng = stores[name], format_module(name), np.random.default_rng(0)
    for attempt in range(40):
        root = tmp_path / str(attempt) / store.root.name
        shutil.copytree(store.root, root, copy_function=os.link)
        meta = root / METADATA_FILES[name][rng.integers(len(METADATA_FILES[name]))]
        document = json.loads(meta.read_text())
        what = mutate_one_value(document, rng)
        meta.unlink()  # a hard link to the shared store: replace, never write through it
        meta.write_text(json.dumps(document))
        assert isinstance(module.verify(root), list), what
        try:
            module.inspect(root)
        except FormatError:
            pass
        shutil.rmtree(root.parent)


@pytest.mark.parametrize("name", sorted(UNRECORD))
def test_a_checksum_taken_out_of_its_record_is_named_not_skipped(stores, name, tmp_path):
    """Every writer records each data file's sha256: a record left with its size alone (and a byte
    of the file then changed) is named by verify, never passed on the size."""
    store = stores[name]
    root = tmp_path / store.root.name
    shutil.copytree(store.root, root, symlinks=True)
    meta, edit = UNRECORD[name]
    edit_json(root / meta, edit)
    data = root / store.data
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    problems = format_module(name).verify(root)
    assert any(data.name in p for p in problems), problems


def test_a_store_whose_loader_index_would_not_fit_is_named_not_a_memory_error(stores, monkeypatch):
    from actstore.errors import ConfigError
    from actstore.formats.saev import loader
    store = stores["saev"].root
    assert len(loader.ShuffledActivations(store).runs) > 0
    monkeypatch.setattr(loader, "memory_budget", lambda: 0)  # as if the store outgrew the machine
    with pytest.raises(ConfigError, match=r"blocks of \d+ bytes \(\d+ examples\): the loader.s block index would need"):
        loader.ShuffledActivations(store)


def test_json_streamed_in_small_blocks_reads_as_json_loads(tmp_path, monkeypatch):
    """stream_json_object at 7 characters a block: values split anywhere (numbers, escapes, multi-byte
    text), any spacing, the nested object read or skipped; bad JSON is named with its character."""
    import random

    from actstore import integrity

    monkeypatch.setattr(integrity, "JSON_BLOCK_CHARS", 7)
    rng, path = random.Random(0), tmp_path / "doc.json"
    for _ in range(50):
        files = {f"d/{i}/é\u2028\"x": {"bytes": rng.randrange(10**12), "sha256": "%064x" % rng.getrandbits(256)}
                 for i in range(rng.randrange(6))}
        doc = {"a": rng.random(), "files": files, "z": [1, {"q": None}], "n": 123456789}
        path.write_text(json.dumps(doc, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5),
                        encoding="utf-8")
        read = {k: dict(v) if k == "files" else v for k, v in integrity.stream_json_object(path, "files")}
        assert read == doc
        assert {k: v for k, v in integrity.stream_json_object(path, "files") if k != "files"} == \
            {k: v for k, v in doc.items() if k != "files"}
    for text, match in [("{", r"not valid JSON \(Expecting value at character 1\)"), ("[]", "not a listing"),
                        ('{"files": [1]}', "not a listing"), ('{"a": 1} x', r"not valid JSON \(extra data at character 9\)"),
                        ('{"a" 1}', r"not valid JSON \(expected : at character 5\)"),
                        ("{1: 2}", r"not valid JSON \(a key that is not a string at character 1\)")]:
        path.write_text(text)
        with pytest.raises(FormatError, match=f"doc.json: {match}"):
            [(k, list(v) if k == "files" else v) for k, v in integrity.stream_json_object(path, "files", "a listing")]
    with pytest.raises(FormatError, match="nothing.json: missing"):
        list(integrity.stream_json_object(tmp_path / "nothing.json", "files"))


DEEP = "[" * 100_000 + "]" * 100_000  # past any recursion limit: json.loads raised RecursionError


@pytest.mark.parametrize("text, why", [
    ('{"a": 1, "b": {"c": 2, "c": 3}}', "key 'c' given twice"),
    ('{"n_examples": 1, "d_model": 4, "n_examples": 8}', "key 'n_examples' given twice"),
    ('{"a": [1, NaN]}', "NaN is not a JSON number"),
    ('{"a": Infinity}', "Infinity is not a JSON number"),
    ('{"a": -Infinity}', "-Infinity is not a JSON number"),
    ('{"a": ' + DEEP + "}", "nested too deeply to parse"),
])
def test_json_that_json_loads_lets_through_is_refused_naming_the_file(tmp_path, text, why):
    """A duplicate key (json.loads keeps the last value, where a hash of the text saw both), NaN or
    Infinity (not JSON numbers) and nesting too deep to parse: FormatError naming the file, whether
    read whole or streamed (outside the streamed object, whose millions of names are not held)."""
    from actstore.integrity import read_json, stream_json_object

    path = tmp_path / "metadata.json"
    path.write_text(text)
    named = re.escape(f"{path}: not valid JSON ({why})")
    with pytest.raises(FormatError, match=named):
        read_json(path)
    with pytest.raises(FormatError, match=named):
        list(stream_json_object(path, "files"))


def read_in_thread(read: Callable[[], object], fifo: Path) -> list[str]:
    """The FormatError messages of read(), run on a thread; fails the test when it waits on the FIFO
    (then released by opening the FIFO's other end, so that the thread ends)."""
    errors: list[str] = []

    def run() -> None:
        try:
            read()
        except FormatError as exc:
            errors.append(str(exc))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        with open(fifo, "w"):
            pass
        thread.join()
        pytest.fail(f"the read of {fifo} waited on the FIFO")
    return errors


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_json_file_that_is_not_a_regular_file_is_refused_never_waited_on(tmp_path, kind):
    """A FIFO named metadata.json blocked every command reading it forever; a directory raised
    IsADirectoryError: each is a FormatError naming it, read whole or streamed."""
    from actstore.integrity import read_json, stream_json_object

    path = tmp_path / "metadata.json"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    named = f"{path}: not a regular file (a FIFO, device or directory is never read)"
    assert read_in_thread(lambda: read_json(path), path) == [named]
    assert read_in_thread(lambda: list(stream_json_object(path, "files")), path) == [named]


def test_a_json_file_over_the_size_limit_is_refused_unread(tmp_path):
    """A file larger than any metadata file (a sparse one here: no disk) is named before any of it is
    read into memory."""
    from actstore import integrity

    path = tmp_path / "files.json"
    path.write_text("{}")
    size = integrity.JSON_MAX_BYTES + 1
    os.truncate(path, size)
    with pytest.raises(FormatError, match=re.escape(f"{path}: {size} bytes, over the {integrity.JSON_MAX_BYTES}")):
        integrity.read_json(path)


# What each reader reads by a recorded size, in a copy of a store (root: sys.argv[1]; the swapped
# file: path, its size and sha256: size, sha), for 3 seconds: (store, file, read).
SIZED_READS = {
    "zarr": ("zarr", "shards/shard-0000.zarr/arrays/seq_len/0",
             "from actstore.formats.zarr import ZarrStore\n"
             "read = lambda: ZarrStore(root / 'shards/shard-0000.zarr').vector('seq_len')"),
    "pickle": ("pickle", None,  # the Store's data file: the first shard
               "from actstore.formats.pickle import load_metadata, load_shard\n"
               "info = load_metadata(root)['shards'][0]\n"
               "read = lambda: load_shard(root, info)"),
    "verify": ("pickle", None,  # every format's verify checks a listed file so
               "from actstore.integrity import file_problem\n"
               "read = lambda: file_problem(path, {'bytes': size, 'sha256': sha}, 'the test')"),
}


@pytest.mark.parametrize("name", sorted(SIZED_READS))
def test_a_file_read_by_its_recorded_size_is_the_one_opened_never_one_looked_at_before(stores, tmp_path, name):
    """A zarr vector chunk, a pickle shard and a file verify hashes (integrity.file_problem) were looked
    at (is_file, stat) and then opened by name: a FIFO renamed into the file's place in between
    blocked the reader forever (within a second of swaps). With the file and a FIFO swapped into its
    name over and over, every read returns or refuses, naming the file."""
    import hashlib
    import subprocess
    import sys

    store_name, rel, reads = SIZED_READS[name]
    store = stores[store_name]
    root = tmp_path / store.root.name
    shutil.copytree(store.root, root, symlinks=True)
    path = root / (rel or store.data)
    data, stop = path.read_bytes(), threading.Event()

    def swap() -> None:
        for k in itertools.count():
            if stop.is_set():
                return
            tmp = tmp_path / f"swap{k % 2}"
            tmp.write_bytes(data) if k % 2 else os.mkfifo(tmp)
            os.rename(tmp, path)

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    script = ("import sys, time\nfrom pathlib import Path\nfrom actstore.errors import FormatError\n"
              f"root, path = Path(sys.argv[1]), Path({str(path)!r})\n"
              f"size, sha = {len(data)}, {hashlib.sha256(data).hexdigest()!r}\n"
              f"{reads}\nend = time.time() + 3\nwhile time.time() < end:\n"
              "    try:\n        read()\n    except FormatError:\n        pass\n")
    try:
        subprocess.run([sys.executable, "-c", script, str(root)], check=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a read of {path} waited on the FIFO swapped into its place")
    finally:
        stop.set()
        swapper.join()


def test_read_sized_names_the_file_and_both_sizes(tmp_path):
    """integrity.read_sized: a file of another size, a FIFO, and a file that reads longer than it
    said it was when opened (/proc's files say 0 bytes) are each a FormatError naming the file."""
    from actstore.integrity import read_sized

    path = tmp_path / "0"
    path.write_bytes(b"12345678")
    assert read_sized(path, 8, "the test") == b"12345678"
    with pytest.raises(FormatError, match=re.escape(f"{path}: 8 bytes, expected 9 from the test")):
        read_sized(path, 9, "the test")
    path.unlink()
    os.mkfifo(path)
    assert read_in_thread(lambda: read_sized(path, 0, "the test"), path) == [
        f"{path}: not a regular file (a FIFO, device or directory is never read)"]
    with pytest.raises(FormatError, match="/proc/self/status: more than 0 bytes read, 0 when opened: it changed"):
        read_sized(Path("/proc/self/status"), 0, "the test")


def test_sorted_files_walks_in_sorted_name_order(tmp_path):
    """Names that sort around "/" ("a.x", "a-b", "a0" against the directory "a"), digits sorted as
    text, links listed and not followed: one directory at a time gives what sorting every name does."""
    from actstore.integrity import sorted_files

    for rel in ["a/b", "a/c/d", "a.x", "a-b", "a0", "ab/1", "10/0", "2/0", "1/0", "b", ".z", "a/.b/c"]:
        (tmp_path / "root" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "root" / rel).write_text(rel)
    (tmp_path / "root" / "link").symlink_to(tmp_path / "root" / "a")
    names = [p.relative_to(tmp_path / "root").as_posix() for p in (tmp_path / "root").rglob("*")
             if p.is_file() and not p.is_relative_to(tmp_path / "root" / "link") or p.is_symlink()]
    assert list(sorted_files(tmp_path / "root")) == sorted(names)
    assert "link" in names and "a/c/d" in names and len(names) == 13


def test_problems_of_checks_at_once_in_item_order(tmp_path):
    """Files are checked `threads` at a time (a barrier only two concurrent checks can pass), the
    problems come back in the items' order however the checks finish, and a check's error is raised."""
    files = [tmp_path / f"f{i}" for i in range(9)]
    for i, path in enumerate(files):
        path.write_bytes(bytes([i]) * 1000)
    records = [file_record(path) for path in files]
    for i in (2, 7):
        files[i].write_bytes(b"x" * 1000)
    meeting = threading.Barrier(2, timeout=10)

    def check(i: int) -> list[str]:
        if i < 2:
            meeting.wait()  # raises BrokenBarrierError unless items 0 and 1 are checked at once
        return [p] if (p := file_problem(files[i], records[i], "the test's records")) else []

    assert problems_of(check, range(9), threads=2) == [f"{files[i]}: sha256 differs from the test's records"
                                                       for i in (2, 7)]

    def broken(i: int) -> list[str]:
        raise FormatError(f"item {i}")

    with pytest.raises(FormatError, match="item 0"):
        problems_of(broken, range(3), threads=2)


def test_a_stage_seal_is_checked_inside_its_directory_only(tmp_path):
    """The seal of a stage config (integrity.SEAL_KEY): every name resolved inside the stage
    directory, its records' shape checked, each file's bytes compared."""
    from actstore.integrity import SEAL_KEY, STAGE_CONFIG_FILE, seal, stage_config_problems
    from actstore.io_utils import canonical_sha256

    directory = tmp_path / "stage"
    (directory / "sub").mkdir(parents=True)
    (directory / "report.json").write_text('{"loss": 1.0}')
    (directory / "sub" / "data.bin").write_bytes(b"\0" * 10)
    (tmp_path / "secret.json").write_text("{}")
    (directory / "scatter").mkdir()
    (directory / "scatter" / "job.json").write_text("{}")  # a workflow temp (STAGE_TEMPS): never sealed
    sealed = seal(directory, "lut")
    assert sealed == {"report.json": file_record(directory / "report.json")}
    assert set(seal(directory, "sae")) == {"report.json", "sub/data.bin"}  # no format's store: every file

    def problems_with(seal_value) -> list[str]:
        payload = {"stage": "lut", "config": {}, "upstream": {}}
        record = {**payload, "hash": canonical_sha256(payload), SEAL_KEY: seal_value}
        (directory / STAGE_CONFIG_FILE).write_text(json.dumps(record))
        return stage_config_problems(directory)

    assert problems_with(sealed) == []
    assert "sealed: files must be an object" in problems_with("report.json")[0]
    outside = {**sealed, "../secret.json": file_record(tmp_path / "secret.json")}
    assert problems_with(outside) == [f"{directory / STAGE_CONFIG_FILE} (sealed): '../secret.json' is not a "
                                      f"relative path inside {directory}"]
    (directory / "report.json").write_text('{"loss": 2.0}')
    assert problems_with(sealed) == [f"{directory / 'report.json'}: sha256 differs from "
                                     f"{directory / STAGE_CONFIG_FILE} (sealed)"]
    (directory / "report.json").write_text('{"loss": 1.0}')
    not_sealed = (f"{directory / 'report.json'}: not sealed by {directory / STAGE_CONFIG_FILE} "
                  "(written after the stage, or its record removed)")
    assert problems_with({}) == [not_sealed]  # the record removed from the seal
    (directory / "sub" / "late.json").write_text("{}")
    assert problems_with(sealed) == [not_sealed.replace("report.json", "sub/late.json")]
    payload = {"stage": "lut", "config": {}, "upstream": {}}  # the seal's key itself removed
    (directory / STAGE_CONFIG_FILE).write_text(json.dumps({**payload, "hash": canonical_sha256(payload)}))
    assert stage_config_problems(directory) == [
        f"{directory / STAGE_CONFIG_FILE}: no 'sealed' record, so the stage's metadata files cannot be checked "
        "against it (its key removed, or written by an actstore from before stages were sealed: rerun the stage "
        "to seal it)"]


def test_a_link_loop_is_named_not_a_crash(tmp_path):
    """Links that cannot be resolved (`loop -> loop`, two links to each other) are each a problem naming
    the link, in a store's links and as its stage config, and a name leading through one is a
    FormatError; before, pathlib's RuntimeError ("Symlink loop") ended verify."""
    from actstore.integrity import STAGE_CONFIG_FILE, inside, links_out, stage_config_problems

    root = tmp_path / "store"
    (root / "sub").mkdir(parents=True)
    (root / "loop").symlink_to("loop")
    (root / "sub" / "a").symlink_to("b")
    (root / "sub" / "b").symlink_to("a")
    unresolved = "a link that cannot be resolved (a loop of links)"
    assert links_out(root) == [f"{root / name}: {unresolved}" for name in ("loop", "sub/a", "sub/b")]
    with pytest.raises(FormatError, match=r"meta.json: 'sub/a/x.npy' leads through a loop of links under"):
        inside(root, "sub/a/x.npy", "meta.json")
    (root / STAGE_CONFIG_FILE).symlink_to(STAGE_CONFIG_FILE)
    assert stage_config_problems(root, required=True) == [
        f"{root / STAGE_CONFIG_FILE}: {unresolved}: not read, so nothing it seals is checked"]


@pytest.mark.parametrize("linked, store_files, name", [
    ("lut", ["lut/metadata.json"], "lut"),  # a folder part of a marker is the link
    ("dataset", ["dataset/index/train.parquet", "dataset/tensors/x.safetensors"], "lmprobe"),
    ("shard_0000.pkl", ["machine-0000/metadata.json"], "pickle"),  # the link is itself the marker's name
])
def test_detection_by_names_never_looks_through_a_link(linked, store_files, name, tmp_path, monkeypatch):
    """A store with a link near its top is detected by its file names alone (formats.detect_format):
    a link named by a marker is taken by its name, and the folder it leads to, outside, is never
    listed or looked at (verify then names the link)."""
    import os

    from actstore import formats

    outside = tmp_path / "outside"
    for rel in store_files:
        (outside / rel).parent.mkdir(parents=True, exist_ok=True)
        (outside / rel).write_text("{}")
    store = tmp_path / "store"
    store.mkdir()
    (store / linked).symlink_to(outside / linked if (outside / linked).exists() else outside)
    listed, real_scandir = [], os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(str(path)) or real_scandir(path))
    assert formats.detect_format(store) == name
    assert listed and not [p for p in listed if p.startswith(str(outside))]
    assert formats.detect_format(outside / "nothing") is None


def linked_out(path: Path, outside: Path) -> None:
    """`path` replaced by a link to a copy of it at `outside`: the same bytes, living outside."""
    shutil.copyfile(path, outside)
    path.unlink()
    path.symlink_to(outside)


def test_a_stage_config_linked_out_is_named_when_its_store_is_opened_below_it(extracted, tmp_path):
    """A LUT opened by its lut/ folder with verify=True: the stage config above it, linked out, is named
    (the format's verify never looks above lut/), so a value only its seal records (k_active) cannot
    change unseen; before, the seal was skipped in silence and the changed k_active served."""
    from actstore.hashing import stage_dir, stage_problems
    from actstore.integrity import STAGE_CONFIG_FILE
    from actstore.workflow import record_stage

    config, _ = extracted("bert")
    config = {**config, "dump_to": str(tmp_path / "dump")}
    directory = stage_dir(config, "lut")
    lut = build_lut(directory)
    record_stage(config, "lut", directory)
    assert open_lut(lut, verify=True).k_active == 4
    linked_out(directory / STAGE_CONFIG_FILE, tmp_path / "outside.json")
    edit_json(lut / "metadata.json", lambda m: m["sae_config"].update(k_active=2))
    named = (f"{directory / STAGE_CONFIG_FILE}: a link to {tmp_path / 'outside.json'}, outside {directory}: "
             "not read, so nothing it seals is checked")
    assert stage_problems(lut) == [named]
    with pytest.raises(FormatError, match="outside.json, outside .*: not read, so nothing it seals is checked"):
        open_lut(lut, verify=True)


def test_a_stage_config_linked_out_is_named_in_a_stage_holding_no_store(extracted, tmp_path):
    """The sae stage holds no format's store: its stage config's seal is all `actstore verify` checks
    (hashing.stage_problems). Linked out, it is named, not skipped with every file it seals (here a
    checkpoint with a changed byte)."""
    from actstore.hashing import stage_dir, stage_problems
    from actstore.integrity import STAGE_CONFIG_FILE
    from actstore.sae.checkpoint import save_sae
    from actstore.sae.model import TopKSAE
    from actstore.workflow import record_stage

    config, _ = extracted("bert")
    config = {**config, "dump_to": str(tmp_path / "dump")}
    directory = stage_dir(config, "sae")
    directory.mkdir(parents=True)
    sae = TopKSAE(8, 16, 4)
    torch.nn.init.normal_(sae.encoder_weight)
    torch.nn.init.normal_(sae.decoder_weight)
    save_sae(sae, directory / "sae.safetensors", {"hook": "encoder.layer.1"})
    record_stage(config, "sae", directory)
    assert stage_problems(directory) == []
    linked_out(directory / STAGE_CONFIG_FILE, tmp_path / "outside.json")
    checkpoint = directory / "sae.safetensors"
    raw = bytearray(checkpoint.read_bytes())
    raw[-1] ^= 0x01
    checkpoint.write_bytes(bytes(raw))
    assert stage_problems(directory) == [f"{directory / STAGE_CONFIG_FILE}: a link to {tmp_path / 'outside.json'}, "
                                         f"outside {directory}: not read, so nothing it seals is checked"]


@pytest.mark.parametrize("key, value, named", [
    ("source_extraction", "0" * 64, "source_extraction '000.*' is not the extraction .*metadata.json names in data"),
    ("model_type", "llama", "model_type 'llama' does not name family 'bert' of .*metadata.json"),
    ("model_type", None, "field 'model_type' missing"),
])
def test_a_saev_stores_provenance_is_checked_against_its_hashed_metadata(stores, key, value, named, tmp_path):
    """A saev store given by its own path has no pointer whose seal records actstore.json: its
    source_extraction and model_type are checked against metadata.json (which names the store), so
    a store claiming another extraction or model is named, not passed."""
    store = stores["saev"]
    root = tmp_path / store.root.name  # the same name: a saev store's directory is its metadata's hash
    shutil.copytree(store.root, root, symlinks=True)
    edit_json(root / "actstore.json", lambda m: m.pop(key) if value is None else m.update({key: value}))
    problems = saev.verify(root)
    assert len(problems) == 1 and re.search(f"actstore.json: {named}", problems[0]), problems
    with pytest.raises(FormatError, match=named):
        saev.open_store(root, verify=True)


def test_a_directory_store_reaches_the_disk_before_it_takes_its_name(tmp_path, monkeypatch):
    """atomic_path syncs a directory's filesystem (its files, the ones no writer fsynced included)
    before the rename, never after; a file is fsynced alone. A failed sync leaves no store."""
    from actstore import io_utils

    final, synced, sync = tmp_path / "shard.zarr", [], io_utils.sync_filesystem

    def watched(path: Path) -> None:
        synced.append((path.parent, sorted(p.name for p in path.iterdir()), final.exists()))
        sync(path)
    monkeypatch.setattr(io_utils, "sync_filesystem", watched)
    with io_utils.atomic_path(final) as tmp:
        tmp.mkdir()
        (tmp / "0").write_bytes(b"chunk")
    assert synced == [(tmp_path, ["0"], False)] and (final / "0").read_bytes() == b"chunk"
    with io_utils.atomic_path(tmp_path / "manifest.json") as tmp:
        tmp.write_text("{}")
    assert len(synced) == 1

    def failing(path: Path) -> None:
        raise OSError(5, f"{path}: syncfs: Input/output error")
    monkeypatch.setattr(io_utils, "sync_filesystem", failing)
    with pytest.raises(OSError, match="Input/output error"):
        with io_utils.atomic_path(tmp_path / "second.zarr") as tmp:
            tmp.mkdir()
            (tmp / "0").write_bytes(b"chunk")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard.zarr"]


def rewrite_npy_header(path: Path, header: str) -> None:
    """`path`'s .npy header text replaced by `header`, padded to the old length (the data stays where it was)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[8:10], "little")
    assert len(header) < length
    path.write_bytes(raw[:10] + (header + " " * (length - 1 - len(header)) + "\n").encode("latin1") + raw[10 + length:])


LYING_HEADERS = {  # what np.load did with each before the header was checked against the file's size
    "negative": "{'descr': '<f4', 'fortran_order': False, 'shape': (ROWS, -1), }",  # OverflowError (mmap)
    "huge": "{'descr': '<i8', 'fortran_order': False, 'shape': (1099511627776, 3), }",  # MemoryError (24 TiB)
    "garbled": "{'descr': '<f4', 'fortran_order': False, 'shape': (ROWS,\0\0\0",  # tokenize.TokenError
}


@pytest.mark.parametrize("lie", sorted(LYING_HEADERS))
@pytest.mark.parametrize("name, file", [("extract", "part-0000/layer_000.npy"), ("extract", "part-0000/offsets.npy"),
                                        ("saev", "windows.npy")])
def test_a_npy_header_that_lies_about_its_data_is_named_never_loaded(stores, name, file, lie, tmp_path):
    """A .npy header of a negative, huge or garbled shape: numpy trusted it and raised OverflowError,
    MemoryError (allocating the shape before reading) or tokenize.TokenError (verify of an extraction
    included). Now verify names the file and the reader (read_vector, which opens without verifying)
    raises FormatError naming it."""
    store = stores[name]
    root = tmp_path / store.root.name
    shutil.copytree(store.root, root, symlinks=True)
    rows = len(np.load(root / file, mmap_mode="r"))
    rewrite_npy_header(root / file, LYING_HEADERS[lie].replace("ROWS", str(rows)))
    problems = format_module(name).verify(root)
    assert any(file.split("/")[-1] in p for p in problems), problems
    with pytest.raises(FormatError, match=re.escape(file.split("/")[-1])):
        format_module(name).read_vector(root, 0, 0, 0)


@pytest.mark.parametrize("field, value", [("layers", -1), ("sample_id_range", -1), ("sample_id_range", [None, 40]),
                                          ("num_samples", "x"), ("shard_id", None)])
def test_a_mistyped_pickle_shard_entry_is_named_by_every_reader_never_a_type_error(stores, field, value, tmp_path):
    """A shard entry of metadata.json given a value of another type: verify and inspect named it, but
    read_vector, iter_activations and ActivationDataset computed with it and raised TypeError or
    KeyError naming nothing. Each now raises FormatError naming metadata.json and the field."""
    root = tmp_path / "pickle"
    shutil.copytree(stores["pickle"].root, root, symlinks=True)
    edit_json(root / "metadata.json", lambda m: m["shards"][0].update({field: value}))
    named = re.escape(f"{root / 'metadata.json'}: shards[0].{field}")
    assert any(re.match(named, p) for p in pickle_format.verify(root))
    for read in (lambda: pickle_format.read_vector(root, 0, 0, 0),
                 lambda: list(pickle_format.iter_activations(root, 0)),
                 lambda: pickle_format.ActivationDataset(root, 0)[0]):
        with pytest.raises(FormatError, match=named):
            read()


@pytest.mark.parametrize("column", ["num_tokens", "token_shard_ids"])
def test_an_index_column_pyarrow_cannot_decode_is_named_by_verify_and_the_reader(stores, column, tmp_path):
    """One column chunk of the lmprobe index zeroed: the reader raised pyarrow's bare OSError ("Couldn't
    deserialize thrift"), naming no file, and verify of a damaged token column stopped at "<root>:
    verification aborted", never naming the index nor checking SHA256SUMS. Both now name the index."""
    import pyarrow.parquet as pq

    root = tmp_path / "lmprobe"
    shutil.copytree(stores["lmprobe"].root, root, symlinks=True)
    index = root / stores["lmprobe"].meta
    row_group = pq.ParquetFile(index).metadata.row_group(0)
    chunk = next(row_group.column(i) for i in range(row_group.num_columns)
                 if row_group.column(i).path_in_schema.split(".")[0] == column)
    raw = bytearray(index.read_bytes())
    start, size = chunk.data_page_offset, chunk.total_compressed_size
    raw[start:start + size] = bytes(size)
    index.write_bytes(bytes(raw))
    problems = lmprobe.verify(root)
    assert f"{index}: sha256 differs from SHA256SUMS" in problems, problems
    assert not any("aborted" in p for p in problems), problems
    with pytest.raises(FormatError, match=re.escape(str(index))):
        lmprobe.read_vector(root, 0, 0, 0)


def test_a_zarr_manifest_listing_no_store_is_named_by_the_reader_never_a_key_error(stores, tmp_path):
    """manifest.json with an empty shards list and no layers (another store's files.json copied over it
    keeps the format name): verify named it, the reader and inspect raised KeyError: 'layers'."""
    root = tmp_path / "zarr"
    shutil.copytree(stores["zarr"].root, root, symlinks=True)
    edit_json(root / "manifest.json", lambda m: (m.update(shards=[]), m.pop("layers")))
    named = re.escape(f"{root / 'manifest.json'}: 'shards' must be a non-empty list")
    assert any(re.match(named, p) for p in zarr_format.verify(root))
    for read in (lambda: zarr_format.read_vector(root, 0, 0, 0), lambda: zarr_format.inspect(root)):
        with pytest.raises(FormatError, match=named):
            read()


@pytest.mark.parametrize("document", [1, "actstore-zarr-activation-logger", [], None])
def test_a_zarr_manifest_that_is_no_object_is_named_by_verify(stores, document, tmp_path):
    """manifest.json holding another JSON value: verify raised AttributeError inside, reported as
    "<run>: cannot verify (AttributeError: ...)", naming the directory, not the file."""
    root = tmp_path / "zarr"
    shutil.copytree(stores["zarr"].root, root, symlinks=True)
    (root / "manifest.json").write_text(json.dumps(document))
    assert zarr_format.verify(root) == [f"{root / 'manifest.json'}: not a JSON object, got {document!r}"]


def test_lmprobe_schema_metadata_that_is_not_utf8_is_named_never_a_unicode_error(stores, tmp_path):
    """An lmprobe: schema-metadata value of bytes that are not UTF-8: open, inspect and read_vector
    raised UnicodeDecodeError from json.loads (only JSONDecodeError was turned into FormatError)."""
    import pyarrow.parquet as pq

    root = tmp_path / "lmprobe"
    shutil.copytree(stores["lmprobe"].root, root, symlinks=True)
    index = root / stores["lmprobe"].meta
    table = pq.read_table(index)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"lmprobe:dataset": b'"\xdf"'}), index)
    named = re.escape(f"{index}: schema metadata 'lmprobe:dataset' is not JSON")
    assert any(re.match(named, p) for p in lmprobe.verify(root))
    for read in (lambda: lmprobe.read_vector(root, 0, 0, 0), lambda: lmprobe.inspect(root)):
        with pytest.raises(FormatError, match=named):
            read()


def test_an_lmprobe_token_list_shifted_from_num_tokens_is_refused_never_read_as_another_token(stores, tmp_path):
    """Index row 0's token_shard_ids and token_shard_offsets lose their first entry: token t of its
    prompt was read from token t+1's address (another vector, no error), and the last token past the
    list raised a bare IndexError. verify names the lengths; the reader now refuses them, naming the index."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "lmprobe"
    shutil.copytree(stores["lmprobe"].root, root, symlinks=True)
    index = root / stores["lmprobe"].meta
    table = pq.read_table(index)
    for name in ("token_shard_ids", "token_shard_offsets"):
        lists = table.column(name).to_pylist()
        lists[0] = lists[0][1:]
        table = table.set_column(table.column_names.index(name), name, pa.array(lists, table.schema.field(name).type))
    pq.write_table(table, index)
    sample = table.column("sample_idx")[0].as_py()
    assert any(p.startswith(f"{index}: token_shard_ids lengths differ from num_tokens") for p in lmprobe.verify(root))
    with pytest.raises(FormatError, match=re.escape(f"{index}: row 0 ")):
        lmprobe.read_vector(root, sample, 0, 0)


@pytest.mark.parametrize("field, edit", [
    ("actstore.dtype", lambda m: m["actstore"].update(dtype="bfloat16")),
    ("shards[0].layers", lambda m: m["shards"][0].update(layers=[0, 0, *m["shards"][0]["layers"][1:]])),
    ("extraction_config.layers_extracted",
     lambda m: [m[key].update(layers_extracted=[0, *m[key]["layers_extracted"]])
                for key in ("extraction_config", "statistics")]),
])
def test_a_pickle_metadata_value_no_writer_stores_is_named_by_verify(stores, field, edit, tmp_path):
    """metadata.json stating a dtype other than the float32 every shard holds (inspect reported it), or
    a layer listed twice (inspect reported it twice): verify names the file and the field."""
    root = tmp_path / "pickle"
    shutil.copytree(stores["pickle"].root, root, symlinks=True)
    edit_json(root / "metadata.json", edit)
    problems = pickle_format.verify(root)
    assert any(f"{root / 'metadata.json'}: {field}" in p for p in problems), problems
    with pytest.raises(FormatError, match=re.escape(field)):
        pickle_format.inspect(root)
