"""The LUT stage's memory at scale: build_tables makes each target's tables when write_lut asks for them,
and write_lut writes and drops each before the next is made (one target's tables held, not every
target's: GBs each at 65k latents); the bytes are those of a dict of the same tables."""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import numpy as np
import pytest
import torch
from torch import nn

from actstore import resources
from actstore.errors import ConfigError, FormatError
from actstore.formats.lut import open_lut, precompute, verify, write_lut
from actstore.lut import build_tables, relative_errors
from actstore.lut_runtime import install_luts
from test_lut_install_hostile_inputs import BASIS, D_IN, K, sae_state
from tiny import traced_peak

OUTS = {"a": 24, "b": 40, "c": 8}  # three widths; b without a bias


class Targets(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(D_IN, out, bias=name != "b") for name, out in OUTS.items())


def lut_config(dtype: str = "float16") -> dict:
    return {"lut": {"targets": list(OUTS), "dtype": dtype}}


def files_of(lut) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(lut.iterdir())}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_streamed_tables_are_the_bytes_of_a_dict_of_them(tmp_path, monkeypatch, dtype):
    """build_tables' pairs, written one at a time, give the lut/ directory a dict of every target's
    tables (as build_tables returned before) gave, byte for byte: names, order, metadata, sha256."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    torch.manual_seed(0)
    model, sae = Targets(), sae_state()
    held = {path: precompute(sae, linear.weight.detach().T, None if linear.bias is None else linear.bias.detach(),
                             dtype, path) for path, linear in ((p, getattr(model, p)) for p in OUTS)}
    whole = write_lut(tmp_path / "dict", held, K, {"model_type": "tiny"}, {"hook": "h"})
    streamed = write_lut(tmp_path / "pairs", build_tables(lut_config(dtype), model, sae), K,
                         {"model_type": "tiny"}, {"hook": "h"})
    assert files_of(streamed) == files_of(whole)
    assert sorted(files_of(streamed)) == ["a.lut.safetensors", "b.lut.safetensors", "c.lut.safetensors",
                                          "metadata.json"]
    assert verify(streamed) == []


def numpy_tables(n_targets: int, basis: int = 512, out: int = 1024) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """n_targets' tables made one at a time in numpy's memory (tracemalloc sees numpy's, not torch's)."""
    for i in range(n_targets):
        arrays = {"encoder_weight": (basis, D_IN), "encoder_bias": (basis,), "decoder_weight": (basis, D_IN),
                  "decoder_bias": (D_IN,), "precomputed_products": (basis, out), "bias_product": (out,)}
        yield f"t{i}", {key: torch.from_numpy(np.full(shape, i + 1, np.float16)) for key, shape in arrays.items()}


def test_writing_n_targets_holds_one_targets_tables_not_n(tmp_path, monkeypatch):
    """write_lut took a dict of every target's tables, so the stage held them all before the first
    file was written (32 o_proj targets of a 65k-latent SAE on d 4096: 50 GB). Given pairs, its peak is
    one target's tables and the checks' reads, whatever their number; a dict of them, N targets'."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    n = 16
    one = sum(t.nbytes for t in next(numpy_tables(1))[1].values())
    _, one_peak = traced_peak(lambda: write_lut(tmp_path / "one", numpy_tables(1), K))
    streamed, peak = traced_peak(lambda: write_lut(tmp_path / "pairs", numpy_tables(n), K))
    held, held_peak = traced_peak(lambda: write_lut(tmp_path / "dict", dict(numpy_tables(n)), K))
    assert peak - one_peak < one / 2  # the sha256's 4 MiB reads apart: one target's tables, for 1 target or 16
    assert held_peak >= n * one
    assert files_of(streamed) == files_of(held)


def one_at_a_time(pairs: Iterable[tuple[str, dict[str, torch.Tensor]]], made: list[str]
                  ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """`pairs` passed on, each asked for only once every earlier pair's tensors were let go."""
    refs: list[weakref.ref] = []
    iterator = iter(pairs)
    while True:
        alive = [ref for ref in refs if ref() is not None]
        assert not alive, f"{len(alive)} tensors of {made[-1]!r} alive when the next target's were asked for"
        try:
            path, tensors = next(iterator)
        except StopIteration:
            return
        made.append(path)
        refs += [weakref.ref(t) for t in tensors.values()]
        yield path, tensors
        del tensors


def test_the_stage_builds_each_targets_tables_after_the_last_was_written(tmp_path):
    """build_lut's build_tables -> write_lut: no target's tables are made while another's are held."""
    torch.manual_seed(0)
    made: list[str] = []
    lut = write_lut(tmp_path, one_at_a_time(build_tables(lut_config(), Targets(), sae_state()), made), K)
    assert made == list(OUTS)
    assert verify(lut) == []


def test_relative_errors_load_one_targets_tables_at_a_time(tmp_path):
    """relative_errors' loop held the last target's tables (and their float32 copies) while the next
    loaded: two targets' at once."""
    torch.manual_seed(0)
    model = Targets()
    store = open_lut(write_lut(tmp_path, build_tables(lut_config(), model, sae_state()), K))
    refs: list[weakref.ref] = []
    load = store.load

    def watched(module_path: str) -> dict[str, torch.Tensor]:
        assert all(ref() is None for ref in refs), f"an earlier target's tables alive when {module_path} loads"
        tables = load(module_path)
        refs.extend(weakref.ref(t) for t in tables.values())
        return tables

    store.load = watched
    errors = relative_errors(store, model, torch.randn(64, D_IN), [0, D_IN])
    assert sorted(errors) == sorted(OUTS)
    assert all(errors[path][str(D_IN)]["relative_error"] < 1e-2 for path in OUTS)  # exact up to float16


def test_a_target_given_twice_is_refused_and_nothing_written(tmp_path):
    """A dict cannot hold a module path twice, pairs can: the second file replaced the first's."""
    tables = dict(build_tables(lut_config(), Targets(), sae_state()))
    with pytest.raises(FormatError, match=r"the tables of 'a' are given twice"):
        write_lut(tmp_path, iter([("a", tables["a"]), ("b", tables["b"]), ("a", tables["a"])]), K)
    assert not (tmp_path / "lut").exists()


def test_pairs_disagreeing_on_num_basis_are_refused_naming_the_target(tmp_path):
    tables = dict(build_tables(lut_config(), Targets(), sae_state()))
    narrow = {key: value[: BASIS // 2] if value.shape[0] == BASIS else value for key, value in tables["b"].items()}
    with pytest.raises(FormatError, match=rf"disagree on num_basis \[{BASIS // 2}, {BASIS}\] \('b' has"):
        write_lut(tmp_path, iter([("a", tables["a"]), ("b", narrow)]), K)
    assert not (tmp_path / "lut").exists()


def test_lut_memory_counts_every_targets_installed_products_on_the_host_only(tmp_path):
    """lut_table_bytes counted every target's 16-bit tables (6 bytes a value each) as if held at once
    by the build, which now holds one; the end-to-end evaluation does hold every target's products, in
    the float32 model's dtype, on the host unless lut.device is cuda: measured on a real install, each
    target adds at least twice its installed products (the concatenation copies them) there, none on a GPU."""
    torch.manual_seed(0)
    model = Targets()
    square = {"lut": {"targets": ["a"], "dtype": "float16"}}  # a's outputs at D_IN: the sizing's w.d
    model.a = nn.Linear(D_IN, D_IN)
    installed = install_luts(model, open_lut(write_lut(tmp_path, build_tables(square, model, sae_state()), K)))
    products = installed["a"].encoder.products.nbytes
    work = resources.Workload(rows=1, tokens=1, d=D_IN, n_tensors=1, weight_bytes=0, text_bytes=0, itemsize=4)

    def table_bytes(device: str, targets: int) -> int:
        config = {"sae": {"num_basis": BASIS}, "lut": {"device": device, "targets": [f"t{i}" for i in range(targets)]}}
        return resources.lut_table_bytes(config, work)

    assert table_bytes("cpu", 5) - table_bytes("cpu", 1) >= 4 * 2 * products
    assert table_bytes("auto", 5) == table_bytes("cpu", 5)  # auto may find no GPU
    assert table_bytes("cuda:0", 5) == table_bytes("cuda:0", 1)


def test_a_bad_creation_info_is_named_before_any_table_is_made(tmp_path):
    """A hand-made SAE checkpoint without a model name gave creation_info.source_model None, refused by
    the metadata check after every target's tables were built and written (GBs of work lost)."""
    made: list[str] = []
    pairs = one_at_a_time(build_tables(lut_config(), Targets(), sae_state()), made)
    with pytest.raises(FormatError, match=r"metadata.json: field 'creation_info.source_model' must be a string, "
                                          r"got None \(not written\)"):
        write_lut(tmp_path, pairs, K, {"model_type": "tiny"}, {"source_model": None})
    assert made == []
    assert not (tmp_path / "lut").exists()


def test_precompute_names_a_weight_of_another_input_width():
    """An nn.Linear weight not transposed ([out, in]) was a bare torch shape error naming no target."""
    linear = nn.Linear(D_IN, 24)
    with pytest.raises(ConfigError, match=r"^layers\.0\.q: w_target \[24, 16\] is not \[input_dim, output_dim\] "
                                          r"of the SAE's input_dim 16"):
        precompute(sae_state(), linear.weight.detach(), None, "float16", "layers.0.q")


def test_the_end_to_end_kl_of_near_equal_outputs_is_never_negative():
    """KL(original || LUT) is >= 0 token by token; float32 rounding put the KL of two near-equal
    distributions a few 1e-8 either side of 0, and report.json gave a kl_mean of -1.3e-8 at a budget
    that recovers the model. Each token's is at least 0, and equal outputs give exactly 0."""
    from actstore.lut import Comparison

    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(4, 16, 300, generator=gen) * 5
    nearly = reference + torch.randn(reference.shape, generator=gen) * 1e-6
    inputs = {"input_ids": torch.randint(0, 300, (4, 16), generator=gen), "attention_mask": torch.ones(4, 16)}
    near, equal = Comparison("causal"), Comparison("causal")
    near.add(reference, nearly, inputs)
    equal.add(reference, reference.clone(), inputs)
    assert near.result()["kl_mean"] >= 0
    assert equal.result()["kl_mean"] == 0

