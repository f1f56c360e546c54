"""lmprobe review 64: a layer not stored is the FormatError every reader raises; lmprobe.logits_topk on a
model without logits is refused; bfloat16 overflow is counted; an integer label -1 is never read as 'none'."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch

from actstore.errors import ConfigError, FormatError
from actstore.formats import lmprobe
from actstore.formats.extract import synthetic_extraction
from actstore.model_config import run_config
from test_lmprobe_verify_addressing import rewrite_index


def build(extracted, tmp_path: Path, kind: str = "gpt2", **options) -> Path:
    _, extract_dir = extracted(kind)
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, {"token_strings": False, **options}, progress=False)
    return out


@pytest.mark.parametrize("layer", [-1, 1, 3])
def test_a_layer_not_stored_is_a_format_error_naming_the_stored_layers(extracted, tmp_path, layer):
    """get/tokens/last_tokens/torch_dataset of a layer not stored raised a bare KeyError, where the saev,
    zarr and pickle readers raise FormatError naming the stored layers; the stored ones still read."""
    ds = lmprobe.open_dataset(build(extracted, tmp_path, storage="full_sequence"))
    assert ds.layers == [0, 2]
    message = f"layer {layer} not stored; layers are \\[0, 2\\]"
    for read in (lambda: ds.get(0, layer), lambda: ds.get(-1, layer, 0), lambda: ds.tokens(0, layer),
                 lambda: ds.last_tokens(layer), lambda: ds.torch_dataset([layer])):
        with pytest.raises(FormatError, match=message):
            read()
    assert np.array_equal(ds.get(-1, 2), ds.last_tokens(2)[-1])


def test_logits_topk_of_a_model_without_logits_is_refused_naming_the_key(extracted, tmp_path):
    """lmprobe.logits_topk on an encoder (extract.logits_topk is 20 by default for any model) was
    silently dropped: the dataset had no logits. Refused at parse time and by the writer, before any
    file; a causal LM's is taken, and an encoder's dataset without it is written."""
    config, extract_dir = extracted("bert")
    asked = {**config, "lmprobe": {**config["lmprobe"], "logits_topk": 3}}
    with pytest.raises(ConfigError, match="lmprobe.logits_topk: 3 asked for, but the extraction keeps no logits"):
        lmprobe.check_options(asked, run_config(asked["model"]))
    with pytest.raises(ConfigError, match="lmprobe.logits_topk: 3"):
        lmprobe.write_dataset(extract_dir, tmp_path / "ds", {"token_strings": False, "logits_topk": 3},
                              progress=False)
    assert not (tmp_path / "ds").exists() and list(tmp_path.iterdir()) == []
    lmprobe.check_options(config, run_config(config["model"]))
    gpt2_config, _ = extracted("gpt2")
    lmprobe.check_options({**gpt2_config, "lmprobe": {**gpt2_config["lmprobe"], "logits_topk": 3}},
                          run_config(gpt2_config["model"]))
    assert lmprobe.open_dataset(build(extracted, tmp_path, "bert", storage="pooled")).logits_desc is None


def test_bfloat16_overflow_is_counted_and_logged_as_torch_makes_it(tmp_path, caplog):
    """A float32 activation past bfloat16's largest finite value (by half a step) is stored as +-inf,
    as torch's cast makes it; float16's were counted and logged, bfloat16's passed unsaid. The count
    logged is exactly the infs the bfloat16 shards hold beyond the float32 shards' of the same rows."""
    values = np.array([3.3895e38, 3.39e38, 3.397e38, -3.40e38, np.inf, -np.inf, np.nan, 1.0], np.float32)
    bits, overflow = lmprobe.layout.from_float32(values, "bfloat16")
    cast = torch.from_numpy(values).to(torch.bfloat16)
    assert np.array_equal(bits, cast.view(torch.int16).numpy().view(np.uint16))
    assert overflow == int(torch.isinf(cast).sum()) - 2 == 2
    # scale near float32's largest: ~1% of values fall between bfloat16's largest and float32's
    extract = synthetic_extraction(tmp_path / "extract", 200_000, parts=2, dim=16, layers=[0], tokens=(4, 16),
                                   scale=3.4e38)
    options = {"token_strings": False, "storage": "full_sequence", "shard_bytes": 1 << 30}
    lmprobe.write_dataset(extract, tmp_path / "f32", options, progress=False)
    with caplog.at_level("WARNING", logger="actstore.formats.lmprobe.write"):
        lmprobe.write_dataset(extract, tmp_path / "bf16", {**options, "dtype": "bfloat16"}, progress=False)
    files = sorted(p.relative_to(tmp_path / "f32") for p in (tmp_path / "f32" / "tensors").glob("*.safetensors"))
    wide = sum(int(np.isinf(t).sum()) for rel in files for t in load_file(tmp_path / "f32" / rel).values())
    narrow = sum(int(torch.isinf(t).sum()) for rel in files for t in load_torch(tmp_path / "bf16" / rel).values())
    assert narrow - wide > 0
    assert f"lmprobe.dtype bfloat16: {narrow - wide} finite activations beyond +-3.3895e38" in caplog.text


def test_an_integer_label_minus_one_is_never_read_as_no_label(extracted, tmp_path):
    """labels gives -1 to a row without a label. Another writer's integer label column (no label_id)
    holding both -1 (a binary task's -1/1 classes) and nulls read both as -1, silently: refused, naming
    the column. -1 without a null is the label itself; actstore's label_id tells any -1 apart."""
    root = build(extracted, tmp_path, storage="pooled")
    index = lmprobe.find_index(root)
    table = pq.read_table(index).drop_columns(["label_id"])
    n = table.num_rows
    classes = [-1 if i % 3 == 0 else 1 for i in range(n)]
    position = table.schema.get_field_index("label")
    field = pa.field("label", pa.int32())
    rewrite_index(root, table.set_column(position, field, pa.array(classes, pa.int32())))
    assert lmprobe.open_dataset(root).labels.tolist() == classes
    rewrite_index(root, table.set_column(position, field, pa.array([None] + classes[1:], pa.int32())))
    with pytest.raises(FormatError, match="column 'label' holds both nulls and the label -1"):
        lmprobe.open_dataset(root).labels
    rewrite_index(root, table.set_column(position, field, pa.array([None, *[2] * (n - 1)], pa.int32())))
    assert lmprobe.open_dataset(root).labels.tolist() == [-1] + [2] * (n - 1)


def test_a_descriptor_naming_more_files_than_the_dataset_holds_is_named_not_enumerated(extracted, tmp_path):
    """A 64 KB index naming 1000 layers x 1000 shards had verify list, check and report each of its 10^6
    file names (36 s and 400 MB; 10^8 in a few hundred KB, hours and gigabytes): one problem names the
    descriptor and both counts, and the checks of the index still run."""
    import json

    root = build(extracted, tmp_path, storage="pooled")
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    metadata = dict(table.schema.metadata)
    tensors = json.loads(metadata[b"lmprobe:tensors"])
    tensors["hidden_layers"]["layers"] = list(range(1000))
    tensors["hidden_layers"]["shards"] = [{"num_prompts": 0}] * 999 + [{"num_prompts": table.num_rows}]
    metadata[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    rewrite_index(root, table.replace_schema_metadata(metadata))
    held = sum(1 for path in root.rglob("*") if path.is_file())
    problems = lmprobe.verify(root)
    assert f"{index}: lmprobe:tensors.hidden_layers names 1000000 tensor files, the dataset holds {held} files; " \
           "its files are not checked" in problems
    assert len(problems) < 10 and any("row_offset not a row of its last-token shard" in p for p in problems)
