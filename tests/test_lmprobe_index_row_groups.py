"""lmprobe review 64, the index job at scale: a row group ends at its rows' samples.jsonl bytes as well
as its tokens (texts are whole, not cut at max_seq_length); the perplexity columns are reduced per
body length, to the bits a per-prompt np.mean/min/max gives; verify of a path with no dataset names it;
a samples.jsonl line read as another sample is refused."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pandas  # noqa: F401  pa.array's import: loaded by the first index, not held by the job
import pyarrow.parquet as pq
import pytest

import tiny
from actstore import io_utils
from actstore.errors import FormatError
from actstore.formats import lmprobe
from actstore.formats.lmprobe import write
from test_lmprobe import scattered

LONG_TEXT = 400_000  # characters of each long text: thousands of times what max_seq_length keeps
LONG_TEXTS = 40


@pytest.fixture(scope="module")
def long_jsonl(tmp_path_factory):
    """Real docstrings repeated into 400 kB texts (books, web pages), labelled as the corpus is."""
    rows = tiny.corpus_rows(LONG_TEXTS)
    for i, row in enumerate(rows):
        row["text"] = f"{i} " + (row["text"] + " ") * (LONG_TEXT // len(row["text"]) + 1)
    path = tmp_path_factory.mktemp("long") / "long.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow
def test_an_index_row_group_ends_at_its_lines_bytes_and_the_job_holds_a_few_groups(extracted, long_jsonl,
                                                                                   tmp_path, monkeypatch):
    """40 texts of 400 kB cut to 24 tokens: a row group (2^20 tokens) held every one whole, 16 MB
    (a 2,048-prompt group of 1 MB texts: 2 GB). Groups now end at 1 MiB of lines here (128 MiB
    in a run): the finishing job's traced peak (5 MiB; 16 before) stays within a few groups, under
    the texts' total, and every text reads back whole."""
    _, extract_dir = extracted("gpt2", data=long_jsonl)
    monkeypatch.setattr(write, "ROW_GROUP_LINE_BYTES", 1 << 20)
    options = {"storage": "full_sequence", "token_strings": False}
    out = tmp_path / "dataset"
    job_dirs = scattered(extract_dir, out, options, 1)
    _, peak = tiny.traced_peak(lambda: lmprobe.finish_dataset(extract_dir, job_dirs, out, options))

    texts = sum(len(line) for line in long_jsonl.read_bytes().splitlines())
    index = pq.ParquetFile(lmprobe.find_index(out))
    groups = [index.metadata.row_group(g).num_rows for g in range(index.metadata.num_row_groups)]
    assert len(groups) >= LONG_TEXTS // 4 and max(groups) <= 1 + (1 << 20) // LONG_TEXT, groups
    bound = io_utils.CHUNK + 3 * (1 << 20)  # the index's sha256 read block, and a group with the next's first rows
    assert peak < bound < texts, f"peak {peak / 2**20:.1f} MiB, texts {texts / 2**20:.1f} MiB"
    stored = dict(zip(index.read(columns=["sample_idx"]).column(0).to_pylist(),
                      index.read(columns=["text"]).column(0).to_pylist()))
    assert [stored[i] for i in range(LONG_TEXTS)] == [json.loads(line)["text"] for line in
                                                     long_jsonl.read_text().splitlines()]
    assert lmprobe.verify(out) == []


def test_ordinary_prompts_keep_the_row_groups_their_tokens_make(extracted, tmp_path, monkeypatch):
    """Short texts never reach the lines' bound: the groups end where the tokens alone end them."""
    _, extract_dir = extracted("gpt2")
    monkeypatch.setattr(write, "ROW_GROUP_TOKENS", 40)
    lmprobe.write_dataset(extract_dir, tmp_path / "ds", {"token_strings": False}, progress=False)
    metadata = pq.ParquetFile(lmprobe.find_index(tmp_path / "ds")).metadata
    num_tokens = pq.read_table(lmprobe.find_index(tmp_path / "ds"), columns=["num_tokens"]).column(0).to_pylist()
    ends = np.cumsum([metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)])
    expected, total = [], 0
    for row, tokens in enumerate(num_tokens):
        total += tokens
        if total >= 40 or row == len(num_tokens) - 1:
            expected, total = [*expected, row + 1], 0
    assert ends.tolist() == expected


def reference_stats(list_offsets: np.ndarray, logprob: np.ndarray) -> list[list]:
    """perplexity_mean/min/max as the spec defines them: numpy over each prompt's tokens 1.., None with none."""
    ppl = np.exp(-logprob.astype(np.float64))
    bodies = [ppl[a + 1:b] for a, b in zip(list_offsets[:-1], list_offsets[1:])]
    return [[float(fn(body)) if len(body) else None for body in bodies] for fn in (np.mean, np.min, np.max)]


def same_bits(got: list, want: list) -> bool:
    return [x is None for x in got] == [x is None for x in want] and (
        np.array([0.0 if x is None else x for x in got]).tobytes()
        == np.array([0.0 if x is None else x for x in want]).tobytes())


def test_perplexity_columns_are_bit_identical_to_numpy_per_prompt():
    """Bodies of 0..20,000 tokens (numpy's pairwise sum changes form at 8, 128 and 8,192), prompts of one
    token and none, NaN and +-inf logprobs: the same float64 bits as np.mean/min/max of each prompt
    (np.add.reduceat, summing in order, differs in the last bit from 3 tokens on)."""
    rng = np.random.default_rng(64)
    lengths = rng.choice([0, 1, 2, 3, 4, 8, 9, 10, 128, 129, 130, 1000, 8192, 8193, 8194, 20001], size=120)
    list_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    logprob = (rng.standard_normal(list_offsets[-1]) * 4).astype(np.float32)
    for value, count in ((np.nan, 30), (np.inf, 5), (-np.inf, 5)):
        logprob[rng.integers(0, len(logprob), count)] = value
    cols = write._perplexity_columns(list_offsets, logprob)
    want = reference_stats(list_offsets, logprob)
    for name, expected in zip(("perplexity_mean", "perplexity_min", "perplexity_max"), want):
        assert same_bits(cols[name].to_pylist(), expected), name
    assert cols["token_logprob"].flatten().to_numpy().tobytes() == logprob.tobytes()


def test_the_written_perplexity_columns_are_numpys_over_each_rows_tokens(extracted, tmp_path):
    """On a real causal LM's extraction, every row's statistics are numpy's over its token_logprob list."""
    _, extract_dir = extracted("gpt2")
    lmprobe.write_dataset(extract_dir, tmp_path / "ds", {"token_strings": False}, progress=False)
    index = pq.read_table(lmprobe.find_index(tmp_path / "ds"))
    logprob = index.column("token_logprob").combine_chunks()
    list_offsets = logprob.offsets.to_numpy()
    want = reference_stats(list_offsets, logprob.flatten().to_numpy())
    for name, expected in zip(("perplexity_mean", "perplexity_min", "perplexity_max"), want):
        assert same_bits(index.column(name).to_pylist(), expected), name


def test_verify_of_a_path_with_no_dataset_names_it(tmp_path):
    """A missing path was "verification aborted: FileNotFoundError"; the other formats name what is missing."""
    assert lmprobe.verify(tmp_path / "nowhere") == [f"{tmp_path / 'nowhere'}: missing (an lmprobe dataset is "
                                                    "a directory)"]
    (tmp_path / "file").write_text("x")
    assert lmprobe.verify(tmp_path / "file") == [f"{tmp_path / 'file'}: not a directory (an lmprobe dataset is "
                                                 "a directory)"]


def test_a_samples_line_moved_within_its_part_is_refused_naming_it(extracted, tmp_path):
    """Lines 2 and 3 of a part's samples.jsonl swapped (each keeps its own sample_idx): the index stored
    sample 1's text and label beside sample 2's activations, and verify of the dataset passed. Refused
    naming the line, before any index is written."""
    _, extract_dir = extracted("gpt2")
    damaged = tmp_path / "extract"
    shutil.copytree(extract_dir, damaged)
    rows = damaged / "part-0000" / "samples.jsonl"
    lines = rows.read_text().splitlines(keepends=True)
    lines[1], lines[2] = lines[2], lines[1]
    rows.write_text("".join(lines))
    with pytest.raises(FormatError, match=rf"{rows}: line [23] says sample_idx [12], where the part's sample_range "
                                          "makes it sample [12]; the extraction is damaged"):
        lmprobe.write_dataset(damaged, tmp_path / "ds", {"token_strings": False}, progress=False)
    assert not (tmp_path / "ds").exists()
