"""Review 66, journey: "I upgrade actstore and my dump_to holds stores from earlier releases". Tried with
the stores 0f1c008 (2026-11-25), c545348 (2026-11-27) and bdb99a3 (2026-11-29) wrote for one config
enabling every stage (the demo model, 40 rows): with today's code `snakemake -n` has nothing to do,
every stage directory keeps its hash, `actstore verify`/`inspect`/`locate` pass them and the readers
return the extraction's values. A config that writes out a value a later release canonicalised gets
new stage directories (documented in docs/recovery.md, Upgrading actstore: no spelling gives the old
hash back). Found, fixed (review 66, helper-223): a part lost from an extraction made before 2026-11-28
(whose scan was a temp file, gone) was redone with every other part of it; today that part alone, where
the other parts were cut from the same data (rules/extract.smk part_scan, datasets.scan.cut_from_scan):
data edited since those parts redoes them too, and `--forcerun extract_scan` still redoes every part."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import tiny
from test_workflow import job_counts, scheduled, snakemake


@dataclass
class OldReleaseExtraction:
    """A two-part extraction as releases before 2026-11-28 left it in `workdir`, and a copy of that state in
    `as_left` that each case starts from (copy2 keeps the mtimes Snakemake and cut_from_scan compare)."""
    workdir: Path
    as_left: Path
    configfile: Path
    extract_dir: Path

    def recover(self, edit_data: bool = False) -> None:
        """The state as left, its part-0001 lost and redone by the recovery command docs/recovery.md gives;
        with `edit_data`, a row of the data edited in place (same row count and labels) before that command."""
        shutil.rmtree(self.workdir)
        shutil.copytree(self.as_left, self.workdir, symlinks=True)
        shutil.rmtree(self.extract_dir / "part-0001")  # the part lost after the upgrade
        if edit_data:
            data = self.workdir / "docs.jsonl"
            rows = [json.loads(line) for line in data.read_text().splitlines()]
            rows[0]["text"] = "Edited after the extraction. " + rows[0]["text"]
            data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        snakemake(self.workdir, self.configfile, str(self.extract_dir / "part-0001"))


@pytest.fixture(scope="module")
def old_release(tmp_path_factory, model_dir, text_jsonl) -> OldReleaseExtraction:
    """Releases up to c545348 (2026-11-27) declared the scan `temp(...)` (rules/extract.smk, rule
    extract_scan): Snakemake deleted it after the last part, so their extractions hold none. Their Snakemake
    metadata recorded the checksum of their own scan (other bytes: unsealed before 627fb18), which a rescan
    never matches; a scan of the same bytes would pass Snakemake's checksum check of a newer small input.
    No metadata is the same case."""
    workdir = tmp_path_factory.mktemp("old-release")
    data = Path(shutil.copy(text_jsonl, workdir / "docs.jsonl"))  # a dataset.path of its own: edited by a case
    off = {"enabled": False}
    config = tiny.make_config(workdir, model_dir("bert"), data, saev=off, pickle=off, lmprobe=off, zarr=off,
                              sae=off, lut=off, validate=off)
    configfile = tiny.save_config(config, workdir / "config.yaml")
    snakemake(workdir, configfile)
    extract_dir = next((Path(config["dump_to"]) / "extract").iterdir())
    (extract_dir / "dataset_scan.json").unlink()
    shutil.rmtree(workdir / ".snakemake" / "metadata")
    as_left = workdir.with_name(workdir.name + "-as-left")
    shutil.copytree(workdir, as_left, symlinks=True)
    return OldReleaseExtraction(workdir, as_left, configfile, extract_dir)


@pytest.fixture(scope="module")
def recovered(old_release) -> dict:
    """A plain run after the recovery: part-0000's part.json (mtime, bytes) before and after it; what a dry
    run then schedules, and one forcing the scan."""
    old_release.recover()
    part_json = old_release.extract_dir / "part-0000" / "part.json"
    before = (part_json.stat().st_mtime_ns, part_json.read_bytes())
    snakemake(old_release.workdir, old_release.configfile)
    return {"part-0000 before": before, "part-0000 after": (part_json.stat().st_mtime_ns, part_json.read_bytes()),
            "then": scheduled(old_release.workdir, old_release.configfile),
            "forced": job_counts(snakemake(old_release.workdir, old_release.configfile, "-n", "--forcerun",
                                           "extract_scan"))}


@pytest.mark.slow
def test_a_lost_part_of_an_extraction_from_before_the_kept_scan_is_redone_alone(recovered):
    """docs/recovery.md: `snakemake {dump_to}/extract/<hash>/part-0001` redoes that part alone from the kept
    scan. Found with a store 0f1c008 wrote: the scan job ran again, then the next plain run redid part-0000
    as well ("Updated input files: dataset_scan.json"), every part of a 64-part extraction to recover one.
    Now part-0000, cut from the data the new scan saw, keeps the scan as an ancient() input."""
    assert recovered["part-0000 after"] == recovered["part-0000 before"], "the kept part-0000 is redone too"


@pytest.mark.slow
def test_a_part_cut_from_data_edited_since_is_redone_with_the_lost_one(old_release):
    """Rows, row count and labels as before, text edited: part-0000 holds the old text's activations, part-0001
    (redone) the new text's. Keeping part-0000 would mix the two silently: it is redone."""
    old_release.recover(edit_data=True)
    assert scheduled(old_release.workdir, old_release.configfile).get("extract_part") == 1, \
        "part-0000, cut from the old text, is kept"


def test_forcing_the_scan_still_redoes_every_part_of_a_recovered_extraction(recovered):
    """docs/recovery.md, Upgrading actstore: `--forcerun extract_scan` extracts every part again (to add what
    today's part.json records). After a recovery part-0000 is older than the new scan and kept by ancient(),
    which would stop the forced scan's rerun from reaching it."""
    assert recovered["then"] == {}
    assert recovered["forced"].get("extract_part") == 2, recovered["forced"]
