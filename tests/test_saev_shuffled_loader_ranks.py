"""saev shuffled loader review: sizes asked past the store, seeds/epochs numpy refuses late, and
the split across data-parallel ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from actstore.errors import ConfigError
from actstore.formats import saev
from actstore.formats.saev.loader import ShuffledActivations

from test_saev import synthetic_store

EVERY_VECTOR = [(e, t) for e in range(6) for t in range(5)]  # synthetic_store(n=6, tokens=5)


def rows(batches) -> list[tuple[int, int]]:
    return [(int(e), int(t)) for b in batches for e, t in zip(b["example_idx"], b["token_idx"])]


def stored_vectors(store_dir) -> np.ndarray:
    """(n, T, D) vectors of a one-layer store, read in example order."""
    return np.concatenate([chunk[:, 0] for _, chunk in saev.open_store(store_dir).iter_ordered()])


def test_blocks_asked_larger_than_a_shard_are_the_shards(tmp_path):
    """block_bytes or block_examples past a shard (to read whole shards) sized each fill thread's
    scratch and the buffers by what was asked: a MemoryError of exabytes on a 30-vector store. A block
    never crosses a shard, so they are the shard's blocks: the batches of block_examples=3 (a shard)."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    shard = list(ShuffledActivations(store_dir, batch_size=4, seed=2, block_examples=3, buffer_blocks=1))
    for asked in (dict(block_bytes=1 << 62), dict(block_examples=10**16)):
        got = list(ShuffledActivations(store_dir, batch_size=4, seed=2, buffer_blocks=1, **asked))
        assert len(got) == len(shard) and all(torch.equal(a["act"], b["act"]) and torch.equal(
            a["example_idx"], b["example_idx"]) for a, b in zip(shard, got))
    assert sorted(rows(shard)) == EVERY_VECTOR


def test_a_batch_size_past_the_store_is_one_batch_of_it(tmp_path):
    """Each buffer kept batch_size rows for the last one's leftovers: batch_size=10**16 (one batch of
    everything) was a MemoryError of exabytes. It is one batch holding every vector once (none with
    drop_last), in one process and across DataLoader workers."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    whole = list(ShuffledActivations(store_dir, batch_size=10**16, seed=1, block_bytes=8, buffer_blocks=4))
    assert len(whole) == 1 and sorted(rows(whole)) == EVERY_VECTOR
    ref = stored_vectors(store_dir)
    assert all(np.array_equal(a.numpy(), ref[e, t]) for a, e, t in zip(whole[0]["act"], whole[0]["example_idx"],
                                                                        whole[0]["token_idx"]))
    assert list(ShuffledActivations(store_dir, batch_size=10**16, drop_last=True)) == []
    loader = torch.utils.data.DataLoader(ShuffledActivations(store_dir, batch_size=10**16, block_bytes=8),
                                         batch_size=None, num_workers=2)
    assert sorted(rows(loader)) == EVERY_VECTOR


def test_seeds_epochs_and_buffer_blocks_numpy_or_torch_would_take_are_named(tmp_path):
    """seed=None failed on `None < 0` (TypeError naming nothing), seed=1.5 in numpy at the first batch
    (in a DataLoader worker); set_epoch(-1) in numpy at the first batch, set_epoch(2.7) was epoch 2;
    buffer_blocks=0 was the default. Each is a ConfigError naming it; numpy integers still count."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    for bad, named in (({"seed": None}, "seed=None "), ({"seed": 1.5}, "seed=1.5 "), ({"seed": True}, "seed=True "),
                       ({"buffer_blocks": 0}, "buffer_blocks=0 ")):
        with pytest.raises(ConfigError, match=named):
            ShuffledActivations(store_dir, **bad)
    ds = ShuffledActivations(store_dir, seed=np.int64(3))
    for epoch in (-1, 2.7, "1"):
        with pytest.raises(ConfigError, match=f"epoch={epoch!r} "):
            ds.set_epoch(epoch)
    ds.set_epoch(np.int64(4))
    assert ds.epoch == 4 and sorted(rows(ds)) == EVERY_VECTOR


def test_data_parallel_ranks_and_their_workers_read_every_vector_once(tmp_path):
    """Under DDP each rank read the whole store every epoch (world_size x the data). Now ranks and their
    DataLoader workers take disjoint slices of one block order: together every vector once, each rank
    its own; one rank of one is the loader as before, batch for batch."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    options = dict(batch_size=3, seed=4, block_bytes=8, buffer_blocks=2)
    per_rank = []
    for rank in range(3):
        loader = torch.utils.data.DataLoader(ShuffledActivations(store_dir, rank=rank, world_size=3, **options),
                                             batch_size=None, num_workers=2)
        per_rank.append(rows(loader))
    assert all(per_rank) and sorted(sum(per_rank, [])) == EVERY_VECTOR
    alone = list(ShuffledActivations(store_dir, **options))
    assert [rows([b]) for b in alone] == [rows([b]) for b in ShuffledActivations(store_dir, rank=0, world_size=1,
                                                                                   **options)]
    for bad in (dict(rank=3, world_size=3), dict(rank=-1, world_size=2), dict(rank=0, world_size=0),
                dict(rank=0.0, world_size=2)):
        with pytest.raises(ConfigError, match="rank=.* and world_size=.* must be whole numbers"):
            ShuffledActivations(store_dir, **bad)


def test_a_store_of_more_shards_than_open_files_says_what_to_change(tmp_path):
    """A process keeps every shard it read open; past the open-file limit the error said "reading at
    byte 0". It now names the limit, the shards and what to change. (In a child process whose limit is
    lowered to the files it has open plus two.)"""
    import subprocess
    import sys

    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=1)
    child = f"""
import os, resource
from actstore.formats.saev.loader import ShuffledActivations
loader = ShuffledActivations({str(store_dir)!r}, batch_size=30, block_bytes=8)
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))
try:
    list(loader)
except OSError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120).stdout
    assert "cannot open it" in out and "of the store's 6 shards open, at its open-file limit of" in out, out
    assert "ulimit -n" in out and "saev.patches_per_shard" in out and "reading at byte" not in out


def test_ranks_shuffle_their_buffers_each_its_own_way(tmp_path):
    """Every rank drew its buffer permutations from one stream ([seed, epoch, worker]), so ranks of
    equal share permuted their disjoint buffers alike: the n-th vector of each rank's batch came from
    the same buffer slot on every rank. Each rank now has its own stream."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    options = dict(batch_size=100, seed=0, block_examples=1, buffer_blocks=10)

    def slots(ds: ShuffledActivations) -> list[int]:
        """Each yielded vector's place in the rank's buffer (its blocks, one example each, in order)."""
        blocks = ds.my_blocks(0).tolist()
        return [blocks.index(e) * 5 + t for e, t in rows(ds)]

    per_rank = [slots(ShuffledActivations(store_dir, rank=rank, world_size=2, **options)) for rank in range(2)]
    assert sorted(per_rank[0]) == sorted(per_rank[1]) == list(range(15))
    assert per_rank[0] != per_rank[1]
