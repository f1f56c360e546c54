"""SAE stage review 55, on real files: a diverged training run stops within two curve intervals, naming
its first non-finite step and loss (it ran every step first); a saev checkpoint is imported holding
its weights about 1.5 times, not twice (a copy of the file's bytes, isfinite's masks and a copy of
every weight into new parameters); the held-out evaluation's memory does not grow with num_basis
times 8,192 rows."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actstore.errors import ConfigError
from actstore.formats.extract import synthetic_extraction
from actstore.sae import init_sae, split_tokens, stream_batches, tensors, train_steps
from actstore.sae.model import TopKSAE
from actstore.sae.train import train_sae
from test_sae_training import CFG, extraction_of


def counted(batches):
    """`batches`, counting in `drawn` how many the training loop took."""
    def gen():
        for batch in batches:
            drawn[0] += 1
            yield batch
    drawn = [0]
    return gen(), drawn


@pytest.mark.parametrize("lr, scale, first", [(1e30, 1.0, 2), (0.003, 1e20, 1)])
def test_a_diverged_run_stops_within_two_curve_intervals_naming_its_first_step_and_loss(tmp_path, lr, scale, first):
    """An lr that diverges (or activations whose squares overflow float32) made every weight NaN by
    step 2; the run took all its batches (its GPU hours) before the error, read once at the end."""
    extraction = extraction_of(tmp_path / "x", scale=scale)
    arrays, split = tensors(extraction, "layer_1"), split_tokens(extraction, 0.2, seed=0)
    sae = TopKSAE(8, 32, 4)
    init_sae(sae, torch.zeros(8), seed=0)
    batches, drawn = counted(stream_batches(arrays, split.train, 64, np.random.default_rng(0)))
    cfg = dict(CFG, steps=1000, lr=lr)
    with pytest.raises(ConfigError, match=re.escape(f"not finite from step {first} of 1000 (loss nan")) as raised:
        train_steps(sae, torch.optim.Adam(sae.parameters(), lr=lr), batches, cfg, progress=False)
    stopped = int(re.search(r"stopped at step (\d+)", str(raised.value))[1])
    assert drawn[0] == stopped <= 2 * (1000 // 100)


def test_the_stage_names_the_step_a_diverged_run_stopped_at(tmp_path):
    with pytest.raises(ConfigError, match=r"not finite from step 2 of 500 \(loss nan, sae\.lr 1e\+30; stopped at "
                                          r"step 10\)"):
        train_sae(extraction_of(tmp_path / "x"), "layer_1", dict(CFG, steps=500, lr=1e30), progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_diverged_run_stops_early_through_the_pinned_copy(tmp_path):
    extraction = extraction_of(tmp_path / "x")
    arrays, split = tensors(extraction, "layer_1"), split_tokens(extraction, 0.2, seed=0)
    sae = TopKSAE(8, 32, 4)
    init_sae(sae, torch.zeros(8), seed=0)
    sae.cuda()
    source = (batch.cuda() for batch in stream_batches(arrays, split.train, 64, np.random.default_rng(0)))
    batches, drawn = counted(source)
    with pytest.raises(ConfigError, match=r"not finite from step 2 of 1000 \(loss nan"):
        train_steps(sae, torch.optim.Adam(sae.parameters(), lr=1e30), batches, dict(CFG, steps=1000, lr=1e30),
                    progress=False)
    assert drawn[0] <= 20
    finite = TopKSAE(8, 32, 4)
    init_sae(finite, torch.zeros(8), seed=0)
    finite.cuda()
    source = (batch.cuda() for batch in stream_batches(arrays, split.train, 64, np.random.default_rng(0)))
    seen, curve = train_steps(finite, torch.optim.Adam(finite.parameters(), lr=0.003), source,
                              dict(CFG, steps=200), progress=False)
    assert seen == 200 * 64 and curve[-1]["step"] == 200


# VmHWM, the process's peak resident memory: ru_maxrss keeps the parent's (pytest's) peak across exec.
PEAK = """
import re, sys, torch
from pathlib import Path
from actstore.sae import import_sae
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
torch.zeros(1) @ torch.zeros(1, 1)
before = peak()
sae = import_sae(sys.argv[1], "saev", 3)
print(peak() - before, sae.num_basis)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
def test_a_saev_import_holds_its_weights_about_one_and_a_half_times_not_twice(tmp_path):
    """A 128 MiB saev checkpoint peaked at 2x its size (its bytes read whole, then torch.load of them;
    isfinite's abs and masks, 1.8x a weight; each weight copied into a new parameter): now the
    weights as loaded and the encoder's transposed copy, [d_sae, d_in] as the LUT spec lays it."""
    d_in, d_sae = 512, 32768
    g = torch.Generator().manual_seed(0)
    state = {"W_enc": torch.randn(d_in, d_sae, generator=g), "b_enc": torch.randn(d_sae, generator=g),
             "W_dec": torch.randn(d_sae, d_in, generator=g), "b_dec": torch.randn(d_in, generator=g)}
    topk = {"cls": "TopK", "params": {"top_k": 3}}
    header = {"schema": 5, "cfg": {"d_model": d_in, "d_sae": d_sae, "activation": topk}}
    path = tmp_path / "sae.pt"
    with open(path, "wb") as fh:
        fh.write(json.dumps(header).encode() + b"\n")
        torch.save(state, fh)
    del state
    proc = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr
    peak, num_basis = map(int, proc.stdout.split())
    assert num_basis == d_sae and peak < 1.7 * path.stat().st_size


EVAL_PEAK = """
import re, sys, numpy as np, torch
from pathlib import Path
from actstore.formats.extract import open_extraction
from actstore.sae import evaluate, init_sae, tensors
from actstore.sae.model import TopKSAE
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
extraction = open_extraction(sys.argv[1])
sae = TopKSAE(8, 16384, 4)
init_sae(sae, torch.zeros(8), seed=0)
arrays, rows = tensors(extraction, "layer_1"), [np.arange(p.info.n_tokens) for p in extraction.parts]
before = peak()
held = evaluate(sae, arrays, rows)
print(peak() - before, held["n_tokens"])
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
def test_the_heldout_evaluation_of_many_latents_encodes_a_bounded_chunk_at_once(tmp_path):
    """8,192 held-out rows were encoded at once: 1 GB for 16,384 latents, 4 GB for 65,536, 64 GB for
    2^20, allocated after the whole training run (which a job's memory limit then killed)."""
    root = synthetic_extraction(tmp_path / "x", 8300 * 8 * 4, 1, 8, [1], tokens=(50, 100))
    proc = subprocess.run([sys.executable, "-c", EVAL_PEAK, str(root)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr
    peak, n_tokens = map(int, proc.stdout.split())
    assert n_tokens >= 8192 and peak < 8192 * 16384 * 4 / 2  # half one (8192, 16384) float32 array: 4 were made
