"""Integrity review 56: names from metadata the operating system cannot take, a JSON number Python
cannot read and a value longer than the read window in a streamed file, and a safetensors write's
error, each through the real writers' stores and files."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch

from actstore import integrity
from actstore.errors import FormatError
from actstore.formats import zarr as zs
from actstore.formats.zarr.layout import FILES_JSON
from actstore.integrity import JSON_BLOCK_CHARS, STRICT_JSON, inside, read_json, stream_json_object
from actstore.safetensors_io import save_safetensors
from test_zarr import bert_run, copied_run  # noqa: F401 (bert_run: a fixture)

# A NUL byte, and a lone surrogate (what a JSON "\ud800" escape reads as): no file name holds either,
# and os calls raise a bare ValueError for both.
NO_FILE_NAMES = ["a\x00b", "a\ud800b"]


@pytest.mark.parametrize("name", NO_FILE_NAMES)
def test_a_name_the_os_cannot_take_is_refused_naming_its_source(tmp_path, name):
    """inside() passed it, and reading the path raised ValueError ('embedded null byte', 'surrogates
    not allowed') naming neither the file nor the metadata that gave it."""
    with pytest.raises(FormatError, match="meta.json: .* is not a relative path inside"):
        read_json(inside(tmp_path, name, "meta.json"))


@pytest.mark.parametrize("name", NO_FILE_NAMES)
def test_a_zarr_store_path_the_os_cannot_take_is_named(bert_run, tmp_path, name):
    """The manifest's shards[0].path holding one: open_zarr raised the bare ValueError, verify called
    the store's files.json missing; both now name manifest.json's entry."""
    run = copied_run(bert_run, tmp_path, lambda m: m["shards"][0].update(path=name))
    named = re.escape(str(run / zs.MANIFEST))
    assert any(re.match(f"{named}.*is not a relative path inside", p) for p in zs.verify(run)), zs.verify(run)
    with pytest.raises(FormatError, match=f"{named}.*is not a relative path inside"):
        zs.open_zarr(run)


def test_a_number_past_pythons_digit_limit_in_files_json_is_named(bert_run, tmp_path):
    """A files.json record's bytes of 5,000 digits, the store verified by its own path: read_json
    names such a file, but the streamed read (files.json lists millions of files) let int()'s
    ValueError out, and verify gave up on the whole store ('cannot verify'), its other problems
    dropped and files.json not named."""
    run = copied_run(bert_run, tmp_path, lambda m: None)
    store = run / read_json(run / zs.MANIFEST)["shards"][0]["path"]
    files_json = store / FILES_JSON
    text = files_json.read_text()
    files_json.write_text(re.sub(r'"bytes": ?\d+', '"bytes": ' + "1" * 5000, text, count=1))
    problems = zs.verify(store)
    assert any(p.startswith(f"{files_json}: unreadable ({files_json}: not valid JSON (Exceeds the limit")
               for p in problems), problems


class CountingDecoder(json.JSONDecoder):
    """The streamed reader's decoder, counting its parses of the window (each scans the text again)."""

    def __init__(self) -> None:
        super().__init__(**STRICT_JSON)
        self.parses = 0

    def raw_decode(self, s: str, idx: int = 0):
        self.parses += 1
        return super().raw_decode(s, idx)


def test_a_streamed_value_longer_than_the_window_is_parsed_a_few_times(tmp_path, monkeypatch):
    """A value running past the read window was parsed again from its start once per 1 MiB block:
    quadratic, so an unterminated string of 128 MB in a files.json took 11 s and one of gigabytes
    hung verify. With 64-character blocks, a 64 KiB value took 1,024 parses; the blocks now double.
    The value still comes back whole, and a cut-off one is still named."""
    decoder = CountingDecoder()
    monkeypatch.setattr(integrity, "_JSON_DECODER", decoder)
    monkeypatch.setattr(integrity, "JSON_BLOCK_CHARS", 64)
    long_value = "x" * (64 << 10)
    path = tmp_path / "files.json"
    path.write_text(json.dumps({"files": {"a": long_value, "b": 1}}))
    assert [(k, list(v)) for k, v in stream_json_object(path, "files")] == [("files", [("a", long_value), ("b", 1)])]
    assert decoder.parses < 40, decoder.parses
    path.write_text('{"files": {"a": "' + long_value)
    with pytest.raises(FormatError, match=f"{re.escape(str(path))}: not valid JSON \\(Unterminated string"):
        list(stream_json_object(path, "files"))


def test_a_safetensors_write_on_a_full_disk_names_the_file(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full scratch file system or a quota does: the
    LUT's and the SAE's writes raised '[Errno 28] No space left on device', naming no file."""
    full = Path("/dev/full")
    if not (full.exists() and stat.S_ISCHR(full.stat().st_mode)):
        pytest.skip("no /dev/full")
    with pytest.raises(OSError, match="/dev/full: No space left on device"):
        save_safetensors({"w": torch.zeros(1 << 16)}, full, {"format": "pt"})


def test_the_checks_leave_good_names_and_values_alone(bert_run, tmp_path):
    """The undamaged copy verifies clean, a unicode name inside a store is a name like any other, and
    a streamed value cut by the read window's end ('tr|ue', a JSONDecodeError until the next block
    comes, and a ValueError too) is read whole, not refused."""
    run = copied_run(bert_run, tmp_path, lambda m: None)
    assert zs.verify(run) == []
    assert inside(tmp_path, "caf\u00e9/x.json", "meta.json") == tmp_path / "caf\u00e9" / "x.json"
    head = '{"files": {"pad": "'
    cut = tmp_path / "cut.json"
    cut.write_text(head + "x" * (JSON_BLOCK_CHARS - len(head) - 10) + '", "a": true}}')
    assert [(k, list(v)) for k, v in stream_json_object(cut, "files")] == [
        ("files", [("pad", "x" * (JSON_BLOCK_CHARS - len(head) - 10)), ("a", True)])]


def budget_in_child(setup: str) -> int:
    """memory_budget() in a fresh Python that first runs `setup`."""
    import subprocess
    import sys

    script = f"{setup}\nfrom actstore.integrity import memory_budget\nprint(memory_budget())\n"
    return int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)


def test_the_memory_budget_is_a_quarter_of_an_address_space_limit():
    """A process limited below physical memory (ulimit -v, as some clusters set) had a quarter of the
    machine's: a hostile file's allocation under that failed as a bare MemoryError."""
    limit = 3 << 30
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert physical > limit
    assert budget_in_child(f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({limit}, -1))") == limit // 4


def own_memory_cgroup() -> Path | None:
    """A new memory cgroup below this process's (v1 or v2), where it may make one (root), else None."""
    for _, group, name in integrity.memory_cgroups():
        folder = group / "actstore-test56"
        try:
            folder.mkdir()
        except OSError:
            continue
        if (folder / name).exists():
            return folder
        folder.rmdir()
    return None


def test_the_memory_budget_is_a_quarter_of_the_cgroups_limit():
    """A Slurm job's --mem is its cgroup's memory limit: a job given 16 GB of a 512 GB node had a budget
    of 128 GB, so a file's claim under it was allocated, and the kernel killed the job naming nothing."""
    group = own_memory_cgroup()
    if group is None:
        pytest.skip("no memory cgroup this process may make one below")
    try:
        limit_file = group / ("memory.max" if (group / "memory.max").exists() else "memory.limit_in_bytes")
        limit_file.write_text(str(2 << 30))
        budget = budget_in_child(f"import os\nopen({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))")
    finally:
        group.rmdir()
    assert budget == (2 << 30) // 4
