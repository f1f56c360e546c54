"""Review 59 of small leftovers: a pickle level refused where nothing is compressed, a JSON lines row
Python cannot read crashing the scan naming no line, and rule scripts whose first import
(actstore.workflow, before the rule's log is set up) could fail with no log written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from actstore.config import validate_config
from actstore.datasets import scan_dataset
from actstore.errors import ConfigError, FormatError
from actstore.formats import pickle as ps
from test_pickle import params_of


def _pickle_config(tmp_path: Path, text_jsonl: Path, **pickle) -> dict:
    return validate_config({"dump_to": str(tmp_path / "dump"), "model": {"path": "m"},
                            "dataset": {"path": str(text_jsonl)}, "pickle": pickle})


def test_the_schema_ignores_the_level_where_nothing_is_compressed(tmp_path, text_jsonl):
    """compression none with a level ISA-L lacks (a zlib config's 6) was refused, though that level is
    neither used, recorded nor hashed; a gzip shard's level is still checked."""
    assert _pickle_config(tmp_path, text_jsonl, compression="none", compresslevel=6)["pickle"]["compresslevel"] == 6
    with pytest.raises(ConfigError, match="pickle/compresslevel: 6 is greater than the maximum of 3"):
        _pickle_config(tmp_path, text_jsonl, compresslevel=6)


def test_the_writer_ignores_the_level_where_nothing_is_compressed(extracted, tmp_path, monkeypatch):
    """The store of compression none is the same at any level; a gzip shard's bad level is refused.
    created_at fixed (SOURCE_DATE_EPOCH): two writes on a loaded machine straddled a second."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    config, extract_dir = extracted("bert")
    part = extract_dir / "part-0000"
    stores = [tmp_path / f"level-{level}" for level in (1, 6)]
    for out, level in zip(stores, (1, 6)):
        ps.write_machine(part, out, model_params=params_of(config), compression="none", compresslevel=level,
                         shard_size_mb=0.01, progress=False)
    names = sorted(p.name for p in stores[0].iterdir())
    assert len(names) > 2 and names == sorted(p.name for p in stores[1].iterdir())
    assert all((stores[0] / n).read_bytes() == (stores[1] / n).read_bytes() for n in names)
    with pytest.raises(FormatError, match="compressor 'isal' with compresslevel 6"):
        ps.write_machine(part, tmp_path / "gzip", model_params=params_of(config), compresslevel=6, progress=False)


def test_a_number_python_will_not_read_is_named_with_its_line(tmp_path):
    """A whole number of over 4300 digits (sys.get_int_max_str_digits), in any field of a row, raised
    Python's bare ValueError from the scan (and a part's read), naming no file or line."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n' + '{"text": "b", "n": ' + "7" * 5000 + "}\n")
    with pytest.raises(ConfigError, match=r"data\.jsonl:2: cannot be read \(Exceeds the limit"):
        scan_dataset(path)


# A rule script's start, as Snakemake's `script:` runs it, where a library cannot be imported.
CHILD = """
import sys
from types import SimpleNamespace
sys.modules[{module!r}] = None  # built for another node's libraries: its import fails
from actstore.workflow import setup_logging
setup_logging(SimpleNamespace(log=[sys.argv[1]]))
import {module}
"""


@pytest.mark.parametrize("module", ["numpy", "pyarrow", "isal", "yaml"])
def test_a_library_that_cannot_be_imported_is_named_in_the_rules_log(tmp_path, module):
    """actstore.workflow imported numpy, pyarrow, isal and yaml before the script could set up its
    log: their import error went to Slurm's output and the rule's log was never written."""
    log = tmp_path / "rule.log"
    child = subprocess.run([sys.executable, "-c", CHILD.format(module=module), str(log)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 1
    assert f"ModuleNotFoundError: import of {module} halted" in log.read_text(), child.stderr[-2000:]
    assert child.stderr == "", child.stderr[-2000:]
