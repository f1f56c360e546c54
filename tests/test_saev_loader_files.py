"""saev readers and the shuffled loader against the files they hold: how many shards stay open, and
which store a loader reads after the working directory changed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from actstore.formats import saev
from actstore.formats.saev.loader import ShuffledActivations

from test_saev import synthetic_store

N_SHARDS = 200  # of one example each: far more than a child process lowered to 64 open files may hold
LOADER = dict(batch_size=16, seed=3, block_bytes=8, buffer_blocks=200)  # ~130 shards a buffer

# Run in a child process whose open-file limit is lowered to 64; saves to the .npz named by argv[2].
LIMITED = """
import resource, sys
import numpy as np
from actstore.formats import saev
from actstore.formats.saev import loader
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
"""
EXAMPLES = f"""
store = saev.open_store(sys.argv[1])
np.savez(sys.argv[2], examples=np.stack([store.example(ex).copy() for ex in range({N_SHARDS})]))
"""
BATCHES = f"""
out = {{}}
for name, scatter in (("c", loader._scatter), ("numpy", None)):  # the C scatter, then the fallback
    loader._scatter = scatter
    batches = list(loader.ShuffledActivations(sys.argv[1], **{LOADER!r}))
    for key in ("act", "example_idx", "token_idx"):
        out[f"{{name}}_{{key}}"] = np.concatenate([b[key].numpy() for b in batches])
np.savez(sys.argv[2], **out)
"""


def read_limited(script: str, store_dir: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    """What `script` saved, run with the store in a child process limited to 64 open files."""
    done = subprocess.run([sys.executable, "-c", LIMITED + script, str(store_dir), str(tmp_path / "child.npz")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(np.load(tmp_path / "child.npz"))


def test_examples_of_more_shards_than_the_open_file_limit_are_read(tmp_path):
    """store.memmap kept every shard it mapped (each map holds a file descriptor): store.example over a
    store of more shards than the open-file limit (often 1,024 on a cluster) failed with an EMFILE
    naming no file. It keeps at most a quarter of the limit mapped: a child limited to 64 open files
    reads every example of a 200-shard store, each as stored."""
    store_dir = synthetic_store(tmp_path / "store", n=N_SHARDS, tokens=3, d=4, per_shard=1)
    child = read_limited(EXAMPLES, store_dir, tmp_path)
    stored = np.concatenate([chunk for _, chunk in saev.open_store(store_dir).iter_ordered()])
    assert np.array_equal(child["examples"], stored)


def test_a_loader_over_more_shards_than_the_open_file_limit_yields_the_same_batches(tmp_path):
    """The loader kept every shard it read open: a store of more shards than the open-file limit failed
    with EMFILE however the loader was set up. It keeps at most a quarter of the limit open (least
    recently used no fill job is reading closed first): a child limited to 64 open files reads a
    200-shard store, every batch as without the limit, through the C scatter and the numpy fallback."""
    store_dir = synthetic_store(tmp_path / "store", n=N_SHARDS, tokens=3, d=4, per_shard=1)
    child = read_limited(BATCHES, store_dir, tmp_path)
    batches = list(ShuffledActivations(store_dir, **LOADER))
    for name in ("c", "numpy"):
        for key in ("act", "example_idx", "token_idx"):
            assert np.array_equal(child[f"{name}_{key}"], np.concatenate([b[key].numpy() for b in batches])), key
    assert len(child["c_act"]) == N_SHARDS * 3  # every vector once


def test_a_relative_path_reads_its_store_after_the_working_directory_changes(tmp_path, monkeypatch):
    """The loader kept the path as given and reopened it at each __iter__ (in each DataLoader worker):
    built from a relative path, it read whatever that path named in the working directory of the time
    (a trainer that changes directory, as Hydra does) or failed naming a store that was never asked
    for. It reads the store it was built from."""
    store_dir = synthetic_store(tmp_path / "run" / "store", n=6, tokens=3, d=4, per_shard=2)
    monkeypatch.chdir(store_dir.parent)
    loader = ShuffledActivations(store_dir.name, batch_size=4, seed=1, block_bytes=8)
    before = list(loader)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    after = list(loader)
    assert len(after) == len(before) and all(np.array_equal(a[key], b[key]) for a, b in zip(before, after)
                                             for key in ("act", "example_idx", "token_idx"))

