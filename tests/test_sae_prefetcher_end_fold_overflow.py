"""Review 57 of the sae stage, on real files and the real Prefetcher: a finite batch source ends the
Prefetcher (it waited forever), and an import whose folded weights overflow float32 is refused naming
the file and tensor (it was imported as an infinite SAE, written, and refused only at the lut stage)."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file

from actstore.errors import ConfigError, FormatError
from actstore.sae import Prefetcher, TopKSAE, import_sae, init_sae, train_steps

WAIT_S = 30  # far longer than a few CPU batches take; a hang is reported as one, not waited on forever


def outcome_within(consume: Callable[[Prefetcher], Any], source: Any) -> tuple[bool, Any]:
    """(finished, result or exception) of `consume` on a CPU Prefetcher of `source`, run on a daemon
    thread: a consumer that blocks forever fails the test instead of hanging the suite."""
    return finished_within(lambda: consume(Prefetcher(source, torch.device("cpu"))))


def finished_within(consume: Callable[[], Any]) -> tuple[bool, Any]:
    """(finished, result or exception) of `consume()` on a daemon thread, waited on WAIT_S."""
    done: list[Any] = []

    def run() -> None:
        try:
            done.append(consume())
        except BaseException as exc:
            done.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    return bool(done), done[0] if done else None


def test_prefetcher_ends_where_a_finite_source_ends():
    batches = [torch.full((2, 3), float(i)) for i in range(3)]
    finished, got = outcome_within(list, iter(batches))
    assert finished, "iterating a Prefetcher of a finite source never ended"
    assert [b.tolist() for b in got] == [b.tolist() for b in batches]


def test_prefetcher_stays_ended_and_re_raises_the_sources_error():
    """A later next() after the end, or after the source's error, raised again; it waited forever."""
    def twice(prefetcher: Prefetcher) -> list[str]:
        names = []
        for _ in range(2):
            try:
                next(prefetcher)
            except (StopIteration, ValueError) as exc:
                names.append(type(exc).__name__)
        return names

    finished, names = outcome_within(twice, iter([]))
    assert finished and names == ["StopIteration", "StopIteration"]

    def failing():
        raise ValueError("unreadable part")
        yield  # a generator

    finished, names = outcome_within(twice, failing())
    assert finished and names == ["ValueError", "ValueError"]


def saelens_weights(d_in: int = 4, d_sae: int = 8, **scales: float) -> dict[str, torch.Tensor]:
    """A SAELens checkpoint of finite float32 values, each tensor times scales[name] (default 1)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    return {name: torch.rand(shape, generator=g).add(0.5) * scales.get(name, 1.0) for name, shape in shapes.items()}


def test_import_refuses_a_b_dec_fold_that_overflows_float32(tmp_path):
    """b_enc - b_dec @ W_enc of finite weights past float32's range: the encoder bias was -inf."""
    path = tmp_path / "sae.safetensors"
    weights = saelens_weights(W_enc=1e20, b_dec=1e20)
    assert all(bool(t.isfinite().all()) for t in weights.values())
    save_file(weights, str(path))
    with pytest.raises(FormatError, match=rf"{path}: encoder_bias overflows float32 with b_dec"):
        import_sae(path, "saelens", k_active=2)


def test_import_refuses_a_decoder_norm_fold_that_overflows_float32(tmp_path: Path):
    """W_enc * |W_dec row| (SAELens' rescale_acts_by_decoder_norm) past float32's range: W_enc was inf."""
    save_file(saelens_weights(W_enc=1e37, W_dec=100.0), str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps({
        "architecture": "topk", "k": 2, "d_in": 4, "d_sae": 8, "apply_b_dec_to_input": False,
        "rescale_acts_by_decoder_norm": True, "metadata": {"sae_lens_version": "6.18.0"}}))
    with pytest.raises(FormatError, match=r"sae_weights\.safetensors: W_enc overflows float32 with "
                                          r"rescale_acts_by_decoder_norm"):
        import_sae(tmp_path, "saelens", k_active=2)


def test_train_steps_names_batches_that_end_before_sae_steps():
    """A finite source of fewer batches than sae.steps: a bare StopIteration (a hang before the
    Prefetcher ended)."""
    sae = TopKSAE(4, 8, 2)
    init_sae(sae, torch.zeros(4), seed=0)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
    cfg = {"steps": 5, "aux_k": None, "aux_coef": 1 / 32, "dead_tokens": 100, "lr": 1e-3}
    g = torch.Generator().manual_seed(0)
    with Prefetcher(iter([torch.randn(16, 4, generator=g) for _ in range(2)]), torch.device("cpu")) as batches:
        with pytest.raises(ConfigError, match=r"sae: the batches ended before step 3 of sae\.steps 5"):
            train_steps(sae, opt, batches, cfg, progress=False)
