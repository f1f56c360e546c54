"""lmprobe review 63: the reader against the safetensors and pyarrow libraries on real extractions;
verify on a damaged seed, SHA256SUMS or patterns, hashing each file once; the writer's own option checks."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from actstore import integrity
from actstore.casts import to_float32
from actstore.errors import ConfigError, FormatError
from actstore.formats import lmprobe
from actstore.formats.extract import open_extraction
from test_lmprobe_verify_addressing import rewrite_index
from tiny import traced_peak

SMALL = 32 * 4 * 7  # 7 float32 rows of the tiny models' dim 32: prompts past several shard boundaries


def build(extracted, tmp_path: Path, **options) -> tuple[Path, object]:
    _, extract_dir = extracted("gpt2")
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, {"token_strings": False, **options}, progress=False)
    return out, open_extraction(extract_dir)


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor safetensors.torch read, as numpy (bfloat16 as its uint16 bits, as the reader stores it)."""
    return (tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16
            else tensor.numpy())


@pytest.mark.parametrize("options", [
    {"storage": "full_sequence", "dtype": "float32", "layers": [2], "logits_topk": 3},
    {"storage": "full_sequence", "dtype": "bfloat16", "prompt_ordering": "original"},
    {"storage": "pooled", "dtype": "float16", "layers": [0, 2]}])
def test_the_reader_equals_the_libraries_and_the_extraction(extracted, tmp_path, options):
    """Every vector the reader returns is the one safetensors' load_file reads at the address pyarrow
    reads from the index, and the extraction's own vector in the stored dtype."""
    root, ext = build(extracted, tmp_path, shard_bytes=SMALL, **options)
    ds = lmprobe.open_dataset(root)
    table = pq.read_table(root / "index/train-00000-of-00001.parquet").to_pylist()
    hidden = ds.hidden
    files = {rel: {key: as_numpy(t) for key, t in load_file(root / rel).items()}
             for rel in lmprobe.check.tensor_files(ds.info)}
    assert len(table) == ds.num_prompts == ext.n_samples
    for layer in ds.layers:
        key = hidden["key_pattern"].format(layer=layer)
        last = ds.last_tokens(layer)
        for p, row in enumerate(table):
            want = ext.activations(f"layer_{layer}", row["sample_idx"])
            stored = lmprobe.layout.from_float32(np.ascontiguousarray(want, np.float32), ds.dtype)[0]
            lib = files[hidden["file_pattern"].format(layer=layer, shard=row["shard_index"])][key]
            assert np.array_equal(lib[row["row_offset"]].view(stored.dtype), stored[-1])
            assert np.array_equal(ds.get(p, layer), to_float32(stored[-1:], ds.dtype)[0], equal_nan=True)
            assert np.array_equal(last[p], ds.get(p, layer), equal_nan=True)
            if ds.full_sequence:
                rows = [files[hidden["file_pattern"].format(layer=layer, shard=s)][key][o]
                        for s, o in zip(row["token_shard_ids"], row["token_shard_offsets"])]
                assert np.array_equal(np.stack(rows).view(stored.dtype), stored)
                assert np.array_equal(ds.tokens(p, layer), to_float32(stored, ds.dtype), equal_nan=True)
    if ds.logits_desc:
        for p, row in enumerate(table):
            shard = files[ds.logits_desc["file_pattern"].format(shard=row["shard_index_logits"])]
            values, indices = ds.logits(p)
            assert np.array_equal(values, shard["topk_values"][row["row_offset_logits"]])
            assert np.array_equal(indices, shard["topk_indices"][row["row_offset_logits"]])
    assert lmprobe.verify(root) == []


@pytest.mark.parametrize("seed", ["0", -1, 1.5, True, [0], {"a": 1}])
def test_a_seed_that_is_no_whole_number_is_named_by_verify(extracted, tmp_path, seed):
    """lmprobe:prompt_ordering_seed "0", -1 or 1.5 aborted verify (numpy's bare TypeError or ValueError,
    naming no field, every tensor file left unchecked); True passed for seed 1's permutation."""
    root, _ = build(extracted, tmp_path, storage="pooled")
    table = pq.read_table(lmprobe.find_index(root))
    metadata = {**table.schema.metadata, b"lmprobe:prompt_ordering_seed": json.dumps(seed).encode()}
    index = rewrite_index(root, table.replace_schema_metadata(metadata))
    (root / "tensors/hidden_layer000_shard000.safetensors").unlink()
    problems = lmprobe.verify(root)
    assert f"{index}: lmprobe:prompt_ordering_seed {seed!r} is not a whole number" in problems
    assert any("hidden_layer000_shard000.safetensors: missing" in p for p in problems)



def test_a_sha256sums_no_writer_made_is_named_without_reading_it_whole(extracted, tmp_path):
    """SHA256SUMS was read whole, however large (gigabytes in its place took that memory, twice, and a
    list entry a line): it lists each file of the dataset once, so more bytes than that takes is damage."""
    root, _ = build(extracted, tmp_path, storage="pooled")
    sums = root / "SHA256SUMS"
    with sums.open("r+b") as fh:
        fh.truncate(256 << 20)  # the lines, then 256 MiB of zero bytes (sparse: no disk)
    problems, peak = traced_peak(lambda: lmprobe.verify(root))
    assert [p for p in problems if "SHA256SUMS" in p] == [
        f"{sums}: {256 << 20} bytes, more than the dataset's files take to list; not a SHA256SUMS a writer made"]
    assert peak < 32 << 20  # 1 MiB of SHA256SUMS read; each hashing thread's 4 MiB blocks


@pytest.mark.parametrize("edit, problem", [
    (lambda text: text.replace("\n", "\r\n"), None),  # sha256sum -c reads CRLF lines too
    (lambda text: text + "\n", "{root}/SHA256SUMS: '' is not a relative path inside {root}"),
    (lambda text: text.replace("  README.md", "  tensors/../README.md"),
     "{root}/SHA256SUMS: 'tensors/../README.md' is not a relative path inside {root}"),
    (lambda text: text + f"{'0' * 64}  tensors/a name  with spaces\n",
     "{root}/tensors/a name  with spaces: missing (listed in SHA256SUMS)")])
def test_damaged_sha256sums_lines_are_named(extracted, tmp_path, edit, problem):
    root, _ = build(extracted, tmp_path, storage="pooled")
    sums = root / "SHA256SUMS"
    sums.write_bytes(edit(sums.read_text()).encode())
    for checksums in (True, False):
        found = [p for p in lmprobe.verify(root, checksums=checksums) if "README.md: not listed" not in p]
        assert found == ([problem.format(root=root)] if problem else [])


@pytest.mark.parametrize("options, named", [
    ({"layers": []}, "lmprobe.layers: [] names no layer"),
    ({"logits_topk": True}, "lmprobe.logits_topk: True is not a whole number of 1 or more"),
    ({"logits_topk": -1}, "lmprobe.logits_topk: -1 is not a whole number of 1 or more"),
    ({"logits_topk": 0}, "lmprobe.logits_topk: 0 is not a whole number of 1 or more")])
def test_options_the_schema_refuses_are_named_by_the_writer_too(extracted, tmp_path, options, named):
    """write_dataset's options (the library's, which no schema checked): layers [] was a bare IndexError,
    logits_topk True a bare TypeError, -1 numpy's ValueError, and 0 silently the extraction's k."""
    _, extract_dir = extracted("gpt2")
    with pytest.raises(ConfigError) as error:
        lmprobe.write_dataset(extract_dir, tmp_path / "ds", options, progress=False)
    assert str(error.value) == named
    assert not (tmp_path / "ds").exists()


def test_patterns_without_a_layer_field_over_several_layers_are_named(extracted, tmp_path):
    """file_pattern and key_pattern with no {layer} name one tensor for every layer: layer 2's vectors
    were layer 0's, and verify passed (each file still listed and intact)."""
    root, _ = build(extracted, tmp_path, storage="pooled")
    table = pq.read_table(lmprobe.find_index(root))
    tensors = json.loads(table.schema.metadata[b"lmprobe:tensors"])
    hidden = tensors["hidden_layers"]
    assert hidden["layers"] == [0, 2]
    hidden.update(file_pattern=hidden["file_pattern"].replace("{layer:03d}", "000"),
                  key_pattern=hidden["key_pattern"].format(layer=0))
    metadata = {**table.schema.metadata, b"lmprobe:tensors": json.dumps(tensors).encode()}
    index = rewrite_index(root, table.replace_schema_metadata(metadata))
    problem = (f"{index}: hidden_layers.file_pattern {hidden['file_pattern']!r} and key_pattern "
               f"{hidden['key_pattern']!r} have no {{layer}} field for its 2 layers: they would all be one tensor")
    with pytest.raises(FormatError) as error:
        lmprobe.open_dataset(root)
    assert str(error.value) == problem
    assert problem in lmprobe.verify(root)


def test_verify_hashes_each_file_once(extracted, tmp_path, monkeypatch):
    """Each tensor file was hashed twice, against SHA256SUMS and again against lmprobe:files (twice the
    reading of a terabyte dataset, where open_dataset(verify=True) says it reads each file once): the
    SHA256SUMS digest of a file lmprobe:files records is compared with that record, the file hashed once.
    A flipped byte is still named."""
    root, _ = build(extracted, tmp_path, storage="full_sequence", shard_bytes=SMALL)
    hashed: list[str] = []

    def counted(fd: int, sha256=integrity.DIGESTS["sha256"]) -> str:
        hashed.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sha256(fd)

    monkeypatch.setitem(integrity.DIGESTS, "sha256", counted)
    assert lmprobe.verify(root) == []
    listed = [line.split("  ", 1)[1] for line in (root / "SHA256SUMS").read_text().splitlines()]
    assert sorted(hashed) == sorted(str(root / rel) for rel in listed)
    rel = "tensors/hidden_layer002_shard003.safetensors"
    data = bytearray((root / rel).read_bytes())
    data[-5] ^= 1
    (root / rel).write_bytes(bytes(data))
    assert lmprobe.verify(root) == [f"{root / rel}: sha256 differs from lmprobe:files"]
