"""Review 64: Slurm runtimes of the jobs that read no activation byte (the lmprobe and zarr merge
finishers' links and index, the SAE's sampled rows) follow their own work, not the activations' bytes,
which sized them at the 48 h cap for a 10B-token run; and the weight files sized are those loaded."""
import dataclasses
import json
import re
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny
from actstore import resources
from actstore.formats.extract import open_extraction, synthetic_extraction
from actstore.sae.data import split_tokens, stream_batches, tensors
from test_journey_slurm_sizing import dry_run_runtime
from test_workflow_slurm_requests import sparse_jsonl


@pytest.mark.slow
def test_the_finishers_that_read_no_activation_ask_the_same_time_for_wider_values(model_dir, tmp_path):
    """lmprobe_dataset links its tensor files and writes a token index; zarr_merge_chunks links chunk
    files: neither reads a value, so storing float32 instead of float16 (twice the bytes, the same
    tokens, files and chunks) changes neither runtime, where the zarr shard jobs, which write the
    values, are given more."""
    data = sparse_jsonl(tmp_path / "big.jsonl", 2 * 10**9)
    minutes = {}
    for dtype in ("float16", "float32"):
        (tmp_path / dtype).mkdir()
        config = tiny.make_config(tmp_path / dtype, model_dir("gpt2"), data, zarr={"merged": True, "t_chunk": 16},
                                  extract={"parts": 4, "max_seq_length": 64, "storage_dtype": dtype})
        minutes[dtype] = {rule: dry_run_runtime(tmp_path / dtype, config, rule, target)
                          for rule, target in (("lmprobe_dataset", "lmprobe"), ("zarr_merge_chunks", "zarr"),
                                               ("zarr_shards", "zarr"))}
    assert minutes["float32"]["zarr_shards"] > minutes["float16"]["zarr_shards"], minutes  # the bytes count there
    for rule in ("lmprobe_dataset", "zarr_merge_chunks"):
        assert minutes["float32"][rule] == minutes["float16"][rule] > resources.STARTUP_MIN, (rule, minutes)


@pytest.fixture
def seven_b_run(model_dir, tmp_path, text_jsonl, monkeypatch):
    """A config whose workload is a 7B-class run of 10B tokens (4 layers of 4,096 float32 values, 20M
    rows of 500 tokens) over 64 parts: docs/scale.md's example model."""
    config = tiny.make_config(tmp_path, model_dir("llama"), text_jsonl, extract={"parts": 64, "max_seq_length": 500})
    run = dataclasses.replace(resources.workload(config), tokens=10**10, d=4096, n_tensors=4, itemsize=4,
                              weight_bytes=16 * 10**9, rows=2 * 10**7, text_bytes=4 * 10**10)
    monkeypatch.setattr(resources, "workload", lambda config: run)
    config["extract"]["layers"] = [0, 1, 2, 3]
    return config


def test_an_sae_run_is_sized_by_its_steps_not_by_every_token_read(seven_b_run):
    """train_sae reads sae.steps x sae.batch_size sampled rows (and 65,536 for b_dec, 50,000 held out),
    not the whole extraction: a thousand steps at 10B tokens is not a 48 h job, and ten times the steps
    takes more time."""
    short = resources.sae_runtime(seven_b_run)
    seven_b_run["sae"]["steps"] *= 10
    assert short < resources.MAX_RUNTIME_MIN / 4
    assert resources.sae_runtime(seven_b_run) > short


def test_the_zarr_link_jobs_share_the_chunk_files(seven_b_run):
    """A zarr_merge_chunks job links the chunk files of the parts it takes: half the jobs, twice the
    parts and links each, twice the time (the startup apart), and below the cap at 10B tokens."""
    seven_b_run["zarr"].update(merged=True, merge_jobs=64)
    sixty_four = resources.zarr_merge_chunks_runtime(seven_b_run) - resources.STARTUP_MIN
    seven_b_run["zarr"]["merge_jobs"] = 32
    thirty_two = resources.zarr_merge_chunks_runtime(seven_b_run) - resources.STARTUP_MIN
    assert thirty_two < resources.MAX_RUNTIME_MIN
    assert thirty_two == pytest.approx(2 * sixty_four, abs=1)


def sharded_copies(model, folder, safetensors: bool, bin: bool) -> None:
    """`model` saved into `folder` in shards, as safetensors (save_pretrained) and / or as torch's .bin
    with their pytorch_model.bin.index.json, as older transformers saved them (a Hub download has both)."""
    if safetensors:
        model.save_pretrained(folder, max_shard_size="50KB")
    if bin:
        state = model.state_dict()
        halves = [dict(list(state.items())[i::2]) for i in range(2)]
        names = [f"pytorch_model-{i:05d}-of-00002.bin" for i in (1, 2)]
        for name, half in zip(names, halves):
            torch.save(half, folder / name)
        weight_map = {key: name for name, half in zip(names, halves) for key in half}
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("copies, loaded", [((True, True), "*.safetensors"), ((False, True), "*.bin")])
def test_a_sharded_download_is_sized_at_the_shards_loaded(model_dir, tmp_path, text_jsonl, copies, loaded):
    """Shards of both formats (model-*.safetensors with their index, pytorch_model-*.bin with theirs):
    sized at the safetensors shards from_pretrained reads; a .bin-only download at its .bin shards."""
    source = model_dir("llama")
    folder = tmp_path / "download"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    sharded_copies(AutoModelForCausalLM.from_pretrained(source), folder, *copies)
    shards = sorted(folder.glob(loaded))
    assert len(shards) > 1 and all(re.match(r"(model|pytorch_model)-\d+-of-\d+\.", p.name) for p in shards)
    config = tiny.make_config(tmp_path, folder, text_jsonl)
    assert resources.workload(config).weight_bytes == sum(p.stat().st_size for p in shards)


def test_the_sae_job_asks_for_the_token_indices_it_holds(tmp_path, seven_b_run):
    """train_sae holds every token's row in its part and an epoch's shuffled order of the training
    tokens (8 B a token in int32, 12 past 2^31 tokens): measured here on 3M tokens, the rules' count of
    them bounds it, and a 10B-token run asks for the 120 GB, where it asked 5 GB."""
    extraction = open_extraction(synthetic_extraction(tmp_path / "extract", 3_000_000 * 4 * 4, 2, 4, [1]))
    arrays = tensors(extraction, extraction.tensor_names[0])

    def split_and_first_batch():
        split = split_tokens(extraction, 0.1, 0)
        return next(stream_batches(arrays, split.train, 16, np.random.default_rng(0)))

    _, peak = tiny.traced_peak(split_and_first_batch)
    counted = resources.sae_index_bytes(dataclasses.replace(resources.workload(seven_b_run),
                                                            tokens=extraction.n_tokens), parts=2)
    assert 7 * extraction.n_tokens < peak <= counted  # 4 B a token split, 4 a training token ordered
    assert resources.sae_mem_mb(seven_b_run) > 12 * 10**10 / 1e6


def test_the_index_job_has_the_time_to_hash_a_weight_copy_never_loaded(model_dir, tmp_path, text_jsonl):
    """The index job hashes every model file of the folder (model_identity), a .bin copy beside the
    safetensors loaded too: the jobs that load the weights are sized at the copy loaded, the index at
    both (30 GB more to hash: 5 minutes at the scratch rate, twice that asked)."""
    plain, both = tmp_path / "plain", tmp_path / "both"
    for folder in (plain, both):
        shutil.copytree(model_dir("llama"), folder)
    with open(both / "pytorch_model.bin", "wb") as fh:
        fh.truncate(30 * 10**9)
    configs = [tiny.make_config(tmp_path, folder, text_jsonl) for folder in (plain, both)]
    assert resources.workload(configs[0]).weight_bytes == resources.workload(configs[1]).weight_bytes
    minutes = [resources.extract_index_runtime(config) for config in configs]
    assert minutes[1] - minutes[0] >= 2 * 30 * 10**9 / resources.IO_BYTES_PER_S / 60
