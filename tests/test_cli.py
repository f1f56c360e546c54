"""The `actstore` command and the validate stage on a real tiny workflow run: every format is
identified, verifies clean, and one flipped byte or one truncated file is caught by name."""
from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import numpy as np
import yaml

import tiny
from actstore import __version__, cli, integrity
from actstore.config import load_config
from actstore.formats import FORMAT_STAGES
from actstore.hashing import stage_dir
from actstore.verify import find_store

ACTSTORE = str(Path(sys.executable).with_name("actstore"))
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
METADATA_SUFFIXES = (".json", ".jsonl", ".zarray", ".zattrs", ".zgroup", ".zmetadata", ".parquet", ".log", ".tsv")
STORES = ("extract", *FORMAT_STAGES, "lut")
DEFAULT_CHECK_THREADS = integrity.CHECK_THREADS


def tiny_workflow_config(tmp: Path, model: Path, data: Path) -> dict:
    return {
        "dump_to": str(tmp / "dump"), "model": {"path": str(model)}, "dataset": {"path": str(data)},
        "extract": {"layers": [0, 2], "max_seq_length": 24, "batch_size": 8, "parts": 2,
                    "hooks": ["encoder.layer.1.attention.self.query:input"]},
        # 50 steps, not the default 1000: these tests read the stores and checkpoints the stages write,
        # not how well the SAE learnt (test_sae's); train_sae took 20 CPU-s with 1000 steps, 9 s with 50.
        "sae": {"enabled": True, "hook": "encoder.layer.1.attention.self.query:input", "steps": 50},
        # One budget evaluated, on 2 samples end to end: report.json's errors, which no test here reads;
        # the LUT store's files are the same for any budgets.
        "lut": {"targets": [f"encoder.layer.1.attention.self.{m}" for m in ("query", "key", "value")],
                "budgets": [0], "eval_samples": 2},
    }


def run(*cmd: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def actstore(*args: str) -> subprocess.CompletedProcess:
    """`actstore ARGS` run in this process through its entry point, cli.main: the damage and per-store
    tests run it dozens of times (the installed command itself is run by the sae stage's inspect, help and
    exit-code tests)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(["actstore", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def workflow_run(tmp_path_factory, model_dir, text_jsonl):
    tmp = tmp_path_factory.mktemp("cli")
    configfile = tmp / "config.yaml"
    configfile.write_text(yaml.safe_dump(tiny_workflow_config(tmp, model_dir("bert"), text_jsonl)))
    proc = run(SNAKEMAKE, "-s", str(tiny.REPO / "Snakefile"), "-d", str(tmp), "--configfile", str(configfile),
               "--cores", "2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return tmp, configfile


def copied_run(workflow_run, tmp_path: Path) -> dict:
    """The workflow run's config, pointed at a copy of its dump_to that a test may damage."""
    config = load_config(workflow_run[1])
    shutil.copytree(config["dump_to"], tmp_path / "dump", symlinks=True)
    config["dump_to"] = str(tmp_path / "dump")
    return config


def store_path(config: dict, name: str) -> Path:
    """The store's own directory (a saev stage dir's pointer leads to the store beside it)."""
    from actstore.formats import saev

    directory = stage_dir(config, name)
    return directory if name == "extract" else saev.resolve(directory) if name == "saev" else find_store(directory, name)


def data_file(store: Path) -> Path:
    """The largest data (non-metadata) file of a store."""
    files = [p for p in store.rglob("*") if p.is_file() and not p.name.endswith(METADATA_SUFFIXES)
             and p.name != "actstore_config.json"]
    return max(files, key=lambda p: (p.stat().st_size, str(p)))


@pytest.mark.slow
@pytest.mark.parametrize("name", STORES)
def test_inspect_identifies_and_clean_store_verifies(workflow_run, name):
    tmp, configfile = workflow_run
    store = store_path(load_config(configfile), name)
    proc = actstore("inspect", "--json", str(store))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert name in info["format"] or (name, info["format"]) == ("extract", "actstore-extract")
    proc = actstore("verify", str(store))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_inspect_summarises_the_sae_stages_sae(workflow_run):
    """The sae stage holds no format's store: inspect reads its checkpoint's header and report.json."""
    config = load_config(workflow_run[1])
    directory = stage_dir(config, "sae")
    proc = run(ACTSTORE, "inspect", "--json", str(directory))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    report = json.loads((directory / "report.json").read_text())
    assert {key: info[key] for key in ("format", "hook", "d_in", "num_basis", "k_active", "source")} == {
        "format": "sae", "hook": report["hook"], "d_in": report["d_in"], "num_basis": report["num_basis"],
        "k_active": report["k_active"], "source": "trained"}
    assert info["heldout_fvu"] == report["heldout"]["fvu"] and info["saelens"] == str(directory / "saelens")
    assert actstore("inspect", str(directory)).stdout.splitlines()[0] == "format      sae"


@pytest.mark.slow
def test_inspect_names_an_sae_checkpoint_whose_header_is_damaged(workflow_run, tmp_path):
    """A damaged sae.safetensors header was the safetensors library's SafetensorError, which no
    handler took: a traceback and exit 1. It is named, exit 2, as any store inspect cannot summarise."""
    source = stage_dir(load_config(workflow_run[1]), "sae")
    directory = tmp_path / "sae" / source.name
    shutil.copytree(source, directory)
    checkpoint = directory / "sae.safetensors"
    raw = bytearray(checkpoint.read_bytes())
    raw[8] = ord("[")  # the header's opening brace
    checkpoint.write_bytes(raw)
    proc = actstore("inspect", str(directory))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{checkpoint}: safetensors header is not JSON" in proc.stderr


@pytest.mark.slow
def test_version_is_the_packages():
    done = subprocess.run([ACTSTORE, "--version"], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, f"actstore {__version__}\n")
    assert __version__ == importlib.metadata.version("actstore")


def test_the_command_never_imports_torch(workflow_run):
    """inspect, verify and locate on every store, in one fresh process: none of them loads torch
    (~2 s of a login node's time per call, before the LUT format stopped importing it)."""
    tmp, configfile = workflow_run
    stores = [str(store_path(load_config(configfile), name)) for name in STORES]
    stores.append(str(stage_dir(load_config(configfile), "sae")))  # inspected from its checkpoint's header
    code = f"""
import sys
from actstore import cli
for store in {stores!r}:
    assert cli.main(["inspect", store]) == 0 and cli.main(["verify", store]) == 0, store
assert cli.main(["locate", "--configfile", {str(configfile)!r}]) == 0
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    proc = run(sys.executable, "-c", code)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "[]", (proc.stdout[-2000:], proc.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("name", STORES)
def test_damaged_data_file_fails_verify_naming_it(workflow_run, name, damage, tmp_path):
    config = copied_run(workflow_run, tmp_path)
    store = store_path(config, name)
    target = data_file(store)
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[:-1]
    target.write_bytes(bytes(data))
    proc = actstore("verify", str(store))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert target.name in proc.stdout
    # One file at a time or three at once: the same report.
    assert actstore("verify", "--threads", "1", str(store)).stdout == proc.stdout
    assert actstore("verify", "--threads", "3", str(store)).stdout == proc.stdout
    assert integrity.CHECK_THREADS == DEFAULT_CHECK_THREADS  # the option holds for its own call only


def test_verify_threads_must_be_at_least_one(tmp_path):
    proc = run(ACTSTORE, "verify", "--threads", "0", str(tmp_path))
    assert proc.returncode == 2 and "--threads: '0': a whole number of at least 1" in proc.stderr


@pytest.mark.slow
def test_validate_report_covers_every_format(workflow_run):
    tmp, configfile = workflow_run
    config = load_config(configfile)
    report = json.loads((stage_dir(config, "validate") / "report.json").read_text())
    for name in FORMAT_STAGES:
        entry = report["formats"][name]
        assert entry["problems"] == [] and entry["checked"] > 0, name
    assert report["formats"]["extract"]["checked"] == report["coordinates"]


@pytest.mark.slow
def test_an_edited_or_misplaced_stage_config_fails_verify_and_validate(workflow_run, tmp_path):
    """A stage's actstore_config.json says which config made its outputs: one edited by hand, or
    copied in from another stage directory, is named by verify (on the stage directory or a store
    inside it) and by the validate stage."""
    from actstore.errors import FormatError
    from actstore.verify import validate_all

    config = copied_run(workflow_run, tmp_path)
    extract, lmprobe, pickle = (stage_dir(config, name) for name in ("extract", "lmprobe", "pickle"))
    edited = json.loads((lmprobe / "actstore_config.json").read_text())
    edited["config"]["lmprobe"]["dtype"] = "float16"
    (lmprobe / "actstore_config.json").write_text(json.dumps(edited))
    shutil.copyfile(extract / "actstore_config.json", pickle / "actstore_config.json")
    edited_problem = f"{lmprobe / 'actstore_config.json'}: its content hashes to "
    moved_problem = (f"{pickle / 'actstore_config.json'}: the config of stage directory {extract.name}, "
                     f"found in {pickle.name}")
    for store, problem in [(store_path(config, "lmprobe"), edited_problem), (lmprobe, edited_problem),
                           (pickle, moved_problem)]:
        proc = actstore("verify", str(store))
        assert proc.returncode == 1 and f"BAD  {problem}" in proc.stdout, (store, proc.stdout)
    assert actstore("verify", str(extract)).returncode == 0
    with pytest.raises(FormatError) as raised:
        validate_all(config, tmp_path / "report.json")
    assert edited_problem in str(raised.value) and moved_problem in str(raised.value)


@pytest.mark.slow
def test_every_stage_seals_the_metadata_files_it_wrote(workflow_run):
    """Each stage config records {bytes, sha256} of every metadata file its stage wrote (the sae
    stage, which writes no format's store: of every file), and of nothing the workflow deletes
    afterwards (its temps), nor of the files it keeps outside its stores (the dataset scan,
    integrity.STAGE_TEMPS): verify and validate check them."""
    from actstore.formats import is_metadata_name

    config = load_config(workflow_run[1])
    must = {"extract": {"extract.json", "part-0000/part.json"}, "lut": {"lut/metadata.json", "report.json"},
            "sae": {"report.json", "sae.safetensors", "saelens/cfg.json", "saelens/sae_weights.safetensors"},
            "validate": {"report.json"},
            "pickle": {"metadata.json", "machine-0000/metadata.json"},
            "lmprobe": {"dataset/SHA256SUMS"}, "saev": {"saev.json"},
            "zarr": {"manifest.json", "shards/shard-0000.zarr/arrays/activations/.zarray"}}
    for stage, names in must.items():
        directory = stage_dir(config, stage)
        sealed = json.loads((directory / "actstore_config.json").read_text())["sealed"]
        on_disk = {rel for rel in integrity.sorted_files(directory)
                   if Path(rel).name not in integrity.TOOL_FILES | integrity.STAGE_TEMPS
                   and (is_metadata_name(Path(rel).name) or stage == "sae")}  # sae: no format, every file
        assert names <= set(sealed) == on_disk, stage
        assert integrity.stage_config_problems(directory, required=True) == []


def json_edit(edit):
    """A text edit that changes one value of a JSON document (`edit` mutates the parsed object)."""
    def apply(text: str) -> str:
        document = json.loads(text)
        edit(document)
        return json.dumps(document, indent=2)
    return apply


def bump(mapping: dict, key: str) -> None:
    mapping[key] += 1


SEAL_ONLY_EDITS = {  # an edit no record of the format covers (found by fuzzing): the file, the edit
    "extract": ("extract.json", json_edit(lambda m: m.pop("model"))),
    "pickle": ("metadata.json",
               json_edit(lambda m: bump(m["extraction_config"]["model_params"], "num_attention_heads"))),
    "lut": ("lut/metadata.json", json_edit(lambda m: bump(m["sae_config"], "k_active"))),
    "lmprobe": ("dataset/SHA256SUMS", lambda text: text.rstrip("\n")),
    "zarr": ("manifest.json", json_edit(lambda m: m.update(created="2000-01-01T00:00:00+00:00"))),
}


def open_verified(name: str, path: Path) -> None:
    """Open the store at `path` with the format's reader and verify=True (pickle's reader has none:
    it checks each shard's sha256 as it loads it)."""
    from actstore.formats.extract import open_extraction
    from actstore.formats.lmprobe import open_dataset
    from actstore.formats.lut import open_lut
    from actstore.formats.saev import open_store
    from actstore.formats.zarr import open_zarr

    {"extract": open_extraction, "lut": open_lut, "lmprobe": open_dataset, "saev": open_store,
     "zarr": open_zarr}[name](path, verify=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SEAL_ONLY_EDITS))
def test_a_metadata_edit_no_record_covers_is_named_by_the_stage_seal(workflow_run, name, tmp_path):
    """A changed value in a store's top metadata file (a LUT's k_active, a deleted model entry)
    passes every check of the format itself, which has nothing to compare it with: the stage
    config's seal names it, in verify, in the readers' verify=True and in the validate stage."""
    from actstore.errors import FormatError
    from actstore.formats import format_module
    from actstore.verify import validate_all

    config = copied_run(workflow_run, tmp_path)
    rel, edit = SEAL_ONLY_EDITS[name]
    path = stage_dir(config, name) / rel
    text = path.read_text()
    path.write_text(edit(text))
    assert path.read_text() != text
    store = store_path(config, name)
    assert format_module(name).verify(store) == []  # the format alone passes it
    proc = actstore("verify", str(store))
    problem = f"{path}: "
    assert proc.returncode == 1 and problem in proc.stdout, proc.stdout
    assert f"{stage_dir(config, name) / 'actstore_config.json'} (sealed)" in proc.stdout
    if name != "pickle":
        with pytest.raises(FormatError, match=re.escape(problem)):
            open_verified(name, store)
    with pytest.raises(FormatError, match=re.escape(problem)):
        validate_all(config, tmp_path / "report.json")


@pytest.mark.slow
def test_a_saev_store_linked_from_outside_its_stage_is_refused_through_the_pointer(workflow_run, tmp_path):
    """The pointer's store is the stage dir's sibling: one that is a link leading out of
    {dump_to}/saev (an identical copy elsewhere) is named, and neither verify nor a reader follows it."""
    from actstore.errors import FormatError
    from actstore.formats import saev

    config = copied_run(workflow_run, tmp_path)
    stage, store = stage_dir(config, "saev"), store_path(config, "saev")
    (tmp_path / "elsewhere").mkdir()
    store.rename(tmp_path / "elsewhere" / store.name)
    store.symlink_to(tmp_path / "elsewhere" / store.name)
    problem = f"{stage / 'saev.json'}: store: '{store.name}' leads outside {store.parent} (through a link)"
    proc = actstore("verify", str(stage))
    assert proc.returncode == 1 and problem in proc.stdout, proc.stdout
    with pytest.raises(FormatError, match=re.escape(problem)):
        saev.open_store(stage)
    assert saev.verify(store) == []  # the link given by the user is theirs to follow


@pytest.mark.slow
@pytest.mark.parametrize("rel", ["actstore.json", "shards.json", "metadata.json"])
def test_the_saev_pointer_seals_the_metadata_of_the_store_beside_its_stage(workflow_run, rel, tmp_path):
    """The saev store sits beside its stage directory, outside the stage config's seal: the pointer
    the stage config seals records the store's metadata files, so any change to them (actstore.json's
    model_type, found by fuzzing, is now also checked against the store's family) is named when the
    stage is verified."""
    from actstore.errors import FormatError
    from actstore.formats import saev
    from actstore.verify import validate_all

    config = copied_run(workflow_run, tmp_path)
    stage, store = stage_dir(config, "saev"), store_path(config, "saev")
    sealed = json.loads((stage / "saev.json").read_text())["sealed"]
    assert set(sealed) == {"actstore.json", "shards.json", "metadata.json"}
    path, sealed_by = store / rel, f"{stage / 'saev.json'} (sealed)"
    size = path.stat().st_size
    text = path.read_text()  # actstore.json: another model type of the same length, so only its sha256 differs
    path.write_text(text.replace('"', ' "', 1) if rel != "actstore.json" else text.replace('"bert"', '"gpt2"'))
    assert path.read_text() != text
    alone = saev.verify(store)  # the store alone: JSON whitespace passes; the model_type is checked
    assert alone == ([f"{path}: model_type 'gpt2' does not name family 'bert' of {store / 'metadata.json'}"]
                     if rel == "actstore.json" else [])  # against metadata.json's family, which its name hashes
    problem = (f"{path}: sha256 differs from {sealed_by}" if rel == "actstore.json"
               else f"{path}: {size + 1} bytes, {sealed_by} says {size}")
    proc = actstore("verify", str(stage))
    assert proc.returncode == 1 and problem in proc.stdout, proc.stdout
    with pytest.raises(FormatError, match=re.escape(problem)):
        open_verified("saev", stage)
    with pytest.raises(FormatError, match=re.escape(problem)):
        validate_all(config, tmp_path / "report.json")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sae.safetensors", "saelens/sae_weights.safetensors"])
def test_a_flipped_byte_in_the_sae_checkpoint_is_named_by_verify_and_validate(workflow_run, tmp_path, name):
    """The sae stage writes no format's store: its stage config seals every file it wrote, so the
    checkpoints users load (ours, and SAELens' copy) are checked."""
    from actstore.errors import FormatError
    from actstore.verify import validate_all

    config = copied_run(workflow_run, tmp_path)
    directory = stage_dir(config, "sae")
    proc = actstore("verify", str(directory))
    assert proc.returncode == 0 and proc.stdout.strip() == f"sae stage {directory}: OK", proc.stdout
    checkpoint = directory / name
    raw = bytearray(checkpoint.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    checkpoint.write_bytes(bytes(raw))
    proc = actstore("verify", str(directory))
    assert proc.returncode == 1, proc.stdout
    assert f"BAD  {checkpoint}: sha256 differs from {directory / 'actstore_config.json'} (sealed)" in proc.stdout
    with pytest.raises(FormatError, match=re.escape(f"{checkpoint}: sha256 differs")):
        validate_all(config, tmp_path / "report.json")


@pytest.mark.slow
def test_a_stage_directory_without_its_stage_config_is_named_a_copied_out_store_is_not(workflow_run, tmp_path):
    config = copied_run(workflow_run, tmp_path)
    directory = stage_dir(config, "lut")
    (directory / "actstore_config.json").unlink()
    for path in (directory, directory / "lut"):
        proc = actstore("verify", str(path))
        assert proc.returncode == 1, proc.stdout
        assert f"BAD  {directory / 'actstore_config.json'}: missing" in proc.stdout
    shutil.copytree(directory / "lut", tmp_path / "mine" / "lut")  # a store outside the workflow's layout
    assert actstore("verify", str(tmp_path / "mine" / "lut")).returncode == 0
    assert actstore("verify", str(tmp_path / "mine")).returncode == 0


@pytest.mark.slow
def test_report_builds(workflow_run):
    tmp, configfile = workflow_run
    out = tmp / "report.html"
    proc = run(SNAKEMAKE, "-s", str(tiny.REPO / "Snakefile"), "-d", str(tmp), "--configfile", str(configfile),
               "--report", str(out))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert out.stat().st_size > 10000


def test_locate_prints_every_stage_dir(tmp_path):
    proc = run(ACTSTORE, "locate", "--json", "--configfile", str(tiny.REPO / "config" / "config.yaml"))
    assert proc.returncode == 0, proc.stderr
    located = json.loads(proc.stdout)
    config = load_config(tiny.REPO / "config" / "config.yaml")
    assert located["extract"] == str(stage_dir(config, "extract"))
    assert set(located) >= {"extract", "saev", "pickle", "lmprobe", "zarr", "validate"}


def test_unknown_directory_exits_2(tmp_path):
    proc = run(ACTSTORE, "inspect", str(tmp_path))
    assert proc.returncode == 2 and "none of the known formats" in proc.stderr


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_path_that_does_not_exist_exits_2_not_1(command, tmp_path):
    """Bad usage is 2 (1 is verify's "problems found"), the message on stderr."""
    proc = run(ACTSTORE, command, str(tmp_path / "nothing"))
    assert proc.returncode == 2 and proc.stderr == f"actstore: {tmp_path / 'nothing'}: no such file or directory\n"


def test_locate_names_a_config_file_it_cannot_parse(tmp_path):
    """Deep nesting in the YAML: exit 2 naming the file, no traceback."""
    configfile = tmp_path / "config.yaml"
    configfile.write_text("model: " + "[" * 100_000 + "]" * 100_000)
    proc = run(ACTSTORE, "locate", "--configfile", str(configfile))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"actstore: {configfile}: not valid YAML (nested too deeply to parse)\n"


@pytest.mark.parametrize("command", ["inspect", "verify", "locate"])
def test_every_command_has_help(command):
    proc = run(ACTSTORE, command, "--help")
    assert proc.returncode == 0 and "usage: actstore" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name, metadata", [("extract", "part-0000/part.json"), ("saev", "metadata.json"),
                                            ("pickle", "metadata.json"), ("zarr", "manifest.json"),
                                            ("lut", "lut/metadata.json")])
def test_invalid_top_metadata_fails_verify_naming_the_file(workflow_run, name, metadata, tmp_path):
    config = copied_run(workflow_run, tmp_path)
    store = store_path(config, name)
    (store / metadata).write_text('{"truncated": ')
    proc = actstore("verify", str(store))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"BAD  {store / metadata}: not" in proc.stdout and "JSON" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name, metadata", [("extract", "extract.json"), ("extract", "part-0000/part.json"),
                                            ("saev", "metadata.json"), ("pickle", "metadata.json"),
                                            ("pickle", "machine-0000/metadata.json"), ("zarr", "manifest.json"),
                                            ("zarr", "shards/shard-0000.zarr/meta/files.json"),
                                            ("lmprobe", "SHA256SUMS"), ("lmprobe", "train-00000-of-00001.parquet"),
                                            ("saev pointer", "shards.json"), ("lut", "lut/metadata.json")])
def test_metadata_linked_from_outside_is_named_and_never_read(workflow_run, name, metadata, tmp_path):
    """A store's metadata file replaced by a link to a FIFO outside it: reading it would block, so
    the command finishing at all shows that neither detection nor verify read it; verify names the link."""
    import os

    config = copied_run(workflow_run, tmp_path)
    store = store_path(config, name.split()[0])
    target = next(store.rglob(metadata)) if name == "lmprobe" else store / metadata
    os.mkfifo(tmp_path / "outside")
    target.unlink()
    target.symlink_to(tmp_path / "outside")
    checked = stage_dir(config, "saev") if name == "saev pointer" else store  # the stage dir's saev.json leads to it
    code = f"import sys; from actstore import cli; sys.exit(cli.main(['verify', {str(checked)!r}]))"
    proc = run(sys.executable, "-c", code, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{target}: a link to {tmp_path / 'outside'}, outside" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name, metadata", [("extract", "part-0000/part.json"), ("extract", "extract.json"),
                                            ("saev", "metadata.json"), ("saev", "shards.json"),
                                            ("pickle", "metadata.json"), ("zarr", "manifest.json"),
                                            ("lmprobe", "dataset/index/train-00000-of-00001.parquet"),
                                            ("lut", "lut/metadata.json")])
def test_a_deleted_top_metadata_file_is_named_not_an_unknown_format(workflow_run, name, metadata, tmp_path):
    """The store is still recognised by its other files' names, and verify names what is missing."""
    config = copied_run(workflow_run, tmp_path)
    store = store_path(config, name)
    (store / metadata).unlink()
    proc = actstore("verify", str(store))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert str(store / metadata) in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name, gone, sealed", [("lut", "lut", "lut/metadata.json"),
                                                ("lmprobe", "dataset", "dataset/SHA256SUMS"),
                                                ("saev", "saev.json", "saev.json")])
def test_a_format_stage_whose_store_is_gone_is_a_problem_not_an_unknown_format(workflow_run, name, gone, sealed,
                                                                               tmp_path):
    """A workflow stage directory of a format stage whose store folder or pointer was deleted or renamed:
    verify exits 1 naming the stage directory and, by its stage config's seal, the file now missing
    (before: exit 2, "holds none of the known formats")."""
    config = copied_run(workflow_run, tmp_path)
    directory = stage_dir(config, name)
    (directory / gone).rename(directory / f"{gone}.old")
    proc = actstore("verify", str(directory))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{directory}: holds no {name} store" in proc.stdout
    assert str(directory / sealed) in proc.stdout, proc.stdout


def _point_outside(store: Path, name: str, outside: Path) -> str:
    """Plant a name leading out of the store in the metadata readers follow; return it."""
    if name == "saev":
        pointer = store.parent / next(p for p in store.parent.iterdir() if (p / "saev.json").is_file()) / "saev.json"
        pointer.write_text(json.dumps({"store": str(store)}))  # absolute: a copy elsewhere would be followed
        return str(store)
    if name == "pickle":
        shard = next(store.glob("machine-0000/shard_*.pkl*"))
        shard.unlink()
        shard.symlink_to(outside)
        return shard.name
    if name == "lmprobe":
        sums = next(store.rglob("SHA256SUMS"))
        sums.write_text(sums.read_text() + f"{'0' * 64}  {outside}\n")
        return str(outside)
    manifest = store / "manifest.json"
    meta = json.loads(manifest.read_text())
    meta["shards"][0]["path"] = "../../../" + meta["shards"][0]["path"]
    manifest.write_text(json.dumps(meta))
    return meta["shards"][0]["path"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["saev", "pickle", "lmprobe", "zarr"])
def test_a_name_leading_outside_the_store_is_refused_naming_it(workflow_run, name, tmp_path):
    config = copied_run(workflow_run, tmp_path)
    store = store_path(config, name)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the store's")
    planted = _point_outside(store, name, outside)
    target = stage_dir(config, name) if name == "saev" else store
    proc = actstore("verify", str(target))
    assert proc.returncode in (1, 2), proc.stdout + proc.stderr
    assert planted in proc.stdout + proc.stderr
    assert "outside" in proc.stdout + proc.stderr or "not '../<metadata sha256>'" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", [("saev", "acts000099.bin"), ("pickle", "machine-0000/shard_0099.pkl.gz"),
                                         ("lmprobe", "tensors/hidden_layer000_shard099.safetensors"),
                                         ("extract", "part-0000/layer_001.npy")])
def test_an_unlisted_data_file_fails_verify_naming_it(workflow_run, name, extra, tmp_path):
    config = copied_run(workflow_run, tmp_path)
    store = store_path(config, name)
    root = next(store.rglob("SHA256SUMS")).parent if name == "lmprobe" else store
    planted = root / extra
    planted.write_bytes(data_file(store).read_bytes()[:4096])
    proc = actstore("verify", str(store))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"BAD  {planted}: not listed in" in proc.stdout


def _save_npy(array: np.ndarray) -> Callable[[Path], None]:
    return lambda path: (path.unlink(), np.save(path, array, allow_pickle=True))


def _save_npz(path: Path) -> None:
    path.unlink()
    with open(path, "wb") as fh:
        np.savez(fh, windows=np.zeros((1, 3), np.int64))


def _replace_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


DEEP_JSON = "[" * 100_000 + "]" * 100_000


@pytest.mark.slow
@pytest.mark.parametrize("rel, damage, named", [
    ("windows.npy", _save_npy(np.array([{}], dtype=object)), "not a .npy array of windows"),
    ("windows.npy", _save_npy(np.arange(3)), "int64 (3,), not an integer (n_examples, 3) table"),
    ("windows.npy", _save_npz, "not a .npy array of windows (an .npz archive)"),
    ("shards.json", _replace_dir, "not a regular file"),
    ("metadata.json", lambda path: path.write_text(DEEP_JSON), "not valid JSON (nested too deeply to parse)"),
    ("metadata.json", lambda path: path.write_text(path.read_text().replace("{", '{"d_model": 4,', 1)),
     "not valid JSON (key 'd_model' given twice)"),
    ("../saev.json", lambda path: path.write_text(DEEP_JSON), "not valid JSON (nested too deeply to parse)"),
])
def test_a_hostile_saev_file_is_named_by_inspect_and_verify_never_a_traceback(workflow_run, rel, damage, named,
                                                                              tmp_path):
    """inspect exits 2 naming the file and why, verify 1 naming the file (before: IndexError,
    ValueError, IsADirectoryError or RecursionError tracebacks, and a duplicate key verified)."""
    config = copied_run(workflow_run, tmp_path)
    store = store_path(config, "saev")
    pointer = rel.startswith("../")
    target = stage_dir(config, "saev") / "saev.json" if pointer else store / rel
    given = stage_dir(config, "saev") if pointer else store
    damage(target)
    proc = actstore("inspect", str(given))
    assert proc.returncode == 2 and proc.stderr.startswith(f"actstore: {target}: {named}"), proc.stderr
    proc = actstore("verify", str(given))
    assert proc.returncode == 1 and f"BAD  {target}: " in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name, rel", [("saev", "windows.npy"), ("saev pointer", "windows.npy"),
                                       ("pickle", "metadata.json"), ("zarr", "manifest.json"),
                                       ("extract", "extract.json")])
def test_inspect_refuses_a_file_linked_out_of_the_store(workflow_run, name, rel, tmp_path):
    """A store's file replaced by a link to a copy outside it: inspect summarised the outside file as
    the store's; it exits 2 naming the link (for a saev stage dir, a link in the store its pointer
    leads to)."""
    config = copied_run(workflow_run, tmp_path)
    store = store_path(config, name.split()[0])
    outside = tmp_path / "outside"
    shutil.copy(store / rel, outside)
    (store / rel).unlink()
    (store / rel).symlink_to(outside)
    given = stage_dir(config, "saev") if name == "saev pointer" else store
    proc = actstore("inspect", str(given))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"actstore: {store / rel}: a link to {outside}, outside {store}"), proc.stderr


# Stage hashes against the documented chain (README "Stages and hashes"): a section's key changes the
# hash of the stage reading it and of every stage downstream of that one, nothing else.
DOWNSTREAM = {"extract": {"extract", *FORMAT_STAGES, "sae", "lut", "validate"},
              **{stage: {stage, "validate"} for stage in FORMAT_STAGES},
              "sae": {"sae", "lut", "validate"}, "lut": {"lut", "validate"}, "validate": {"validate"}}
READER = {"model": "extract", "dataset": "extract", **{stage: stage for stage in DOWNSTREAM}}
# A value each key takes that makes its stage write other bytes (or, for `enabled`, other stages).
CHANGED_VALUES = {
    "model": {"path": "/elsewhere/model", "name": "other", "revision": "v2", "torch_dtype": "float16",
              "fix_mistral_regex": True, "tower": "vision"},
    "dataset": {"path": "OTHER", "format": "jsonl", "text_field": "body", "label_field": "y",
                "image_field": "img", "messages_field": "chat", "tokens_field": "ids", "prompt_template": "Q: {text}",
                "encoding": "latin-1", "add_generation_prompt": False, "keep_fields": ["a"], "identity": "stat",
                "name": "other", "split": "test", "limit": 5},
    "extract": {"layers": [1], "max_seq_length": 64, "batch_size": 4, "parts": 3, "hooks": ["a.c:input"],
                "logits_topk": 5, "token_logprobs": False, "device": "cpu", "storage_dtype": "float16",
                "image_pipeline": "gpu"},
    "saev": {"enabled": False, "layers": [0], "patches_per_shard": 100, "tokens_per_window": 8,
             "flavor": "upstream", "patch_labels": {"masks": "/masks"}},
    "pickle": {"enabled": False, "shard_size_mb": 5, "compression": "none", "compresslevel": 2,
               "compressor": "zlib"},
    "lmprobe": {"enabled": False, "storage": "pooled", "prompt_ordering": "original", "seed": 1,
                "dtype": "float16", "shard_bytes": 1000, "layers": [0], "logits_topk": 3, "token_strings": False},
    "zarr": {"enabled": False, "t_chunk": 16, "merged": True},
    "sae": {"enabled": False, "hook": "a.d:input", "num_basis": 64, "k_active": 4, "steps": 10,
            "batch_size": 64, "lr": 0.01, "aux_k": 8, "aux_coef": 0.5, "dead_tokens": 10, "heldout_fraction": 0.2,
            "eval_tokens": 100, "seed": 1, "device": "cpu", "import": {"path": "/sae.safetensors", "style": "saev"}},
    "lut": {"enabled": False, "targets": ["a.q"], "dtype": "bfloat16", "budgets": [0], "eval_tokens": 10,
            "eval_samples": 2, "device": "cpu", "runtime": "auto", "crossover_tokens": 7},
    "validate": {"enabled": False, "n_coords": 3, "seed": 1},
}


def _hash_walk_base(tmp_path: Path) -> dict:
    """A config with every stage enabled (the sae and lut too), on a real data file; no model needed."""
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "a"}\n')
    return {"dump_to": str(tmp_path / "dump"), "model": {"path": str(tmp_path / "model")},
            "dataset": {"path": str(data)}, "extract": {"layers": [0, 2], "hooks": ["a.c:input", "a.d:input"]},
            "sae": {"enabled": True, "hook": "a.c:input"}, "lut": {"targets": ["a.p"]}}


def test_every_hashed_schema_key_changes_exactly_its_stage_and_the_stages_downstream(tmp_path):
    """Every key of the schema is either an execution key (hashing.EXECUTION_KEYS: no hash changes) or
    changes the hash of the stage reading it and of every stage downstream, nothing else: a key that
    changed what a stage writes but not its hash would let two different runs share a directory."""
    from actstore.config import SCHEMA_PATH, validate_config
    from actstore.hashing import EXECUTION_KEYS, stage_hashes

    schema = yaml.safe_load(SCHEMA_PATH.read_text())["properties"]
    sections = {name: set(spec["properties"]) for name, spec in schema.items() if "properties" in spec}
    listed = {name: set(values) | set(EXECUTION_KEYS.get(name, ())) for name, values in CHANGED_VALUES.items()}
    assert listed == sections, "a schema key is neither in CHANGED_VALUES nor an execution key"
    raw = _hash_walk_base(tmp_path)
    base = stage_hashes(validate_config(json.loads(json.dumps(raw))))
    (tmp_path / "OTHER").write_text('{"text": "b"}\n')
    for section, values in CHANGED_VALUES.items():
        for key, value in values.items():
            changed = json.loads(json.dumps(raw))
            changed.setdefault(section, {})[key] = str(tmp_path / value) if value == "OTHER" else value
            after = stage_hashes(validate_config(changed))
            moved = {stage for stage in base if after[stage] != base[stage]}
            assert moved == DOWNSTREAM[READER[section]], f"{section}.{key} = {value!r} moved {sorted(moved)}"


@pytest.mark.parametrize("command, what", [("inspect", "summarise"), ("verify", "integrity check"),
                                           ("locate", "output directory")])
def test_each_subcommand_help_says_what_it_does(command, what):
    """`actstore COMMAND --help` describes the command, not only its arguments."""
    proc = actstore_help(command)
    assert what in " ".join(proc.split())


def actstore_help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    return out.getvalue()


def test_locate_calls_a_stage_directory_without_its_stage_config_incomplete(tmp_path):
    """A run cut short leaves a stage directory its last job never finished (no stage config):
    locate must not call it done."""
    configfile = tiny.save_config(_hash_walk_base(tmp_path), tmp_path / "config.yaml")
    extract = stage_dir(load_config(configfile), "extract")
    assert "extract   " + f"{extract}  (not built)" in actstore("locate", "--configfile", str(configfile)).stdout
    (extract / "part-0000").mkdir(parents=True)
    assert f"{extract}  (incomplete)" in actstore("locate", "--configfile", str(configfile)).stdout
    (extract / integrity.STAGE_CONFIG_FILE).write_text("{}")
    assert f"{extract}  (done)" in actstore("locate", "--configfile", str(configfile)).stdout


def test_locate_calls_a_finished_extraction_of_data_changed_since_stale(tmp_path):
    """Rows appended to a path-hashed JSONL file after its extraction finished: the next run stops at
    parse (datasets.check_extraction_data_unchanged), and locate says so of every done stage instead of
    `done` alone, naming the file."""
    from actstore.datasets import scan_dataset, write_scan

    config = _hash_walk_base(tmp_path)
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    extract = stage_dir(load_config(configfile), "extract")
    extract.mkdir(parents=True)
    write_scan(scan_dataset(config["dataset"]["path"]), extract / "dataset_scan.json")
    for name in ("extract.json", integrity.STAGE_CONFIG_FILE):
        (extract / name).write_text("{}")
    assert f"{extract}  (done)\n" in actstore("locate", "--configfile", str(configfile)).stdout
    with open(config["dataset"]["path"], "a") as data:
        data.write('{"text": "b"}\n')
    out = actstore("locate", "--configfile", str(configfile)).stdout
    assert f"{extract}  (done, stale)" in out and f"stale: {config['dataset']['path']}: changed since" in out, out


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_file_given_for_a_store_exits_2_saying_it_is_not_a_directory(command, tmp_path):
    metadata = tmp_path / "dir with ünïcode" / "metadata.json"
    metadata.parent.mkdir()
    metadata.write_text("{}")
    proc = run(ACTSTORE, command, str(metadata))
    assert proc.returncode == 2 and proc.stderr.startswith(f"actstore: {metadata}: not a directory"), proc.stderr


@pytest.mark.slow
def test_a_part_lost_after_the_run_is_redone_alone(workflow_run, tmp_path):
    """The dataset scan every part was cut from stays in the stage directory (rules/extract.smk: never
    temp(); a temp scan, deleted with the run's last part, was scanned again for a lost part, and its
    new mtime redid every part, a GPU job each): a part lost after the run is planned alone."""
    config = copied_run(workflow_run, tmp_path)
    out = stage_dir(config, "extract")
    assert (out / "dataset_scan.json").is_file()
    shutil.rmtree(out / "part-0001")
    (out / "extract.json").unlink()
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    proc = run(SNAKEMAKE, "-s", str(tiny.REPO / "Snakefile"), "-d", str(tmp_path), "--configfile", str(configfile),
               "-n", "extract")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    table = proc.stdout.split("Job stats:")[1].split("Reasons:")[0]
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}
    assert jobs == {"extract_part": 1, "extract_index": 1, "extract": 1, "total": 3}, table
