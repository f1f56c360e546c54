"""A rule's log file gets everything its script's process writes: native code's and subprocesses'
writes to file descriptor 2 (not only Python's sys.stderr), stdout, the traceback of an uncaught error,
a native crash's Python stack; and every script sets that up before the imports that can fail."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "workflow" / "scripts").glob("*.py"))

# A script's process as Snakemake's `script:` runs it: a `snakemake` object naming the rule's log.
CHILD = """
import os, subprocess, sys
from types import SimpleNamespace
from actstore.workflow import setup_logging
setup_logging(SimpleNamespace(log=[sys.argv[1]]))
print("python stderr", file=sys.stderr)
os.write(2, b"native fd 2\\n")
subprocess.run(["sh", "-c", "echo subprocess stderr >&2"], check=True)
print("python stdout")
{tail}
"""


def run_child(log: Path, tail: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD.format(tail=tail), str(log)], capture_output=True,
                          text=True, timeout=120)


def test_native_and_subprocess_writes_and_an_uncaught_error_go_to_the_rules_log(tmp_path):
    log = tmp_path / "rule.log"
    child = run_child(log, 'raise RuntimeError("uncaught")')
    assert child.returncode == 1
    text = log.read_text()
    for line in ("python stderr", "native fd 2", "subprocess stderr", "python stdout", "RuntimeError: uncaught"):
        assert line in text, (line, text)
    assert text.index("native fd 2") < text.index("python stdout") < text.index("Traceback")  # in the order written
    assert child.stdout == child.stderr == "", (child.stdout, child.stderr)  # nothing left for Slurm's log


def test_a_crash_in_native_code_leaves_its_python_stack_in_the_rules_log(tmp_path):
    log = tmp_path / "rule.log"
    child = run_child(log, "import faulthandler; faulthandler._sigsegv()")
    assert child.returncode != 0
    assert "Segmentation fault" in log.read_text() and "<string>" in log.read_text()


def imports_before_setup(script: Path) -> list[str]:
    """The modules `script` imports before its setup_logging(snakemake) call."""
    modules = []
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "setup_logging":
            return modules
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules.append(node.module)
    raise AssertionError(f"{script.name} never calls setup_logging(snakemake)")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_script_logs_before_importing_what_can_fail(script):
    """torch, CUDA, the model code: an import's error would otherwise miss the rule's log."""
    early = [m for m in imports_before_setup(script)
             if m != "actstore.workflow" and m.split(".")[0] not in sys.stdlib_module_names]
    assert early == [], (script.name, early)
