"""saev review 60: indices numpy or Python would take as another vector's, a shard cut short seen only
by numpy's memmap, and a loader that kept reading a store by the layout of the one replaced at its path."""
from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

from actstore.errors import FormatError
from actstore.formats import saev
from actstore.formats.saev.layout import shard_name
from actstore.formats.saev.loader import ShuffledActivations

from test_saev import synthetic_store

JOIN_SECONDS = 60  # a loader that hangs fails the test instead of the run


@pytest.mark.parametrize("call, named", [
    (lambda s: s.vector(True, 0, 0), "example True"),  # was example 1's vector
    (lambda s: s.vector(1.0, 0, 0), "example 1.0"),  # was "Unknown format code 'd'"
    (lambda s: s.vector(0, 0, 1.5), "token 1.5"),  # was "'float' object cannot be interpreted"
    (lambda s: s.vector(0, 0, True), "token True"),  # was token 1's vector
    (lambda s: s.vector(0, 0.0, 0), "layer 0.0"),  # was layer 0's vector
    (lambda s: s.example(True), "example True"),  # was example 1
    (lambda s: s.find(True, 0), "sample_idx True"),  # was (True, 0)
    (lambda s: s.find(0, 1.5), "token_idx 1.5"),  # was (0, 1.5)
    (lambda s: ShuffledActivations(s.dir, layers=[False]), "layer False"),  # yielded layer 0
])
def test_indices_that_are_not_integers_are_refused_naming_them(tmp_path, call, named):
    """A bool is 1 to `0 <= i < n` and to `layer in layers`, a float 1.0 matched layer 1: True read
    example 1's vector, and a float failed in string formatting or os.preadv naming nothing."""
    store = saev.open_store(synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3))
    with pytest.raises(TypeError, match=rf"{store.dir}: {named} is not an integer"):
        call(store)
    assert np.array_equal(store.vector(np.int64(1), 0, np.int32(2)), store.example(1)[0, 2])  # numpy ints still count


def test_a_shard_cut_short_after_opening_is_named_by_example(tmp_path):
    """example() mapped the shard at its shards.json size: numpy refused one cut short since the store
    was opened with "mmap length is greater than file size", naming no file."""
    store = saev.open_store(synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3))
    shard = store.dir / shard_name(1)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(FormatError, match=rf"{shard}: 100 bytes, expected 240"):
        store.example(4)
    assert store.example(1).shape == (1, 5, 4)  # the intact shard still reads


def _epoch_rows(loader: ShuffledActivations) -> list:
    """Every (example, token) an epoch yields, or the exception it raised; run in a thread with a
    timeout, so that a loader that hangs fails the test."""
    result: list = []

    def run() -> None:
        try:
            result.extend((int(e), int(t)) for b in loader for e, t in zip(b["example_idx"], b["token_idx"]))
        except Exception as exc:  # noqa: BLE001 - handed to the test to match
            result.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(JOIN_SECONDS)
    assert not thread.is_alive(), "the loader hung"
    return result


@pytest.mark.parametrize("replacement_examples", [9, 4])
def test_a_store_replaced_between_epochs_is_refused_naming_it(tmp_path, replacement_examples):
    """Blocks are planned from the store opened when the loader was made; each epoch reopens the path.
    A store of 9 examples copied over one of 6 yielded 30 of its 45 vectors as a whole epoch; one of 4
    failed with a bare IndexError. The next epoch names the store and says to make a new loader."""
    store_dir = synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3)
    loader = ShuffledActivations(store_dir, batch_size=4, block_bytes=8, buffer_blocks=3)
    assert sorted(_epoch_rows(loader)) == [(e, t) for e in range(6) for t in range(5)]
    other = synthetic_store(tmp_path / "other", n=replacement_examples, tokens=5, d=4, per_shard=3)
    shutil.rmtree(store_dir)
    shutil.copytree(other, store_dir)
    got = _epoch_rows(loader)
    assert len(got) == 1 and isinstance(got[0], FormatError), got[:3]
    assert str(got[0]).startswith(f"{store_dir}: changed since this loader was made"), got[0]
    fresh = ShuffledActivations(store_dir, batch_size=4, block_bytes=8, buffer_blocks=3)
    assert sorted(_epoch_rows(fresh)) == [(e, t) for e in range(replacement_examples) for t in range(5)]


def test_examples_read_from_several_threads_past_the_map_budget(tmp_path, monkeypatch):
    """memmap() checked that a shard was mapped, then moved it to the end of its LRU and looked it up:
    another thread mapping one more shard in between let it go, a KeyError (7 of 8 threads here).
    Each thread gets its example's bytes, whatever the others let go."""
    import sys

    from actstore.formats.saev import read
    store = saev.open_store(synthetic_store(tmp_path / "store", n=64, tokens=3, d=4, per_shard=1))
    want = np.stack([store.vector(e, 0, 1) for e in range(64)])
    monkeypatch.setattr(read, "open_files_budget", lambda: 2)  # 64 shards past it, as thousands past the limit
    failures: list[str] = []

    def read_examples(first: int) -> None:
        try:
            for _ in range(200):
                failures.extend(f"example {e} wrong" for e in range(first, 64, 8)
                                if not np.array_equal(store.example(e)[0, 1], want[e]))
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(repr(exc))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, as a busy machine does
    try:
        threads = [threading.Thread(target=read_examples, args=(k,), daemon=True) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_SECONDS)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads), "reading hung"
    assert failures == []
    assert len(store._maps) <= 2 + len(threads)  # still bounded: each thread adds at most its own map


def test_a_token_out_of_range_names_the_store(tmp_path):
    """locate's IndexError for a token past T named no store, unlike the example's beside it."""
    store = saev.open_store(synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3))
    with pytest.raises(IndexError, match=rf"{store.dir}: token 5 out of range \[0, 5\)"):
        store.vector(0, 0, 5)


LABELS_CUT_MID_EPOCH = """
import sys
from pathlib import Path
from actstore.formats.saev.loader import ShuffledActivations
store = Path(sys.argv[1])
loader = ShuffledActivations(store, batch_size=4, seed=1, block_bytes=8, buffer_blocks=8, keep_labels=[1])
try:
    for i, batch in enumerate(loader):
        if i == 0:
            (store / "labels.bin").write_bytes(b"")  # purged while the epoch runs
    print("no error")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_labels_cut_short_mid_epoch_are_named_not_sigbus(tmp_path):
    """The loader filtered by a memory map of labels.bin, checked for size when the epoch began: cut
    short meanwhile (purged scratch), reading the map killed the training process with SIGBUS (or read
    zeros as labels in the file's last page). The loader reads the labels and names the file."""
    import subprocess
    import sys

    n, tokens = 2048, 5  # labels.bin 8 KiB: pages a map of it would fault on once it is emptied
    store_dir = synthetic_store(tmp_path / "store", n=n, tokens=tokens, d=4, per_shard=64)
    saev.write_labels(store_dir, np.random.default_rng(3).integers(0, 3, (n, tokens - 1)).astype(np.uint8))
    done = subprocess.run([sys.executable, "-c", LABELS_CUT_MID_EPOCH, str(store_dir)], capture_output=True,
                          text=True, timeout=JOIN_SECONDS * 2)
    assert done.returncode == 0, f"killed by signal {-done.returncode}: {done.stderr[-500:]}"
    assert done.stdout.startswith(f"FormatError {store_dir / 'labels.bin'}: ends at byte 0"), done.stdout


def test_labels_filter_buffers_of_single_tokens(tmp_path):
    """One token a block, one block a buffer: buffers holding only a CLS token have no label to read.
    Every patch whose label is kept is yielded once, with every CLS."""
    n, tokens = 6, 5
    store_dir = synthetic_store(tmp_path / "store", n=n, tokens=tokens, d=4, per_shard=3)
    labels = np.random.default_rng(5).integers(0, 3, (n, tokens - 1)).astype(np.uint8)
    saev.write_labels(store_dir, labels)
    loader = ShuffledActivations(store_dir, batch_size=2, seed=0, block_bytes=1, buffer_blocks=1, keep_labels=[2])
    want = [(e, 0) for e in range(n)] + [(int(e), int(p) + 1) for e, p in zip(*np.nonzero(labels == 2))]
    assert sorted(_epoch_rows(loader)) == sorted(want)


@pytest.mark.parametrize("options, named", [
    ({"layers": [0, 0]}, r"layers=\[0, 0\] names a layer twice"),
    ({"include_cls": "no"}, r"include_cls='no' and drop_last=False must be True or False"),
    ({"drop_last": 1}, r"include_cls=True and drop_last=1 must be True or False"),
])
def test_a_layer_twice_or_a_flag_that_is_not_a_bool_is_refused(tmp_path, options, named):
    """layers=[0, 0] yielded layer 0 twice in every batch, as two layers; include_cls="no" kept CLS."""
    from actstore.errors import ConfigError

    store = saev.open_store(synthetic_store(tmp_path / "store", n=6, tokens=5, d=4, per_shard=3))
    with pytest.raises(ConfigError, match=named):
        ShuffledActivations(store.dir, **options)
