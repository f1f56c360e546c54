"""Review 66: `actstore list DUMP_TO` tells what a dump_to holds and what no config uses any more (a stage
whose hash moved leaves its earlier directory, docs/recovery.md "Upgrading actstore"). On real dump_to
trees written by the workflow: two configs differing in one pickle key, so that the first's pickle
directory is unreferenced by the second; zarr's merged store, whose chunks are hard links to its shards'
(counted once); saev's store, outside its stage directory; a writer's temp left; a damaged stage config.
Sizes are checked against du's arithmetic (st_blocks, each inode once) computed here."""
from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

import tiny
from actstore.hashing import STAGES, stage_dirs
from actstore.integrity import STAGE_CONFIG_FILE

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
ACTSTORE = str(Path(sys.executable).with_name("actstore"))
OFF = {"enabled": False}


def du_bytes(*roots: Path, seen: set | None = None) -> int:
    """du -B1 of `roots` together: every entry's st_blocks * 512, links not followed, an inode once."""
    seen = set() if seen is None else seen
    total = 0
    for root in roots:
        for path in [root, *root.rglob("*")]:
            info = path.lstat()
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                total += info.st_blocks * 512
    return total


def snakemake(workdir: Path, configfile: Path) -> None:
    proc = subprocess.run([SNAKEMAKE, "-s", str(tiny.REPO / "Snakefile"), "-d", str(workdir), "--configfile",
                           str(configfile), "--cores", "2"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def actstore_list(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([ACTSTORE, "list", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, model_dir, text_jsonl):
    """A dump_to written by the workflow for config A (extract, saev, pickle, zarr with its merged store)
    and then config B, A with pickle.shard_size_mb changed: B's run adds a pickle directory only."""
    tmp = tmp_path_factory.mktemp("dumplist")
    off = {stage: OFF for stage in ("lmprobe", "sae", "lut", "validate")}
    config_a = tiny.make_config(tmp, model_dir("bert"), text_jsonl, zarr={"merged": True}, **off)
    config_b = tiny.make_config(tmp, model_dir("bert"), text_jsonl, zarr={"merged": True},
                                pickle={"shard_size_mb": 7}, **off)
    files = tiny.save_config(config_a, tmp / "a.yaml"), tiny.save_config(config_b, tmp / "b.yaml")
    for configfile in files:
        snakemake(tmp, configfile)
    return tmp, Path(config_a["dump_to"]), stage_dirs(config_a), stage_dirs(config_b)


def copied(two_runs, tmp_path: Path) -> Path:
    """A copy of the run's dump_to, to damage (its own files: the run's are shared by the other tests)."""
    dump_to = tmp_path / "dump"
    shutil.copytree(two_runs[1], dump_to, symlinks=True)
    return dump_to


@pytest.mark.slow
def test_lists_each_stage_directory_with_its_use_size_and_extraction(two_runs):
    tmp, dump_to, dirs_a, dirs_b = two_runs
    proc = actstore_list(str(dump_to), "--configfile", "b.yaml", "--json", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    rows = [row for row in listed if row["state"] != "other"]
    expected = sorted({dirs_a[s] for s in ("extract", "saev", "pickle", "zarr")} | {dirs_b["pickle"]},
                      key=lambda d: (STAGES.index(d.parent.name), d.name))
    assert [Path(row["path"]) for row in rows] == [d.absolute() for d in expected]
    by_path = {Path(row["path"]): row for row in rows}
    old_pickle, new_pickle = by_path[dirs_a["pickle"].absolute()], by_path[dirs_b["pickle"].absolute()]
    assert old_pickle["used_by"] == [] and new_pickle["used_by"] == ["b.yaml"]
    assert by_path[dirs_a["extract"].absolute()]["used_by"] == ["b.yaml"]
    extraction = dirs_a["extract"].name
    for row in rows:
        assert row["state"] == "done" and row["reason"] is None, row
        assert row["extraction"] == (None if row["stage"] == "extract" else extraction)
        assert row["extraction_exists"] is (None if row["stage"] == "extract" else True)
        config_mtime = (Path(row["path"]) / STAGE_CONFIG_FILE).stat().st_mtime
        assert abs(datetime.fromisoformat(row["written"]).timestamp() - config_mtime) < 1
    # Sizes: each directory's du, the zarr one holding its merged store's links once; saev's with its store.
    saev = by_path[dirs_a["saev"].absolute()]
    store = (dump_to / saev["store"])
    assert store.parent == dump_to / "saev" and (store / "metadata.json").is_file()
    seen: set = set()
    for row in rows:
        roots = [Path(row["path"])] + ([dump_to / row["store"]] if row["store"] else [])
        assert row["bytes"] == du_bytes(*roots, seen=seen), row
    others = {row["path"]: row["bytes"] for row in listed if row["state"] == "other"}
    assert "logs" in others and others["logs"] == du_bytes(dump_to / "logs", seen=seen)
    # Nothing left out: du of the whole dump_to but for its own folder and the stage folders' entries.
    folders = [dump_to, *(dump_to / stage for stage in STAGES if (dump_to / stage).is_dir())]
    assert sum(row["bytes"] for row in listed) == du_bytes(dump_to) - sum(f.stat().st_blocks * 512 for f in folders)
    # The text form: one line per directory in the same order, the unreferenced one said so, and the total.
    text = actstore_list(str(dump_to), "--configfile", "b.yaml", cwd=tmp)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert [line.split()[:3] for line in lines[1:1 + len(rows)]] == \
        [[row["stage"], row["hash"][:12], "done"] for row in rows]
    old_line = next(line for line in lines if old_pickle["hash"][:12] in line)
    assert old_line.endswith("unreferenced by the given configs") and extraction[:12] in old_line
    assert lines[-2].startswith("other: ") and "logs (" in lines[-2]
    total = sum(row["bytes"] for row in listed)
    assert lines[-1].startswith("total: ") and f"({total} bytes) in {len(rows)} stage directories" in lines[-1]


def test_zarr_merged_store_links_are_counted_once(two_runs):
    """The merged store's chunks are hard links to the shards' chunks: du counts them once, so does list."""
    _, dump_to, dirs_a, _ = two_runs
    zarr = dirs_a["zarr"]
    linked = [p for p in (zarr / "merged").rglob("*") if p.is_file() and p.lstat().st_nlink > 1]
    assert linked, "the merged store holds no hard-linked chunk"
    row = next(row for row in json.loads(actstore_list(str(dump_to), "--json").stdout)
               if row["path"] == str(zarr.absolute()))
    naive = sum(p.lstat().st_blocks * 512 for p in [zarr, *zarr.rglob("*")])
    assert row["bytes"] == du_bytes(zarr) < naive


def test_a_config_naming_both_stage_directories_and_configs_from_a_directory(two_runs):
    """Read as locate reads them: each --configfile from where the command runs, its paths from -d."""
    tmp, dump_to, dirs_a, dirs_b = two_runs
    configs = [f"{tmp.name}/a.yaml", f"{tmp.name}/b.yaml"]
    proc = actstore_list(str(dump_to), "--configfile", configs[0], "--configfile", configs[1], "-d", tmp.name,
                         "--json", cwd=tmp.parent)
    assert proc.returncode == 0, proc.stderr
    used = {row["path"]: row["used_by"] for row in json.loads(proc.stdout) if row["state"] != "other"}
    assert used[str(dirs_a["pickle"].absolute())] == configs[:1]
    assert used[str(dirs_b["pickle"].absolute())] == configs[1:]
    assert used[str(dirs_a["extract"].absolute())] == used[str(dirs_a["zarr"].absolute())] == configs


def test_a_temp_and_a_damaged_stage_config_are_shown_never_a_traceback(two_runs, tmp_path):
    dump_to = copied(two_runs, tmp_path)
    _, _, dirs_a, dirs_b = two_runs
    pickle_dir = dump_to / "pickle" / dirs_b["pickle"].name
    temp = pickle_dir / ".metadata.json.ab12cd34.tmp"
    temp.write_bytes(b"a killed writer's bytes")
    (pickle_dir / (temp.name + ".lock")).touch()
    zarr_config = dump_to / "zarr" / dirs_a["zarr"].name / STAGE_CONFIG_FILE
    zarr_config.write_text('{"stage": "zarr", ')
    extract_config = dump_to / "extract" / dirs_a["extract"].name / STAGE_CONFIG_FILE
    record = json.loads(extract_config.read_text())
    record["config"]["extract"]["batch_size"] = 999
    extract_config.write_text(json.dumps(record))
    rows = {row["path"]: row for row in json.loads(actstore_list(str(dump_to), "--json").stdout)}
    temp_row = rows[str(pickle_dir)]
    assert temp_row["state"] == "temp" and temp.name in temp_row["reason"]
    assert rows[str(zarr_config.parent)]["state"] == "damaged" and rows[str(zarr_config.parent)]["written"]
    assert str(zarr_config) in rows[str(zarr_config.parent)]["reason"] and "not valid JSON" in \
        rows[str(zarr_config.parent)]["reason"]
    assert rows[str(extract_config.parent)]["state"] == "damaged"
    assert "edited" in rows[str(extract_config.parent)]["reason"]
    proc = actstore_list(str(dump_to))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert any(line.split()[2] == "damaged" and "not valid JSON" in line for line in proc.stdout.splitlines()[1:-2])


def test_an_incomplete_stage_and_a_deleted_extraction(two_runs, tmp_path):
    dump_to = copied(two_runs, tmp_path)
    _, _, dirs_a, _ = two_runs
    zarr = dump_to / "zarr" / dirs_a["zarr"].name
    (zarr / STAGE_CONFIG_FILE).unlink()  # a run cut short
    shutil.rmtree(dump_to / "extract" / dirs_a["extract"].name)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "big.bin").write_bytes(bytes(1 << 22))
    (zarr / "link_out").symlink_to(outside)  # counted as a link, never followed out of dump_to
    rows = [row for row in json.loads(actstore_list(str(dump_to), "--json").stdout) if row["state"] != "other"]
    assert {row["stage"]: row["state"] for row in rows}["zarr"] == "incomplete"
    assert {row["stage"]: row["bytes"] for row in rows}["zarr"] == du_bytes(zarr) < 1 << 22
    assert "extract" not in {row["stage"] for row in rows}
    for row in rows:
        if row["state"] == "done":
            assert row["extraction"] == dirs_a["extract"].name and row["extraction_exists"] is False
    assert "(gone)" in actstore_list(str(dump_to)).stdout


def test_bad_dump_to_and_a_config_of_another_dump_to_exit_2(two_runs, tmp_path):
    tmp, dump_to, _, _ = two_runs
    proc = actstore_list(str(tmp_path / "nothing"))
    assert proc.returncode == 2 and proc.stderr == f"actstore: {tmp_path / 'nothing'}: not a directory " \
                                                   "(give a workflow's dump_to)\n"
    proc = actstore_list(str(tmp_path), "--configfile", str(tmp / "a.yaml"), "-d", str(tmp))
    assert proc.returncode == 2 and str(tmp / "a.yaml") in proc.stderr and "dump_to" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_list_has_help():
    proc = subprocess.run([ACTSTORE, "list", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: actstore list" in proc.stdout and "--configfile" in proc.stdout


def test_listing_while_a_writer_makes_and_removes_its_temps(two_runs, tmp_path):
    """A listing taken while a run writes: a temp folder listed and gone before it is walked (renamed into
    place, or swept) is passed over, never an error (FileNotFoundError made `actstore list` exit 2)."""
    from actstore.dump_listing import list_dump

    dump_to = copied(two_runs, tmp_path)
    stage = dump_to / "pickle" / two_runs[3]["pickle"].name
    writing = threading.Event()
    writing.set()

    def writer() -> None:
        for n in itertools.count():
            if not writing.is_set():
                return
            temp = stage / f".shard_{n % 8:05d}.pkl.ab12cd34.tmp"
            temp.mkdir()
            (temp / "part").write_bytes(b"a writer's bytes")
            shutil.rmtree(temp)

    thread = threading.Thread(target=writer)
    thread.start()
    errors, listings, end = [], 0, time.monotonic() + 3
    try:
        while time.monotonic() < end:
            listings += 1
            try:
                list_dump(dump_to)
            except OSError as exc:
                errors.append(exc)
    finally:
        writing.clear()
        thread.join()
    assert listings > 50 and errors == [], (listings, errors[:3])
