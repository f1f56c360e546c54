"""save_safetensors writes the bytes of the library's save with a canonical header, without holding the
file in memory; a damaged parse memo leaves a job to read the data itself, naming the file."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save

from actstore import parse_memo
from actstore.safetensors_io import LIBRARY_DTYPES, canonical_header, save_safetensors

DTYPES = [getattr(torch, name.removeprefix("torch.")) for name in LIBRARY_DTYPES]
NAMES = ["w", "W", "b", "a.b", "a_b", "a", "a0", "a10", "a9", "Z", "é", "z", "encoder.weight", "ü_ß"]


def library_file(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """What save_safetensors wrote before: the library's save, its header serialised again canonically."""
    raw = save(tensors, metadata=metadata)
    (length,) = struct.unpack("<Q", raw[:8])
    return canonical_header(json.loads(raw[8:8 + length])) + raw[8 + length:]


def random_tensors(generator: torch.Generator, count: int) -> dict[str, torch.Tensor]:
    """Tensors of every dtype written, scalars and 0-element ones among them, under names in no order."""
    tensors = {}
    for i in torch.randperm(len(NAMES), generator=generator)[:count].tolist():
        dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=generator))]
        shape = [[], [0], [3, 0], [1], [5], [2, 3], [4, 1, 3]][int(torch.randint(7, (1,), generator=generator))]
        values = torch.randint(0, 2 if dtype == torch.bool else 100, shape, generator=generator)
        tensors[NAMES[i]] = values.to(dtype)
    return tensors


def test_every_dtype_is_laid_out_as_the_library_lays_it(tmp_path):
    # One tensor of each dtype, of one width and of several: the library's order is its Dtype enum's.
    for shape in ([3], [0], []):
        tensors = {f"t{i}": torch.ones(shape, dtype=dtype) for i, dtype in enumerate(reversed(DTYPES))}
        save_safetensors(tensors, tmp_path / "t.safetensors", {"format": "pt"})
        assert (tmp_path / "t.safetensors").read_bytes() == library_file(tensors, {"format": "pt"})


def test_random_tensors_and_metadata_give_the_library_files_bytes(tmp_path):
    generator = torch.Generator().manual_seed(55)
    for case in range(200):
        tensors = random_tensors(generator, 1 + case % len(NAMES))
        metadata = {} if case % 7 == 0 else {f"k{(case * j) % 11}é": f"v {j}" for j in range(case % 5 + 1)}
        save_safetensors(tensors, tmp_path / "t.safetensors", metadata)
        assert (tmp_path / "t.safetensors").read_bytes() == library_file(tensors, metadata), (case, tensors)


def test_views_and_grad_tensors_give_their_own_bytes(tmp_path):
    big = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    tensors = {"rows": big[2:5], "bf": torch.arange(6, dtype=torch.bfloat16)[1:4],
               "grad": torch.ones(4, requires_grad=True), "scalar": torch.tensor(7, dtype=torch.int64),
               "flag": torch.tensor([True, False, True])}
    save_safetensors(tensors, tmp_path / "t.safetensors", {"format": "pt"})
    assert (tmp_path / "t.safetensors").read_bytes() == library_file(tensors, {"format": "pt"})


def test_a_non_contiguous_tensor_is_refused_as_the_library_refuses_it(tmp_path):
    tensors = {"t": torch.arange(6, dtype=torch.float32).reshape(2, 3).T}
    with pytest.raises(ValueError, match="non contiguous"):
        save(tensors)
    with pytest.raises(ValueError, match="'t' is not contiguous"):
        save_safetensors(tensors, tmp_path / "t.safetensors", {})


def test_metadata_other_than_text_is_refused_as_the_library_refuses_it(tmp_path):
    with pytest.raises(TypeError, match="not an instance of .str."):
        save({"t": torch.ones(2)}, metadata={"seed": 0})
    with pytest.raises(ValueError, match="t.safetensors: metadata 'seed': 0 is not text"):
        save_safetensors({"t": torch.ones(2)}, tmp_path / "t.safetensors", {"seed": 0})


PEAK = """
import sys, torch
from actstore.safetensors_io import save_safetensors

def peak() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))

tensors = {"w": torch.ones(2**25, dtype=torch.float32), "b": torch.ones(1000, dtype=torch.bfloat16)}
before = peak()
save_safetensors(tensors, sys.argv[1], {"format": "pt"})
print(peak() - before)
"""


def test_saving_holds_no_copy_of_the_file(tmp_path):
    # 128 MiB of tensors: the library's save and a copy of its bytes rose the peak by 2x the file.
    path = tmp_path / "t.safetensors"
    rise = int(subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True,
                              check=True).stdout)
    assert rise < 0.5 * path.stat().st_size, f"peak rose {rise / 2**20:.0f} MiB"


def job_facts(path, monkeypatch) -> dict:
    """The facts a job's parse takes from the handed file at `path` (the module's state restored after)."""
    monkeypatch.setattr(parse_memo, "_memo", None)
    monkeypatch.setattr(parse_memo, "_handed", {})
    monkeypatch.setenv(parse_memo.ENV, str(path))
    parse_memo.start(main_process=False)
    return parse_memo._handed


def test_a_memo_nested_too_deep_is_read_again_naming_the_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "memo.json"
    path.write_text('{"version": 1, "facts": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert job_facts(path, monkeypatch) == {}
    assert f"{parse_memo.ENV}={path} cannot be read" in capsys.readouterr().err


@pytest.mark.parametrize("name, value", [("dataset size", "12"), ("dataset size", [1, 2]),
                                         ("dataset size", [1, True, 0]), ("dataset scan processes", [4]),
                                         ("dataset scan processes", -1), ("dataset identity", {"data_stat": 3}),
                                         ("dataset checked", 0), ("dataset colour", None)])
def test_a_memo_holding_a_wrong_fact_is_read_again_naming_the_file(tmp_path, monkeypatch, capsys, name, value):
    key = json.dumps({"path": "data"}, separators=(",", ":"))
    good = {f"dataset size {key}": [10, 200, 0], f"dataset scan processes {key}": 1,
            f"dataset identity {key}": {"data_stat": "ab"}, f"dataset checked {key}": None}
    path = tmp_path / "memo.json"
    path.write_text(json.dumps({"version": 1, "facts": good}))
    assert job_facts(path, monkeypatch) == good  # the same memo with every fact right is taken
    path.write_text(json.dumps({"version": 1, "facts": {**good, f"{name} {key}": value}}))
    assert job_facts(path, monkeypatch) == {}
    err = capsys.readouterr().err
    assert f"{parse_memo.ENV}={path} cannot be read" in err and name in err


def test_a_fact_without_a_check_is_refused_where_it_is_remembered():
    with pytest.raises(ValueError, match="no check for the fact 'dataset colour'"):
        parse_memo.remembered("dataset colour", {"path": "data"}, lambda: 1)
