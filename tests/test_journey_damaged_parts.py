"""Review 65, journey F: a run cut short, a disk not what it seems. Faults found by damaging real stores."""
from __future__ import annotations

import json
import shutil

import pytest

import tiny
from actstore.datasets import configured_scan, write_scan
from actstore.errors import FormatError
from actstore.extract import run_part
from actstore.formats import extract as ex
from actstore.formats import pickle as ps
from actstore.formats import zarr as zs
from actstore.model_config import model_params, read_model_config


@pytest.fixture(scope="module")
def damaged_part(extracted, tmp_path_factory):
    """A copy of a finished extraction whose part 1 has one flipped bit in a layer's rows (a disk's damage,
    same size, same mtime order): verify names it; the part opens, as a reader's cheap checks allow."""
    config, extract_dir = extracted("gpt2")
    copy = tmp_path_factory.mktemp("damaged") / extract_dir.name
    shutil.copytree(extract_dir, copy)
    npy = copy / "part-0001" / "layer_000.npy"
    data = bytearray(npy.read_bytes())
    data[len(data) // 2] ^= 0x01
    npy.write_bytes(data)
    assert any("part-0001/layer_000.npy" in p for p in ex.verify(copy))
    return config, copy / "part-0001"


def test_pickle_writer_refuses_a_part_whose_bytes_differ_from_part_json(damaged_part, tmp_path):
    """`snakemake --forcerun pickle_machines` (README: how to redo a damaged format) over a part one bit
    of which a disk flipped wrote the flipped value into the pickle shard and recorded that shard's
    sha256: `actstore verify` then says OK and the store's readers return the wrong vector. Only the
    validate stage (not run by `snakemake pickle`) names the part. A writer reads every byte of the part
    anyway, so the part's recorded sha256 can be checked as it reads."""
    config, part_dir = damaged_part
    out = tmp_path / "machine-0001"
    params = model_params(read_model_config(config["model"]["path"]))
    with pytest.raises(FormatError, match="layer_000.npy"):
        ps.write_machine(part_dir, out, model_params=params, progress=False)
    assert not out.exists()


def test_zarr_writer_refuses_a_part_whose_bytes_differ_from_part_json(damaged_part, tmp_path):
    """The same damage through `zarr_shards`: the shard store holds the flipped value (float16-rounded) and
    records its own checksums over it, so verify of the zarr stage passes."""
    _, part_dir = damaged_part
    out = tmp_path / "shard-0001.zarr"
    with pytest.raises(FormatError, match="layer_000.npy"):
        zs.write_shard(part_dir, out)
    assert not out.exists()



def test_a_part_refuses_a_scan_whose_row_count_is_not_the_datas(model_dir, text_jsonl, tmp_path):
    """dataset_scan.json is kept (skipped by verify) so that a lost part is redone from it. Its
    `n_samples` edited from 60 to 56 in a finished run (the data untouched, so its stamps still match)
    and the lost last part redone by the README's command: Snakemake, seeing the scan newer, redid every
    part from it, and the extraction, every format and validate held rows 0..55 of 60 with `verify` OK
    and `n_dataset_samples` 56 everywhere: four rows silently gone. The scan now carries a seal over
    its content (datasets.scan.write_scan), so a part's job refuses the edited scan, naming it."""
    config = tiny.make_config(tmp_path, model_dir("gpt2"), text_jsonl)
    edited = tmp_path / "dataset_scan.json"
    write_scan(configured_scan(config), edited)
    record = json.loads(edited.read_text())
    edited.write_text(json.dumps({**record, "n_samples": record["n_samples"] - 4}))
    last = config["extract"]["parts"] - 1
    with pytest.raises(FormatError, match=f"{edited}: edited since it was written.*forcerun extract_scan"):
        run_part(config, last, tmp_path / "part", progress=False, scan=edited)
    assert not (tmp_path / "part").exists()
