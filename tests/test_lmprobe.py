"""lmprobe 2.0 datasets: the spec's resolution snippets on our output, both storage modes, ordering,
dtypes, token columns, the reader, and verify() catching damage."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from actstore.errors import ConfigError, FormatError
from actstore.formats import lmprobe
from actstore.formats.extract import open_extraction
from actstore.model_config import run_config

SPEC = Path(__file__).resolve().parents[2] / "shared" / "specs" / "lmprobe-format-2.0.md"

# The spec's three resolution snippets, verbatim ("Resolving a prompt to a tensor").
SNIPPET_LAST = '''import pyarrow.parquet as pq
import json
from safetensors import safe_open

# 1. Load the index
table = pq.read_table("index/train-00000-of-00001.parquet")
df = table.to_pandas()

# 2. Read the tensor descriptor
meta = table.schema.metadata
tensors = json.loads(meta[b"lmprobe:tensors"])
hidden = tensors["hidden_layers"]

# 3. Pick a prompt and a layer
row = df.iloc[42]
layer = 16

# 4. Construct the filename and key
filename = hidden["file_pattern"].format(layer=layer, shard=row["shard_index"])
key = hidden["key_pattern"].format(layer=layer)

# 5. Read the vector
with safe_open(filename, framework="pt") as f:
    vector = f.get_tensor(key)[row["row_offset"]]
'''
SNIPPET_TOKEN = '''# For token i of prompt 42:
row = df.iloc[42]
token_idx = 5
layer = 16

shard = row["token_shard_ids"][token_idx]
offset = row["token_shard_offsets"][token_idx]

filename = hidden["file_pattern"].format(layer=layer, shard=shard)
key = hidden["key_pattern"].format(layer=layer)

with safe_open(filename, framework="pt") as f:
    vector = f.get_tensor(key)[offset]
'''
SNIPPET_LOGITS = '''logits_desc = tensors["logits_topk"]
row = df.iloc[42]

filename = logits_desc["file_pattern"].format(shard=row["shard_index_logits"])

with safe_open(filename, framework="pt") as f:
    # Contains top-k values and indices
    values = f.get_tensor("topk_values")[row["row_offset_logits"]]
    indices = f.get_tensor("topk_indices")[row["row_offset_logits"]]
'''
ROW_BYTES = 32 * 4  # tiny models: dim 32, float32
SMALL = {"shard_bytes": ROW_BYTES * 12}  # 3 last-token shards for 30 prompts, many sequence shards


def run(snippet: str, ns: dict, prompt: int, layer: int, token: int = 5) -> dict:
    """exec a spec snippet with only its example numbers (prompt 42, layer 16, token 5) replaced."""
    code = (snippet.replace("df.iloc[42]", f"df.iloc[{prompt}]").replace("layer = 16", f"layer = {layer}")
            .replace("token_idx = 5", f"token_idx = {token}"))
    exec(compile(code, "<spec snippet>", "exec"), ns)
    return ns


def build(extracted, kind: str, tmp_path: Path, name: str = "ds", **options) -> tuple[Path, object, dict]:
    config, extract_dir = extracted(kind)
    out = tmp_path / name
    lmprobe.write_dataset(extract_dir, out, options, progress=False)
    return out, open_extraction(extract_dir), config


def test_snippets_are_the_specs():
    if not SPEC.is_file():
        pytest.skip(f"{SPEC} not present in this checkout")
    text = SPEC.read_text()
    for snippet in (SNIPPET_LAST, SNIPPET_TOKEN, SNIPPET_LOGITS):
        assert snippet.strip() in text


def test_full_sequence_spec_snippets_match_extraction(extracted, tmp_path, monkeypatch):
    root, ext, _ = build(extracted, "gpt2", tmp_path, storage="full_sequence", **SMALL)
    monkeypatch.chdir(root)
    info = json.loads(pq.read_schema("index/train-00000-of-00001.parquet").metadata[b"lmprobe:tensors"])
    hidden = info["hidden_layers"]
    assert hidden["storage"] == "full_sequence" and hidden["last_token_shards"] == 3
    assert len(hidden["shards"]) > 4 and hidden["shards"][0] == {"num_prompts": 12, "num_tokens": 12}
    ns: dict = {}
    for prompt in (0, 7, 13, 29):
        for layer in (0, 2):
            run(SNIPPET_LAST, ns, prompt, layer)
            s = int(ns["row"]["sample_idx"])
            want = ext.activations(f"layer_{layer}", s)
            assert torch.equal(ns["vector"], torch.from_numpy(want[-1].copy()))
            for token in (0, len(want) // 2, len(want) - 1):
                run(SNIPPET_TOKEN, ns, prompt, layer, token)
                assert torch.equal(ns["vector"], torch.from_numpy(want[token].copy()))
        run(SNIPPET_LOGITS, ns, prompt, 0)
        part, local = ext.locate(s)
        values, indices = part.topk(local)
        assert np.array_equal(ns["values"].numpy(), values) and np.array_equal(ns["indices"].numpy(), indices)


def test_pooled_encoder_has_no_sequence_or_logits(extracted, tmp_path, monkeypatch):
    root, ext, _ = build(extracted, "bert", tmp_path, storage="pooled", **SMALL)
    table = pq.read_table(root / "index/train-00000-of-00001.parquet")
    for absent in ("token_shard_ids", "token_offset", "shard_index_logits", "perplexity_mean", "token_perplexity"):
        assert absent not in table.column_names
    assert {"text", "label", "num_tokens", "shard_index", "row_offset", "sample_idx", "token_ids",
            "token_strings", "module", "qualname"} <= set(table.column_names)
    tensors = json.loads(table.schema.metadata[b"lmprobe:tensors"])
    assert set(tensors) == {"hidden_layers"} and tensors["hidden_layers"]["pooling"] == "last_token"
    assert tensors["hidden_layers"]["row_bytes"] == ROW_BYTES
    assert sorted(p.name for p in (root / "tensors").iterdir()) == [
        f"hidden_layer{layer:03d}_shard{s:03d}.safetensors" for layer in (0, 2) for s in range(3)]
    monkeypatch.chdir(root)
    ns: dict = {}
    for prompt in range(30):
        run(SNIPPET_LAST, ns, prompt, 2)
        want = ext.activations("layer_2", int(ns["row"]["sample_idx"]))[-1]
        assert np.array_equal(ns["vector"].numpy(), want)
    ds = lmprobe.open_dataset(root)
    s = int(ds.sample_idx[3])
    n = ext.sample(s)["num_tokens"]
    assert lmprobe.read_vector(root, s, 2, 0) is None  # pooled: only the last token is stored
    assert np.array_equal(lmprobe.read_vector(root, s, 2, n - 1), ext.activations("layer_2", s)[-1])
    with pytest.raises(FormatError, match="pooled"):
        ds.tokens(3, 2)


def test_ordering_random_is_seeded_permutation_and_original_is_identity(extracted, tmp_path):
    root, ext, _ = build(extracted, "gpt2", tmp_path, "r", storage="pooled", seed=7)
    info = lmprobe.read_info(lmprobe.find_index(root))
    assert info["prompt_ordering"] == "random" and info["prompt_ordering_seed"] == 7
    order = pq.read_table(root / "index/train-00000-of-00001.parquet").column("sample_idx").to_numpy()
    assert np.array_equal(order, np.random.default_rng(info["prompt_ordering_seed"]).permutation(info["num_prompts"]))
    assert not np.array_equal(order, np.arange(30))
    again, _, _ = build(extracted, "gpt2", tmp_path, "r2", storage="pooled", seed=7)
    assert np.array_equal(pq.read_table(lmprobe.find_index(again)).column("sample_idx").to_numpy(), order)
    orig, _, _ = build(extracted, "gpt2", tmp_path, "o", storage="pooled", prompt_ordering="original")
    ds_o, ds_r = lmprobe.open_dataset(orig), lmprobe.open_dataset(root)
    assert np.array_equal(ds_o.sample_idx, np.arange(30)) and ds_o.info["prompt_ordering_seed"] is None
    assert np.array_equal(ds_r.last_tokens(2)[np.argsort(order)], ds_o.last_tokens(2))
    assert ds_o.table.column("text").to_pylist() == [ext.sample(i)["text"] for i in range(30)]


def test_token_columns_and_perplexity(extracted, tmp_path, model_dir):
    from transformers import AutoTokenizer

    root, ext, _ = build(extracted, "gpt2", tmp_path, storage="pooled", prompt_ordering="original")
    table = pq.read_table(lmprobe.find_index(root))
    tok = AutoTokenizer.from_pretrained(model_dir("gpt2"), local_files_only=True)
    rows = table.to_pylist()
    for s, row in enumerate(rows):
        part, local = ext.locate(s)
        ids, lp = part.token_ids(local), part.token_logprob(local)
        assert row["token_ids"] == ids.tolist() and row["num_tokens"] == len(ids)
        assert np.isnan(row["token_perplexity"][0]) and np.isnan(lp[0])
        ppl = np.exp(-lp[1:].astype(np.float64))
        assert np.array_equal(np.array(row["token_perplexity"][1:]), ppl)
        assert np.array_equal(np.array(row["token_logprob"], np.float32)[1:], lp[1:])
        if len(ids) > 1:
            assert row["perplexity_mean"] == pytest.approx(ppl.mean(), rel=1e-12)
            assert (row["perplexity_min"], row["perplexity_max"]) == (ppl.min(), ppl.max())
        assert row["token_strings"] == [tok.decode([i]) for i in ids.tolist()]
        assert row["label"] == ext.sample(s)["label"] and row["sample_idx"] == s


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes_round_like_torch(extracted, tmp_path, monkeypatch, dtype):
    root, ext, _ = build(extracted, "llama", tmp_path, storage="full_sequence", dtype=dtype, **SMALL)
    hidden = json.loads(pq.read_schema(lmprobe.find_index(root)).metadata[b"lmprobe:tensors"])["hidden_layers"]
    assert hidden["dtype"] == dtype and hidden["row_bytes"] == 32 * 2
    monkeypatch.chdir(root)
    ns: dict = {}
    tdtype = getattr(torch, dtype)
    for prompt in (0, 21):
        run(SNIPPET_LAST, ns, prompt, 0)
        want = torch.from_numpy(ext.activations("layer_0", int(ns["row"]["sample_idx"])).copy())
        assert ns["vector"].dtype == tdtype and torch.equal(ns["vector"], want[-1].to(tdtype))
        run(SNIPPET_TOKEN, ns, prompt, 0, 1)
        assert torch.equal(ns["vector"], want[1].to(tdtype))
    ds = lmprobe.open_dataset(root)
    s = int(ds.sample_idx[21])
    assert np.array_equal(ds.tokens(21, 0), ext.activations("layer_0", s).astype(np.float32)
                          if dtype == "float32" else
                          torch.from_numpy(ext.activations("layer_0", s).copy()).to(tdtype).float().numpy())


def test_float16_overflow_is_counted_and_logged_not_silent(tmp_path, caplog):
    """Activations past float16's range (some LLMs have them) become +-inf with lmprobe.dtype float16
    (the synthetic extraction has no inf of its own): the job says how many, exactly the infs stored."""
    from safetensors.numpy import load_file

    from actstore.formats.extract import synthetic_extraction

    extract = synthetic_extraction(tmp_path / "extract", 400_000, parts=2, dim=16, layers=[0, 1], tokens=(4, 16),
                                   scale=30_000.0)
    with caplog.at_level("WARNING", logger="actstore.formats.lmprobe.write"):
        lmprobe.write_dataset(extract, tmp_path / "ds", {"token_strings": False, "dtype": "float16",
                                                           "storage": "full_sequence"}, progress=False)
    stored = sum(int(np.isinf(array).sum()) for path in (tmp_path / "ds" / "tensors").glob("*.safetensors")
                 for array in load_file(path).values())
    assert stored > 100 and f"lmprobe.dtype float16: {stored} finite activations beyond +-65504" in caplog.text
    caplog.clear()
    lmprobe.write_dataset(extract, tmp_path / "bf16", {"token_strings": False, "dtype": "bfloat16"}, progress=False)
    assert "beyond" not in caplog.text


def test_reader_matches_extraction(extracted, tmp_path):
    root, ext, _ = build(extracted, "llama", tmp_path, storage="full_sequence", logits_topk=5, **SMALL)
    ds = lmprobe.open_dataset(root)
    assert ds.layers == [0, 2] and ds.num_prompts == 30 and ds.dim == 32
    for layer in (0, 2):
        last = ds.last_tokens(layer)
        for prompt in range(30):
            s = int(ds.sample_idx[prompt])
            want = ext.activations(f"layer_{layer}", s)
            assert np.array_equal(last[prompt], want[-1])
            assert np.array_equal(ds.get(prompt, layer), want[-1])
            assert np.array_equal(ds.tokens(prompt, layer), want)
            assert np.array_equal(ds.get(prompt, layer, 0), want[0])
            assert np.array_equal(lmprobe.read_vector(root, s, layer, len(want) - 1), want[-1]) if prompt < 3 else True
    s = int(ds.sample_idx[4])
    part, local = ext.locate(s)
    fresh = lmprobe.open_dataset(root)
    values, indices = fresh.logits(4)
    assert values.shape == (5,) and np.array_equal(values, part.topk(local)[0][:5])
    assert np.array_equal(indices, part.topk(local)[1][:5])
    assert np.array_equal(fresh.labels, ds.labels)
    assert fresh._table is None  # labels and logits read their columns, not every prompt's text and token lists
    assert lmprobe.read_vector(root, s, 1, 0) is None  # layer 1 not extracted
    assert lmprobe.read_vector(root, s, 0, 10_000) is None
    assert np.array_equal(lmprobe.read_vector(root, s, 2, 1), ext.activations("layer_2", s)[1])


def test_torch_dataset_over_prompts_and_layers(extracted, tmp_path):
    root, ext, _ = build(extracted, "gpt2", tmp_path, storage="pooled", **SMALL)
    ds = lmprobe.open_dataset(root)
    probe = ds.torch_dataset()
    assert len(probe) == 60
    batch = next(iter(torch.utils.data.DataLoader(probe, batch_size=60, shuffle=False)))
    labels = ext.meta["dataset"]["labels"]
    for i in range(60):
        layer, s = int(batch["layer"][i]), int(batch["sample_idx"][i])
        assert layer == (0 if i < 30 else 2)
        assert torch.equal(batch["activation"][i], torch.from_numpy(ext.activations(f"layer_{layer}", s)[-1].copy()))
        assert labels[int(batch["label"][i])] == ext.sample(s)["label"]


def test_detect_inspect_and_clean_verify(extracted, tmp_path):
    root, ext, _ = build(extracted, "gpt2", tmp_path, storage="full_sequence", **SMALL)
    assert lmprobe.detect(root) and not lmprobe.detect(tmp_path)
    summary = lmprobe.inspect(root)
    assert summary["format"] == "lmprobe" and summary["layers"] == [0, 2] and summary["n_examples"] == 30
    assert summary["n_tokens"] == ext.n_tokens and summary["d_model"] == 32 and summary["dtype"] == "float32"
    assert summary["logits_topk"] == ext.meta["logits_topk"]
    assert summary["n_shards"] == len(list((root / "tensors").iterdir()))
    assert summary["bytes"] == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert lmprobe.verify(root) == []
    pooled, _, _ = build(extracted, "bert", tmp_path, "pooled", storage="pooled")
    assert lmprobe.verify(pooled) == [] and lmprobe.inspect(pooled)["n_tokens"] is None


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_catches_every_flipped_byte_kind(extracted, tmp_path):
    clean, _, _ = build(extracted, "gpt2", tmp_path, storage="full_sequence", **SMALL)
    targets = ["tensors/hidden_layer002_shard004.safetensors", "tensors/logits_topk_000.safetensors",
               "index/train-00000-of-00001.parquet", "README.md"]
    for i, rel in enumerate(targets):
        root = tmp_path / f"bad{i}"
        shutil.copytree(clean, root)
        size = (root / rel).stat().st_size
        flip(root / rel, size - 9)
        problems = lmprobe.verify(root)
        assert problems and any(rel in p for p in problems), (rel, problems)
    root = tmp_path / "missing"
    shutil.copytree(clean, root)
    (root / "tensors/hidden_layer000_shard001.safetensors").unlink()
    problems = lmprobe.verify(root)
    assert any("hidden_layer000_shard001.safetensors: missing" in p for p in problems)


def test_reader_errors_name_the_fault(extracted, tmp_path):
    import pyarrow as pa
    from safetensors.numpy import save_file

    clean, _, _ = build(extracted, "gpt2", tmp_path, storage="full_sequence", **SMALL)
    root = tmp_path / "broken"
    shutil.copytree(clean, root)
    (root / "tensors/hidden_layer000_shard000.safetensors").unlink()
    ds = lmprobe.open_dataset(root)
    prompt = int(np.flatnonzero(ds.shard_index == 0)[0])
    with pytest.raises(FormatError, match="hidden_layer000_shard000.safetensors: shard file missing"):
        ds.get(prompt, 0)
    # A last-token shard cut after it was opened is named, not read as what the output held.
    cut = root / "tensors/hidden_layer002_shard000.safetensors"
    ds.last_tokens(2)
    os.truncate(cut, cut.stat().st_size - 4)
    with pytest.raises(FormatError, match=f"{cut}: ends before byte"):
        ds.last_tokens(2)
    save_file({"wrong.key": np.zeros((12, 32), np.float32)}, str(root / "tensors/hidden_layer002_shard000.safetensors"))
    with pytest.raises(FormatError, match="no tensor 'hidden.layer_2'"):
        lmprobe.open_dataset(root).last_tokens(2)
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    pq.write_table(table.replace_schema_metadata({}), index)
    with pytest.raises(FormatError, match="no 'lmprobe:' schema metadata"):
        lmprobe.open_dataset(root)
    assert not lmprobe.detect(root)
    meta = dict(table.schema.metadata)
    meta[b"lmprobe:format_version"] = json.dumps("3.0").encode()
    pq.write_table(table.replace_schema_metadata(meta), index)
    with pytest.raises(FormatError, match="format_version '3.0' unknown"):
        lmprobe.open_dataset(root)
    assert lmprobe.verify(root)  # never raises, reports
    pq.write_table(pa.table({"x": [1]}), index)
    assert any("lmprobe:" in p for p in lmprobe.verify(root))


@pytest.mark.parametrize("edit, named", [
    (lambda t: t["hidden_layers"].update(shards=None), r"hidden_layers\.shards is malformed: None"),
    (lambda t: t["hidden_layers"]["shards"][0].update(num_prompts="12"), r"hidden_layers\.shards is malformed"),
    (lambda t: t["hidden_layers"].update(layers=[0, None]), r"hidden_layers\.layers is malformed"),
    (lambda t: t["hidden_layers"].update(dim=0), r"hidden_layers\.dim is malformed: 0"),
    (lambda t: t["hidden_layers"].update(file_pattern="{layer.__class__}"), r"hidden_layers\.file_pattern is malformed"),
    (lambda t: t["hidden_layers"].update(key_pattern="x{layer:>999999999}"), r"hidden_layers\.key_pattern is malformed"),
    (lambda t: t["logits_topk"].update(k=True), r"logits_topk\.k is malformed: True"),
    (lambda t: t["logits_topk"].pop("k"), r"logits_topk\.k is malformed: None"),
    (lambda t: t["hidden_layers"].update(dtype="int8"), r"hidden_layers\.dtype is malformed: 'int8'"),
    (lambda t: t["hidden_layers"].pop("dim"), r"hidden_layers\.dim is malformed: None"),
])
def test_a_descriptor_field_of_the_wrong_type_is_named_by_every_reader(extracted, tmp_path, edit, named):
    """lmprobe:tensors' fields build file names, tensor keys and array shapes: each is typed when the
    index is read, so open, inspect and verify name the field instead of raising a Python error (or
    formatting a pattern that reaches into objects or builds a name gigabytes long)."""
    clean, _, _ = build(extracted, "gpt2", tmp_path, storage="full_sequence", **SMALL)
    root = tmp_path / "broken"
    shutil.copytree(clean, root)
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    meta = dict(table.schema.metadata)
    tensors = json.loads(meta[b"lmprobe:tensors"])
    edit(tensors)
    meta[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    pq.write_table(table.replace_schema_metadata(meta), index)
    for read in (lmprobe.open_dataset, lmprobe.inspect):
        with pytest.raises(FormatError, match=named):
            read(root)
    assert any(re.search(named, p) for p in lmprobe.verify(root)), lmprobe.verify(root)


def test_lmprobe_files_not_an_object_is_named(extracted, tmp_path):
    """lmprobe:files maps each tensor file to its size and sha256: a list there stopped verify with
    "verification aborted: AttributeError", its other problems lost."""
    root, _, _ = build(extracted, "gpt2", tmp_path, storage="pooled", **SMALL)
    index = lmprobe.find_index(root)
    table = pq.read_table(index)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"lmprobe:files": b"[1]"}), index)
    with pytest.raises(FormatError, match=r"lmprobe:files is malformed: \[1\]"):
        lmprobe.open_dataset(root)
    problems = lmprobe.verify(root)
    assert any("lmprobe:files is malformed" in p for p in problems) and not any("aborted" in p for p in problems)


def test_index_is_the_specs_path_whatever_the_split(extracted, tmp_path, monkeypatch):
    """The spec names one index path, index/train-00000-of-00001.parquet (its snippets and file layout),
    and lmprobe's own readers fetch only that path (lmprobe.sharing.PARQUET_PATH in 0.10.3): a dataset
    of split `validation` keeps its index there (it was index/validation-..., which neither found);
    the split is recorded in lmprobe:dataset.split and the card."""
    _, extract_dir = extracted("gpt2", dataset={"split": "validation"})
    ext = open_extraction(extract_dir)
    root = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, root, {"storage": "pooled", **SMALL}, progress=False)
    assert [p.name for p in (root / "index").iterdir()] == ["train-00000-of-00001.parquet"]
    assert lmprobe.read_info(root / "index/train-00000-of-00001.parquet")["dataset"]["split"] == "validation"
    assert "- split: validation\n    path: index/train-00000-of-00001.parquet\n" in (root / "README.md").read_text()
    assert lmprobe.verify(root) == []
    monkeypatch.chdir(root)
    ns: dict = {}
    for prompt in (0, 17):
        run(SNIPPET_LAST, ns, prompt, 2)  # the spec's snippet, verbatim path
        assert np.array_equal(ns["vector"].numpy(), ext.activations("layer_2", int(ns["row"]["sample_idx"]))[-1])
    assert lmprobe.find_index(root, "validation") == root / "index/train-00000-of-00001.parquet"
    with pytest.raises(FormatError, match="no index parquet of split 'train'"):
        lmprobe.find_index(root, "train")
    old = tmp_path / "old"  # a dataset written before: index/validation-00000-of-00001.parquet still reads
    shutil.copytree(root, old)
    (old / "index/train-00000-of-00001.parquet").rename(old / "index/validation-00000-of-00001.parquet")
    for split in (None, "validation"):
        ds = lmprobe.open_dataset(old, split)
        assert ds.index_path.name == "validation-00000-of-00001.parquet" and ds.num_prompts == 30


def test_bad_options_fail_before_writing(extracted, tmp_path):
    _, extract_dir = extracted("gpt2")
    for options, field in (({"layers": [1]}, "lmprobe.layers"), ({"logits_topk": 10_000}, "lmprobe.logits_topk"),
                           ({"storage": "mean"}, "lmprobe.storage")):
        with pytest.raises(ConfigError, match=field):
            lmprobe.write_dataset(extract_dir, tmp_path / "never", options, progress=False)
        assert not (tmp_path / "never").exists()


def test_safetensors_library_reads_our_shards(extracted, tmp_path):
    from safetensors import safe_open

    root, ext, _ = build(extracted, "gpt2", tmp_path, storage="full_sequence", prompt_ordering="original", **SMALL)
    hidden = lmprobe.open_dataset(root).hidden
    first_seq = hidden["last_token_shards"]
    with safe_open(str(root / hidden["file_pattern"].format(layer=2, shard=first_seq)), framework="np") as f:
        assert list(f.keys()) == ["hidden.layer_2"] and f.metadata() == {"format": "pt"}
        block = f.get_tensor("hidden.layer_2")
    n = hidden["shards"][first_seq]["num_tokens"]
    assert np.array_equal(block, ext.parts[0].tensor("layer_2")[:n])  # original order: tokens packed as extracted


def test_stage_dir_resolves_and_dataset_card_snippet_runs(extracted, tmp_path, monkeypatch):
    config, _ = extracted("gpt2")
    stage = tmp_path / "stage"
    root, ext, _ = build(extracted, "gpt2", stage, lmprobe.DATASET_DIR, storage="pooled")
    assert lmprobe.detect(stage) and lmprobe.verify(stage) == [] and lmprobe.inspect(stage)["n_examples"] == 30
    s = int(lmprobe.open_dataset(stage).sample_idx[0])
    assert np.array_equal(lmprobe.read_vector(stage, s, 0, ext.sample(s)["num_tokens"] - 1),
                          ext.activations("layer_0", s)[-1])
    card = (root / "README.md").read_text()
    code = card.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(root)
    ns: dict = {}
    exec(code, ns)
    assert np.array_equal(ns["vector"].numpy(), ext.activations("layer_0", s)[-1])
    lmprobe.check_options(config, run_config(config["model"]))
    with pytest.raises(ConfigError, match="lmprobe.layers"):
        lmprobe.check_options({**config, "lmprobe": {**config["lmprobe"], "layers": [0, 1]}},
                              run_config(config["model"]))


# ---------------------------------------------------------------- scattered jobs and the finishing job

def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def scattered(extract_dir: Path, out: Path, options: dict, jobs: int, threads: int = 2) -> list[Path]:
    """`jobs` write_job directories under out.parent/scatter (what the lmprobe_tensors rule runs),
    each writing `threads` files at once."""
    job_dirs = [out.parent / "scatter" / f"job-{j:04d}" for j in range(jobs)]
    for j, job_dir in enumerate(job_dirs):
        lmprobe.write_job(extract_dir, job_dir, options, jobs=jobs, job=j, progress=False, threads=threads)
    return job_dirs


@pytest.mark.parametrize("storage", ["full_sequence", "pooled"])
def test_scattered_jobs_and_finish_are_byte_identical_to_one_go(extracted, tmp_path, monkeypatch, storage):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # created_at in the index provenance
    _, extract_dir = extracted("gpt2")
    options = {"storage": storage, **SMALL}
    one, _, _ = build(extracted, "gpt2", tmp_path, "one", **options)
    want = tree(one)
    n_tensors = sum(rel.startswith("tensors/") for rel in want)
    assert n_tensors > 6 and "tensors/logits_topk_000.safetensors" in want
    # the last jobs of n_tensors + 2 get no file; one go wrote 2 files at once, these 1 and 4
    for jobs, threads in ((3, 4), (n_tensors + 2, 1)):
        out = tmp_path / f"jobs{jobs}" / "dataset"
        job_dirs = scattered(extract_dir, out, options, jobs, threads)
        records = [json.loads((d / "job.json").read_text())["files"] for d in job_dirs]
        assert sum(map(len, records)) == n_tensors and (jobs <= n_tensors or records[-1] == {})
        lmprobe.finish_dataset(extract_dir, job_dirs, out, options)
        assert tree(out) == want, jobs
        linked = [p for d in job_dirs for p in (d / "tensors").glob("*") if p.is_file()]
        assert len(linked) == n_tensors and all(p.samefile(out / "tensors" / p.name) for p in linked)  # not copied
        assert lmprobe.verify(out, checksums=False) == []


@pytest.fixture(scope="module")
def typed_metadata(tmp_path_factory):
    """The test corpus with a `score` field null in the first rows, then ints, then floats, and a
    `note` field only in the last rows: types pyarrow finds only by looking past the first rows."""
    import tiny

    path = tiny.write_jsonl(tmp_path_factory.mktemp("typed") / "docs.jsonl", 30)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for i, row in enumerate(rows):
        row["score"] = None if i < 10 else (i if i < 20 else i + 0.5)
        if i >= 25:
            row["note"] = f"n{i}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_index_streamed_in_small_row_groups_reads_back_as_one(extracted, typed_metadata, tmp_path, monkeypatch):
    from actstore.formats.lmprobe import write

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    _, extract_dir = extracted("gpt2", data=typed_metadata)
    options = {"storage": "full_sequence", "prompt_ordering": "original", **SMALL}
    one = tmp_path / "one"
    lmprobe.write_dataset(extract_dir, one, options, progress=False)
    monkeypatch.setattr(write, "ROW_GROUP_TOKENS", 40)  # a group ends at the row that reaches 40 tokens
    streamed = tmp_path / "streamed"
    lmprobe.write_dataset(extract_dir, streamed, options, progress=False)
    a, b = pq.ParquetFile(lmprobe.find_index(one)), pq.ParquetFile(lmprobe.find_index(streamed))
    assert a.metadata.num_row_groups == 1 and b.metadata.num_row_groups > 5
    group_tokens = [sum(b.read_row_group(g, columns=["num_tokens"]).column(0).to_pylist())
                    for g in range(b.metadata.num_row_groups)]
    assert max(group_tokens) < 40 + 24  # bound + one prompt (max_seq_length 24)
    ta, tb = a.read(), b.read()
    assert ta.schema == tb.schema and ta.schema.metadata == tb.schema.metadata
    assert str(tb.schema.field("score").type) == "double" and str(tb.schema.field("note").type) == "string"
    for name in ta.column_names:  # NaN perplexity at token 0: compare as strings
        assert str(ta.column(name).to_pylist()) == str(tb.column(name).to_pylist()), name
    assert tb.column("score").to_pylist()[:12] == [None] * 10 + [10.0, 11.0]
    assert tree(one)["tensors/hidden_layer002_shard004.safetensors"] == tree(streamed)[
        "tensors/hidden_layer002_shard004.safetensors"]
    assert lmprobe.verify(streamed) == []
    ds = lmprobe.open_dataset(streamed)
    ext = open_extraction(extract_dir)
    for prompt in (0, 13, 29):
        assert np.array_equal(ds.tokens(prompt, 2), ext.activations("layer_2", int(ds.sample_idx[prompt])))


def test_finish_with_a_missing_or_short_file_fails_naming_it_and_leaves_no_dataset(extracted, tmp_path):
    _, extract_dir = extracted("gpt2")
    options = {"storage": "full_sequence", **SMALL}
    out = tmp_path / "dataset"
    job_dirs = scattered(extract_dir, out, options, 3)
    before = tree(tmp_path / "scatter")
    victim = next(p for p in sorted((job_dirs[2] / "tensors").iterdir()))
    record, rel = job_dirs[2] / "job.json", victim.relative_to(job_dirs[2]).as_posix()
    saved = json.loads(record.read_text())
    record.write_text(json.dumps({**saved, "files": {k: v for k, v in saved["files"].items() if k != rel}}))
    with pytest.raises(FormatError, match=f"job-0002/job.json: does not list {rel}, a file the plan gives job 2"):
        lmprobe.finish_dataset(extract_dir, job_dirs, out, options)
    record.write_text(json.dumps(saved))
    for damage, match in ((lambda: victim.write_bytes(victim.read_bytes()[:-4]), f"{victim.name}: .* bytes"),
                          (victim.unlink, f"{victim.name}: missing"),
                          (lambda: (job_dirs[1] / "job.json").unlink(), "job-0001/job.json: missing")):
        damage()
        with pytest.raises(FormatError, match=match):
            lmprobe.finish_dataset(extract_dir, job_dirs, out, options)
        assert not out.exists() and not list(tmp_path.glob(".dataset*"))
        assert (job_dirs[0] / "job.json").is_file() and any((job_dirs[0] / "tensors").iterdir())
    with pytest.raises(FormatError, match="job-0002/job.json: records of 3 jobs, none of job 1"):
        lmprobe.finish_dataset(extract_dir, [job_dirs[0], job_dirs[2]], out, options)
    untouched = {rel: data for rel, data in before.items() if rel.startswith("job-0000/")}
    assert untouched and all(tree(tmp_path / "scatter")[rel] == data for rel, data in untouched.items())


def test_finish_failing_after_linking_leaves_the_jobs_whole(extracted, tmp_path, monkeypatch):
    _, extract_dir = extracted("gpt2")
    options = {"storage": "pooled", **SMALL}
    out = tmp_path / "dataset"
    job_dirs = scattered(extract_dir, out, options, 2)
    before = tree(tmp_path / "scatter")
    (Path(open_extraction(extract_dir).info.model.path) / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    try:
        with pytest.raises(ConfigError, match="lmprobe.token_strings"):
            lmprobe.finish_dataset(extract_dir, job_dirs, out, options)
    finally:
        (tmp_path / "tokenizer.json").rename(Path(open_extraction(extract_dir).info.model.path) / "tokenizer.json")
    assert not out.exists() and tree(tmp_path / "scatter") == before
    lmprobe.finish_dataset(extract_dir, job_dirs, out, options)  # the rerun finds every job's files
    assert lmprobe.verify(out) == []


def test_half_precision_extraction_converts_through_the_gather(extracted, tmp_path):
    """Tensor rows stored bfloat16 by the extraction are read raw and widened like the reader does."""
    _, extract_dir = extracted("gpt2", extract={"storage_dtype": "bfloat16"})
    out = tmp_path / "ds"
    lmprobe.write_dataset(extract_dir, out, {"storage": "full_sequence", **SMALL}, progress=False)
    ds, ext = lmprobe.open_dataset(out), open_extraction(extract_dir)
    assert ext.parts[0].tensor("layer_2").stored_dtype == "bfloat16"
    for prompt in (0, 11, 29):
        s = int(ds.sample_idx[prompt])
        assert np.array_equal(ds.tokens(prompt, 2), ext.activations("layer_2", s))
        assert np.array_equal(ds.get(prompt, 0), ext.activations("layer_0", s)[-1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_part_stored_in_the_dataset_dtype_is_copied_bit_for_bit(tmp_path, dtype):
    """lmprobe.dtype equal to the extraction's storage dtype: its stored bits go to the shards as
    they are (no float32 round trip). The shards equal, byte for byte, the ones written from the
    same values stored float32 and rounded by the writer, in both storages and with a shard split
    inside prompts' runs; the last-token rows are the stored bits of each prompt's last token."""
    from safetensors import safe_open

    from actstore.formats.extract import synthetic_extraction

    shape = dict(parts=2, dim=16, layers=[0, 1], tokens=(4, 16))
    wide = synthetic_extraction(tmp_path / "float32", 400_000, **shape)
    narrow = synthetic_extraction(tmp_path / dtype, 400_000, dtype=dtype, **shape)
    ext = open_extraction(narrow)
    for storage in ("full_sequence", "pooled"):
        options = {"token_strings": False, "dtype": dtype, "storage": storage, "shard_bytes": 4096}
        lmprobe.write_dataset(wide, tmp_path / f"{storage}-from-float32", options, progress=False)
        lmprobe.write_dataset(narrow, tmp_path / f"{storage}-as-stored", options, progress=False)
        assert lmprobe.verify(tmp_path / f"{storage}-as-stored") == []
        assert tree(tmp_path / f"{storage}-as-stored" / "tensors") == tree(tmp_path / f"{storage}-from-float32" / "tensors")
    ds = lmprobe.open_dataset(tmp_path / "full_sequence-as-stored")
    with safe_open(tmp_path / "full_sequence-as-stored" / "tensors" / "hidden_layer001_shard000.safetensors",
                   framework="pt") as f:
        shard = f.get_tensor("hidden.layer_1").view(torch.int16).numpy()
    prompts = np.flatnonzero(ds.shard_index == 0).tolist()
    assert len(prompts) > 10
    for prompt in prompts:
        part, local = ext.locate(int(ds.sample_idx[prompt]))
        raw = part.tensor("layer_1").raw[part.sample_slice(local)]
        assert shard[ds.row_offset[prompt]].tobytes() == raw[-1].tobytes()


def test_dtype_auto_stores_the_extractions_dtype_and_hashes_as_naming_it(tmp_path, model_dir, text_jsonl):
    """lmprobe.dtype auto = the extraction's storage dtype: a bfloat16 extraction's dataset is
    bfloat16, the same bytes as naming it; a float32 one's is float32. Its stage hash is that of
    the dtype it resolves to (as model.torch_dtype auto's is), so naming it reuses the dataset."""
    import tiny

    from actstore.formats.extract import synthetic_extraction
    from actstore.hashing import stage_hash

    for dtype in ("bfloat16", "float32"):
        extract = synthetic_extraction(tmp_path / dtype, 100_000, parts=1, dim=16, layers=[0], tokens=(4, 16),
                                       dtype=dtype)
        for named in ("auto", dtype):
            lmprobe.write_dataset(extract, tmp_path / f"{dtype}-{named}", {"token_strings": False, "dtype": named},
                                  progress=False)
        assert lmprobe.open_dataset(tmp_path / f"{dtype}-auto").dtype == dtype
        assert tree(tmp_path / f"{dtype}-auto" / "tensors") == tree(tmp_path / f"{dtype}-{dtype}" / "tensors")

    def config(storage: str, lmprobe_dtype: str) -> dict:
        return tiny.make_config(tmp_path, model_dir("gpt2"), text_jsonl, extract={"storage_dtype": storage},
                                lmprobe={"dtype": lmprobe_dtype})

    assert stage_hash(config("bfloat16", "auto"), "lmprobe") == stage_hash(config("bfloat16", "bfloat16"), "lmprobe")
    assert stage_hash(config("float32", "auto"), "lmprobe") == stage_hash(config("float32", "float32"), "lmprobe")
    assert stage_hash(config("bfloat16", "auto"), "lmprobe") != stage_hash(config("bfloat16", "float32"), "lmprobe")
    with pytest.raises(ConfigError, match="lmprobe.dtype: unknown value 'int8'"):
        lmprobe.write_dataset(tmp_path / "float32", tmp_path / "bad", {"dtype": "int8"}, progress=False)


def test_verify_without_checksums_checks_sizes_headers_and_recorded_digests(extracted, tmp_path):
    clean, _, _ = build(extracted, "gpt2", tmp_path, storage="full_sequence", **SMALL)
    rel = "tensors/hidden_layer002_shard004.safetensors"
    assert lmprobe.verify(clean, checksums=False) == []
    cases = {"flipped": lambda root: flip(root / rel, (root / rel).stat().st_size - 9),
             "short": lambda root: (root / rel).write_bytes((root / rel).read_bytes()[:-4]),
             "sums": lambda root: (root / "SHA256SUMS").write_text(
                 (root / "SHA256SUMS").read_text().replace(lmprobe.read_info(lmprobe.find_index(root))["files"][rel]
                                                           ["sha256"], "0" * 64)),
             "index": lambda root: flip(lmprobe.find_index(root), 100)}
    found = {}
    for name, damage in cases.items():
        root = tmp_path / name
        shutil.copytree(clean, root)
        damage(root)
        found[name] = lmprobe.verify(root, checksums=False)
        assert lmprobe.verify(root) and all(str(root) in p for p in lmprobe.verify(root))
    assert found["flipped"] == []  # a flipped data byte needs the full hash: what checksums=False skips
    assert any(rel in p and "bytes" in p for p in found["short"])
    assert any(rel in p and "differs from lmprobe:files" in p for p in found["sums"])
    assert any("index/train-00000-of-00001.parquet" in p for p in found["index"])


@pytest.mark.parametrize("damage, message", [
    (lambda ids: [[i + 10_000 for i in row] if n == 17 else row for n, row in enumerate(ids)], "point outside"),
    (lambda ids: [row[:-1] if n == 29 else row for n, row in enumerate(ids)], "lengths differ from num_tokens")])
def test_token_addresses_checked_batch_by_batch_name_the_index(extracted, tmp_path, monkeypatch, damage, message):
    """A token_shard_ids entry out of the sequence shards, or a list one short, past the first batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actstore.formats.lmprobe import check

    monkeypatch.setattr(check, "TOKEN_BATCH_ROWS", 4)  # 30 prompts: the damage sits in a later batch
    out, _, _ = build(extracted, "gpt2", tmp_path, storage="full_sequence", **SMALL)
    index = lmprobe.open_dataset(out).index_path
    table = pq.read_table(index)
    ids = pa.array(damage(table.column("token_shard_ids").to_pylist()), pa.list_(pa.int64()))
    table = table.set_column(table.schema.get_field_index("token_shard_ids"), "token_shard_ids", ids)
    pq.write_table(table, index)
    assert any(message in p and str(index) in p for p in lmprobe.verify(out, checksums=False))


def write_safetensors(path: Path, header: bytes, data: bytes) -> Path:
    """A safetensors file of these header bytes (padded with spaces to 8 bytes) and data."""
    import struct

    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def reference_read(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes as the safetensors library (the spec's reader) reads them."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return {key: f.get_tensor(key).shape for key in f.keys()}


@pytest.mark.parametrize("shape, offsets", [([2, 2], [16, 0]), ([0, 4], [8, 8])])
def test_a_shard_header_whose_entry_points_backwards_is_refused(tmp_path, shape, offsets):
    """A header's shape and data_offsets must describe a region inside the file, start before end:
    a negative dimension times a backwards range passed the size check and reached np.memmap (a
    negative count is now refused by the parse: test_a_shard_header_the_library_refuses_is_refused)."""
    from actstore.formats.lmprobe.layout import read_safetensors_header, tensor_entry
    header = json.dumps({"t": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}).encode()
    path = write_safetensors(tmp_path / "x.safetensors", header, np.zeros(16, np.float32).tobytes())
    parsed, start = read_safetensors_header(path)
    if math.prod(shape) == 0 and offsets[0] == offsets[1]:  # an empty tensor is legal
        assert tensor_entry(path, parsed, start, "t")[1] == tuple(shape)
        return
    with pytest.raises(FormatError, match=r"tensor 't' data_offsets .* do not fit"):
        tensor_entry(path, parsed, start, "t")


ENTRY = '"dtype": "F32", "shape": [8], "data_offsets": [0, 32]'


@pytest.mark.parametrize("header, named", [
    ('{"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
     '"t": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}', "is not JSON \\(key 't' given twice"),
    ('{"t": {"dtype": "F32", "dtype": "F16", "shape": [8], "data_offsets": [0, 32]}}',
     "is not JSON \\(key 'dtype' given twice"),
    ('{"t": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 32]}}', "is not JSON \\(NaN is not a JSON number"),
    ('{"t": {"dtype": "F32", "shape": [8], "data_offsets": [0, Infinity]}}', "is not JSON \\(Infinity is not"),
    ('{"__metadata__": {"format": 1}, "t": {%s}}' % ENTRY, "key '__metadata__': .* is not an object of strings"),
    ('{"__metadata__": "pt", "t": {%s}}' % ENTRY, "key '__metadata__': 'pt' is not an object of strings"),
    ('{"t": {"dtype": "F32", "shape": [8.0], "data_offsets": [0, 32]}}', "key 't': shape \\[8.0\\] is not"),
    ('{"t": {"dtype": "F32", "shape": [8e0], "data_offsets": [0, 32]}}', "key 't': shape \\[8.0\\] is not"),
    ('{"t": {"dtype": "F32", "shape": [true, 8], "data_offsets": [0, 32]}}', "key 't': shape \\[True, 8\\] is not"),
    ('{"t": {"dtype": "F32", "shape": [-8], "data_offsets": [0, 32]}}', "key 't': shape \\[-8\\] is not"),
    ('{"t": {"dtype": "F32", "shape": [8], "data_offsets": ["0", "32"]}}', "key 't': data_offsets .* is not two"),
    ('{"t": {"dtype": "F32", "shape": [8], "data_offsets": [-0, 32]}}', "key 't': data_offsets .* is not two"),
    ('{"t": {"dtype": "F32", "shape": [18446744073709551616, 0], "data_offsets": [0, 0]}, '
     '"u": {%s}}' % ENTRY, "key 't': shape .* is not a list of whole numbers"),
    ('{"t": null}', "key 't': None is not a tensor entry object"),
    ('\ufeff{"t": {%s}}' % ENTRY, "is not JSON \\(Unexpected UTF-8 BOM"),
    ("[" * 100_000 + "]" * 100_000, "is not JSON \\(nested too deeply to parse\\)"),
], ids=["key-twice", "field-twice", "nan", "infinity", "metadata-int", "metadata-str", "float-shape",
        "exponent-shape", "bool-shape", "negative-shape", "string-offsets", "negative-zero", "over-u64",
        "null-entry", "bom", "nested"])
def test_a_shard_header_the_library_refuses_is_refused(tmp_path, header, named):
    """The header is parsed as strictly as the safetensors library (the spec's reader) parses it: a key
    given twice, NaN, a __metadata__ that is not strings, counts that are floats, bools, strings,
    negative or past u64 were read (json.loads keeps the last of two keys, int() takes 8.0 and True),
    Infinity and deep nesting crashed; each is refused naming the file (and key)."""
    from actstore.formats.lmprobe.read import open_tensor
    path = write_safetensors(tmp_path / "x.safetensors", header.encode(), np.arange(8, dtype=np.float32).tobytes())
    with pytest.raises(Exception):
        reference_read(path)
    with pytest.raises(FormatError, match=f"{re.escape(str(path))}: safetensors header {named}"):
        open_tensor(path, "t")


def test_a_shard_header_past_the_library_limit_is_refused(tmp_path):
    """The library refuses a header over 100,000,000 bytes; 100 MiB (4.8 MB more) passed here. The
    file is sparse: both refuse on the length alone, before reading the header."""
    import struct

    from actstore.formats.lmprobe.layout import read_safetensors_header
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", 100_000_008))
        fh.truncate(8 + 100_000_008)
    with pytest.raises(Exception, match="header too large"):
        reference_read(path)
    with pytest.raises(FormatError, match=f"{re.escape(str(path))}: safetensors header length 100000008 exceeds"):
        read_safetensors_header(path)


@pytest.mark.parametrize("header, data", [
    ("{}", b""), ('{"__metadata__": null, "t": {%s}}' % ENTRY, 32), ('{"__metadata__": {}, "t": {%s}}' % ENTRY, 32),
    ('{"t": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32], "note": [1.5, null]}}', 32),
    ('{"t": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}', 4),
    ('{"t": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]}}', 0),
], ids=["empty", "metadata-null", "metadata-empty", "extra-member", "scalar", "zero-rows"])
def test_a_shard_header_the_library_accepts_is_read(tmp_path, header, data):
    """What the library reads, the strict parse reads too, with the same shapes."""
    from actstore.formats.lmprobe.layout import read_safetensors_header, tensor_entry
    data = b"\0" * data if isinstance(data, int) else data
    path = write_safetensors(tmp_path / "x.safetensors", header.encode(), data)
    parsed, start = read_safetensors_header(path)
    ours = {key: tensor_entry(path, parsed, start, key)[1] for key in parsed if key != "__metadata__"}
    assert ours == reference_read(path)


def test_schema_metadata_nested_too_deeply_to_parse_is_named(tmp_path):
    """json.loads raises RecursionError, not a JSON error, past Python's nesting limit: named as not JSON."""
    import pyarrow as pa

    index = tmp_path / "index.parquet"
    pq.write_table(pa.table({"a": [1]}).replace_schema_metadata({b"lmprobe:info": b"[" * 100_000 + b"]" * 100_000}),
                   index)
    with pytest.raises(FormatError, match="schema metadata 'lmprobe:info' is not JSON"):
        lmprobe.read_info(index)


def set_columns(index: Path, columns: dict[str, list]) -> None:
    """Rewrite these index columns (types and schema metadata kept)."""
    import pyarrow as pa

    table = pq.read_table(index)
    for name, values in columns.items():
        field = table.schema.field(name)
        table = table.set_column(table.schema.get_field_index(name), field, pa.array(values, field.type))
    pq.write_table(table, index)


def at(cols: dict[str, list], shard: int, offset: int) -> int:
    """The index row whose last token is row `offset` of shard `shard`."""
    return next(r for r, address in enumerate(zip(cols["shard_index"], cols["row_offset"])) if address == (shard, offset))


def replaced(values: list, row: int, value) -> list:
    return values[:row] + [value] + values[row + 1:]


# name: (damage(columns) -> (index row, changed columns), reader call or None, verify's problem, the reader's error)
ADDRESS_DAMAGE = {
    "row_offset_logits -1": (
        lambda c: (0, {"row_offset_logits": replaced(c["row_offset_logits"], 0, -1)}), lambda ds, p: ds.logits(p),
        r"row_offset_logits not a row of its logits shard \(shards\[\]\.num_prompts\) at row {p}: -1$",
        r"row {p} row_offset_logits -1 is not a row of \S+logits_topk_000\.safetensors \(25 rows\)"),
    "shard_index_logits 7": (
        lambda c: (0, {"shard_index_logits": replaced(c["shard_index_logits"], 0, 7)}), lambda ds, p: ds.logits(p),
        r"shard_index_logits not a logits shard \(0\.\.1\) at row {p}: 7$",
        r"shard_index_logits 7 is not one of the 2 logits shards"),
    "row_offset -1": (
        lambda c: (at(c, 0, 0), {"row_offset": replaced(c["row_offset"], at(c, 0, 0), -1)}),
        lambda ds, p: ds.last_tokens(0),
        r"row_offset not a row of its last-token shard \(shards\[\]\.num_prompts\) at row {p}: -1$",
        r"row {p} row_offset -1 is not a row of \S+hidden_layer000_shard000\.safetensors \(12 rows\)"),
    "row_offset 12": (
        lambda c: (at(c, 0, 11), {"row_offset": replaced(c["row_offset"], at(c, 0, 11), 12)}),
        lambda ds, p: ds.get(p, 0),
        r"row_offset not a row of its last-token shard \(shards\[\]\.num_prompts\) at row {p}: 12$",
        r"row {p} row_offset 12 is not a row of \S+hidden_layer000_shard000\.safetensors \(12 rows\)"),
    "shard_index of a sequence shard": (
        lambda c: (at(c, 0, 0), {"shard_index": replaced(c["shard_index"], at(c, 0, 0), 3)}),
        lambda ds, p: ds.last_tokens(0),
        r"shard_index not a last-token shard \(0\.\.2\) at row {p}: 3$",
        r"row {p} shard_index 3 is not a last-token shard \(0\.\.2\)"),
    "token_shard_offsets -5": (
        lambda c: (3, {"token_shard_offsets": replaced(c["token_shard_offsets"], 3, [-5] + c["token_shard_offsets"][3][1:])}),
        lambda ds, p: ds.tokens(p, 0),
        r"token_shard_offsets not a row of their sequence shard \(shards\[\]\.num_tokens\) at row {p}: -5$",
        r"row {p} token_shard_offsets -5 is not a row of \S+hidden_layer000_shard\d+\.safetensors"),
    "logits address given twice": (
        lambda c: (1, {k: replaced(c[k], 1, c[k][0]) for k in ("shard_index_logits", "row_offset_logits")}), None,
        r"shard_index_logits/row_offset_logits repeats an earlier row's address at row {p}: \(0, 0\)$", None),
    "token_offset": (
        lambda c: (2, {"token_offset": replaced(c["token_offset"], 2, c["row_offset"][2] + 1)}), None,
        r"token_offset differs from row_offset at row {p}: \d+$", None),
}


@pytest.mark.parametrize("case", ADDRESS_DAMAGE)
def test_an_address_outside_its_shard_is_named_by_verify_and_refused_by_readers(extracted, tmp_path, case):
    """The index's addressing columns against the shards' rows: numpy reads a negative offset as a row
    counted from the end (another prompt's logits or vector), and last_tokens left a prompt whose
    shard_index is a sequence shard as np.empty's bytes. verify names each bad value by index row."""
    damage, read, problem, error = ADDRESS_DAMAGE[case]
    root, _, _ = build(extracted, "llama", tmp_path, storage="full_sequence", logits_topk=5, **SMALL)
    index = lmprobe.find_index(root)
    prompt, columns = damage(pq.read_table(index).to_pydict())
    set_columns(index, columns)
    problems = lmprobe.verify(root, checksums=False)
    assert any(re.search(problem.format(p=prompt), p) for p in problems), problems
    if read:
        with pytest.raises(FormatError, match=error.format(p=prompt)):
            read(lmprobe.open_dataset(root), prompt)


def test_a_shard_tensor_other_than_its_descriptors_is_refused(extracted, tmp_path):
    """A hidden shard of float16 [12, 64] holds the bytes of float32 [12, 32]: last_tokens read them as
    float32 vectors; a logits shard whose indices are wider than k passed verify."""
    from safetensors.numpy import save_file

    root, _, _ = build(extracted, "llama", tmp_path, storage="full_sequence", logits_topk=5, **SMALL)
    hidden = root / "tensors/hidden_layer000_shard000.safetensors"
    save_file({"hidden.layer_0": np.ones((12, 64), np.float16)}, str(hidden))
    logits = root / "tensors/logits_topk_000.safetensors"
    save_file({"topk_values": np.ones((25, 5), np.float32), "topk_indices": np.ones((25, 6), np.int64)}, str(logits))
    ds = lmprobe.open_dataset(root)
    wrong_hidden = rf"{hidden}: tensor shape \[12, 64\] float16, descriptor says \[rows, 32\] float32"
    wrong_logits = rf"{logits}: topk_values \[25, 5\] float32 and topk_indices \[25, 6\] int64, expected \[rows, 5\]"
    with pytest.raises(FormatError, match=wrong_hidden):
        ds.last_tokens(0)
    with pytest.raises(FormatError, match=wrong_logits):
        ds.logits(int(np.flatnonzero(ds.logits_rows()[0] == 0)[0]))
    problems = lmprobe.verify(root, checksums=False)
    for wrong in (wrong_hidden, wrong_logits):
        assert any(re.search(wrong, p) for p in problems), problems


def overlap_indices(header: dict) -> None:
    """topk_indices made to start where topk_values does."""
    begin, end = header["topk_indices"]["data_offsets"]
    header["topk_indices"]["data_offsets"] = [0, end - begin]


@pytest.mark.parametrize("edit, trailing, named", [
    (overlap_indices, b"", r"tensor 'topk_indices' data starts at byte \d+, the previous tensor's ends at \d+"),
    (lambda header: None, b"\0" * 8, r"tensor data ends at byte \d+ of \d+ \(trailing bytes\)")], ids=["overlap", "trailing"])
def test_shard_data_overlapping_or_not_covering_the_file_is_refused(extracted, tmp_path, edit, trailing, named):
    """The safetensors library (the spec's reader) refuses a file whose tensors overlap, leave a gap or
    leave bytes after them; the reader read topk_values' bytes as topk_indices, verify passed both."""
    import struct

    from actstore.formats.lmprobe.layout import read_safetensors_header

    root, _, _ = build(extracted, "llama", tmp_path, storage="full_sequence", logits_topk=5, **SMALL)
    path = root / "tensors/logits_topk_000.safetensors"
    header, start = read_safetensors_header(path)
    data = path.read_bytes()[start:]
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data + trailing)
    with pytest.raises(FormatError, match=f"{path}: {named}"):
        lmprobe.open_dataset(root).logits(0)
    assert any(re.search(f"{path}: {named}", p) for p in lmprobe.verify(root, checksums=False))


def test_a_sample_idx_given_twice_is_refused_by_lookups(extracted, tmp_path):
    """row_of / read_vector answered with one of the two prompts claiming a source row."""
    root, _, _ = build(extracted, "gpt2", tmp_path, storage="pooled", **SMALL)
    index = lmprobe.find_index(root)
    sample_idx = pq.read_table(index, columns=["sample_idx"]).column("sample_idx").to_pylist()
    set_columns(index, {"sample_idx": replaced(sample_idx, 1, sample_idx[0])})
    with pytest.raises(FormatError, match=f"{index}: column sample_idx holds {sample_idx[0]} more than once"):
        lmprobe.open_dataset(root).row_of(sample_idx[0])
    with pytest.raises(FormatError, match="more than once"):
        lmprobe.read_vector(root, sample_idx[0], 0, 0)
