"""validate's cross-format comparison against lmprobe stores that verify on their own but are not
what the config asked for: index rows of another order (two samples swapped), another dtype."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.formats import lmprobe
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.verify import check_format, sample_coordinates
from test_extract import LMPROBE_DEFAULTS

INDEX = "index/train-00000-of-00001.parquet"


def reseal(store: Path, name: str) -> None:
    """SHA256SUMS's line of `name` rewritten to the file's bytes, as a writer that wrote them would."""
    digest = hashlib.sha256((store / name).read_bytes()).hexdigest()
    lines = [f"{digest}  {name}" if line.endswith(f"  {name}") else line
             for line in (store / "SHA256SUMS").read_text().splitlines()]
    (store / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def swap_two_index_rows(store: Path) -> tuple[int, int]:
    """Two index rows of equal num_tokens trade sample_idx (each reads the other's vectors), resealed."""
    table = pq.read_table(store / INDEX)
    ids, n_tokens = table.column("sample_idx").to_numpy().copy(), table.column("num_tokens").to_numpy()
    a = 0
    b = int(np.flatnonzero((n_tokens == n_tokens[a]) & (np.arange(len(ids)) != a))[0])
    ids[[a, b]] = ids[[b, a]]
    column = table.schema.get_field_index("sample_idx")
    table = table.set_column(column, "sample_idx", pa.array(ids, table.schema.field("sample_idx").type))
    pq.write_table(table, store / INDEX)
    reseal(store, INDEX)
    return a, b


@pytest.fixture
def extraction_root(tmp_path):
    return synthetic_extraction(tmp_path / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_validate_names_an_lmprobe_index_whose_rows_swapped_two_samples(seed, extraction_root, tmp_path):
    """Two index rows of equal num_tokens with their sample_idx swapped verified (a permutation, and
    an "original" order is checked against no seed), and validate's 48 rows of 437 samples read
    either at about 1 seed in 5. The order the config's prompt_ordering makes is checked now."""
    store = tmp_path / "lmprobe"
    lmprobe.write_dataset(extraction_root, store, LMPROBE_DEFAULTS, progress=False)
    a, b = swap_two_index_rows(store)
    # lmprobe's own verify names it too, from the store's recorded ordering alone
    assert lmprobe.verify(store) == [f"{store / INDEX}: row {a} holds sample_idx {b}, where lmprobe:prompt_ordering "
                                     "'original' keeps rows in sample order (2 rows differ)"]
    extraction = open_extraction(extraction_root)
    problems = check_format("lmprobe", store, extraction, sample_coordinates(extraction, 48, seed),
                            LMPROBE_DEFAULTS)["problems"]
    assert any(re.fullmatch(rf"{re.escape(str(store))}: index row {a} holds sample_idx {b}, lmprobe.prompt_ordering "
                            r"'original' \(seed 0\) puts 0 there \(2 rows differ\)", p) for p in problems), problems


def test_validate_names_an_lmprobe_store_of_another_seed_than_the_configs(extraction_root, tmp_path):
    store = tmp_path / "lmprobe"
    lmprobe.write_dataset(extraction_root, store, {**LMPROBE_DEFAULTS, "prompt_ordering": "random", "seed": 1},
                          progress=False)
    assert lmprobe.verify(store) == []
    extraction = open_extraction(extraction_root)
    section = {**LMPROBE_DEFAULTS, "prompt_ordering": "random", "seed": 0}
    problems = check_format("lmprobe", store, extraction, sample_coordinates(extraction, 4, 0), section)["problems"]
    assert any(re.search(r"lmprobe.prompt_ordering 'random' \(seed 0\) puts", p) for p in problems), problems


@pytest.mark.parametrize("extracted_in, written, asked, problem", [
    ("float32", "float16", "float32", r"dtype 'float16', the config's lmprobe.dtype 'float32'$"),
    ("float32", "bfloat16", "auto",
     r"dtype 'bfloat16', the config's lmprobe.dtype 'auto' \(the extraction's storage dtype 'float32'\)$"),
    ("float16", "auto", "auto", None),
    ("float32", "float16", "float16", None)])
def test_validate_names_an_lmprobe_store_of_another_dtype_than_the_configs(extracted_in, written, asked, problem,
                                                                         tmp_path):
    """The extraction was rounded to the dtype the store says it holds before the comparison, so a
    store written in float16 where the config asks float32 passed validate."""
    root = synthetic_extraction(tmp_path / "x", 100_000, 2, 8, [1, 2], tokens=(4, 10), dtype=extracted_in)
    store = tmp_path / "lmprobe"
    lmprobe.write_dataset(root, store, {**LMPROBE_DEFAULTS, "dtype": written}, progress=False)
    extraction = open_extraction(root)
    problems = check_format("lmprobe", store, extraction, sample_coordinates(extraction, 48, 0),
                            {**LMPROBE_DEFAULTS, "dtype": asked})["problems"]
    if problem is None:
        assert problems == []
    else:
        assert any(re.fullmatch(rf"{re.escape(str(store))}: {problem}", p) for p in problems), problems
