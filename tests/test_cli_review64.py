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
