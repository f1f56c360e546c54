"""Review 66: a part lost from an extraction made before 2026-11-28 (its scan a temp file, gone) is redone
alone from a new scan only where the other parts were cut from the same data (rules/extract.smk part_scan,
datasets.scan.cut_from_scan): data edited since those parts redoes them too, and `--forcerun extract_scan`
still redoes every part. The part kept is test_journey_upgrade_review66.py's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import tiny
from test_workflow import job_counts, scheduled, snakemake


def recovered_extraction(tmp_path: Path, model_dir, text_jsonl: Path, edit_data: bool = False) -> tuple[Path, Path]:
    """(config file, extraction) of a two-part extraction left as releases before 2026-11-28 left it (no
    dataset_scan.json, no Snakemake metadata), its part-0001 lost and redone by the recovery command
    docs/recovery.md gives; with `edit_data`, a row of the data edited in place (same row count and labels)
    before that command."""
    data = Path(shutil.copy(text_jsonl, tmp_path / "docs.jsonl"))  # a dataset.path of its own: edited below
    off = {"enabled": False}
    config = tiny.make_config(tmp_path, model_dir("bert"), data, saev=off, pickle=off, lmprobe=off, zarr=off,
                              sae=off, lut=off, validate=off)
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    snakemake(tmp_path, configfile)
    extract_dir = next((Path(config["dump_to"]) / "extract").iterdir())
    (extract_dir / "dataset_scan.json").unlink()
    shutil.rmtree(tmp_path / ".snakemake" / "metadata")
    shutil.rmtree(extract_dir / "part-0001")
    if edit_data:
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        rows[0]["text"] = "Edited after the extraction. " + rows[0]["text"]
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    snakemake(tmp_path, configfile, str(extract_dir / "part-0001"))
    return configfile, extract_dir


def test_a_part_cut_from_data_edited_since_is_redone_with_the_lost_one(tmp_path, model_dir, text_jsonl):
    """Rows, row count and labels as before, text edited: part-0000 holds the old text's activations, part-0001
    (redone) the new text's. Keeping part-0000 would mix the two silently: it is redone."""
    configfile, _ = recovered_extraction(tmp_path, model_dir, text_jsonl, edit_data=True)
    assert scheduled(tmp_path, configfile).get("extract_part") == 1, "part-0000, cut from the old text, is kept"


def test_forcing_the_scan_still_redoes_every_part_of_a_recovered_extraction(tmp_path, model_dir, text_jsonl):
    """docs/recovery.md, Upgrading actstore: `--forcerun extract_scan` extracts every part again (to add what
    today's part.json records). After a recovery part-0000 is older than the new scan and kept by ancient(),
    which would stop the forced scan's rerun from reaching it."""
    configfile, _ = recovered_extraction(tmp_path, model_dir, text_jsonl)
    snakemake(tmp_path, configfile)
    assert scheduled(tmp_path, configfile) == {}
    forced = job_counts(snakemake(tmp_path, configfile, "-n", "--forcerun", "extract_scan"))
    assert forced.get("extract_part") == 2, forced
