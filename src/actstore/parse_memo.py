"""What a Snakefile parse learns from the data, learnt once by the main Snakemake process and handed
to the jobs it submits.

Every cluster job parses the Snakefile again, and a parse needs the dataset: the extract stage's
hash (dataset.identity: the size and mtime, or the sha256, of every data file), its format and size
(the resource requests) and its check. For ImageNet as an image folder that is a listing and a stat
of 1.28M files in every job (~30 s on a local disk, a metadata storm on a shared one); with
`identity: content`, the whole dataset read again in every job. And a job whose data changed after
the main parse would name its outputs by another hash than the one it was submitted for.

So while a Snakefile is parsed (`start`), each such fact is computed once (`remembered`); when the
main process starts running jobs, the Snakefile's onstart writes them to a file (`hand_over`) whose
path its jobs inherit in their environment (Slurm jobs through sbatch's --export=ALL), and a job's
parse takes the main process's facts from it, as does the stage config a rule's script records
(`main_process_facts`). Elsewhere outside a parse (rule scripts, the actstore command) every fact is
computed afresh: the extraction's scan checks the data against the stage's hash.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from actstore.io_utils import canonical_json, write_json_atomic

ENV = "ACTSTORE_PARSE_MEMO"  # the handed file's path, in the environment of the main process's jobs
VERSION = 1


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0  # not a bool, which JSON's true gives back


# The facts a parse remembers, by their callers' names, and whether a value is one as JSON gives it
# back: a handed file with any other fact is damaged or another actstore's, and a job taking its
# values would fail far from here (resources, hashing) or name its outputs by a wrong hash.
FACTS: dict[str, Callable[[Any], bool]] = {
    "dataset checked": lambda value: value is None,
    "dataset identity": lambda value: isinstance(value, dict) and all(isinstance(v, str) for v in value.values()),
    "dataset size": lambda value: isinstance(value, list) and len(value) == 3 and all(map(_count, value)),
    "dataset scan processes": _count,
}

_memo: dict[str, Any] | None = None  # None: not in a Snakefile parse
_handed: dict[str, Any] = {}         # a job's: the main process's facts
_written: Path | None = None         # the main process's: the file it handed over


def start(main_process: bool) -> None:
    """From now on in this process, remember each fact; in a job (not the main process) whose
    environment names the main process's file, take the facts from it."""
    global _memo, _handed
    _memo, _handed = {}, {}
    path = os.environ.get(ENV)
    if not main_process and path:
        _handed = _read(Path(path))


@contextlib.contextmanager
def main_process_facts() -> Iterator[None]:
    """Within: each fact as the main process read it, from the file its environment names (else
    computed once, as in a job's parse); after, as before. For a rule's script whose output the
    main process named: workflow.record_stage."""
    global _memo, _handed
    before = _memo, _handed
    start(main_process=False)
    try:
        yield
    finally:
        _memo, _handed = before


def remembered(name: str, key: Any, compute: Callable[[], Any]) -> Any:
    """compute()'s value as JSON gives it back (one type, whoever computed it): the main process's
    when it handed one over for (name, key), else computed once per parse, or at each call outside one."""
    if name not in FACTS:  # a job would refuse every handed file holding it, and read the data again
        raise ValueError(f"parse_memo.FACTS has no check for the fact {name!r}")
    entry = f"{name} {canonical_json(key)}"
    if entry in _handed:
        return _handed[entry]
    if _memo is None:
        return json.loads(json.dumps(compute()))
    if entry not in _memo:
        _memo[entry] = json.loads(json.dumps(compute()))
    return _memo[entry]


def hand_over(directory: str | Path) -> Path | None:
    """Write the facts this parse remembered into `directory` and name the file in this process's
    environment, which the jobs it starts inherit; None when there is nothing to hand over."""
    global _written
    if not _memo:
        return None
    path = Path(directory).resolve() / f"{os.getpid()}-{time.time_ns()}.json"
    write_json_atomic(path, {"version": VERSION, "facts": _memo}, indent=None)
    os.environ[ENV] = str(path)
    _written = path
    return path


def withdraw() -> None:
    """Remove the file hand_over wrote (the run is over: no job will read it)."""
    global _written
    if _written is not None:
        os.environ.pop(ENV, None)
        _written.unlink(missing_ok=True)
        _written = None


def _read(path: Path) -> dict[str, Any]:
    """The facts of a handed file; none (each computed here, as without one) when it cannot be read or
    holds a fact that is not one of FACTS (nested too deep to parse, damaged, another actstore's)."""
    try:
        handed = json.loads(path.read_text())
        if handed.get("version") != VERSION or not isinstance(handed.get("facts"), dict):
            raise ValueError(f"not a version {VERSION} parse memo")
        for entry, value in handed["facts"].items():
            _check_fact(entry, value)
    except (OSError, ValueError, AttributeError, RecursionError) as err:
        print(f"actstore: {ENV}={path} cannot be read ({err}); the dataset is read again", file=sys.stderr)
        return {}
    print(f"actstore: the dataset as the main process read it: {path}", file=sys.stderr)
    return handed["facts"]


def _check_fact(entry: str, value: Any) -> None:
    """ValueError unless `entry` (remembered's "name key") names one of FACTS and `value` is one."""
    name = next((name for name in FACTS if entry.startswith(f"{name} ")), None)
    if name is None:
        raise ValueError(f"the fact {entry[:100]!r} is none that actstore remembers")
    if not FACTS[name](value):
        raise ValueError(f"the fact {entry[:100]!r} holds {json.dumps(value)[:100]}, not a {name} value")
