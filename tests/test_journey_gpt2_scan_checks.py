"""Review 64, a new user's journey (GPT-2-style model, Hugging Face data, reduced storage): faults
found by following the docs, pinned until the code is fixed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

import tiny


def test_a_token_id_past_the_vocabulary_fails_the_scan_before_any_part_job(model_dir, tmp_path):
    """README: "A scan job first checks every row, so a bad row fails before any GPU job starts, naming
    its file and line". A pre-tokenized row holding an id past config.json's vocab_size (GPT-2 tiny:
    300) is a bad row the scan can find without torch, as it finds a negative id; it passed the scan,
    and only the job of the part holding it refused it, every other part's job having run on its GPU."""
    ids = [[0, 5, 17, 42] + list(range(1, 2 + i)) for i in range(12)]
    ids[7] = [0, 5, 300, 4]
    data = tiny.write_parquet(tmp_path / "ids", pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}))
    config = tiny.make_config(tmp_path, model_dir("gpt2"), data, dataset={"tokens_field": "input_ids"},
                              extract={"parts": 2, "max_seq_length": 64})
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-s", str(tiny.REPO / "Snakefile"), "-d",
           str(tmp_path), "--configfile", str(configfile), "--cores", "1", "extract_scan"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    logs = "".join(p.read_text() for p in (tmp_path / "dump" / "logs").rglob("scan.log"))
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    assert "token id 300 is outside the model's vocabulary of 300" in logs
    assert not list((tmp_path / "dump").rglob("dataset_scan.json"))


@pytest.mark.parametrize("form", ["jsonl", "parquet", "arrow"])
def test_the_scan_names_the_row_of_a_token_id_past_the_vocabulary_in_every_table_form(form, tmp_path):
    """scan_dataset(vocab=...) refuses the first row holding an id at or past it, naming the row, in JSON
    lines and in a table, whether or not a Parquet row group's statistics could vouch for its ids (a row
    group whose largest id is below the vocabulary is not read); ids below it all pass."""
    import json

    from actstore.datasets import scan_dataset
    from actstore.errors import ConfigError

    ids = [[1 + (i % 7), 2, 3] for i in range(100)]
    ids[73] = [4, 299, 300, 5]
    if form == "jsonl":
        path = tmp_path / "ids.jsonl"
        path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids))
        where = r"ids\.jsonl:74: field 'input_ids': "
    else:
        table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))})
        path = (tiny.write_parquet(tmp_path / "ids", table, row_group_size=16) if form == "parquet"
                else tiny.write_arrow_stream(tmp_path / "ids.arrow", table, batch_rows=16))
        where = r"#73, column 'input_ids': "
    with pytest.raises(ConfigError, match=where + r"token id 300 is outside the model's vocabulary of 300"):
        scan_dataset(path, tokens_field="input_ids", vocab=300)
    assert scan_dataset(path, tokens_field="input_ids", vocab=301).n_samples == 100
    assert scan_dataset(path, tokens_field="input_ids").n_samples == 100


def test_a_lut_target_that_is_no_linear_map_fails_the_scan_before_any_part_job(model_dir, tmp_path):
    """A lut.targets module of another kind (GPT-2's token embedding) was refused by the sae job, once
    every part had run on its GPU; the scan job, which already builds the model's skeleton for
    extract.hooks, names it. GPT-2's Conv1D projections pass (they are LUT targets)."""
    from actstore.errors import ConfigError
    from actstore.extract.run import check_hooks

    data = tiny.write_jsonl(tmp_path / "data.jsonl", 8)
    config = tiny.make_config(tmp_path, model_dir("gpt2"), data, extract={"hooks": ["h.1.attn.c_attn:input"]},
                              sae={"enabled": True, "num_basis": 64, "k_active": 8},
                              lut={"targets": ["h.1.attn.c_attn", "wte"]})
    with pytest.raises(ConfigError, match=r"lut.targets: 'wte' is a Embedding, not nn.Linear nor a transformers "
                                          r"Conv1D"):
        check_hooks(config)
    config["lut"]["targets"] = ["h.1.attn.c_attn"]
    check_hooks(config)
    configfile = tiny.save_config({**config, "lut": {**config["lut"], "targets": ["wte"]}}, tmp_path / "config.yaml")
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-s", str(tiny.REPO / "Snakefile"), "-d",
           str(tmp_path), "--configfile", str(configfile), "--cores", "1", "extract_scan"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    logs = "".join(p.read_text() for p in (tmp_path / "dump" / "logs").rglob("scan.log"))
    assert proc.returncode != 0 and "lut.targets: 'wte' is a Embedding" in logs, (proc.stdout + proc.stderr)[-2000:]
