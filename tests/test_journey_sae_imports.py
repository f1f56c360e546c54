"""Review 64, journey E (SAEs and LUTs): faults a new user hit, pinned until they are fixed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tiny

HOOK = "encoder.layer.1.attention.self.query:input"


def run_sae_target(tmp_path: Path, model: Path, data: Path, sae_import: dict) -> tuple[int, str, Path]:
    """`snakemake sae` on a tiny BERT config importing `sae_import`; (rc, output, dump_to)."""
    config = tiny.make_config(tmp_path, model, data,
                              extract={"layers": [1], "parts": 1, "hooks": [HOOK]},
                              sae={"enabled": True, "hook": HOOK, "num_basis": 64, "k_active": 4,
                                   "import": sae_import},
                              lut={"targets": ["encoder.layer.1.attention.self.query"]})
    configfile = tiny.save_config(config, tmp_path / "import.yaml")
    cmd = [str(Path(sys.executable).with_name("snakemake")), "-s", str(tiny.REPO / "Snakefile"), "-d", str(tmp_path),
           "--configfile", str(configfile), "--cores", "1", "sae"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr, Path(config["dump_to"])


def saelens_folder(folder: Path, d_in: int, d_sae: int, cfg: dict) -> Path:
    """A SAELens-layout folder (sae_weights.safetensors + cfg.json) of seeded random weights."""
    gen = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True)
    save_file({"W_enc": torch.randn(d_in, d_sae, generator=gen), "b_enc": torch.zeros(d_sae),
               "W_dec": torch.randn(d_sae, d_in, generator=gen), "b_dec": torch.zeros(d_in)},
              str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({
        "architecture": "topk", "k": 4, "d_in": d_in, "d_sae": d_sae, "apply_b_dec_to_input": False,
        "normalize_activations": "none", "metadata": {"sae_lens_version": "6.0.0"}, **cfg}))
    return folder


@pytest.mark.parametrize("d_in,cfg,named", [(16, {}, "d_in 16"),  # the hook is 32 wide
                                            (32, {"architecture": "jumprelu"}, "architecture 'jumprelu'")])
@pytest.mark.slow
def test_an_import_the_sae_stage_refuses_is_named_before_any_extraction_part(
        model_dir, text_jsonl, tmp_path, d_in, cfg, named):
    """The import_sae job named it after every extraction part had run (a real run's GPU hours); the
    dataset scan job reads its header and cfg.json against the hook's width (extract.run.check_sae_import)."""
    folder = saelens_folder(tmp_path / "saelens", d_in, 64, cfg)
    rc, output, dump_to = run_sae_target(tmp_path, model_dir("bert"), text_jsonl,
                                         {"path": str(folder), "style": "saelens"})
    assert rc != 0, output[-3000:]
    logs = "".join(p.read_text() for p in (dump_to / "logs").rglob("*.log")) if (dump_to / "logs").exists() else ""
    assert named in output + logs, (output + logs)[-3000:]
    parts = sorted((dump_to / "extract").glob("*/part-*"))
    assert parts == [], f"the refusal came after extraction parts were written: {parts}"


def test_a_saelens_folder_without_its_cfg_json_is_refused_when_the_config_is_parsed(tmp_path):
    """A SAELens folder copied without cfg.json (the sae stage's saelens/ copy, whose cfg.json says
    apply_b_dec_to_input: false) was imported as a bare file, b_dec subtracted: another SAE (held-out FVU
    0.53 where the SAE had 0.195), without a word. SAELens' load_from_disk needs the file too; the
    Snakefile's parse (import_files, rules/sae.smk) names it, and a bare file named itself still imports."""
    from actstore.config import import_files
    from actstore.errors import ConfigError

    folder = saelens_folder(tmp_path / "saelens", 32, 64, {})
    assert import_files(folder, "saelens") == [folder / "sae_weights.safetensors", folder / "cfg.json"]
    (folder / "cfg.json").unlink()
    with pytest.raises(ConfigError, match=r"saelens: a SAELens folder without cfg\.json"):
        import_files(folder, "saelens")
    assert import_files(folder / "sae_weights.safetensors", "saelens") == [folder / "sae_weights.safetensors"]
