"""lmprobe lookups by sample_idx and verify's checks of the addressing, on datasets the project's own
writer built: an index damaged where only verify could notice must be named by it."""
from __future__ import annotations

import hashlib
import json
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actstore.errors import FormatError
from actstore.formats import lmprobe
from actstore.formats.lmprobe.read import LmprobeDataset

FULL = {"storage": "full_sequence", "shard_bytes": 32 * 4 * 12}  # dim 32 float32: 3 last-token shards


def build(extracted, tmp_path: Path, kind: str, options: dict) -> Path:
    _, extract_dir = extracted(kind)
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, options, progress=False)
    return out


def rewrite_index(root: Path, table: pa.Table) -> Path:
    """Write `table` as the index and its digest into SHA256SUMS, as a writer with that index would:
    what is left to notice a wrong address is verify's index checks."""
    index = lmprobe.find_index(root)
    pq.write_table(table, index)
    rel = index.relative_to(root).as_posix()
    digest = hashlib.sha256(index.read_bytes()).hexdigest()
    sums = root / "SHA256SUMS"
    sums.write_text("".join(f"{digest}  {rel}\n" if line.endswith(f"  {rel}") else f"{line}\n"
                            for line in sums.read_text().splitlines()))
    return index


def with_column(table: pa.Table, name: str, values: list) -> pa.Table:
    field = table.schema.field(name)
    return table.set_column(table.schema.get_field_index(name), field, pa.array(values, field.type))


def test_sample_lookups_hold_eight_bytes_a_prompt_and_answer_as_before(extracted, tmp_path):
    """has_sample / row_of (every `actstore locate`) built a dict of every prompt: 112 B a prompt held,
    11 GB for a 100M-prompt index. Every sample_idx finds its row; one not stored is not found."""
    root = build(extracted, tmp_path, "gpt2", {"storage": "pooled"})
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    n = 20_000  # the writer's rows repeated: only the index is read by a lookup
    table = table.take(np.arange(n) % table.num_rows)
    table = with_column(table, "sample_idx", np.random.default_rng(0).permutation(n).tolist())
    pq.write_table(table, index)
    ds = LmprobeDataset(root)
    tracemalloc.start()
    try:
        assert ds.has_sample(0)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held <= 16 * n, f"{held / n:.0f} B a prompt held by a lookup"
    assert [ds.row_of(s) for s in ds.sample_idx.tolist()] == list(range(n))
    for absent in (-1, n, n + 7, 2**70):
        assert not ds.has_sample(absent)
        with pytest.raises(IndexError, match=rf"{re.escape(str(index))}: no prompt with sample_idx {absent}$"):
            ds.row_of(absent)


def test_a_token_address_given_twice_is_named_by_verify(extracted, tmp_path):
    """Token 1 of a prompt addressing token 0's row passed verify (every address in range), and the
    reader returned token 0's vector for token 1; two index rows' last tokens sharing one was named."""
    root = build(extracted, tmp_path, "llama", FULL)
    table = pq.read_table(lmprobe.find_index(root))
    offsets = table.column("token_shard_offsets").to_pylist()
    shard = table.column("token_shard_ids")[0].as_py()[0]
    offsets[0] = [offsets[0][0]] + offsets[0][:1] + offsets[0][2:]
    index = rewrite_index(root, with_column(table, "token_shard_offsets", offsets))
    assert lmprobe.verify(root) == [f"{index}: token_shard_ids/token_shard_offsets repeats an earlier token's "
                                    f"address at row 0: ({shard}, {offsets[0][0]})"]


def test_a_last_token_shard_is_checked_against_its_prompt_count(extracted, tmp_path):
    """A full-sequence last-token shard holds one row a prompt (the spec: num_tokens = num_prompts), the
    rows row_offset addresses; verify checked its header against num_tokens, so a descriptor whose
    num_prompts said 13 for a 12-row shard passed verify while the reader refused row 12."""
    root = build(extracted, tmp_path, "llama", FULL)
    table = pq.read_table(lmprobe.find_index(root))
    metadata = dict(table.schema.metadata)
    tensors = json.loads(metadata[b"lmprobe:tensors"])
    shards = tensors["hidden_layers"]["shards"]
    assert shards[0] == shards[1] == {"num_prompts": 12, "num_tokens": 12}
    shards[0]["num_prompts"], shards[1]["num_prompts"] = 13, 11  # the prompt counts still sum to the index's
    metadata[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    columns = table.select(["shard_index", "row_offset", "token_offset"]).to_pydict()
    moved = list(zip(columns["shard_index"], columns["row_offset"])).index((1, 11))
    for name, value in (("shard_index", 0), ("row_offset", 12), ("token_offset", 12)):
        columns[name][moved] = value
        table = with_column(table, name, columns[name])
    rewrite_index(root, table.replace_schema_metadata(metadata))
    refused = rf"row {moved} row_offset 12 is not a row of \S+shard000\.safetensors \(12 rows\)"
    with pytest.raises(FormatError, match=refused):
        lmprobe.open_dataset(root).get(moved, 0)
    named = {f"{root}/tensors/hidden_layer{layer:03d}_shard{s:03d}.safetensors: tensor of 12 rows, "
             f"descriptor says {rows}" for layer in (0, 2) for s, rows in ((0, 13), (1, 11))}
    index = lmprobe.find_index(root)
    named |= {f"{index}: hidden_layers.shards[{s}] num_tokens 12 is not its num_prompts {rows} (a last-token "
              "shard holds one token a prompt)" for s, rows in ((0, 13), (1, 11))}
    assert set(lmprobe.verify(root)) == named


def test_sequence_shards_holding_other_than_the_index_tokens_are_named(extracted, tmp_path):
    """Each token has a sequence-shard row of its own: a descriptor whose sequence shards hold more
    rows than the index has tokens is named (the rows named so far are one bit a token, never sized
    by a descriptor's number: 2**52 tokens aborted verify on a 512 TiB allocation)."""
    root = build(extracted, tmp_path, "llama", FULL)
    table = pq.read_table(lmprobe.find_index(root))
    metadata = dict(table.schema.metadata)
    tensors = json.loads(metadata[b"lmprobe:tensors"])
    tensors["hidden_layers"]["shards"][-1]["num_tokens"] += 2**52
    metadata[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    index = rewrite_index(root, table.replace_schema_metadata(metadata))
    tokens = sum(table.column("num_tokens").to_pylist())
    problems = lmprobe.verify(root)
    assert f"{index}: sequence shards hold {tokens + 2**52} tokens (shards[].num_tokens), index has {tokens}" \
        in problems, problems
    assert not any("aborted" in p for p in problems), problems
