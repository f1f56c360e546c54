"""Review 66, journey: "I upgrade actstore and my dump_to holds stores from earlier releases". Tried with
the stores 0f1c008 (2026-11-25), c545348 (2026-11-27) and bdb99a3 (2026-11-29) wrote for one config
enabling every stage (the demo model, 40 rows): with today's code `snakemake -n` has nothing to do,
every stage directory keeps its hash, `actstore verify`/`inspect`/`locate` pass them and the readers
return the extraction's values. A config that writes out a value a later release canonicalised gets
new stage directories (documented in docs/recovery.md, Upgrading actstore: no spelling gives the old
hash back). Found, fixed (review 66, helper-223): a part lost from an extraction made before 2026-11-28
(whose scan was a temp file, gone) was redone with every other part of it; today that part alone
(rules/extract.smk part_scan; the other cases in test_lost_part_review66.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import tiny
from test_workflow import scheduled, snakemake


def test_a_lost_part_of_an_extraction_from_before_the_kept_scan_is_redone_alone(tmp_path, model_dir, text_jsonl):
    """docs/recovery.md: `snakemake {dump_to}/extract/<hash>/part-0001` redoes that part alone from the kept
    scan. Releases up to c545348 (2026-11-27) declared the scan `temp(...)` (rules/extract.smk, rule
    extract_scan), so Snakemake deleted it after the last part: their extractions hold none. Found with a
    store 0f1c008 wrote: the scan job ran again, then the next plain run redid part-0000 as well ("Updated
    input files: dataset_scan.json"), every part of a 64-part extraction to recover one. Now part-0000,
    cut from the data the new scan saw, keeps the scan as an ancient() input (datasets.scan.cut_from_scan)."""
    off = {"enabled": False}
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, saev=off, pickle=off, lmprobe=off,
                              zarr=off, sae=off, lut=off, validate=off)
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    snakemake(tmp_path, configfile)
    extract_dir = next((Path(config["dump_to"]) / "extract").iterdir())
    (extract_dir / "dataset_scan.json").unlink()  # as the releases before b04f8aa left it
    # Their Snakemake metadata recorded the checksum of their own scan (other bytes: unsealed before
    # 627fb18), which a rescan never matches; a scan of the same bytes would pass Snakemake's checksum
    # check of a newer small input. No metadata is the same case.
    shutil.rmtree(tmp_path / ".snakemake" / "metadata")
    shutil.rmtree(extract_dir / "part-0001")  # the part lost after the upgrade
    snakemake(tmp_path, configfile, str(extract_dir / "part-0001"))
    assert "extract_part" not in scheduled(tmp_path, configfile), "the kept part-0000 is redone too"
