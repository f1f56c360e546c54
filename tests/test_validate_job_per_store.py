"""Review 65: the validate stage scattered (a job per store, one for the extraction, one writing the report),
so that no job reads more than one store or the extraction: at 100 TB the one job it was ran past Slurm's cap."""
from __future__ import annotations

import re

import numpy as np
import pytest

import tiny
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.verify import reference_dtype
from test_extract import write_real_store
from test_fingerprints import zarr_chunk


def test_a_store_jobs_fingerprints_kept_in_a_file_name_what_they_named_in_one_process(tmp_path):
    """The zarr store's job and the extraction's job leave their fingerprints in files (the stage's
    hand-over); compared from them, the damaged sample is named as it is in one process, and the rows read
    by each view are the same."""
    from actstore.fingerprints import (compared, fingerprint_problems, reference_passes, store_passes,
                                       wanted_of)
    from actstore.verify import load_extraction_check, load_store_check, save_extraction_check, save_store_check

    root = synthetic_extraction(tmp_path / "x", 200_000, 2, 8, [1, 2], tokens=(4, 10))
    extraction = open_extraction(root)
    store = write_real_store("zarr", root, tmp_path / "zarr")
    rows = np.fromfile(zarr_chunk(store, 3, 0), np.float16)
    rows[0] += 1  # one value of sample 3, layer 1
    rows.tofile(zarr_chunk(store, 3, 0))
    stores = {"zarr": (store, "float16")}
    passes = store_passes("zarr", store, "float16", extraction, 0)
    save_store_check(tmp_path / "zarr.npz", {"store": str(store)}, passes)
    reference = reference_passes(extraction, wanted_of(stores, extraction), 0, reference_dtype)
    save_extraction_check(tmp_path / "extract.npz", 7, {"store": str(root)}, reference)

    entry, passes = load_store_check(tmp_path / "zarr.npz")
    n_coords, extract_entry, loaded = load_extraction_check(tmp_path / "extract.npz")
    assert (entry, n_coords, extract_entry) == ({"store": str(store)}, 7, {"store": str(root)})
    from_files = compared(store, passes, loaded)
    assert from_files == fingerprint_problems(stores, extraction, 0, reference_dtype)["zarr"]
    assert len(from_files["problems"]) == 1, from_files
    assert "layer 1, samples 3..3: holds other vectors" in from_files["problems"][0]
    assert from_files["views"] == {"zarr": extraction.n_tokens * 2}


def test_a_file_that_is_not_a_validate_jobs_result_is_named(tmp_path):
    from actstore.errors import FormatError
    from actstore.verify import load_store_check

    bad = tmp_path / "pickle.npz"
    bad.write_bytes(b"not an npz")
    with pytest.raises(FormatError, match=re.escape(str(bad))):
        load_store_check(bad)


def test_each_store_has_its_own_validate_job_sized_by_what_it_reads(tmp_path, model_dir, text_jsonl, monkeypatch):
    """Only the pickle store's job asks for four of its (large) shards' memory; the zarr store's job, which
    reads a merged store too, more time than a store read once. (One validate_stores job read every store
    and the extraction, sized as one.)"""
    from actstore import resources

    config = tiny.make_config(tmp_path, model_dir("gpt2"), text_jsonl, pickle={"shard_size_mb": 3000},
                              sae={"enabled": False}, zarr={"merged": True}, validate={"jobs": 1})
    pickle_mb = resources.validate_store_mem_mb(config, "pickle")
    assert pickle_mb >= 4 * 3000 * 1.1 > resources.validate_store_mem_mb(config, "saev")
    monkeypatch.setattr(resources, "IO_BYTES_PER_S", 100.0)  # the tiny run's bytes as slow as a large run's
    assert resources.validate_runtime(config, "zarr") > resources.validate_runtime(config, "saev") > 30


def timed_apart(report: dict) -> dict:
    """`report` with each store's read latencies (measured, so of every run its own) replaced by their count."""
    for entry in report["formats"].values():
        if "read_latency_us" in entry:
            entry["read_latency_us"] = len(entry["read_latency_us"])
    return report
