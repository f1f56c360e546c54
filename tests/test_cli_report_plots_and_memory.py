"""Review 61 of the `actstore` command (cli.py) and the report's plots (report.py), on real stores and a
real SAE stage the project's own writers build."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from actstore import cli
from actstore.formats import lmprobe

HOOK = "encoder.layer.1.attention.self.query:input"
SAE = {"num_basis": 64, "k_active": 4, "steps": 20, "batch_size": 64, "lr": 0.003, "dead_tokens": 2000}


def actstore(*args: str) -> subprocess.CompletedProcess:
    """`actstore ARGS` through its entry point, cli.main, in this process (an exit as the command's code)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess(["actstore", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def lmprobe_stage(extracted, tmp_path_factory) -> Path:
    """An lmprobe store written where the workflow puts one: {dump_to}/lmprobe/<hash>/."""
    _, extract_dir = extracted("bert")
    root = tmp_path_factory.mktemp("cli61") / "dump" / "lmprobe" / ("ab" * 32)
    lmprobe.write_dataset(extract_dir, root, {}, progress=False)
    return root


@pytest.fixture(scope="module")
def sae_stage(extracted, tmp_path_factory) -> Path:
    """A trained SAE's stage directory, {dump_to}/sae/<hash>/, as the sae stage writes it."""
    from actstore.sae import build_sae

    config, extract_dir = extracted("bert", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    config["sae"].update(SAE, device="cpu")
    out = tmp_path_factory.mktemp("cli61sae") / "dump" / "sae" / ("cd" * 32)
    build_sae(config, extract_dir, out, progress=False)
    return out


@pytest.mark.parametrize("stage", ["lmprobe", "sae"])
def test_verify_of_a_stage_directory_that_does_not_exist_is_an_unknown_path(lmprobe_stage, stage):
    """A stage directory's path with a mistyped hash (or a run's that was deleted) verified as a stage whose
    store is gone: "N problem(s)", exit 1, as if it were a damaged store. It is an unknown path: exit 2,
    named, as `inspect` and any other missing path are."""
    missing = lmprobe_stage.parent.parent / stage / ("ef" * 32)
    proc = actstore("verify", str(missing))
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stdout
    assert f"actstore: {missing}: no such file or directory" in proc.stderr


def test_the_sae_plot_shows_an_imported_saes_held_out_fvu(sae_stage, tmp_path):
    """An imported SAE's report has no training curve (loss_curve []) but a held-out FVU: the plot drew the
    line only beside a curve, so the report showed an empty figure, the FVU the stage measured left out."""
    from actstore import report

    imported = json.loads((sae_stage / "report.json").read_text())
    imported["loss_curve"] = []  # what sae.stage writes for an imported SAE
    assert imported["heldout"]["fvu"] is not None
    unmeasured = copy.deepcopy(imported)
    unmeasured["heldout"]["fvu"] = None
    report.sae_loss({"sae": imported}, tmp_path / "imported.png")
    report.sae_loss({"sae": unmeasured}, tmp_path / "unmeasured.png")
    assert (tmp_path / "imported.png").read_bytes() != (tmp_path / "unmeasured.png").read_bytes()


def test_inspect_prints_the_logits_a_store_holds_as_nan(text_jsonl, tmp_path):
    """`actstore inspect` prints what a store lost when it lost any: its NaN activations, not its NaN logits
    (non_finite_logits_count, counted since), which the text summary left out; --json showed them."""
    import tiny
    from actstore.extract import run_part
    from actstore.formats.extract import write_index

    from test_extract_xlnet_and_masked_logprobs import phi_with_head_bias

    model = phi_with_head_bias(tmp_path / "model", float("nan"))
    config = tiny.make_config(tmp_path, model, text_jsonl,
                              extract={"parts": 1, "layers": [0], "token_logprobs": False, "logits_topk": 5})
    store = tmp_path / "extract"
    counted = run_part(config, 0, store / "part-0000", progress=False)["non_finite_logits_count"]
    write_index(store, store / "extract.json")
    proc = actstore("inspect", str(store))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(actstore("inspect", "--json", str(store)).stdout)["non_finite_logits_count"] == counted > 0
    assert f"non_finite_logits_count {counted}" in proc.stdout.splitlines()


def test_peak_memory_counts_what_the_block_held_at_its_end_and_ends_with_it():
    """PeakMemory sampled only in its thread, every `interval`: memory taken after the last sample and held to
    the block's end was left out of `peak`, and the block's end waited out the thread's sleep (up to a whole
    interval). The end takes a last sample and stops the thread at once."""
    import os
    import time

    import numpy as np

    from actstore.memwatch import PeakMemory

    with PeakMemory([os.getpid()], interval=5) as watch:
        time.sleep(0.3)  # the thread's first sample is taken
        held = np.ones(50 * 2**20)  # 400 MiB, written: anonymous memory
        ended = time.monotonic()
    waited = time.monotonic() - ended
    assert watch.peak.anonymous >= held.nbytes and waited < 1, (watch.peak, waited)


def test_the_norm_plot_names_the_tokens_the_model_computed_as_nan(model_dir, text_jsonl, tmp_path, monkeypatch):
    """A layer holding the model's own NaN (counted in part.json since review 60) had a NaN norm for those
    tokens, and a box of NaN statistics is not drawn: the layer's box vanished from the report without a
    word. The finite norms are drawn and the layer's label says how many tokens were left out."""
    import numpy as np

    import tiny
    from actstore import report
    from actstore.extract import run_part
    from actstore.formats.extract import open_extraction, write_index

    from test_extract_non_finite_activations import nan_bert

    config = tiny.make_config(tmp_path, nan_bert(model_dir, tmp_path / "nan-bert"), text_jsonl,
                              extract={"parts": 1, "layers": [0, 1]})
    store = tmp_path / "extract"
    run_part(config, 0, store / "part-0000", progress=False)
    write_index(store, store / "extract.json")
    extraction = open_extraction(store)
    nan_tokens = int((~np.isfinite(np.load(store / "part-0000" / "layer_001.npy"))).any(axis=1).sum())
    assert nan_tokens > 0
    drawn = {}
    monkeypatch.setattr(report, "_save", lambda fig, path: drawn.setdefault("labels", [
        tick.get_text() for tick in fig.axes[0].get_xticklabels()]))
    report.activation_norms(extraction, tmp_path / "norms.png")
    assert drawn["labels"] == ["0", f"1\n({nan_tokens} non-finite)"]


@pytest.mark.parametrize(("report", "named"), [("[1, 2]", "holds list [1, 2], not a report's JSON object"),
                                               ('"trained"', "holds str 'trained', not a report's JSON object"),
                                               ('{"heldout": 0.5}', "heldout 0.5 is not an object of measures")])
def test_an_sae_report_of_another_shape_is_named_with_its_field(sae_stage, tmp_path, report, named):
    """report.json of another shape (`heldout` a number, the report a list) was an AttributeError traceback,
    exit 1: now exit 2, the report and its field named."""
    directory = tmp_path / "sae" / sae_stage.name
    shutil.copytree(sae_stage, directory)
    (directory / "report.json").write_text(report)
    proc = actstore("inspect", str(directory))
    assert proc.returncode == 2 and f"{directory / 'report.json'}: {named}" in proc.stderr, proc.stderr


def test_available_memory_is_none_where_meminfo_lists_none(tmp_path, monkeypatch):
    """A /proc/meminfo without MemAvailable (kernels before 3.14) raised StopIteration out of the benches,
    where the docstring promises None."""
    from actstore import memwatch

    monkeypatch.setattr(memwatch, "MEMINFO", tmp_path / "meminfo")
    memwatch.MEMINFO.write_text("MemTotal:       24000000 kB\nMemFree:        12000000 kB\n")
    assert memwatch.machine_available_gb() is None
    memwatch.MEMINFO.write_text("MemTotal:       24000000 kB\nMemAvailable:   2000000 kB\n")
    assert memwatch.machine_available_gb() == 2.0
