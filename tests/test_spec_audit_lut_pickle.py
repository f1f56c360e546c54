"""Review 65: the LUT and pickle-shard stores checked against their specs (lut-format.zh.md, normative, and
pickle-shard-format.md) by a reader written from the spec text alone: safetensors and gzip bytes parsed by
hand, the spec's formulas recomputed from the SAE file and the checkpoint's own weights, and stores written
by a spec-only writer handed to the project's readers."""
from __future__ import annotations

import copy
import gzip
import hashlib
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from actstore.formats import lut as lut_format
from actstore.formats import pickle as ps
from actstore.lut import build_lut, build_tables
from actstore.lut_runtime import install_luts
from actstore.model_config import model_params, read_model_config
from actstore.models import load_model
from actstore.sae import build_sae

HOOK = "encoder.layer.1.attention.self.query:input"
TARGETS = [f"encoder.layer.1.attention.self.{m}" for m in ("query", "key", "value")]
SAE = {"num_basis": 64, "k_active": 4, "steps": 100, "batch_size": 64, "lr": 0.003, "dead_tokens": 2000,
       "device": "cpu"}
LUT_KEYS = ("encoder_weight", "encoder_bias", "decoder_weight", "decoder_bias", "precomputed_products",
            "bias_product")
ITEM_KEYS = {"sample_idx", "activation", "shape", "text_preview", "metadata"}


def read_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{key: (dtype, float64 array)} parsed from the bytes as the safetensors format defines them, asserting
    its layout: u64 LE header size, JSON header, data 8-byte aligned, offsets tiling the buffer exactly."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    assert (8 + size) % 8 == 0, f"{path}: tensor data not 8-byte aligned"
    spans = sorted(tuple(info["data_offsets"]) for info in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"{path}: gaps in the data"
    assert 8 + size + spans[-1][1] == len(data), f"{path}: bytes after the last tensor"
    tensors = {}
    for key, info in header.items():
        start, end = info["data_offsets"]
        raw = data[8 + size + start:8 + size + end]
        if info["dtype"] == "BF16":
            values = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            values = np.frombuffer(raw, {"F16": "<f2", "F32": "<f4"}[info["dtype"]])
        tensors[key] = (info["dtype"], values.reshape(info["shape"]).astype(np.float64))
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """float16 tensors as another writer may lay them out: no __metadata__, header padded with spaces, data
    in the reverse order of the header's keys."""
    header, blobs, offset = {}, [], 0
    for key, value in reversed(list(tensors.items())):
        raw = value.astype("<f2").tobytes()
        header[key] = {"dtype": "F16", "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def spec_steps_a_b(tables: dict[str, tuple[str, np.ndarray]], k_active: int, x: np.ndarray) -> np.ndarray:
    """The spec's online inference, Steps A and B, verbatim."""
    sparse_act = np.maximum(x @ tables["encoder_weight"][1].T + tables["encoder_bias"][1], 0)
    top_k_indices = np.argsort(-sparse_act, axis=1, kind="stable")[:, :k_active]
    top_k_values = np.take_along_axis(sparse_act, top_k_indices, axis=1)
    selected = tables["precomputed_products"][1][top_k_indices]
    return (top_k_values[..., None] * selected).sum(axis=1) + tables["bias_product"][1]


def target_inputs(model_path: Path, target: str, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, outputs) of `target` over `texts`, captured on the plain transformers model."""
    from transformers import AutoModel, AutoTokenizer

    model, tokenizer = AutoModel.from_pretrained(model_path).eval(), AutoTokenizer.from_pretrained(model_path)
    seen = []
    handle = model.get_submodule(target).register_forward_hook(lambda m, a, out: seen.append((a[0], out)))
    with torch.no_grad():
        for text in texts:
            model(**tokenizer(text, return_tensors="pt", truncation=True, max_length=24))
    handle.remove()
    return tuple(torch.cat([pair[i].reshape(-1, pair[i].shape[-1]) for pair in seen]).double().numpy()
                 for i in range(2))


@pytest.fixture(scope="module")
def stores(extracted, tmp_path_factory):
    """(config, lut stage dir, sae dir, merged pickle store) of the tiny BERT, built once."""
    config, extract_dir = extracted("bert", extract={"hooks": [HOOK]})
    config = copy.deepcopy(config)
    config["sae"].update(SAE)
    config["lut"].update({"targets": TARGETS, "budgets": [0], "eval_samples": 4, "device": "cpu"})
    sae_dir, lut_out = tmp_path_factory.mktemp("sae"), tmp_path_factory.mktemp("lut")
    build_sae(config, extract_dir, sae_dir, progress=False)
    build_lut(config, extract_dir, sae_dir, lut_out, progress=False)
    out = tmp_path_factory.mktemp("pickle")
    params = model_params(read_model_config(config["model"]["path"]))
    for part in range(config["extract"]["parts"]):
        ps.write_machine(extract_dir / f"part-{part:04d}", out / ps.machine_dirname(part), model_params=params,
                         shard_size_mb=0.02, progress=False)
    ps.merge_machines([out / ps.machine_dirname(p) for p in range(config["extract"]["parts"])], out)
    return config, lut_out, sae_dir, out


def test_lut_bytes_hold_the_specs_tables_of_the_sae_and_the_checkpoints_weights(stores):
    """Each table file, parsed by hand: the six keys of the spec's shapes, one 16-bit dtype; the SAE's four
    tensors its float16 rounding bit for bit; P = W_dec @ W_target and b_dec @ W_target (W_target = the
    checkpoint's nn.Linear weight transposed) within float16's rounding of the exact product."""
    config, lut_out, sae_dir, _ = stores
    meta = json.loads((lut_out / "lut" / "metadata.json").read_text())
    basis, k_active = meta["sae_config"]["num_basis"], meta["sae_config"]["k_active"]
    assert (type(basis), type(k_active), meta["version"]) == (int, int, "1.0")
    listed = {"metadata.json", *(f"{target}.lut.safetensors" for target in TARGETS)}
    assert {path.name for path in (lut_out / "lut").iterdir()} == listed
    sae = read_safetensors(sae_dir / "sae.safetensors")
    weights = read_safetensors(Path(config["model"]["path"]) / "model.safetensors")
    for target in TARGETS:
        entry = meta["layers"][target]
        n_in, n_out = entry["input_dim"], entry["output_dim"]
        tables = read_safetensors(lut_out / "lut" / entry["file"])
        shapes = {"encoder_weight": (basis, n_in), "encoder_bias": (basis,), "decoder_weight": (basis, n_in),
                  "decoder_bias": (n_in,), "precomputed_products": (basis, n_out), "bias_product": (n_out,)}
        assert {key: tables[key][1].shape for key in LUT_KEYS} == shapes
        assert {tables[key][0] for key in tables} == {"F16"}
        for key in LUT_KEYS[:4]:
            assert np.array_equal(tables[key][1], sae[key][1].astype(np.float16).astype(np.float64)), key
        w_target = weights[f"{target}.weight"][1].T
        for key, rows in (("precomputed_products", sae["decoder_weight"][1]), ("bias_product", sae["decoder_bias"][1])):
            exact = rows @ w_target
            scale = np.abs(rows) @ np.abs(w_target)  # float32 accumulation error, relative to it
            assert (np.abs(tables[key][1] - exact) <= 2.0 ** -11 * np.abs(exact) + 1e-6 * scale).all(), key


def test_spec_steps_on_the_tables_are_the_saes_reconstruction_through_the_target(stores):
    """Steps A and B on the stored tables, for the target's real inputs, equal the SAE's TopK reconstruction
    times W_target (what the tables encode), and the installed runtime gives them plus the linear's bias."""
    config, lut_out, _, _ = stores
    meta = json.loads((lut_out / "lut" / "metadata.json").read_text())
    texts = [json.loads(line)["text"] for line in Path(config["dataset"]["path"]).read_text().splitlines()[:4]]
    weights = read_safetensors(Path(config["model"]["path"]) / "model.safetensors")
    model = load_model(Path(config["model"]["path"]), "float32", "cpu").model
    installed = install_luts(model, lut_format.open_lut(lut_out), budget=0, dtype=torch.float32)
    for target in TARGETS:
        tables = read_safetensors(lut_out / "lut" / meta["layers"][target]["file"])
        x, dense_out = target_inputs(Path(config["model"]["path"]), target, texts)
        lookup = spec_steps_a_b(tables, meta["sae_config"]["k_active"], x)
        sparse_act = np.maximum(x @ tables["encoder_weight"][1].T + tables["encoder_bias"][1], 0)
        kept = np.where(sparse_act >= np.sort(sparse_act, axis=1)[:, [-meta["sae_config"]["k_active"]]], sparse_act, 0)
        x_hat = kept @ tables["decoder_weight"][1] + tables["decoder_bias"][1]
        w_target, bias = weights[f"{target}.weight"][1].T, weights[f"{target}.bias"][1]
        np.testing.assert_allclose(lookup, x_hat @ w_target, atol=2e-3 * np.abs(lookup).max())
        runtime = installed[target](torch.from_numpy(x).float()).double().numpy()
        np.testing.assert_allclose(runtime, lookup + bias, atol=1e-5 * np.abs(lookup).max())
        assert np.linalg.norm(x @ w_target + bias - dense_out) < 1e-5 * np.linalg.norm(dense_out)


def test_a_lut_written_from_the_spec_alone_verifies_installs_and_computes_the_spec(stores, tmp_path):
    """Another writer's store: the six keys only (no target_bias, no header metadata, header padded, data
    in another order than the keys), metadata.json with the required fields only. verify passes, and the
    installed runtime is Steps A and B plus the live linear's own bias."""
    config, _, sae_dir, _ = stores
    sae = read_safetensors(sae_dir / "sae.safetensors")
    weights = read_safetensors(Path(config["model"]["path"]) / "model.safetensors")
    lut = tmp_path / "lut"
    lut.mkdir()
    layers = {}
    for target in TARGETS:
        w_target = weights[f"{target}.weight"][1].T
        tables = {key: sae[key][1] for key in LUT_KEYS[:4]}
        tables |= {"precomputed_products": tables["decoder_weight"] @ w_target,
                   "bias_product": tables["decoder_bias"] @ w_target}
        write_safetensors(lut / f"{target}.lut.safetensors", tables)
        layers[target] = {"input_dim": 32, "output_dim": 32, "file": f"{target}.lut.safetensors"}
    (lut / "metadata.json").write_text(json.dumps({"version": "1.0", "sae_config": {"num_basis": 64, "k_active": 4},
                                                    "layers": layers}))
    assert lut_format.verify(lut) == []
    model = load_model(Path(config["model"]["path"]), "float32", "cpu").model
    biases = {target: model.get_submodule(target).bias.detach().double().numpy() for target in TARGETS}
    installed = install_luts(model, lut_format.open_lut(lut), budget=0, dtype=torch.float32)
    x = np.random.default_rng(0).standard_normal((5, 32)) * 2
    for target in TARGETS:
        want = spec_steps_a_b(read_safetensors(lut / f"{target}.lut.safetensors"), 4, x) + biases[target]
        got = installed[target](torch.from_numpy(x).float()).double().numpy()
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_pickle_layer_i_is_the_models_own_block_i_output_in_the_specs_bytes(stores):
    """Read as the spec's loader reads (gzip, then a pickle: our own store, trusted here): every shard a gzip
    member with mtime 0 and no name, a dict of layer_{i} lists; each item the five fields, `shape` a tuple,
    text_preview the text's first 200 characters, and activation float32 equal to the transformers model's
    hidden_states[i + 1] (block i's output) for that dataset row."""
    from transformers import AutoModel, AutoTokenizer

    config, _, _, out = stores
    model_path = config["model"]["path"]
    model, tokenizer = AutoModel.from_pretrained(model_path).eval(), AutoTokenizer.from_pretrained(model_path)
    texts = [json.loads(line)["text"] for line in Path(config["dataset"]["path"]).read_text().splitlines()]
    meta = json.loads((out / "metadata.json").read_text())
    per_machine = meta["distributed_config"]["samples_per_machine"]
    seen = 0
    for info in meta["shards"]:
        raw = (out / info["filename"]).read_bytes()
        assert raw[:4] == b"\x1f\x8b\x08\x00" and raw[4:8] == bytes(4)  # gzip, deflate, no FNAME, mtime 0
        assert info["checksum"] == "sha256:" + hashlib.sha256(raw).hexdigest()
        shard = pickle.loads(gzip.decompress(raw))
        assert sorted(shard) == sorted(f"layer_{i}" for i in info["layers"])
        for key, items in shard.items():
            for item in items:
                assert set(item) == ITEM_KEYS and type(item["shape"]) is tuple
                index, activation = item["sample_idx"], item["activation"]
                assert activation.dtype == np.float32 and item["shape"] == activation.shape
                assert item["text_preview"] == texts[index][:200]
                assert item["metadata"]["machine_id"] == index // per_machine == info["machine_id"]
                encoded = tokenizer(texts[index], return_tensors="pt", truncation=True,
                                    max_length=meta["extraction_config"]["max_seq_length"])
                with torch.no_grad():
                    hidden = model(**encoded, output_hidden_states=True).hidden_states
                block_output = hidden[int(key.removeprefix("layer_")) + 1][0].numpy()
                np.testing.assert_allclose(activation, block_output, atol=1e-4)
                seen += 1
    assert seen == len(texts) * len(meta["extraction_config"]["layers_extracted"])


def spec_only_pickle(out: Path, item_metadata: dict | None, distributed_config: bool) -> Path:
    """A one-shard store with the spec's required fields; each item's optional `metadata` is `item_metadata`
    with its token_count, or left out when None."""
    out.mkdir()
    rng = np.random.default_rng(0)
    shard = {}
    for layer in (0, 2):
        shard[f"layer_{layer}"] = []
        for index in range(3):
            activation = rng.standard_normal((4 + index, 16)).astype(np.float32)
            item = {"sample_idx": index, "activation": activation, "shape": activation.shape,
                    "text_preview": f"text {index}"}
            if item_metadata is not None:
                item["metadata"] = {**item_metadata, "token_count": len(activation)}
            shard[f"layer_{layer}"].append(item)
    raw = gzip.compress(pickle.dumps(shard))
    (out / "shard_0001.pkl.gz").write_bytes(raw)
    meta = {"version": "1.0", "created_at": "2025-01-09T12:00:00Z",
            "extraction_config": {"model_name": "m", "model_architecture": "bert", "dataset_name": "d",
                                  "model_params": {"hidden_size": 16, "num_hidden_layers": 3,
                                                   "num_attention_heads": 4, "vocab_size": 10},
                                  "dataset_config": None, "dataset_split": "train", "layers_extracted": [0, 2],
                                  "max_seq_length": 8, "batch_size": 1},
            "shards": [{"shard_id": 1, "filename": "shard_0001.pkl.gz", "size_bytes": len(raw), "num_samples": 3,
                        "layers": [0, 2], "sample_id_range": [0, 2], "compressed": True,
                        "checksum": "sha256:" + hashlib.sha256(raw).hexdigest()}],
            "statistics": {"total_shards": 1, "total_samples": 3, "total_size_bytes": len(raw),
                           "layers_extracted": [0, 2], "extraction_duration_seconds": 1.0}}
    if distributed_config:
        meta["distributed_config"] = {"machine_id": 0, "total_machines": 1, "multihost": False, "num_hosts": 1,
                                      "mesh_type": "1d"}
    (out / "metadata.json").write_text(json.dumps(meta))
    return out


def test_a_pickle_store_without_distributed_config_is_read(tmp_path):
    """distributed_config is not among the spec's required fields: a store without it verifies and reads."""
    out = spec_only_pickle(tmp_path / "store", {}, distributed_config=False)
    assert ps.verify(out) == []
    assert [item["sample_idx"] for item in ps.iter_activations(out, 2)] == [0, 1, 2]
    assert ps.read_vector(out, 1, 2, 4).shape == (16,)


def test_a_pickle_item_without_the_optional_metadata_is_read(tmp_path):
    out = spec_only_pickle(tmp_path / "store", None, distributed_config=True)
    assert ps.verify(out) == []
    assert [item["sample_idx"] for item in ps.iter_activations(out, 2)] == [0, 1, 2]


def test_a_causal_lm_targets_lut_key_is_its_dotted_path_in_the_model(model_dir):
    """lut.targets `layers.1.self_attn.q_proj` resolves (on the base model) in the LlamaForCausalLM the
    stage loads; its tables should be keyed by the path a spec runtime finds with get_submodule."""
    model = load_model(model_dir("llama"), "float32", "cpu").model
    generator = torch.Generator().manual_seed(0)
    sae_state = {"encoder_weight": torch.randn(16, 32, generator=generator), "encoder_bias": torch.zeros(16),
                 "decoder_weight": torch.randn(16, 32, generator=generator), "decoder_bias": torch.zeros(32)}
    config = {"lut": {"targets": ["layers.1.self_attn.q_proj"], "dtype": "float16"}}
    [(key, _)] = list(build_tables(config, model, sae_state))
    model.get_submodule(key)
    assert key == "model.layers.1.self_attn.q_proj"
