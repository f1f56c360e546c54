"""Review 65: every format writer checks the extraction part files it reads against part.json's sha256
before its output is renamed into place (PartsCheck): a part damaged after extraction (a bit a disk
flipped) is refused, named, and no store that verifies is left. pickle and zarr: test_journey_damaged_parts."""
from __future__ import annotations

from collections import Counter

import pytest

import tiny

from actstore.errors import FormatError
from actstore.formats import lmprobe, saev
from actstore.formats.extract import layer_tensor, open_extraction, tensor_file
from actstore.formats.extract.layout import PER_SAMPLE_FILES
from actstore.formats.lmprobe.write import plan_dataset
from actstore.jobs import job_items

SAEV = {"patches_per_shard": 8 * 2 * 5, "tokens_per_window": 8}  # shards of 5 windows of 8 tokens, 2 layers
LMPROBE = {"token_strings": False, "shard_bytes": 4 * 64 * 8}  # 8 rows a file: many files for 3 jobs


@pytest.fixture(scope="module")
def gpt2(extracted):
    config, extract_dir = extracted("gpt2")
    return config, extract_dir


def test_saev_writer_refuses_a_damaged_part_naming_it(gpt2, tmp_path):
    """write_store (one job: every part's first example is its own) refuses part 1's flipped layer file and
    leaves no file under the stores' root: no metadata.json marking a finished store, no shard."""
    config, extract_dir = gpt2
    bad = f"part-0001/{tensor_file(layer_tensor(2))}"
    extraction = open_extraction(tiny.damaged_copy(extract_dir, tmp_path, bad))
    root = tmp_path / "saev"
    with pytest.raises(FormatError, match=f"{bad}: sha256_tree differs from .*part.json"):
        saev.write_store(extraction, {**config["saev"], **SAEV}, root, model_config=None, progress=False)
    assert [p for p in root.rglob("*") if not p.is_dir()] == []


def test_saev_shard_job_that_fills_the_damaged_parts_first_example_refuses_it(gpt2, tmp_path):
    """Of 3 shard jobs, the one filling part 1's first example checks part 1's files and fails, leaving no
    job record; the others write theirs; the finishing job then refuses to assemble the store."""
    config, extract_dir = gpt2
    bad = f"part-0001/{tensor_file(layer_tensor(0))}"
    extraction = open_extraction(tiny.damaged_copy(extract_dir, tmp_path, bad))
    plan = saev.plan_store(extraction, {**config["saev"], **SAEV}, labels=False, model_config=None)
    dirs = [tmp_path / f"job-{job}" for job in range(3)]
    failed = []
    for job, job_dir in enumerate(dirs):
        try:
            saev.write_shards(plan, saev.extraction_fill(extraction, plan), job_dir, len(dirs), job)
        except FormatError as exc:
            failed.append((job, str(exc)))
    assert len(failed) == 1 and bad in failed[0][1]
    assert [(d / "job.json").is_file() for d in dirs].count(False) == 1
    assert not (dirs[failed[0][0]] / "job.json").exists()
    with pytest.raises(FormatError, match=f"{dirs[failed[0][0]] / 'job.json'}: missing"):
        saev.finish_store(plan, dirs, tmp_path / "saev")


@pytest.mark.parametrize("jobs", [1, 2, 3, 7, 40])
def test_saev_jobs_check_each_part_file_once(gpt2, jobs):
    """Across a scatter's jobs (fewer than, as many as, more than the parts, and more than the shards), every
    file a shard job reads (offsets.npy, each stored layer) of every part is checked by exactly one job."""
    config, extract_dir = gpt2
    extraction = open_extraction(extract_dir)
    plan = saev.plan_store(extraction, {**config["saev"], **SAEV}, labels=False, model_config=None)
    fill = saev.extraction_fill(extraction, plan)
    starts = [0]
    for size in plan.shard_sizes:
        starts.append(starts[-1] + size)
    checked = Counter()
    for job in range(jobs):
        shards = job_items(len(plan.shard_sizes), jobs, job)
        checked.update((str(part.dir), file) for part, file in fill.reads(range(starts[shards.start],
                                                                                  starts[shards.stop])))
    want = {(str(part.dir), file) for part in extraction.parts if part.info.n_samples
            for file in ["offsets.npy", *(tensor_file(layer_tensor(layer)) for layer in plan.metadata["layers"])]}
    assert set(checked) == want and set(checked.values()) == {1}


def test_lmprobe_writer_refuses_a_damaged_part_naming_it(gpt2, tmp_path):
    """write_dataset refuses part 1's flipped layer file, naming it; no dataset is left at its name."""
    _, extract_dir = gpt2
    bad = f"part-0001/{tensor_file(layer_tensor(2))}"
    copy = tiny.damaged_copy(extract_dir, tmp_path, bad)
    out = tmp_path / "ds"
    with pytest.raises(FormatError, match=f"{bad}: sha256_tree differs from .*part.json"):
        lmprobe.write_dataset(copy, out, LMPROBE, progress=False)
    assert not out.exists()


def test_lmprobe_index_refuses_a_damaged_samples_jsonl(gpt2, tmp_path):
    """The index reads every part's samples.jsonl (texts, labels): one changed letter of a text, still valid
    JSON, is refused, naming the file, before the dataset is renamed into place."""
    _, extract_dir = gpt2
    rows = (extract_dir / "part-0000" / "samples.jsonl").read_bytes()
    at = rows.index(b'"text": "') + len(b'"text": "') + 1  # a letter of the first text
    copy = tiny.damaged_copy(extract_dir, tmp_path, "part-0000/samples.jsonl", flip_at=at)
    out = tmp_path / "ds"
    with pytest.raises(FormatError, match="part-0000/samples.jsonl: sha256_tree differs"):
        lmprobe.write_dataset(copy, out, LMPROBE, progress=False)
    assert not out.exists()


def test_lmprobe_jobs_refuse_a_damaged_part_once_and_check_each_file_once(gpt2, tmp_path):
    """Of 3 tensor jobs over a shuffled order (every file takes rows of both parts) exactly one checks part
    1's flipped layer file and fails, leaving no job directory; and over the intact extraction every layer
    file (and top-k file) of every part is checked by exactly one job, in any job count."""
    _, extract_dir = gpt2
    bad = f"part-0001/{tensor_file(layer_tensor(2))}"
    copy = tiny.damaged_copy(extract_dir, tmp_path, bad)
    failed = []
    for job in range(3):
        try:
            lmprobe.write_job(copy, tmp_path / f"job-{job}", LMPROBE, 3, job, progress=False)
        except FormatError as exc:
            failed.append((job, str(exc)))
    assert len(failed) == 1 and bad in failed[0][1]
    assert not (tmp_path / f"job-{failed[0][0]}").exists()

    plan = plan_dataset(extract_dir, LMPROBE)
    topk = PER_SAMPLE_FILES if plan.opts["logits_topk"] else ()
    want = {(str(part.dir), file) for part in plan.extraction.parts if part.info.n_samples
            for file in [*(tensor_file(layer_tensor(layer)) for layer in plan.opts["layers"]), *topk]}
    for jobs in (1, 2, 3, len(plan.files) + 2):
        checked = Counter((str(part.dir), file) for job in range(jobs)
                          for part, file in plan.reads(job_items(len(plan.files), jobs, job)))
        assert set(checked) == want and set(checked.values()) == {1}, jobs

