"""Labels lmprobe's string column would store as one text (a JSONL dataset's 1 and "1"): refused by
the workflow's scan and by each part's preflight when lmprobe is enabled, before any model weight
loads or any part file is written; the other formats take them as two classes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tiny
from actstore.errors import ConfigError
from actstore.extract import preflight, run_part
from actstore.formats.extract import open_part

MESSAGE = r"dataset.path .*labels\.jsonl \(lmprobe is enabled\): labels 1 and \"1\" would both be stored as label '1'"


def mixed_labels(tmp_path):
    rows = [json.loads(line) for line in tiny.write_jsonl(tmp_path / "docs.jsonl", 4).read_text().splitlines()]
    data = tmp_path / "labels.jsonl"
    data.write_text("".join(json.dumps({**row, "label": label}) + "\n"
                            for row, label in zip(rows, [1, "1", "other", 1])))
    return data


def test_a_part_refuses_them_before_any_file_when_lmprobe_is_enabled(model_dir, tmp_path):
    data = mixed_labels(tmp_path)
    config = tiny.make_config(tmp_path, model_dir("bert"), data, extract={"parts": 1})
    with pytest.raises(ConfigError, match=MESSAGE):
        preflight(config, 0)
    out = tmp_path / "part-0000"
    with pytest.raises(ConfigError, match=MESSAGE):
        run_part(config, 0, out, progress=False)
    assert not out.exists()
    config = tiny.make_config(tmp_path, model_dir("bert"), data, extract={"parts": 1}, lmprobe={"enabled": False})
    run_part(config, 0, out, progress=False)
    assert [s["label_id"] for s in open_part(out).samples] == [0, 1, 2, 0]


def test_the_workflow_scan_refuses_them(model_dir, tmp_path):
    """`snakemake extract_scan`: the scan job fails naming both labels, and leaves no scan file."""
    config = tiny.make_config(tmp_path, model_dir("bert"), mixed_labels(tmp_path), extract={"parts": 1})
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-s", str(tiny.REPO / "Snakefile"), "-d",
           str(tmp_path), "--configfile", str(configfile), "--cores", "1", "extract_scan"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    logs = "".join(p.read_text() for p in (tmp_path / "dump" / "logs").rglob("*.log"))
    assert "labels 1 and \"1\" would both be stored as label '1'" in logs, (proc.stdout + proc.stderr)[-3000:]
    assert not list((tmp_path / "dump").rglob("dataset_scan.json"))
