"""validate's full pass (actstore.fingerprints): every vector of every format's store against the
extraction. Stores written by the real writers agree with their extraction; a store whose vectors
were moved inside its data files (two samples swapped, a sample's tokens shifted by one, two layers
traded, a sample missing), which the sampled coordinates find only by chance, is named with its layer
and samples."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from actstore.fingerprints import MAX_CELLS, Fingerprint, fingerprint_problems
from actstore.formats import format_module
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.formats.lmprobe import open_dataset
from actstore.formats.saev import open_store
from actstore.formats.zarr import write_manifest
from actstore.formats.zarr.layout import FILES_JSON, files_json_text
from actstore.verify import check_format, reference_dtype, sample_coordinates
from test_extract import write_real_store
from tiny import traced_peak


def add_fingerprints(formats: dict, extraction, seed: int) -> None:
    """check_format's entries given their stores' fingerprints against the extraction (`fingerprint`, and
    `problems` added), as the validate stage's report job gives them, in this process."""
    stores = {name: (Path(entry["store"]), entry["inspect"].get("dtype", "float32"))
              for name, entry in formats.items() if name != "extract" and entry["inspect"]}
    for name, result in fingerprint_problems(stores, extraction, seed, reference_dtype).items():
        formats[name]["fingerprint"] = result["views"]
        formats[name]["problems"] += result["problems"]


FORMATS = ["pickle", "zarr", "saev", "lmprobe"]


@pytest.fixture(scope="module")
def extraction_root(tmp_path_factory):
    return synthetic_extraction(tmp_path_factory.mktemp("fp") / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))


def problems_of(name: str, store: Path, root: Path) -> tuple[list[str], dict[str, int]]:
    dtype = format_module(name).inspect(store).get("dtype", "float32")
    result = fingerprint_problems({name: (store, dtype)}, open_extraction(root), 0, reference_dtype)[name]
    return result["problems"], result["views"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_format_written_from_an_extraction_agrees_with_it(dtype, tmp_path):
    """Each view reads every row its store holds: every token (lmprobe's sequences too), lmprobe's last
    tokens once a sample; a bf16 or fp16 extraction compared rounded to each store's dtype."""
    root = synthetic_extraction(tmp_path / "x", 100_000, 2, 8, [1, 2], tokens=(4, 10), dtype=dtype)
    extraction = open_extraction(root)
    tokens = extraction.n_tokens * 2  # two layers
    for name in FORMATS:
        problems, views = problems_of(name, write_real_store(name, root, tmp_path / name), root)
        assert problems == [], (name, problems)
        want = {"lmprobe last tokens": extraction.n_samples * 2, "lmprobe sequences": tokens} if name == "lmprobe" \
            else {name: tokens}
        assert views == want


def test_saev_examples_of_two_samples_swapped_are_named(extraction_root, tmp_path):
    """Two windows of equal n_valid of different samples traded places in acts000000.bin."""
    store = write_real_store("saev", extraction_root, tmp_path / "saev")
    saev = open_store(store)
    windows = saev.windows
    a = 0
    b = int(np.flatnonzero((windows[:, 2] == windows[a, 2]) & (windows[:, 0] > windows[a, 0] + 50))[0])
    data = np.memmap(store / "acts000000.bin", np.float32, "r+", shape=(saev.n_examples, saev.L, saev.T, saev.D))
    data[[a, b]] = data[[b, a]]
    data.flush()
    problems, _ = problems_of("saev", store, extraction_root)
    named = {int(re.search(r"\(saev\): layer \d, samples (\d+)\.\.\d+: holds other vectors", p).group(1))
             for p in problems}
    assert named == {int(windows[a, 0]), int(windows[b, 0])}, problems


def zarr_chunk(store: Path, sample: int, layer_position: int) -> Path:
    shard = store / "shards" / "shard-0000.zarr"
    return next(p for p in shard.rglob("0") if p.is_file() and p.parts[-4:-1] == (str(sample), str(layer_position), "0"))


def swap_sealed_chunks(store: Path, first: Path, second: Path) -> None:
    """Two chunk files trade bytes and their meta/files.json entries: a writer that put each sample's
    vectors in the other's place (and hashed what it wrote), so verify passes."""
    shard = store / "shards" / "shard-0000.zarr"
    x, y = first.read_bytes(), second.read_bytes()
    first.write_bytes(y)
    second.write_bytes(x)
    files = json.loads((shard / FILES_JSON).read_text())["files"]
    one, two = (str(p.relative_to(shard)) for p in (first, second))
    files[one], files[two] = files[two], files[one]
    (shard / FILES_JSON).write_text(files_json_text(files))
    write_manifest(store, sorted((store / "shards").iterdir()))


def test_a_zarr_sample_whose_tokens_shifted_by_one_is_named(extraction_root, tmp_path):
    """Token t's vector in token t+1's place (the sum over a sample's tokens is the same)."""
    store = write_real_store("zarr", extraction_root, tmp_path / "zarr")
    chunk = zarr_chunk(store, 3, 0)
    seq_len = int(open_extraction(extraction_root).parts[0].offsets[4] - open_extraction(extraction_root).parts[0].offsets[3])
    hidden = 8
    rows = np.fromfile(chunk, np.float16).reshape(-1, hidden)
    rows[:seq_len] = np.roll(rows[:seq_len], 1, axis=0)
    rows.tofile(chunk)
    problems, _ = problems_of("zarr", store, extraction_root)
    assert len(problems) == 1 and re.search(r"\(zarr\): layer 1, samples 3\.\.3: holds other vectors", problems[0]), problems


def test_zarr_layers_traded_for_one_sample_are_named(extraction_root, tmp_path):
    store = write_real_store("zarr", extraction_root, tmp_path / "zarr")
    first, second = zarr_chunk(store, 5, 0), zarr_chunk(store, 5, 1)
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    problems, _ = problems_of("zarr", store, extraction_root)
    assert [re.sub(r"\(weighted.*", "", p) for p in problems] == [
        f"{store} (zarr): layer {layer}, samples 5..5: holds other vectors than the extraction's " for layer in (1, 2)]


def test_lmprobe_sequence_rows_of_two_prompts_swapped_are_named_in_that_view_only(extraction_root, tmp_path):
    store = write_real_store("lmprobe", extraction_root, tmp_path / "lmprobe")
    dataset = open_dataset(store)
    (shard_a,), (row_a,) = (x[:1] for x in dataset.token_addresses(0))
    (shard_b,), (row_b,) = (x[:1] for x in dataset.token_addresses(100))
    assert shard_a == shard_b
    view = dataset.hidden_tensor(1, int(shard_a))
    data = np.memmap(view.filename, view.dtype, "r+", offset=view.offset, shape=view.shape)
    data[[row_a, row_b]] = data[[row_b, row_a]]
    data.flush()
    problems, _ = problems_of("lmprobe", store, extraction_root)
    samples = sorted(int(dataset.sample_idx[p]) for p in (0, 100))
    assert len(problems) == 2 and all("(lmprobe sequences): layer 1, samples" in p for p in problems), problems
    assert [int(re.search(r"samples (\d+)\.\.", p).group(1)) for p in problems] == samples


def test_a_store_of_one_part_of_two_names_the_rows_it_lacks(extraction_root, tmp_path):
    """A pickle machine's own store (part 0) against the whole extraction: part 1's samples lack rows."""
    store = write_real_store("pickle", extraction_root, tmp_path / "pickle", parts=(0,))
    extraction = open_extraction(extraction_root)
    first = extraction.parts[1].sample_start
    problems, _ = problems_of("pickle", store, extraction_root)
    assert problems and all(re.search(r"holds 0 rows, the extraction \d+$", p) for p in problems), problems
    assert f"samples {first}..{first}" in problems[0]


def test_validate_reports_every_vector_read_and_names_a_swap_the_sampled_rows_miss(extraction_root, tmp_path):
    """check_format's 48 sampled rows read neither swapped sample at this seed; the full pass names it."""
    store = write_real_store("zarr", extraction_root, tmp_path / "zarr")
    extraction = open_extraction(extraction_root)
    coords = sample_coordinates(extraction, 48, 0)
    sampled = {sample for sample, _, _ in coords}
    a, b = [s for s in range(extraction.parts[0].info.n_samples) if s not in sampled and
            extraction.parts[0].offsets[s + 1] - extraction.parts[0].offsets[s] == 6][:2]
    for layer in (0, 1):
        swap_sealed_chunks(store, zarr_chunk(store, a, layer), zarr_chunk(store, b, layer))
    report = check_format("zarr", store, extraction, coords)
    assert report["checked"] == len(coords) and report["problems"] == []
    problems, _ = problems_of("zarr", store, extraction_root)
    assert len(problems) == 4, problems  # two samples, two layers


def test_fingerprint_memory_is_bounded_and_nan_agrees_with_nan():
    """At most MAX_CELLS sums whatever the sample count; a range holding a NaN the model computed
    agrees with the same NaN, differs from a finite vector."""
    big = Fingerprint(10**9, list(range(32)), np.ones(4))
    assert big.sums.size <= MAX_CELLS and big.range_size * big.sums.shape[1] >= 10**9
    rows = np.array([[1.0, np.nan, 0.5, 2.0]], np.float32)
    one, two, finite = (Fingerprint(10, [0], np.ones(4)) for _ in range(3))
    for fingerprint, vectors in ((one, rows), (two, rows), (finite, np.nan_to_num(rows))):
        fingerprint.add(0, np.array([3]), np.array([0]), vectors)
    assert one.differences(two, "x") == []
    hashed = int(one.specials[0, 3])
    assert hashed and one.differences(finite, "x") == [
        f"x: layer 0, samples 3..3: holds its NaN or inf rows elsewhere than the extraction (their hash sum "
        f"{hashed:#x}, the extraction's 0x0)"]


def test_a_nan_the_model_computed_blinds_neither_its_range_nor_itself():
    """Sample 1's token 1 holds a NaN: its tokens 0 and 2 traded, the NaN row moved to token 2, or its
    NaN stored as an inf, each is named in sample 1's range; the same rows in another order agree.
    (A NaN made the range's whole sum NaN, which agreed with any other NaN sum.)"""
    rng = np.random.default_rng(0)
    samples, tokens = np.repeat(np.arange(4), 3), np.tile(np.arange(3), 4)
    vectors = rng.standard_normal((12, 8)).astype(np.float32)
    vectors[4, 2] = np.nan

    def fingerprint(order: np.ndarray, rows: np.ndarray, at_tokens: np.ndarray = tokens) -> Fingerprint:
        folded = Fingerprint(4, [0], np.linspace(-1, 1, 8))
        folded.add(0, samples[order], at_tokens[order], rows[order])
        return folded
    want = fingerprint(np.arange(12), vectors)
    assert fingerprint(rng.permutation(12), vectors).differences(want, "x") == []
    traded = vectors.copy()
    traded[[3, 5]] = vectors[[5, 3]]
    moved = tokens.copy()
    moved[[4, 5]] = [2, 1]
    as_inf = vectors.copy()
    as_inf[4, 2] = np.inf
    for rows, at_tokens, what in ((traded, tokens, "holds other vectors"), (vectors, moved, "NaN or inf rows"),
                                  (as_inf, tokens, "NaN or inf rows")):
        problems = fingerprint(np.arange(12), rows, at_tokens).differences(want, "x")
        assert len(problems) == 1 and problems[0].startswith("x: layer 0, samples 1..1: ") and what in problems[0]


def test_validate_report_of_the_demo_format_stores_lists_the_rows_read(extraction_root, tmp_path):
    """validate_all's entries carry `fingerprint` (rows read by view): checked through add_fingerprints."""
    stores = {name: write_real_store(name, extraction_root, tmp_path / name) for name in FORMATS}
    extraction = open_extraction(extraction_root)
    formats = {name: {"store": str(store), "inspect": format_module(name).inspect(store), "problems": []}
               for name, store in stores.items()}
    add_fingerprints(formats, extraction, 0)
    assert {name: sum(entry["fingerprint"].values()) for name, entry in formats.items()} == {
        "pickle": 2 * extraction.n_tokens, "zarr": 2 * extraction.n_tokens, "saev": 2 * extraction.n_tokens,
        "lmprobe": 2 * (extraction.n_tokens + extraction.n_samples)}
    assert all(entry["problems"] == [] for entry in formats.values())
    json.dumps(formats)  # the report is JSON


def test_two_samples_of_one_range_swapped_differ():
    """Past MAX_CELLS sums, a range holds many samples: their weights r(sample) still tell a swap."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((2, 16)).astype(np.float32)
    right, swapped = (Fingerprint(10**8, list(range(16)), rng.standard_normal(16)) for _ in range(2))
    swapped.direction = right.direction
    assert right.range_size > 2
    right.add(3, np.array([0, 1]), np.array([0, 0]), vectors)
    swapped.add(3, np.array([0, 1]), np.array([0, 0]), vectors[::-1])
    last = right.range_size - 1
    assert [p.split(" (")[0] for p in swapped.differences(right, "x")] == [
        f"x: layer 3, samples 0..{last}: holds other vectors than the extraction's"]


def test_the_full_pass_holds_a_few_blocks_whatever_the_data_size(tmp_path, monkeypatch):
    """Blocks of BLOCK_BYTES read at a time, a thread each: 64 blocks of data, a few blocks' memory."""
    from actstore import fingerprints
    root = synthetic_extraction(tmp_path / "x", 32 << 20, 2, 64, [1, 2], tokens=(32, 128))
    stores = {name: write_real_store(name, root, tmp_path / name) for name in ("saev", "zarr", "lmprobe")}
    monkeypatch.setattr(fingerprints, "BLOCK_BYTES", 512 << 10)
    monkeypatch.setattr(fingerprints.integrity, "CHECK_THREADS", 4)
    extraction = open_extraction(root)
    dtypes = {name: (store, format_module(name).inspect(store).get("dtype", "float32"))
              for name, store in stores.items()}
    results, peak = traced_peak(lambda: fingerprint_problems(dtypes, extraction, 0, reference_dtype))
    assert all(result["problems"] == [] for result in results.values())
    assert peak < 24 << 20, peak  # the data: 32 MiB; blocks of 0.5 MiB, float64 copies, 4 threads


def test_a_zarr_merged_store_is_its_own_view_and_named_where_it_differs(extraction_root, tmp_path):
    """The merged store is another copy users read: a chunk replaced there alone (its own file, not the
    shards' link) is named in the `zarr merged` view, the shards' view still agreeing."""
    from actstore.formats.zarr import merge_stores
    store = write_real_store("zarr", extraction_root, tmp_path / "zarr")
    shards = sorted((store / "shards").iterdir())
    merge_stores(shards, store / "merged", progress=False)
    write_manifest(store, shards, store / "merged")
    problems, views = problems_of("zarr", store, extraction_root)
    assert problems == [] and views == {"zarr": views["zarr"], "zarr merged": views["zarr"]}
    merged_chunk = next(p for p in (store / "merged").rglob("0") if p.is_file() and
                        p.parts[-4:-1] == ("7", "1", "0"))
    replaced = merged_chunk.with_name("new")
    replaced.write_bytes(zarr_chunk(store, 8, 1).read_bytes())
    replaced.rename(merged_chunk)
    problems, _ = problems_of("zarr", store, extraction_root)
    assert [p.split(": holds")[0] for p in problems] == [f"{store} (zarr merged): layer 2, samples 7..7"]
