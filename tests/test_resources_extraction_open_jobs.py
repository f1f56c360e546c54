"""Review 62: jobs that open the whole extraction are sized for it."""
import re
from pathlib import Path

import tiny
from actstore import resources
from actstore.formats.extract import open_extraction, synthetic_extraction
from test_workflow_slurm_requests import sparse_jsonl

ROOT = Path(__file__).resolve().parents[1]


def test_an_opened_extraction_is_measured_at_what_the_jobs_opening_it_are_given(model_dir, tmp_path):
    """extract_index and validate_plots open every part (offsets, samples.jsonl line index: 16 bytes a
    sample, held); they asked for a fixed 1,000 and 2,000 MB, which 10^8 samples pass."""
    root = synthetic_extraction(tmp_path / "x", 2_000_000, 4, 8, [1], tokens=(1, 2))
    extraction = open_extraction(root)
    held = sum(part.offsets.nbytes + part.samples._starts.nbytes for part in extraction.parts)
    assert held >= resources.OPENED_SAMPLE_BYTES * extraction.n_samples > 0
    config = tiny.make_config(tmp_path, model_dir("gpt2"), sparse_jsonl(tmp_path / "big.jsonl", 9 * 10**9))
    rows = resources.workload(config).rows
    assert rows > 10**8
    for base in (resources.WRITER_BASE_MB, resources.PLOTS_BASE_MB):
        assert resources.opened_extraction_mb(config, base) >= base + resources.OPENED_SAMPLE_BYTES * rows / 1e6
    rules = (ROOT / "rules" / "extract.smk").read_text() + (ROOT / "rules" / "validate.smk").read_text()
    assert len(re.findall(r"mem_mb=lambda wildcards, attempt: actstore_resources.opened_extraction_mb\(", rules)) == 2


def test_the_saev_finisher_is_timed_for_the_masks_it_labels(model_dir, tmp_path, monkeypatch):
    """With saev.patch_labels the finishing job runs every image's mask through the model's processor
    (labels.bin); its runtime was a fixed 30 minutes, which COCO-Stuff's 164k masks (~14 min measured
    at MASK_SECONDS / 2) and larger mask sets pass."""
    import dataclasses

    images, masks, _ = tiny.write_segmentation_folder(tmp_path / "seg", (4, 4), (8, 8), n_images=2)
    plain = tiny.make_config(tmp_path, model_dir("dinov2"), images)
    labelled = tiny.make_config(tmp_path, model_dir("dinov2"), images, saev={"patch_labels": {"masks": str(masks)}})
    assert resources.saev_runtime(plain) == resources.saev_runtime(labelled) == resources.SAEV_FINISH_MIN
    coco = dataclasses.replace(resources.workload(labelled), rows=164_000 * 4)  # COCO-Stuff's, four times over
    monkeypatch.setattr(resources, "workload", lambda config: coco)
    assert resources.saev_runtime(labelled) >= coco.rows * resources.MASK_SECONDS / 60 > resources.SAEV_FINISH_MIN
    assert resources.saev_runtime(plain) == resources.SAEV_FINISH_MIN
    rules = (ROOT / "rules" / "saev.smk").read_text()
    assert "runtime=lambda wildcards, attempt: actstore_resources.saev_runtime(config, attempt)" in rules


def test_lut_budgets_given_twice_are_refused_at_load(model_dir, tmp_path):
    """A budget listed twice was evaluated twice and listed twice in report.json's budgets, once in its
    per-budget map."""
    import pytest

    from actstore.config import load_config
    from actstore.errors import ConfigError

    config = tiny.make_config(tmp_path, model_dir("gpt2"), tmp_path / "data.jsonl")
    path = tiny.save_config({**config, "lut": {**config["lut"], "budgets": [0, 8, 8]}}, tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match="budgets"):
        load_config(path)
