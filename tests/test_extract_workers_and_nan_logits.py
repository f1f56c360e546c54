"""Review 63 of the extraction's runtime (extract/): its inputs, hooks and write pipeline, on real tiny
models and real files."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from actstore.errors import ConfigError
from actstore.extract import inputs, preflight, run_part
from actstore.formats.extract import NON_FINITE_LOGITS_KEY
from actstore.models import load_image_processor, load_model


def test_a_decoding_worker_stuck_on_one_file_stops_the_job_naming_its_rows(model_dir, tmp_path, monkeypatch):
    """A file whose read never returns (a stalled network file system; here a FIFO no one writes, put in
    an image's place after the scan): its worker never hands the item over, and the DataLoader, with no
    timeout, waited for it for ever (a Slurm job held its GPU to the time limit). Now the wait is bounded
    and the error names the rows whose images were awaited."""
    folder = tiny.write_image_folder(tmp_path / "photos", per_class=2)
    config = tiny.make_config(tmp_path, model_dir("dinov2"), folder, extract={"parts": 1, "batch_size": 2})
    _, dataset = preflight(config, 0)
    stuck = dataset.samples[2]
    os.remove(folder / stuck.text)
    os.mkfifo(folder / stuck.text)
    monkeypatch.setattr(inputs, "ITEM_TIMEOUT_S", 2)
    got: dict[str, BaseException] = {}

    def consume() -> None:
        try:
            list(inputs.image_batches(load_image_processor(model_dir("dinov2")), dataset.opener, dataset.samples,
                                      [[0, 1], [2, 3]], 1, False, torch.float32))
        except BaseException as exc:  # noqa: BLE001 - checked below
            got["error"] = exc
    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(30)
    hung = thread.is_alive()
    if hung:  # release the worker: a writer opens the FIFO and closes it (an empty file)
        os.close(os.open(folder / stuck.text, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(60)
    assert not hung, "the image loader waited for ever on a worker that never returned"
    assert isinstance(got.get("error"), ConfigError)
    message = str(got["error"])
    assert f"{stuck.sample_idx} ({stuck.text})" in message and "2 s" in message, message


def test_nan_logits_with_the_sign_bit_set_are_ranked_first_and_counted(text_jsonl, tmp_path):
    """A NaN's sign bit is noise (x86 makes inf - inf and 0 * inf as -NaN): the top-k's key ranked a
    -NaN logit below -inf, so a head computing -NaN for tokens 200 on stored each row's finite logits
    as its top-k, counted no NaN and warned of none. torch.topk ranks every NaN first, and so now does
    the top-k, ties by lower id."""
    model = tiny.build_family("phi", tmp_path / "model")
    loaded = load_model(model)
    negative_nan = -torch.tensor(float("nan"))
    assert torch.signbit(negative_nan)
    with torch.no_grad():
        loaded.model.lm_head.bias[200:] = negative_nan
    loaded.model.save_pretrained(model)
    config = tiny.make_config(tmp_path, model, text_jsonl,
                              extract={"parts": 1, "layers": [0], "token_logprobs": False, "logits_topk": 3})
    meta = run_part(config, 0, tmp_path / "part", progress=False)
    values, indices = (np.load(tmp_path / "part" / f"topk_{name}.npy") for name in ("values", "indices"))
    assert np.isnan(values).all() and (indices == [200, 201, 202]).all()
    assert meta[NON_FINITE_LOGITS_KEY] == values.size


def test_a_part_failing_after_its_image_workers_started_ends_them_while_its_error_is_held(model_dir, tmp_path):
    """The error's traceback keeps run_part's frame, which kept the image pipeline: its decoding workers
    lived on (a notebook keeps the last error) beside the next part run in the same process."""
    folder = tiny.write_image_folder(tmp_path / "photos", per_class=2)
    config = tiny.make_config(tmp_path, model_dir("dinov2"), folder, extract={
        "parts": 1, "num_workers": 2, "batch_size": 2, "hooks": ["embeddings.patch_embeddings:output"]})
    before = set(multiprocessing.active_children())
    with pytest.raises(ConfigError, match="patch_embeddings:output' produced shape") as held:
        run_part(config, 0, tmp_path / "part", progress=False)
    assert held.value is not None and set(multiprocessing.active_children()) <= before


def test_the_gpu_pipelines_batches_closed_before_the_first_stop_the_decoding_thread(model_dir, tmp_path,
                                                                                     monkeypatch):
    """run_part closes its image batches when it ends, failing before the first batch too (the weights
    did not load): a generator closed before it started ran nothing, so the decoding thread waited for
    room for ever, holding its GPU memory and its workers, for as long as the batches were referenced."""
    import actstore.extract.device_images as device_images
    from actstore.extract.device_images import DECODING_THREAD, device_image_batches

    monkeypatch.setattr(device_images, "AHEAD_BYTES", 1)  # room for one batch: the thread then waits
    folder = tiny.write_image_folder(tmp_path / "photos", per_class=3)
    config = tiny.make_config(tmp_path, model_dir("dinov2"), folder, extract={"parts": 1})
    _, dataset = preflight(config, 0)
    handed = device_image_batches(load_image_processor(model_dir("dinov2")), dataset.opener, dataset.samples,
                                  [[0, 1], [2, 3], [4, 5]], 0, torch.device("cpu"), torch.float32)
    handed.close()
    for _ in range(600):
        if not any(thread.name == DECODING_THREAD for thread in threading.enumerate()):
            break
        time.sleep(0.05)
    assert not any(thread.name == DECODING_THREAD for thread in threading.enumerate())
    assert handed is not None


def test_a_misspelt_hook_is_named_by_the_scan_job_with_what_its_module_holds(tmp_path):
    """extract.hooks "...mlp.downproj:input" passed `snakemake -n` and stopped each part's job (on Slurm,
    after its wait for a GPU), naming the path alone. The scan job, which runs once on a CPU before any
    part's, names it now, with the names the module it stops at holds; no part's job starts."""
    import subprocess
    import sys

    import yaml
    from test_workflow import REPO, demo_config

    config = demo_config(tmp_path / "dump")
    config["extract"]["hooks"] += ["encoder.layer.1.attention.outputt:output"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([str(Path(sys.executable).with_name("snakemake")), "-s", str(REPO / "Snakefile"), "-d",
                           str(tmp_path), "--configfile", str(tmp_path / "c.yaml"), "--cores", "2", "extract"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    logs = "".join(path.read_text() for path in (tmp_path / "dump" / "logs").rglob("*.log"))
    assert ("extract.hooks: module 'encoder.layer.1.attention.outputt' does not exist in BertModel; "
            "encoder.layer.1.attention holds self, output") in logs
    assert "Error in rule extract_scan" in done.stdout + done.stderr
    assert not list((tmp_path / "dump" / "logs").rglob("*part-*")) and not list((tmp_path / "dump").rglob("part-*"))
