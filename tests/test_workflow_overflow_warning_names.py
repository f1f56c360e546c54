"""Review 66, small leads: a string k in an imported SAELens cfg.json named as such; lmprobe's options not
checked when lmprobe is disabled; the float16/bfloat16 overflow warnings name the finished store, not a
temp name; `actstore locate` refuses an extract.layers block the model lacks."""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

import tiny
from actstore import cli
from actstore.errors import ConfigError, FormatError
from actstore.formats import lmprobe, saev
from actstore.formats import zarr as zs
from actstore.formats.extract import synthetic_extraction
from actstore.model_config import num_blocks, run_config
from actstore.sae.checkpoint import import_sae

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
OVERFLOW = "finite activations beyond"  # the lmprobe warning's words


def saelens_folder(folder: Path, cfg: dict, d_in: int = 8, d_sae: int = 16) -> Path:
    """sae_weights.safetensors (seeded random) and `cfg` as its cfg.json."""
    gen = torch.Generator().manual_seed(0)
    folder.mkdir()
    save_file({"W_enc": torch.randn(d_in, d_sae, generator=gen), "b_enc": torch.zeros(d_sae),
               "W_dec": torch.randn(d_sae, d_in, generator=gen), "b_dec": torch.zeros(d_in)},
              str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"d_in": d_in, "d_sae": d_sae, **cfg}))
    return folder


@pytest.mark.parametrize("cfg,field", [
    ({"architecture": "topk", "k": "4", "metadata": {"sae_lens_version": "6.0.0"}}, "k"),
    ({"architecture": "standard", "activation_fn_str": "topk", "activation_fn_kwargs": {"k": "4"},
      "sae_lens_version": "5.9.0"}, "activation_fn_kwargs.k"),
])
def test_a_string_k_in_a_saelens_cfg_json_is_named_with_what_is_expected(tmp_path, cfg, field):
    """k "4" beside sae.k_active 4 was "k '4', but sae.k_active is 4: set sae.k_active to the SAE's k",
    which no sae.k_active could satisfy; the file, the field, the value and a JSON integer are named."""
    folder = saelens_folder(tmp_path / "saelens", cfg)
    with pytest.raises(ConfigError, match=rf"{folder / 'cfg.json'}: {field} '4', but sae.k_active is 4: that "
                                          rf"{field} is a str, where SAELens' k is a whole number \(a JSON integer"):
        import_sae(folder, "saelens", 4)
    (folder / "cfg.json").write_text((folder / "cfg.json").read_text().replace('"4"', "4"))
    assert import_sae(folder, "saelens", 4).k_active == 4


def dry_run(workdir: Path, config: dict) -> subprocess.CompletedProcess:
    configfile = tiny.save_config(config, workdir / "config.yaml")
    return subprocess.run([SNAKEMAKE, "-s", str(tiny.REPO / "Snakefile"), "-d", str(workdir), "--configfile",
                           str(configfile), "--cores", "1", "-n"], capture_output=True, text=True, timeout=600)


def test_a_stages_options_are_not_checked_when_it_is_disabled(tmp_path, model_dir):
    """lmprobe.layers and saev.layers naming a block not extracted stopped the parse of every stage though
    the stage was disabled (rules/lmprobe.smk, rules/saev.smk). Enabled, the same options are refused by
    the check those rules run at parse time (test_workflow.py proves the parse stops there)."""
    data = tiny.write_jsonl(tmp_path / "data.jsonl", 4)
    model = model_dir("bert")
    disabled = tiny.make_config(tmp_path, model, data, extract={"parts": 1, "layers": [0, 2]}, sae={"enabled": False},
                                lmprobe={"enabled": False, "layers": [1]}, saev={"enabled": False, "layers": [1]})
    proc = dry_run(tmp_path, disabled)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert re.search(r"^zarr_manifest\s+1$", proc.stdout, re.M), proc.stdout[-3000:]
    assert not re.search(r"^(lmprobe|saev)", proc.stdout, re.M), proc.stdout[-3000:]
    with pytest.raises(ConfigError, match=re.escape("lmprobe.layers: [1] not extracted (extract.layers = [0, 2])")):
        lmprobe.check_options(disabled, run_config(disabled["model"]))
    with pytest.raises(ConfigError, match=re.escape("saev.layers: [1] not extracted; extract.layers = [0, 2]")):
        saev.check_options(disabled)


def overflow_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if OVERFLOW in record.getMessage()]


def stored_infs(dataset: Path) -> int:
    return sum(int(np.isinf(array).sum()) for path in (dataset / "tensors").glob("*.safetensors")
               for array in load_file(path).values())


@pytest.fixture(scope="module")
def wide_extraction(tmp_path_factory) -> Path:
    """Activations of standard deviation 30000: a few hundred past float16's +-65504."""
    return synthetic_extraction(tmp_path_factory.mktemp("wide") / "extract", 200_000, parts=2, dim=16,
                                layers=[0, 1], tokens=(4, 16), scale=30_000.0)


def test_the_lmprobe_overflow_warning_names_the_dataset_not_its_temp_name(wide_extraction, tmp_path, caplog):
    """write_dataset wrote the files into atomic_path's temp directory and named that, gone once renamed."""
    out = tmp_path / "ds"
    options = {"token_strings": False, "dtype": "float16", "storage": "full_sequence"}
    with caplog.at_level(logging.WARNING, logger="actstore.formats.lmprobe.write"):
        lmprobe.write_dataset(wide_extraction, out, options, progress=False)
    assert overflow_warnings(caplog) == [f"lmprobe.dtype float16: {stored_infs(out)} {OVERFLOW} +-65504 are "
                                         f"stored as +-inf in {out / 'tensors'} (float32 keeps them)"]


def test_the_workflow_jobs_overflow_is_logged_once_by_the_finisher_naming_the_dataset(wide_extraction, tmp_path,
                                                                                       caplog):
    """Each scatter job named its own temp directory (then its scatter folder, removed once the dataset
    is finished): the jobs' counts go into their records, and the finishing job logs their sum, naming
    the dataset the files are linked into; a count damaged in a record is named, not summed."""
    options = {"token_strings": False, "dtype": "float16", "storage": "full_sequence"}
    jobs = [tmp_path / "scatter" / f"job-{job:04d}" for job in range(2)]
    out = tmp_path / "dataset"
    with caplog.at_level(logging.WARNING, logger="actstore.formats.lmprobe.write"):
        for job, job_dir in enumerate(jobs):
            lmprobe.write_job(wide_extraction, job_dir, options, jobs=len(jobs), job=job, progress=False)
        assert overflow_warnings(caplog) == []
        record = jobs[1] / "job.json"
        kept = record.read_text()
        record.write_text(json.dumps({**json.loads(kept), "overflow": "many"}))
        with pytest.raises(FormatError, match=rf"{record}: overflow 'many', expected a whole number"):
            lmprobe.finish_dataset(wide_extraction, jobs, out, options)
        record.write_text(kept)
        lmprobe.finish_dataset(wide_extraction, jobs, out, options)
    assert stored_infs(out) > 100
    assert overflow_warnings(caplog) == [f"lmprobe.dtype float16: {stored_infs(out)} {OVERFLOW} +-65504 are "
                                         f"stored as +-inf in {out / 'tensors'} (float32 keeps them)"]


def test_the_zarr_overflow_warning_names_the_shard_store_it_wrote(wide_extraction, tmp_path, caplog):
    """It named the extraction part alone, not the store holding the +-inf values."""
    part, out = wide_extraction / "part-0000", tmp_path / "shard-0000.zarr"
    with caplog.at_level(logging.WARNING, logger="actstore.formats.zarr.write"):
        zs.write_shard(part, out, progress=False)
    count = zs.ZarrStore(out).attrs["float16_overflow_count"]
    assert count > 0
    assert [record.getMessage() for record in caplog.records] == [
        f"{out}: {count} activation values of {part} exceed float16 range and are stored as +-inf"]


def locate(tmp_path: Path, config: dict, capsys) -> tuple[int, str]:
    configfile = tiny.save_config(config, tmp_path / "locate.yaml")
    code = cli.main(["locate", "--configfile", str(configfile), "-d", str(tmp_path)])
    return code, capsys.readouterr().err


def test_locate_refuses_a_layer_past_the_models_blocks(tmp_path, model_dir, capsys):
    """It printed the stage directories of a config the workflow refuses at parse, and exited 0."""
    model = model_dir("bert")
    n_blocks = num_blocks(run_config({"path": str(model)}))
    data = tiny.write_jsonl(tmp_path / "data.jsonl", 4)
    config = tiny.make_config(tmp_path, model, data, extract={"layers": [0, n_blocks]})
    assert locate(tmp_path, config, capsys) == (
        2, f"actstore: extract.layers: [{n_blocks}] out of range; the model has blocks 0..{n_blocks - 1}\n")
    config["extract"]["layers"] = [0, n_blocks - 1]
    assert locate(tmp_path, config, capsys) == (0, "")
    # a copied dump_to, its model folder elsewhere: the layers are the config's word, as before
    config["model"]["path"], config["extract"]["layers"] = str(tmp_path / "elsewhere"), [0, n_blocks]
    assert locate(tmp_path, config, capsys) == (0, "")
