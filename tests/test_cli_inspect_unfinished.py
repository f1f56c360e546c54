"""`actstore inspect` of an extraction still running, or cut short: its parts so far, said so."""
from __future__ import annotations

import shutil

from actstore.formats.extract import synthetic_extraction
from actstore.formats.extract.layout import INDEX, part_dirname
from test_cli import actstore


def test_inspect_of_an_extraction_without_extract_json_says_it_is_unfinished(tmp_path):
    """Parts finish in any order (one Slurm job each) and extract.json comes after the last: inspect of
    an extraction lacking part 0 said it held no known format, and one lacking other parts summarised
    them as the whole, counts and all, without a word."""
    root = synthetic_extraction(tmp_path / "x", 1 << 16, 3, 8, [1], tokens=(4, 16))
    whole = actstore("inspect", str(root))
    assert whole.returncode == 0 and "unfinished" not in whole.stdout
    examples = int(next(line.split()[1] for line in whole.stdout.splitlines() if line.startswith("n_examples")))
    (root / INDEX).unlink()
    shutil.rmtree(root / part_dirname(0))
    cut = actstore("inspect", str(root))
    assert cut.returncode == 0, cut.stderr
    lines = dict(line.split(maxsplit=1) for line in cut.stdout.splitlines())
    assert lines["format"] == "actstore-extract" and int(lines["n_shards"]) == 2
    assert 0 < int(lines["n_examples"]) < examples
    assert lines["unfinished"].startswith(f"2 of 3 parts, no {INDEX}: still running or cut short")


def test_inspect_of_a_validate_stage_summarises_its_report(tmp_path):
    """A validate stage directory holds no format's store, only its report: inspect said it held "none of
    the known formats" (exit 2) where verify passed it. It prints the stores checked and their problems;
    a report without its stores is named, exit 2."""
    import json

    directory = tmp_path / "dump" / "validate" / ("ab" * 32)
    directory.mkdir(parents=True)
    report = {"coordinates": 7, "formats": {
        "saev": {"store": "saev/x", "checked": 7, "problems": []},
        "zarr": {"store": "zarr/y", "checked": 7, "problems": ["zarr/y/arrays/seq_len/0: missing"]}}}
    (directory / "report.json").write_text(json.dumps(report))
    done = actstore("inspect", str(directory))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["format      validate", "stores      saev, zarr", "coordinates 7",
                                        "problems    1"]
    summary = json.loads(actstore("inspect", "--json", str(directory)).stdout)
    assert summary["checked"]["zarr"] == report["formats"]["zarr"]
    (directory / "report.json").write_text(json.dumps({"coordinates": 7}))
    refused = actstore("inspect", str(directory))
    assert refused.returncode == 2 and "no 'formats' object of stores" in refused.stderr
