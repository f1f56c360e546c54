"""Pickle shard format: round trip against the extraction, checksums, merge, safe loading."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from actstore.errors import FormatError
from actstore.formats import pickle as ps
from actstore.formats.extract import layer_tensor, open_extraction
from actstore.formats.pickle.layout import PICKLE_PROTOCOL
from actstore.model_config import model_params, read_model_config
from tiny import traced_peak

SPEC = Path("/work/shared/specs/pickle-shard-format.md")
SMALL_MB = 0.02  # ~20 kB of raw activations per shard: forces many shards from 15 tiny samples


# ---- The spec's example code, verbatim (test_spec_code_is_verbatim checks it against the spec). ----
import json
import pickle
import gzip
from pathlib import Path
import numpy as np

def load_metadata(output_dir):
    """Load extraction metadata"""
    with open(Path(output_dir) / "metadata.json") as f:
        return json.load(f)

def load_shard(shard_path, compressed=True):
    """Load a single shard"""
    if compressed:
        with gzip.open(shard_path, 'rb') as f:
            return pickle.load(f)
    else:
        with open(shard_path, 'rb') as f:
            return pickle.load(f)

def iter_activations(output_dir, layer_idx):
    """Iterate over all activations for a specific layer"""
    metadata = load_metadata(output_dir)
    layer_key = f"layer_{layer_idx}"

    for shard_info in metadata['shards']:
        if layer_idx not in shard_info['layers']:
            continue

        shard_path = Path(output_dir) / shard_info['filename']
        shard_data = load_shard(shard_path, compressed=shard_info['compressed'])

        if layer_key in shard_data:
            for item in shard_data[layer_key]:
                yield item

from torch.utils.data import Dataset, DataLoader

class ActivationDataset(Dataset):
    def __init__(self, output_dir, layer_idx):
        self.output_dir = Path(output_dir)
        self.layer_idx = layer_idx
        self.layer_key = f"layer_{layer_idx}"

        # Load metadata and build index
        with open(self.output_dir / "metadata.json") as f:
            self.metadata = json.load(f)

        # Build index: [(shard_id, item_idx), ...]
        self.index = []
        for shard_info in self.metadata['shards']:
            if layer_idx in shard_info['layers']:
                shard_path = self.output_dir / shard_info['filename']
                shard_data = load_shard(shard_path, compressed=shard_info['compressed'])
                num_items = len(shard_data[self.layer_key])
                for i in range(num_items):
                    self.index.append((shard_info['shard_id'], i))

        # Cache current shard
        self.current_shard_id = None
        self.current_shard = None

    def __len__(self):
        return len(self.index)

    def __getitem__(self, idx):
        shard_id, item_idx = self.index[idx]

        # Load shard if not cached
        if shard_id != self.current_shard_id:
            shard_info = next(s for s in self.metadata['shards'] if s['shard_id'] == shard_id)
            shard_path = self.output_dir / shard_info['filename']
            self.current_shard = load_shard(shard_path, compressed=shard_info['compressed'])
            self.current_shard_id = shard_id

        item = self.current_shard[self.layer_key][item_idx]
        return {
            'activation': item['activation'],
            'sample_idx': item['sample_idx'],
            'text': item['text_preview']
        }
# ---- end of the spec's code ----


def params_of(config: dict) -> dict:
    """The model parameters the pickle_machines workflow script passes to write_machine."""
    return model_params(read_model_config(config["model"]["path"]))


def write_machines(config: dict, extract_dir: Path, out: Path) -> Path:
    """Each part's machine store, small gzip shards, under out/machine-NNNN/ (not merged)."""
    for part in range(config["extract"]["parts"]):
        ps.write_machine(extract_dir / f"part-{part:04d}", out / ps.machine_dirname(part),
                         model_params=params_of(config), shard_size_mb=SMALL_MB, progress=False)
    return out


@pytest.fixture(scope="module")
def store(extracted, tmp_path_factory):
    """(config, extraction, merged store dir): two machines with small gzip shards, merged."""
    config, extract_dir = extracted("bert")
    out = write_machines(config, extract_dir, tmp_path_factory.mktemp("pickle"))
    ps.merge_machines([out / ps.machine_dirname(p) for p in range(config["extract"]["parts"])], out)
    return config, open_extraction(extract_dir), out


def copy_store(src: Path, dst: Path) -> Path:
    """A byte copy of a whole store (machine dirs included) that a test may damage."""
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_spec_code_is_verbatim():
    spec = SPEC.read_text()
    source = Path(__file__).read_text()
    ours = source.split("verbatim (test_spec_code_is_verbatim checks it against the spec). ----\n")[1]
    ours = ours.split("# ---- end of the spec's code ----")[0]
    head, _, dataset_part = ours.partition("from torch.utils.data import Dataset, DataLoader\n\n")
    assert head.strip() in spec
    assert "def load_shard(shard_path, compressed=True):" in head
    assert dataset_part.strip() in spec


def test_round_trip_equals_extraction(store):
    config, extraction, out = store
    meta = ps.load_metadata(out)
    assert meta["statistics"]["total_samples"] == extraction.n_samples == 30
    assert meta["statistics"]["total_tokens"] == extraction.n_tokens
    assert len(meta["shards"]) > 4  # small target really split the machines
    for layer in config["extract"]["layers"]:
        items = list(ps.iter_activations(out, layer))
        assert [it["sample_idx"] for it in items] == list(range(30))
        for it in items:
            want = extraction.activations(layer_tensor(layer), it["sample_idx"])
            row = extraction.sample(it["sample_idx"])
            assert it["activation"].dtype == np.float32
            assert it["activation"].tobytes() == np.ascontiguousarray(want).tobytes()
            assert it["shape"] == want.shape == (row["num_tokens"], 32)
            assert it["text_preview"] == row["text"][:200]
            assert it["metadata"]["token_count"] == row["num_tokens"]
            assert it["metadata"]["dataset_idx"] == it["sample_idx"]
            assert it["metadata"]["machine_id"] == it["sample_idx"] // 15
            assert it["metadata"]["label"] == row["label"]


def test_metadata_fields_checksums_and_ranges(store):
    config, extraction, out = store
    meta = ps.load_metadata(out)
    ec = meta["extraction_config"]
    assert meta["version"] == "1.0" and meta["created_at"].endswith("Z")
    assert ec["layers_extracted"] == [0, 2] and ec["max_seq_length"] == 24 and ec["batch_size"] == 4
    assert ec["model_params"] == {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                                  "vocab_size": 300}
    assert ec["model_architecture"] == "bert"
    assert meta["distributed_config"]["total_machines"] == 2
    assert meta["statistics"]["extraction_duration_seconds"] == pytest.approx(
        sum(p.meta["extraction_duration_seconds"] for p in extraction.parts))
    assert [s["shard_id"] for s in meta["shards"]] == list(range(1, len(meta["shards"]) + 1))
    for info in meta["shards"]:
        path = out / info["filename"]
        data = path.read_bytes()
        assert info["checksum"] == "sha256:" + hashlib.sha256(data).hexdigest()
        assert info["size_bytes"] == len(data) and info["compressed"] is True
        assert data[:2] == b"\x1f\x8b"  # really gzip
        assert path.name.startswith("shard_") and path.name.endswith(".pkl.gz")
        shard = pickle.loads(gzip.decompress(data))  # our own output, trusted here
        ids = [it["sample_idx"] for it in shard["layer_0"]]
        assert [ids[0], ids[-1]] == info["sample_id_range"] and len(ids) == info["num_samples"]
        assert ids == list(range(ids[0], ids[-1] + 1))
    # each machine directory is a complete store on its own, numbering its shards from 1
    for m in range(2):
        mmeta = ps.load_metadata(out / ps.machine_dirname(m))
        assert mmeta["distributed_config"]["machine_id"] == m
        assert mmeta["shards"][0]["shard_id"] == 1 and mmeta["shards"][0]["filename"] == "shard_0001.pkl.gz"
        assert ps.verify(out / ps.machine_dirname(m)) == []


def test_merge_is_consistent_and_verifies(store):
    _, extraction, out = store
    meta = ps.load_metadata(out)
    ids = [i for s in meta["shards"] for i in range(s["sample_id_range"][0], s["sample_id_range"][1] + 1)]
    assert ids == list(range(30))
    assert {s["machine_id"] for s in meta["shards"]} == {0, 1}
    assert all(s["filename"].startswith("machine-000") for s in meta["shards"])
    assert ps.verify(out) == []
    assert ps.detect(out) and not ps.detect(out / "nope")
    info = ps.inspect(out)
    assert info["format"] == "pickle" and info["layers"] == [0, 2] and info["n_examples"] == 30
    assert info["n_tokens"] == extraction.n_tokens and info["d_model"] == 32 and info["dtype"] == "float32"
    assert info["n_shards"] == len(meta["shards"])
    assert info["bytes"] == sum(s["size_bytes"] for s in meta["shards"]) + (out / "metadata.json").stat().st_size
    for sample_idx in (0, 14, 15, 29):
        acts = extraction.activations("layer_2", sample_idx)
        np.testing.assert_array_equal(ps.read_vector(out, sample_idx, 2, len(acts) - 1), acts[-1])
    assert ps.read_vector(out, 3, 1, 0) is None  # layer 1 not extracted
    assert ps.read_vector(out, 3, 0, 10_000) is None


def test_model_params_come_from_the_model_config_aliases():
    """What pickle_machines passes in: GPT-2's n_* names, a vision tower's nested config and a
    vision-language model's language model understood."""
    gpt2 = {"n_embd": 32, "n_layer": 3, "n_head": 4, "vocab_size": 300}
    clip = {"model_type": "clip", "text_config": {"hidden_size": 64, "vocab_size": 99},
            "vision_config": {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4}}
    gemma3 = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 99},
              "vision_config": {"hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 8}}
    assert model_params(gemma3) == {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                                    "vocab_size": 99}
    assert model_params(gpt2) == {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                                  "vocab_size": 300}
    assert model_params(clip) == {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                                  "vocab_size": 99}
    assert model_params({}) == dict.fromkeys(("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "vocab_size"))


def test_merge_refuses_overlapping_sample_ids(store, tmp_path):
    _, _, out = store
    with pytest.raises(FormatError, match="overlap"):
        ps.merge_machines([out / "machine-0000", out / "machine-0000"], tmp_path)


def test_spec_example_code_runs_on_our_output(store):
    _, extraction, out = store
    for directory in (out, out / "machine-0001"):
        items = list(iter_activations(directory, layer_idx=2))
        first = 0 if directory == out else 15
        assert [it["sample_idx"] for it in items] == list(range(first, 30))
        for item in items:
            activation = item['activation']  # numpy array
            sample_idx = item['sample_idx']
            np.testing.assert_array_equal(activation, extraction.activations("layer_2", sample_idx))
    dataset = ActivationDataset(out, layer_idx=0)
    assert len(dataset) == 30
    loader = DataLoader(dataset, batch_size=1, shuffle=True)
    seen = set()
    for batch in loader:
        activations = batch['activation']  # [batch_size, seq_len, hidden_size]
        idx = int(batch["sample_idx"][0])
        seen.add(idx)
        np.testing.assert_array_equal(activations[0].numpy(), extraction.activations("layer_0", idx))
    assert seen == set(range(30))


def test_library_dataset_matches_spec_dataset_without_reading_shards(store, monkeypatch):
    _, extraction, out = store
    spec_ds = ActivationDataset(out, layer_idx=2)
    calls = []
    real = ps.load_shard
    monkeypatch.setattr(ps.read, "load_shard", lambda *a: calls.append(a) or real(*a))
    ours = ps.ActivationDataset(out, 2)
    assert calls == []  # index built from metadata.json alone
    assert len(ours) == len(spec_ds) == 30
    for i in range(30):
        a, b = ours[i], spec_ds[i]
        assert a["sample_idx"] == b["sample_idx"] and a["text"] == b["text"]
        np.testing.assert_array_equal(a["activation"], b["activation"])
    assert len(calls) == len(ps.load_metadata(out)["shards"])  # sequential access: each shard loaded once
    batch = next(iter(DataLoader(ours, batch_size=4, collate_fn=ps.collate_padded)))
    lengths = batch["lengths"].tolist()
    assert batch["activation"].shape == (4, max(lengths), 32)
    np.testing.assert_array_equal(batch["activation"][1, :lengths[1]].numpy(), extraction.activations("layer_2", 1))
    assert torch.all(batch["activation"][1, lengths[1]:] == 0)


def test_uncompressed_and_deterministic(extracted, tmp_path, monkeypatch):
    # created_at from SOURCE_DATE_EPOCH: the four writes below may straddle a second.
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    config, extract_dir = extracted("bert")
    params = params_of(config)
    a = ps.write_machine(extract_dir / "part-0000", tmp_path / "a", model_params=params, compression="none",
                         shard_size_mb=SMALL_MB, progress=False)
    b = ps.write_machine(extract_dir / "part-0000", tmp_path / "b", model_params=params, compression="none",
                         shard_size_mb=SMALL_MB, progress=False)
    assert [s["checksum"] for s in a["shards"]] == [s["checksum"] for s in b["shards"]]
    assert a["shards"][0]["filename"] == "shard_0001.pkl" and a["shards"][0]["compressed"] is False
    assert (tmp_path / "a" / "shard_0001.pkl").read_bytes()[:1] == b"\x80"  # a bare pickle
    assert ps.verify(tmp_path / "a") == []
    items = list(iter_activations(tmp_path / "a", 0))  # the spec's loader, uncompressed branch
    extraction = open_extraction(extract_dir)
    for it in items:
        np.testing.assert_array_equal(it["activation"], extraction.activations("layer_0", it["sample_idx"]))
    gz = ps.write_machine(extract_dir / "part-0000", tmp_path / "gz", model_params=params, shard_size_mb=SMALL_MB,
                          progress=False)
    gz2 = ps.write_machine(extract_dir / "part-0000", tmp_path / "gz2", model_params=params, shard_size_mb=SMALL_MB,
                           threads=3, progress=False)  # shards dumped three at a time: the same bytes
    assert len(gz["shards"]) > 3 and gz == gz2
    assert all((tmp_path / "gz" / f).read_bytes() == (tmp_path / "gz2" / f).read_bytes()
               for f in os.listdir(tmp_path / "gz"))
    with pytest.raises(FormatError, match="compression"):
        ps.write_machine(extract_dir / "part-0000", tmp_path / "c", model_params=params, compression="lz4",
                         progress=False)


def test_isal_and_zlib_write_standard_gzip_of_the_same_pickles(extracted, tmp_path):
    """Both compressors: what gzip.open (the spec's loader) gives back is the same pickle stream,
    byte for byte, and the store verifies; the zlib store is what earlier releases wrote (its metadata
    has no compressor key, and its config hashes without it); a level ISA-L lacks is refused."""
    config, extract_dir = extracted("bert")
    params = params_of(config)
    stores = {name: ps.write_machine(extract_dir / "part-0000", tmp_path / name, model_params=params,
                                     shard_size_mb=SMALL_MB, compressor=name, progress=False)
              for name in ("isal", "zlib")}
    assert stores["isal"]["actstore"]["compressor"] == "isal" and "compressor" not in stores["zlib"]["actstore"]
    names = [s["filename"] for s in stores["zlib"]["shards"]]
    assert names == [s["filename"] for s in stores["isal"]["shards"]] and len(names) > 1
    for name in names:
        isal_bytes, zlib_bytes = ((tmp_path / c / name).read_bytes() for c in ("isal", "zlib"))
        assert isal_bytes != zlib_bytes and gzip.decompress(isal_bytes) == gzip.decompress(zlib_bytes)
    with gzip.open(tmp_path / "isal" / names[0]) as fh:  # the spec's loader on our own file
        first = pickle.load(fh)["layer_0"][0]
    assert first["activation"].flags.writeable  # pickled as a bytearray: users may modify it
    assert ps.verify(tmp_path / "isal") == [] and ps.verify(tmp_path / "zlib") == []
    with pytest.raises(FormatError, match="compressor 'isal' with compresslevel 6: levels are isal 1-3, zlib 1-9"):
        ps.write_machine(extract_dir / "part-0000", tmp_path / "c", model_params=params, compresslevel=6,
                         progress=False)


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_shards_pickle_the_parts_rows_as_copies_would_without_touching_the_part(extracted, tmp_path, storage):
    """float32 rows are pickled from a copy-on-write mapping of the part, bfloat16 rows from their
    float32 conversion: either way each shard's pickle is, byte for byte, that of writable float32
    copies of the rows, and the part's files are left as they were."""
    config, extract_dir = extracted("bert", extract={"storage_dtype": storage})
    part_dir = extract_dir / "part-0000"
    before = {f.name: f.read_bytes() for f in part_dir.iterdir()}
    meta = ps.write_machine(part_dir, tmp_path / "m", model_params=params_of(config), shard_size_mb=SMALL_MB,
                            progress=False)
    extraction = open_extraction(extract_dir)
    for shard in meta["shards"]:
        with gzip.open(tmp_path / "m" / shard["filename"]) as fh:
            written = fh.read()
        copies = pickle.loads(written)
        for key, items in copies.items():
            for item in items:
                rows = extraction.activations(layer_tensor(int(key.removeprefix("layer_"))), item["sample_idx"])
                assert item["shape"] == rows.shape and {type(n) for n in item["shape"]} == {int}
                item["activation"] = np.array(rows, dtype=np.float32)  # a fresh writable copy
        again = io.BytesIO()
        pickle.dump(copies, again, protocol=PICKLE_PROTOCOL)
        assert again.getvalue() == written
    assert {f.name: f.read_bytes() for f in part_dir.iterdir()} == before


def test_the_compressor_is_hashed_only_when_it_changes_the_bytes():
    """The pickle stage hash covers hashing.hashed_section("pickle"): zlib (the bytes of earlier
    releases, whose configs had no compressor key) and uncompressed stores hash as before; isal,
    the default, hashes apart. ISA-L's missing levels are refused when the config is read."""
    from actstore.config import validate_config
    from actstore.errors import ConfigError
    from actstore.hashing import hashed_section

    def config(**pickle_section):
        return validate_config({"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}, "pickle": pickle_section})

    earlier = {k: v for k, v in config()["pickle"].items() if k not in ("compressor", "threads", "jobs")}
    assert hashed_section(config(compressor="zlib"), "pickle") == earlier
    assert hashed_section(config(), "pickle") == {**earlier, "compressor": "isal"}
    assert "compressor" not in hashed_section(config(compression="none"), "pickle")
    with pytest.raises(ConfigError, match="pickle/compresslevel: 6 is greater than the maximum of 3 .*zlib has 1-9"):
        config(compresslevel=6)
    assert config(compresslevel=6, compressor="zlib")["pickle"]["compresslevel"] == 6


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("entry", [{"dir": "machine-0000"}, "machine-0000", {"dir": 1, "metadata_sha256": "0" * 64}])
def test_a_malformed_machine_entry_is_named(store, tmp_path, entry):
    _, _, out = store
    work = copy_store(out, tmp_path / "store")
    meta = json.loads((work / "metadata.json").read_text())
    meta["distributed_config"]["machines"][0] = entry
    (work / "metadata.json").write_text(json.dumps(meta))
    assert any(p.startswith(f"{work / 'metadata.json'}: distributed_config.machines[0]") for p in ps.verify(work)), \
        ps.verify(work)


def _plant(store_dir: Path, payload: object) -> tuple[Path, dict]:
    """Replace machine-0000's first shard by a gzip pickle of `payload` and fix its size and
    checksum in both metadata.json files, so only the content can give it away."""
    info = ps.load_metadata(store_dir / "machine-0000")["shards"][0]
    path = store_dir / "machine-0000" / info["filename"]
    path.write_bytes(gzip.compress(pickle.dumps(payload, protocol=4)))
    new = {"size_bytes": path.stat().st_size, "checksum": "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()}
    for meta_path in (store_dir / "machine-0000" / "metadata.json", store_dir / "metadata.json"):
        meta = json.loads(meta_path.read_text())
        meta["statistics"]["total_size_bytes"] += new["size_bytes"] - meta["shards"][0]["size_bytes"]
        meta["shards"][0].update(new)
        if meta_path.parent == store_dir:
            meta["distributed_config"]["machines"][0]["metadata_sha256"] = hashlib.sha256(
                (store_dir / "machine-0000" / "metadata.json").read_bytes()).hexdigest()
        meta_path.write_text(json.dumps(meta))
    return path, meta["shards"][0]


@pytest.mark.parametrize("kind", ["os.system", "object array", "eval"])
def test_hostile_pickle_is_refused_and_never_runs(store, tmp_path, kind):
    _, _, out = store
    work = copy_store(out, tmp_path / "store")
    marker = tmp_path / "pwned"
    payload = {
        "os.system": {"layer_0": [_Payload(marker)]},
        "object array": {"layer_0": [{"activation": np.array([_Payload(marker)], dtype=object)}]},
        "eval": {"layer_0": [eval]},
    }[kind]
    path, info = _plant(work, payload)
    assert not marker.exists()
    with pytest.raises(FormatError, match=str(path.name)) as err:
        ps.load_shard(work, info)
    assert "not allowed" in str(err.value) or "not a plain numeric dtype" in str(err.value)
    with pytest.raises(FormatError):
        list(ps.iter_activations(work, 0))
    problems = ps.verify(work)
    assert problems == [p for p in problems if str(path) in p] and problems  # only the planted shard
    assert not marker.exists()  # nothing in the shard ever ran
    if kind == "os.system":  # and the payload is live: a plain pickle.load does run it
        pickle.loads(gzip.decompress(path.read_bytes()))
        assert marker.exists()


def test_non_numeric_dtype_refused():
    data = pickle.dumps({"a": np.array(["x", "y"])}, protocol=5)
    with pytest.raises(pickle.UnpicklingError, match="numeric"):
        ps.safe_loads(data, compressed=False)
    ok = ps.safe_loads(pickle.dumps({"a": np.arange(4, dtype=np.int16), "b": (1, 2.5, None, True)}, protocol=4), False)
    assert ok["a"].dtype == np.int16 and ok["b"] == (1, 2.5, None, True)


class _HugeEmptyArray:
    """Pickles as numpy's own array constructor asked for 10^9 elements up front."""

    def __reduce__(self):
        from numpy._core.multiarray import _reconstruct
        return (_reconstruct, (np.ndarray, (10 ** 9,), b"b"))


def test_an_allocation_sized_by_the_file_is_refused():
    data = pickle.dumps({"layer_0": [_HugeEmptyArray()]}, protocol=4)
    with pytest.raises(pickle.UnpicklingError, match=r"shape \(1000000000,\) is not allowed"):
        ps.safe_loads(data, compressed=False)
    lying = pickle.dumps(np.arange(8, dtype=np.int64), protocol=4).replace(b"\x08\x85", b"\xff\x85")
    with pytest.raises((pickle.UnpicklingError, ValueError)):  # state shape 255 vs 64 bytes of data
        ps.safe_loads(lying, compressed=False)


class _CalledNdarray:
    """A REDUCE of numpy.ndarray itself: ndarray((4,), "f4") is four floats of whatever memory held."""

    def __reduce__(self):
        return (np.ndarray, ((4,), "f4"))


def test_numpy_ndarray_is_never_called_by_a_shard():
    """numpy's pickles only pass ndarray to _reconstruct; called, it would allocate a size the file
    names (object dtypes filled element by element before any check) or hand back uninitialised memory."""
    with pytest.raises(pickle.UnpicklingError, match=r"numpy.ndarray\(...\) called in a shard"):
        ps.safe_loads(pickle.dumps({"layer_0": [_CalledNdarray()]}, protocol=4), compressed=False)
    with pytest.raises(pickle.UnpicklingError, match="_reconstruct: dtype object is not a plain numeric dtype"):
        ps.safe_loads(pickle.dumps(np.arange(2, dtype=np.int16), protocol=4).replace(b"\x01b", b"\x01O"), False)


def test_shared_containers_are_checked_once_and_a_cycle_is_refused(monkeypatch):
    """A pickle's memo lets a few hundred bytes make 10**6 paths through 7 shared lists: each is
    checked once. A list that holds itself is refused."""
    import actstore.formats.pickle.unpickler as unpickler
    body = pickle.PROTO + b"\x04" + pickle.EMPTY_LIST + pickle.MEMOIZE
    for level in range(1, 7):  # list n holds list n - 1 ten times
        body += pickle.EMPTY_LIST + pickle.MEMOIZE + pickle.MARK + (pickle.BINGET + bytes([level - 1])) * 10
        body += pickle.APPENDS
    checks, check = [], unpickler._check_plain
    monkeypatch.setattr(unpickler, "_check_plain", lambda *args: checks.append(1) or check(*args))
    top = ps.safe_loads(body + pickle.STOP, compressed=False)
    assert len(top) == 10 and top[0] is top[9] and len(checks) <= 7 * 11
    looped: list = []
    looped.append(looped)
    with pytest.raises(pickle.UnpicklingError, match="a list that holds itself"):
        ps.safe_loads(pickle.dumps(looped, protocol=4), compressed=False)


def test_a_gzip_bomb_is_refused_before_it_fills_memory(monkeypatch):
    import actstore.formats.pickle.unpickler as unpickler
    # 8 MiB of zeros in about 8 KiB, in a pickle: the shard is unpickled as it is decompressed, and
    # bytes that are no pickle are refused at their first
    bomb = gzip.compress(pickle.dumps({"layer_0": np.zeros(8 << 20, np.uint8)}, protocol=5))
    monkeypatch.setattr(unpickler, "memory_budget", lambda: 1 << 20)
    with pytest.raises(pickle.UnpicklingError, match="decompresses to more than 1,048,576 bytes"):
        ps.safe_loads(bomb, compressed=True)
    with pytest.raises(pickle.UnpicklingError, match="invalid load key"):
        ps.safe_loads(gzip.compress(b"\0" * (8 << 20)), compressed=True)
    two_members = gzip.compress(pickle.dumps({"a": 1})[:5]) + gzip.compress(pickle.dumps({"a": 1})[5:])
    assert ps.safe_loads(two_members, compressed=True) == {"a": 1}
    with pytest.raises(pickle.UnpicklingError, match="not gzip data|truncated"):
        ps.safe_loads(gzip.compress(pickle.dumps({"a": 1}))[:-12], compressed=True)


def test_missing_shard_and_checksum_mismatch_named(store, tmp_path):
    _, _, out = store
    work = copy_store(out, tmp_path / "store")
    meta = ps.load_metadata(work)
    missing, flipped = work / meta["shards"][1]["filename"], work / meta["shards"][-1]["filename"]
    missing.unlink()
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    problems = ps.verify(work)
    assert any(str(missing) in p and "missing" in p for p in problems)
    assert any(str(flipped) in p and "checksum" in p for p in problems)
    assert len(problems) == 2
    with pytest.raises(FormatError, match="checksum"):
        ps.load_shard(work, meta["shards"][-1])
    lo, _ = meta["shards"][1]["sample_id_range"]
    with pytest.raises(FormatError, match=f"{missing}: shard missing"):
        ps.read_vector(work, lo, meta["shards"][1]["layers"][0], 0)


def test_verify_reports_bad_metadata(store, tmp_path):
    _, _, out = store
    work = copy_store(out, tmp_path / "store")
    meta = json.loads((work / "metadata.json").read_text())
    del meta["statistics"]
    meta["shards"][0]["filename"] = "../../etc/shard_0001.pkl.gz"
    (work / "metadata.json").write_text(json.dumps(meta))
    problems = ps.verify(work)
    assert any("statistics" in p for p in problems)
    meta["statistics"] = {}
    (work / "metadata.json").write_text(json.dumps(meta))
    assert any("total_shards" in p for p in ps.verify(work))
    with pytest.raises(FormatError, match="is not a relative path inside"):
        ps.load_shard(work, meta["shards"][0])
    (work / "metadata.json").write_text("{not json")
    assert ps.verify(work) and "metadata.json" in ps.verify(work)[0]
    assert not ps.detect(work)


@pytest.mark.parametrize("edit, named", [
    (lambda m: m["actstore"].update(d_model=31), r"shard_\d+\.pkl\.gz: layer_0 sample 0: activation float32 \(\d+, 32\) "
                                                 r"vs shape \(\d+, 32\), d_model 31 in metadata.json"),
    (lambda m: m["shards"][0].update(num_tokens=m["shards"][0]["num_tokens"] + 1),
     r"shard_0001\.pkl\.gz: \[\d+\] token rows per layer, metadata.json says num_tokens=\d+"),
    (lambda m: m["statistics"].update(total_tokens=-1), r"metadata.json: statistics.total_tokens = -1 but the shards sum to \d+"),
    (lambda m: m["distributed_config"].update(total_machines="x"),
     r"metadata.json: distributed_config.total_machines = x but 2 machines are listed"),
])
def test_metadata_that_misstates_the_data_is_named(store, tmp_path, edit, named):
    """What `inspect` reports (d_model, tokens, machines) is checked against the shards by verify."""
    _, _, out = store
    work = copy_store(out, tmp_path / "store")
    meta = json.loads((work / "metadata.json").read_text())
    edit(meta)
    (work / "metadata.json").write_text(json.dumps(meta))
    problems = ps.verify(work)
    assert any(re.search(named, p) for p in problems), problems


@pytest.mark.parametrize("edit, named", [
    (lambda m: m["shards"][0].update(compressed="yes"), r"shards\[0\]\.compressed must be true or false"),
    (lambda m: m["shards"][0].update(compressed=False), r"shards\[0\]\.compressed .*\.pkl\.gz"),
    (lambda m: m["shards"][1].update(shard_id="x"), r"shards\[1\]\.shard_id must be a whole number"),
    (lambda m: m["shards"][0].update(sample_id_range=[5, 2]), r"shards\[0\]\.sample_id_range must be \[first, last\]"),
    (lambda m: m["shards"][0].update(checksum=7), r"shards\[0\]\.checksum must be 'sha256:<hex>'"),
    (lambda m: m.update(statistics=float("nan")), r"not valid JSON \(NaN is not a JSON number\)"),
    (lambda m: m["extraction_config"].update(layers_extracted=[99]),
     r"extraction_config\.layers_extracted \(the shards hold layers"),
    (lambda m: m["extraction_config"]["model_params"].update(hidden_size={"a": 1}),
     r"extraction_config\.model_params\.hidden_size is malformed"),
    (lambda m: m["actstore"].update(d_model="384"), r"actstore\.d_model is malformed"),
    (lambda m: m.update(version="../x"), r"version is malformed"),
])
def test_a_metadata_field_of_the_wrong_type_is_named_by_verify_and_inspect(store, tmp_path, edit, named):
    """Every field verify, inspect or a reader computes with has its spec type: another value is named
    (by verify as a problem, by inspect as a FormatError), never a Python error or a silent pass."""
    _, _, out = store
    work = copy_store(out, tmp_path / "store")
    meta = json.loads((work / "metadata.json").read_text())
    edit(meta)
    (work / "metadata.json").write_text(json.dumps(meta))
    assert any(re.search(named, p) for p in ps.verify(work)), ps.verify(work)
    with pytest.raises(FormatError, match=named):
        ps.inspect(work)


def test_shards_checked_at_once_still_find_a_sample_in_two_shards(store, tmp_path):
    """verify checks shards on several threads; a sample stored twice (metadata listing shard 0's
    file again, as shard 1) is still named, and the report is the same one shard at a time."""
    from actstore import integrity
    from actstore.formats.pickle import check

    _, _, out = store
    work = copy_store(out, tmp_path / "store")
    meta = json.loads((work / "metadata.json").read_text())
    meta["shards"][1] = {**meta["shards"][0], "shard_id": meta["shards"][1]["shard_id"]}
    (work / "metadata.json").write_text(json.dumps(meta))
    problems = ps.verify(work)
    assert f"{work / meta['shards'][0]['filename']}: duplicate sample_idx within the store" in problems, problems
    with integrity.check_threads(1):
        assert ps.verify(work) == problems
    # As many at once as SHARDS_VERIFY_BYTES holds at ~3x a shard's raw bytes: here every thread.
    assert check._shard_threads(meta["shards"], 32) == integrity.CHECK_THREADS
    big = [{**meta["shards"][0], "size_bytes": check.SHARDS_VERIFY_BYTES // 6}]
    assert check._shard_threads(big, 32) == min(2, integrity.CHECK_THREADS)
    assert check._shard_threads([{**big[0], "size_bytes": check.SHARDS_VERIFY_BYTES}], 32) == 1


def _gzip_shards(root: Path, n_shards: int, samples: int, rows: int, zeros: bool) -> dict:
    """`n_shards` gzip shards (the writer's dump_shard) of one layer, `samples` samples of `rows` x 512
    float32 each (zeros, or float16-rounded normals that gzip leaves ~60%), and a metadata object
    listing them (the fields _verify_shards reads)."""
    from actstore.formats.pickle.write import dump_shard

    rng, shards = np.random.default_rng(0), []
    for k in range(n_shards):
        items = [{"sample_idx": samples * k + i, "shape": (rows, 512), "text_preview": "x", "metadata": {},
                  "activation": np.zeros((rows, 512), np.float32) if zeros
                  else rng.standard_normal((rows, 512)).astype(np.float16).astype(np.float32)}
                 for i in range(samples)]
        path = root / f"shard_{k:04d}.pkl.gz"
        digest = dump_shard({"layer_0": items}, path, True, 1, "isal")
        shards.append({"shard_id": k, "filename": path.name, "size_bytes": path.stat().st_size, "layers": [0],
                       "checksum": f"sha256:{digest}", "compressed": True, "num_samples": samples,
                       "sample_id_range": [samples * k, samples * k + samples - 1]})
    return {"shards": shards, "actstore": {"d_model": 512}, "extraction_config": {"model_params": {}}}


def test_a_gzip_shard_is_unpickled_as_it_is_decompressed_never_held_whole(tmp_path):
    """load_shard decompressed a gzip shard whole (its pieces and their join at once) before the
    arrays were built from it: 2.6x the arrays with the file. Streamed, it holds the file and the
    arrays, and returns the same shard."""
    meta = _gzip_shards(tmp_path, 1, 8, 1024, zeros=False)  # 16 MiB of arrays
    info, arrays = meta["shards"][0], 8 * 1024 * 512 * 4
    shard, peak = traced_peak(lambda: ps.load_shard(tmp_path, info))
    assert peak < info["size_bytes"] + 1.25 * arrays, (peak, info["size_bytes"], arrays)
    # What it returned before: the whole pickle, decompressed first, through the same unpickler.
    expected = ps.safe_loads(gzip.decompress((tmp_path / info["filename"]).read_bytes()), compressed=False)
    assert shard.keys() == expected.keys() and len(shard["layer_0"]) == 8
    for got, want in zip(shard["layer_0"], expected["layer_0"]):
        assert got.keys() == want.keys() and got["shape"] == want["shape"] and got["sample_idx"] == want["sample_idx"]
        np.testing.assert_array_equal(got["activation"], want["activation"])


def test_verify_holds_the_shards_it_checks_at_once_within_one_memory_budget(tmp_path, monkeypatch):
    """verify checks shards on several threads, as many as their metadata sizes allow: shards that
    decompress to more than it says each held up to the whole memory_budget() (twice: the pickle,
    then the arrays). Together they now hold one budget: a shard that finds the rest held waits to
    be checked alone, and is checked (none is refused for another's bytes); one past the budget
    alone is refused, naming it."""
    from actstore import integrity
    from actstore.formats.pickle import check, unpickler

    meta = _gzip_shards(tmp_path, 4, 64, 512, zeros=True)  # 64 MiB of arrays each, ~70 KiB of gzip
    arrays = 64 * 512 * 512 * 4
    budget = int(1.25 * arrays)
    monkeypatch.setattr(integrity, "memory_budget", lambda: budget)
    monkeypatch.setattr(unpickler, "memory_budget", lambda: budget)
    with integrity.check_threads(4):
        problems, peak = traced_peak(lambda: check._verify_shards(tmp_path, meta))
    assert problems == []
    # Beyond the budget, each thread's buffers and the one array it is filling: under 4 MiB.
    assert peak < budget + 4 * (4 << 20), (peak, budget)
    monkeypatch.setattr(integrity, "memory_budget", lambda: arrays // 2)
    with integrity.check_threads(4):
        problems = check._verify_shards(tmp_path, meta)
    assert problems == [f"{tmp_path / info['filename']}: refused to load shard: decompresses to more than "
                        f"{arrays // 2:,} bytes" for info in meta["shards"]]
