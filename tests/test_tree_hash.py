"""Files written by positioned writes in any order, hashed as they fill (io_utils): the extraction's
SHA-256 tree hash and the formats' plain sha256, against references computed here from the bytes;
and the same files filled behind their caller (WriteBehind) from a ring of reused buffers; files
written by parallel workers from a bounded set of buffers (BufferWorkers)."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from actstore.errors import FormatError
from actstore.formats.extract import open_part
from actstore.io_utils import (BEHIND, POOL_MIN_BYTES, BufferWorkers, OrderedHashFile, TreeHashFile, WriteBehind,
                               sha256_tree_file)

MIB = 1 << 20
SIZES = [0, 5, MIB - 1, MIB, MIB + 1, 3 * MIB + 777, 7 * MIB]


def reference_tree_hash(data: bytes) -> str:
    """The SHA-256 tree hash as a recursive Merkle split (the left subtree holds the largest power of
    two of leaves below the count), a formulation independent of the level-by-level one it tests."""
    leaves = [hashlib.sha256(data[i:i + MIB]).digest() for i in range(0, len(data), MIB)]
    if not leaves:
        return hashlib.sha256(b"").hexdigest()

    def root(nodes: list[bytes]) -> bytes:
        if len(nodes) == 1:
            return nodes[0]
        split = 1 << (len(nodes) - 1).bit_length() - 1
        return hashlib.sha256(root(nodes[:split]) + root(nodes[split:])).digest()
    return root(leaves).hex()


def shuffled_regions(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """The file cut at random points (some inside leaves, some across them), in random order."""
    cuts = sorted({0, size, *(rng.randrange(size + 1) for _ in range(12))})
    regions = list(zip(cuts, cuts[1:]))
    rng.shuffle(regions)
    return regions


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", [TreeHashFile, OrderedHashFile])
def test_out_of_order_writes_give_the_digest_of_the_bytes(kind, size, tmp_path):
    rng = random.Random(size)
    data = rng.randbytes(size)
    sink = kind(tmp_path / "f", size)
    for start, stop in shuffled_regions(size, rng):
        sink.write(start, data[start:stop])
    digest = sink.close()
    assert (tmp_path / "f").read_bytes() == data
    expected = reference_tree_hash(data) if kind is TreeHashFile else hashlib.sha256(data).hexdigest()
    assert digest == expected
    if kind is TreeHashFile:
        assert sha256_tree_file(tmp_path / "f", threads=1) == sha256_tree_file(tmp_path / "f", threads=3) == expected
        # one leaf or none: the tree hash is the plain sha256, so small files read the same either way
        assert (expected == hashlib.sha256(data).hexdigest()) == (size <= MIB)


@pytest.mark.parametrize("size", [0, 3 * MIB + 777, 7 * MIB])
@pytest.mark.parametrize("kind", [TreeHashFile, OrderedHashFile])
def test_written_behind_from_a_ring_of_reused_buffers_gives_the_bytes_and_their_digest(kind, size, tmp_path):
    """Each region is copied into the next of BEHIND + 1 buffers, which is overwritten BEHIND + 1
    regions later: a region written or hashed after its buffer was reused would change the file or
    the digest. Regions out of order exercise the OrderedHashFile's read-back of regions ahead."""
    rng = random.Random(size)
    data = rng.randbytes(size)
    ring = [bytearray(size) for _ in range(BEHIND + 1)]
    regions = shuffled_regions(size, rng) + [(size, size)]  # and an empty one
    with WriteBehind(kind(tmp_path / "f", size)) as behind:
        for turn, (start, stop) in enumerate(regions):
            buffer = memoryview(ring[turn % len(ring)])[:stop - start]
            buffer[:] = data[start:stop]
            behind.submit(start, buffer)
    assert (tmp_path / "f").read_bytes() == data
    assert behind.digest == (reference_tree_hash(data) if kind is TreeHashFile else hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize("hole", [0, 5, MIB, MIB + 333, 3 * MIB])
def test_leaves_hashed_by_threads_and_a_zero_hole_give_the_tree_hash_of_the_file(hole, tmp_path):
    """A saev shard's pattern: slabs written behind from a ring, each slab's whole leaves hashed by 3
    threads, the file truncated to its size and its tail a hole counted as zeros, never written."""
    rng = random.Random(hole)
    data = rng.randbytes(5 * MIB + 123)
    size = len(data) + hole
    ring = [bytearray(2 * MIB + 7) for _ in range(BEHIND + 1)]
    with ThreadPoolExecutor(3) as hashers:
        sink = TreeHashFile(tmp_path / "f", size, pool=hashers)
        os.ftruncate(sink.fd, size)
        sink.hole(len(data), hole)
        with WriteBehind(sink) as behind:
            for turn, start in enumerate(range(0, len(data), len(ring[0]))):
                buffer = memoryview(ring[turn % len(ring)])[:min(len(ring[0]), len(data) - start)]
                buffer[:] = data[start:start + len(buffer)]
                behind.submit(start, buffer)
    whole = data + bytes(hole)
    assert (tmp_path / "f").read_bytes() == whole
    assert behind.digest == reference_tree_hash(whole) == sha256_tree_file(tmp_path / "f")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_writes_hashed_by_a_shared_pool_while_they_are_written_give_the_tree_hash(seed, tmp_path):
    """An extraction part's pattern: two files filled out of order by two writer threads, the whole
    leaves of each write hashed by one pool the files share while its bytes go to the kernel."""
    rng = random.Random(seed)
    datas = [rng.randbytes(rng.randrange(2 * POOL_MIN_BYTES, 3 * POOL_MIN_BYTES)) for _ in range(2)]
    # Regions past POOL_MIN_BYTES are hashed on the pool, smaller ones in the writing thread.
    cuts = [sorted({0, len(data), *(rng.randrange(MIB // 2, POOL_MIN_BYTES) * k for k in (1, 2, 3))})
            for data in datas]
    regions = [list(zip(cut, cut[1:])) for cut in cuts]
    sizes = [stop - start for file_regions in regions for start, stop in file_regions]
    assert min(sizes) < POOL_MIN_BYTES <= max(sizes)
    with ThreadPoolExecutor(3) as hashers:
        sinks = [TreeHashFile(tmp_path / f"f{i}", len(data), pool=hashers) for i, data in enumerate(datas)]

        def fill(sink: TreeHashFile, data: bytes, file_regions: list[tuple[int, int]]) -> None:
            for start, stop in random.Random(len(data)).sample(file_regions, len(file_regions)):
                sink.write(start, bytearray(data[start:stop]))
        writers = [threading.Thread(target=fill, args=args) for args in zip(sinks, datas, regions)]
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join()
        digests = [sink.close() for sink in sinks]
    for i, (data, digest) in enumerate(zip(datas, digests)):
        assert (tmp_path / f"f{i}").read_bytes() == data
        assert digest == reference_tree_hash(data)
    with ThreadPoolExecutor(2) as hashers:
        twice = TreeHashFile(tmp_path / "twice", 2 * POOL_MIN_BYTES, pool=hashers)
        twice.write(MIB // 2, bytes(MIB))
        with pytest.raises(OSError, match=r"twice: bytes 0\.\.1048576 written more than once"):
            twice.write(0, bytes(POOL_MIN_BYTES))
        twice.abort()


def test_a_write_wakes_at_most_a_few_of_the_pools_threads(tmp_path):
    """A write of 25 leaves on a 16-thread pool (an image batch's layer) is hashed by at most
    HASH_TASKS_PER_WRITE (4) tasks of consecutive leaves, not a task per leaf, and gives the tree hash."""
    submitted = []

    class CountingPool(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            submitted.append(len(args[0]))
            return super().submit(fn, *args, **kwargs)
    data = random.Random(3).randbytes(24 * MIB + MIB // 3)
    with CountingPool(16) as pool:
        sink = TreeHashFile(tmp_path / "batch", len(data), pool=pool)
        sink.write(0, data)
        digest = sink.close()
    assert submitted == [7, 7, 7, 4]  # the file's 25 leaves, its last a third of a MiB (whole at its size)
    assert digest == reference_tree_hash(data) == sha256_tree_file(tmp_path / "batch")


def test_a_failed_write_behind_names_the_file_and_never_hangs(tmp_path):
    """Disk full, simulated with RLIMIT_FSIZE (the process ignores SIGXFSZ, as Python does): the
    writer thread's error reaches the caller, at a later submit or when the block ends, naming the file."""
    target = tmp_path / "big.bin"
    code = ("import resource; from actstore.io_utils import OrderedHashFile, WriteBehind\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))\n"
            f"with WriteBehind(OrderedHashFile({str(target)!r}, 64 << 20)) as behind:\n"
            "    for i in range(64): behind.submit(i << 20, bytes(1 << 20))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"OSError: {target}: [Errno 27] File too large" in proc.stderr, proc.stderr[-2000:]


def test_an_exception_in_the_caller_abandons_the_file_without_waiting_for_it(tmp_path):
    sink = OrderedHashFile(tmp_path / "f", 4 * MIB)
    with pytest.raises(ValueError, match="the caller's own"):
        with WriteBehind(sink) as behind:
            behind.submit(0, bytes(MIB))
            raise ValueError("the caller's own")
    assert sink.fd == -1 and behind.digest is None


def test_every_leaf_is_hashed_when_the_last_write_returns(tmp_path):
    """The point of the tree hash: nothing is left to hash after the run's last batch, whatever the
    order the batches filled the file in."""
    rng = random.Random(1)
    size = 5 * MIB + 123
    data = rng.randbytes(size)
    sink = TreeHashFile(tmp_path / "f", size)
    regions = shuffled_regions(size, rng)
    for start, stop in regions[:-1]:
        sink.write(start, data[start:stop])
    assert None in sink.leaves
    start, stop = regions[-1]
    sink.write(start, data[start:stop])
    assert None not in sink.leaves
    assert sink.close() == reference_tree_hash(data)


def test_a_region_written_twice_or_never_is_named(tmp_path):
    twice = TreeHashFile(tmp_path / "twice", 2 * MIB)
    twice.write(0, bytes(MIB + 10))
    with pytest.raises(OSError, match=r"twice: bytes 0\.\.1048576 written more than once"):
        twice.write(0, bytes(10))
    twice.abort()
    gap = TreeHashFile(tmp_path / "gap", 2 * MIB)
    gap.write(0, bytes(MIB))
    with pytest.raises(OSError, match=f"gap: {MIB} of {2 * MIB} bytes written"):
        gap.close()
    past = TreeHashFile(tmp_path / "past", 10)
    with pytest.raises(OSError, match="past: a write ends at byte 11, past the file's 10"):
        past.write(5, bytes(6))
    past.abort()


def test_part_json_records_tree_hashes_and_an_older_plain_sha256_still_verifies(extracted, tmp_path):
    _, out = extracted("bert")
    meta = json.loads((out / "part-0000" / "part.json").read_text())
    assert meta["version"] == 2
    for name, record in meta["files"].items():
        assert record["sha256_tree"] == reference_tree_hash((out / "part-0000" / name).read_bytes())
    # a part written before the tree hash (version 1) records plain sha256: still checked
    old = tmp_path / "old"
    shutil.copytree(out / "part-0000", old)
    for name, record in meta["files"].items():
        record["sha256"] = hashlib.sha256((old / name).read_bytes()).hexdigest()
        del record["sha256_tree"]
    (old / "part.json").write_text(json.dumps({**meta, "version": 1}))
    open_part(old).verify()
    target = old / "layer_000.npy"
    data = target.read_bytes()
    target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(FormatError, match="layer_000.npy: sha256 differs from part.json"):
        open_part(old).verify()


def test_buffer_workers_write_each_item_from_its_own_buffer_and_raise_the_first_error(tmp_path):
    """Files written by 3 workers from buffers refilled as soon as they are free: every file holds
    what its buffer held when it was submitted, from no more than workers + BEHIND buffers; a
    failing item stops the rest (none past the buffers in flight runs) and its error reaches the
    caller, naming the file."""
    made = []

    def make() -> bytearray:
        made.append(bytearray(MIB))
        return made[-1]

    def write(buffer: bytearray, i: int) -> None:
        if i == 40:
            raise OSError(f"{tmp_path / str(i)}: failed")
        (tmp_path / str(i)).write_bytes(buffer)

    rng = random.Random(0)
    data = [rng.randbytes(MIB) for _ in range(64)]
    with pytest.raises(OSError, match=f"{tmp_path / '40'}: failed"):
        with BufferWorkers(write, 3, make) as workers:
            for i, payload in enumerate(data):
                buffer = workers.buffer()
                buffer[:] = payload
                workers.submit(buffer, i)
    written = sorted(int(p.name) for p in tmp_path.iterdir())
    assert len(made) == 3 + BEHIND and 40 not in written
    # items before the failing one all run, but the two other workers' own, which may see its error
    assert len(set(range(40)) - set(written)) <= 2 and max(written) < 40 + 3 + BEHIND
    assert all((tmp_path / str(i)).read_bytes() == data[i] for i in written)


@pytest.mark.parametrize("behind", [False, True])
def test_bytes_written_twice_cannot_stand_in_for_bytes_never_written(behind, tmp_path):
    """A leaf's byte count reaches its size when part of it is written twice and part never: that
    must be named, not hashed as a whole leaf with zeros where nothing was written."""
    sink = TreeHashFile(tmp_path / "f", MIB)
    writes = [(0, b"\1" * (MIB // 4)), (3 * MIB // 4, b"\2" * (MIB // 4)), (0, b"\3" * (MIB // 2))]
    with pytest.raises(OSError, match=rf"f: bytes 0\.\.{MIB // 4} written more than once"):
        if behind:
            with WriteBehind(sink) as chain:
                for offset, data in writes:
                    chain.submit(offset, data)
        else:
            for offset, data in writes:
                sink.write(offset, data)
    sink.abort()


def test_many_small_writes_in_any_order_still_give_the_tree_hash(tmp_path):
    """Writes smaller than a leaf, front to back, back to front and shuffled: each leaf's pieces
    are tracked to catch overlaps, and the digest is that of the bytes."""
    rng = random.Random(3)
    size = 2 * MIB + 4321
    data = rng.randbytes(size)
    regions = [(lo, min(lo + 10_000, size)) for lo in range(0, size, 10_000)]
    for order in (regions, regions[::-1], rng.sample(regions, len(regions))):
        sink = TreeHashFile(tmp_path / "f", size)
        for start, stop in order:
            sink.write(start, data[start:stop])
        assert sink.close() == reference_tree_hash(data) == sha256_tree_file(tmp_path / "f")


def test_a_pooled_write_past_the_end_is_named(tmp_path):
    """A write large enough for the pool that ends past the file and covers none of its leaves whole."""
    with ThreadPoolExecutor(2) as pool:
        sink = TreeHashFile(tmp_path / "f", 5 * MIB, pool=pool)
        with pytest.raises(OSError, match=f"f: a write ends at byte {4 * MIB + MIB // 2 + POOL_MIN_BYTES}, "
                                          f"past the file's {5 * MIB}"):
            sink.write(4 * MIB + MIB // 2, bytes(POOL_MIN_BYTES))
        sink.abort()


def test_a_read_that_returns_fewer_bytes_than_asked_is_resumed(monkeypatch, tmp_path):
    """A network file system (or a signal) may return fewer bytes than a read asks for, before the
    file's end: the leaf is still hashed from all its bytes, not from the ones the first read got
    (which gave a good file a digest that matched nothing, and verify called it damaged)."""
    data = random.Random(7).randbytes(3 * MIB + 12345)
    (tmp_path / "f").write_bytes(data)
    real_pread, real_preadv = os.pread, os.preadv  # the kernel's answer, cut short as it may be
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: real_pread(fd, min(n, 65536), offset))
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: real_preadv(fd, [memoryview(buffers[0])[:65536]],
                                                                                offset))
    assert sha256_tree_file(tmp_path / "f", threads=2) == reference_tree_hash(data)
