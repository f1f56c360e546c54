"""Review 62 of the workflow's Slurm requests (actstore/resources.py): jobs asking for less than they need."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

import tiny
from actstore import parse_memo, resources
from actstore.datasets.jsonl import ESTIMATE_BYTES
from actstore.extract import run_part
from actstore.formats import saev
from actstore.formats.extract import write_index
from actstore.hashing import stage_dir, stage_dirs
from actstore.integrity import STAGE_CONFIG_FILE
from actstore.workflow import parse_dataset, record_stage

TEXT_ROW = json.dumps({"text": "a short sentence of plain text for the model", "label": "a"}).encode() + b"\n"


def sparse_jsonl(path: Path, size: int) -> Path:
    """A JSONL file of `size` bytes whose start holds real rows and the rest a hole: the parse-time size
    estimate reads only the start (datasets.jsonl.size_estimate), so it stands for a dataset of that size."""
    with open(path, "wb") as fh:
        fh.write(TEXT_ROW * (ESTIMATE_BYTES // len(TEXT_ROW) + 1))
        fh.truncate(size)
    return path


def test_the_index_job_has_the_time_to_read_every_row_the_scan_read(model_dir, tmp_path):
    """extract_index parses every stored sample's row (formats.extract.write.index_of: the parts must
    cover sample_idx 0..n-1, each row's text as the scan read it): its time counted only the model's
    files hashed, 11 minutes for 6 GB of text the scan job is given 20 for, and Slurm killed it."""
    data = sparse_jsonl(tmp_path / "big.jsonl", 6 * 10**9)
    config = tiny.make_config(tmp_path, model_dir("gpt2"), data, extract={"parts": 64})
    assert resources.extract_index_runtime(config) >= resources.extract_scan_runtime(config)


def bfloat16_copy(model: Path, out: Path) -> Path:
    """`model` saved as a bfloat16 checkpoint: the same parameters in half the bytes, config.json saying so."""
    shutil.copytree(model, out)
    tensors = load_file(model / "model.safetensors")
    save_file({name: tensor.bfloat16() for name, tensor in tensors.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    return out


def test_a_16bit_checkpoint_run_in_float32_is_timed_for_all_its_parameters(model_dir, tmp_path):
    """A part's forward FLOPs counted the parameters as the weight files' bytes over 4: a bfloat16
    checkpoint (Llama's, most on the Hub) run in float32 (model.torch_dtype's default) was counted at
    half its parameters, and its parts were given half the GPU time of the same model saved in float32."""
    data = sparse_jsonl(tmp_path / "big.jsonl", 6 * 10**9)
    float32 = model_dir("gpt2")
    bfloat16 = bfloat16_copy(float32, tmp_path / "bf16")
    minutes = [resources.extract_part_runtime(tiny.make_config(tmp_path, model, data, extract={
        "parts": 1, "layers": [0], "max_seq_length": 128}, model={"torch_dtype": "float32"}))
        for model in (float32, bfloat16)]
    assert minutes[0] < resources.MAX_RUNTIME_MIN  # not both capped: the parameters are what is compared
    assert minutes[1] == minutes[0]


def test_a_text_folders_scan_is_sized_for_its_listing_as_an_image_folders_is(model_dir, image_folder, tmp_path):
    """The scan of a folder of files lists it whole and holds every file's name and label
    (datasets.folders.scan_folder), for texts as for images; a text folder's scan was given nothing for
    them (1 GB flat: ~3M files, a PubMed-sized corpus, passed it)."""
    images = tiny.make_config(tmp_path, model_dir("dinov2"), image_folder)
    texts = tiny.make_config(tmp_path, model_dir("gpt2"), image_folder, dataset={"format": "text_folder"})
    assert resources.workload(texts).rows == resources.workload(images).rows  # the same files listed
    assert resources.extract_scan_mem_mb(texts) >= resources.extract_scan_mem_mb(images)


# A rule's script run as Snakemake's `script:` runs it, in its own process (setup_logging takes over its
# stdout and stderr): a `snakemake` object whose input, output and params are lists with names.
SCRIPT_RUNNER = """
import json, runpy, sys
from types import SimpleNamespace

class Named(list):
    def __init__(self, named):
        super().__init__(named.values())
        self.__dict__.update(named)

job = json.loads(sys.argv[2])
snakemake = SimpleNamespace(input=Named(job["input"]), output=Named(job["output"]), params=Named(job["params"]),
                            log=[job["log"]], config=job["config"], threads=1,
                            wildcards=SimpleNamespace(**job["wildcards"]))
runpy.run_path(sys.argv[1], init_globals={"snakemake": snakemake}, run_name="__main__")
"""


def run_script(name: str, config: dict, log: Path, **job: dict) -> None:
    """workflow/scripts/<name>.py run on `job`'s input, output and params; its log's tail on failure."""
    job = {"input": {}, "output": {}, "params": {}, "wildcards": {}, **job, "log": str(log), "config": config}
    proc = subprocess.run([sys.executable, "-c", SCRIPT_RUNNER, str(tiny.REPO / "workflow" / "scripts" / f"{name}.py"),
                           json.dumps(job)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stderr + log.read_text())[-3000:]


def test_a_saev_store_names_the_extraction_it_was_made_from_when_the_data_is_touched(model_dir, tmp_path):
    """The saev jobs named their store's source by the extract hash of the data as it was when each job
    ran (hashing.stage_hash), not by the extraction they read: data touched during a run (its mtime,
    dataset.identity: stat) gave a store claiming another extraction, and with identity: content every
    job read and hashed the whole dataset again."""
    data = tiny.write_jsonl(tmp_path / "docs.jsonl", 12)
    config = tiny.make_config(tmp_path, model_dir("bert"), data, extract={"parts": 1},
                              dataset={"identity": "stat"}, saev={"enabled": True})
    out = stage_dir(config, "extract")
    run_part(config, 0, out / "part-0000", progress=False)
    write_index(out, out / "extract.json")
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, not changed
    assert stage_dir(config, "extract") != out
    saev_dir = tmp_path / "dump" / "saev" / ("0" * 64)
    job_dir, index = saev_dir / "scatter" / "job-0000", str(out / "extract.json")
    run_script("saev_shards", config, tmp_path / "shards.log", input={"index": index}, output={"job": str(job_dir)},
               params={"job": 0, "jobs": 1})
    run_script("saev", config, tmp_path / "saev.log", input={"index": index, "jobs": [str(job_dir)]},
               output={"pointer": str(saev_dir / "saev.json")})
    sidecar = json.loads((saev.resolve(saev_dir / "saev.json") / saev.SIDECAR).read_text())
    assert sidecar["source_extraction"] == out.name


def test_validation_finds_the_stages_the_run_made_when_the_data_is_touched(model_dir, tmp_path, monkeypatch):
    """validate_stores found every stage by the hashes of the data as it was when the job ran
    (verify.validate_all's stage_dirs), not by those the main process named the run's directories by and
    handed to its jobs (parse_memo): data touched during a run (dataset.identity: stat) failed the
    validation of every store it had made."""
    data = tiny.write_jsonl(tmp_path / "docs.jsonl", 12)
    off = {"enabled": False}
    config = tiny.make_config(tmp_path, model_dir("bert"), data, extract={"parts": 1}, dataset={"identity": "stat"},
                              saev=off, pickle=off, lmprobe=off, zarr=off, sae=off, lut=off, validate={"enabled": True})
    dirs = stage_dirs(config)
    run_part(config, 0, dirs["extract"] / "part-0000", progress=False)
    write_index(dirs["extract"], dirs["extract"] / "extract.json")
    record_stage(config, "extract", dirs["extract"])
    monkeypatch.setenv(parse_memo.ENV, "")  # hand_over's, in this process's environment until the test ends
    with parse_memo.main_process_facts():  # the main process's parse, and its facts handed to the jobs
        parse_dataset(config, main_process=True)
        parse_memo.hand_over(tmp_path / "parse")
    stat = data.stat()
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, not changed
    try:
        extract = str(dirs["validate"] / "scatter" / "extract.0.npz")
        run_script("validate_extract", config, tmp_path / "extract.log", output={"result": extract},
                   wildcards={"share": "0"})
        run_script("validate_stores", config, tmp_path / "validate.log", input={"extract": [extract], "stores": []},
                   params={"shares": {}}, output={"report": str(dirs["validate"] / "report.json"),
                                                  "stage_config": str(dirs["validate"] / STAGE_CONFIG_FILE)})
    finally:
        parse_memo.withdraw()  # as the run's end does: no later test's process inherits the file
    assert json.loads((dirs["validate"] / "report.json").read_text())["formats"]["extract"]["problems"] == []
