"""Config validation and stage hashes."""
from __future__ import annotations

import copy
import re

import pytest
import yaml

import tiny
from actstore.config import load_config, validate_config
from actstore.errors import ConfigError
from actstore.hashing import STAGES, stage_dir, stage_hash, stage_payload, write_stage_config
from actstore.jobs import job_items, jobs_covering, write_jobs


@pytest.fixture()
def demo():
    return load_config(tiny.REPO / "config" / "config.yaml")


def test_defaults_are_filled_and_explicit_defaults_hash_the_same(demo):
    assert demo["extract"]["batch_size"] == 32 and demo["dump_to"] == "results"
    explicit = copy.deepcopy(demo)
    explicit["extract"]["logits_topk"] = 20
    assert stage_hash(validate_config(explicit), "extract") == stage_hash(demo, "extract")


@pytest.mark.parametrize("layers, resolved", [([-1], [5]), ([1, -2], [1, 4]), ("all", [0, 1, 2, 3, 4, 5])])
def test_negative_layers_and_all_are_the_block_indices_they_name(demo, layers, resolved):
    """The demo's MiniLM has 6 blocks: -1 is block 5, `all` is 0..5; each names the same extraction
    (stage hash and directory) as the indices it stands for."""
    symbolic, explicit = copy.deepcopy(demo), copy.deepcopy(demo)
    symbolic["extract"]["layers"], explicit["extract"]["layers"] = layers, resolved
    assert validate_config(symbolic)["extract"]["layers"] == resolved
    assert stage_hash(symbolic, "extract") == stage_hash(validate_config(explicit), "extract")


@pytest.mark.parametrize("layers, message", [
    ([-7], r"extract.layers: \[-7\] out of range; the model has blocks 0..5 \(-1..-6 from the last\)"),
    ([5, -1], r"extract.layers: \[5, -1\] name a block twice \(the model has 6: \[5, 5\]\)"),
    ("some", r"invalid config at extract/layers"),
])
def test_layers_that_name_no_block_or_one_twice_are_refused(demo, layers, message):
    bad = copy.deepcopy(demo)
    bad["extract"]["layers"] = layers
    with pytest.raises(ConfigError, match=message):
        validate_config(bad)


def test_plain_layer_indices_need_no_model_folder(demo):
    """Only `all` or a negative index reads the model's config.json (actstore locate works without it)."""
    elsewhere = copy.deepcopy(demo)
    elsewhere["model"]["path"] = "/nonexistent/model"
    assert validate_config(elsewhere)["extract"]["layers"] == demo["extract"]["layers"]
    elsewhere["extract"]["layers"] = [-1]
    with pytest.raises(ConfigError, match="no model folder with config.json at /nonexistent/model"):
        validate_config(elsewhere)


@pytest.mark.parametrize("section, key, value", [
    ("extract", "layerz", [1]), ("zarr", "t_chunks", 4), ("model", "pth", "x"), ("unknown", None, 1)])
def test_unknown_or_misspelled_key_is_named(demo, section, key, value):
    config = copy.deepcopy(demo)
    if key is None:
        config[section] = value
    else:
        config[section][key] = value
    with pytest.raises(ConfigError, match=key or section):
        validate_config(config)


def test_mistyped_value_is_named(demo):
    config = copy.deepcopy(demo)
    config["extract"]["batch_size"] = "big"
    with pytest.raises(ConfigError, match="big"):
        validate_config(config)


def test_stage_hash_depends_on_exactly_its_sections_and_upstream(demo):
    base = {s: stage_hash(demo, s) for s in STAGES}
    changed = copy.deepcopy(demo)
    changed["zarr"]["t_chunk"] = 7
    after = {s: stage_hash(changed, s) for s in STAGES}
    assert {s for s in STAGES if after[s] != base[s]} == {"zarr", "validate"}
    changed = copy.deepcopy(demo)
    changed["extract"]["layers"] = [0, 1]
    after = {s: stage_hash(changed, s) for s in STAGES}
    assert all(after[s] != base[s] for s in STAGES)


def test_stage_dir_holds_the_config_it_was_made_from(demo, tmp_path):
    demo["dump_to"] = str(tmp_path)
    path = write_stage_config(demo, "pickle", sealed={})
    assert path.parent == stage_dir(demo, "pickle")
    import json
    recorded = json.loads(path.read_text())
    assert recorded["hash"] == path.parent.name
    assert recorded["config"] == stage_payload(demo, "pickle")["config"]
    assert recorded["upstream"]["extract"] == stage_hash(demo, "extract")


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text, why", [(b"model: [1, 2\nextract: {", "not valid YAML (while parsing"),
                                       (b"\xff\xfe: 1\n", "not valid YAML ('utf-8' codec can't decode"),
                                       (b"model: " + b"[" * 100_000 + b"]" * 100_000, "not valid YAML (nested too deeply")])
def test_a_config_file_that_is_not_yaml_is_named(tmp_path, text, why):
    """Bad YAML, text that is not UTF-8 and nesting too deep to parse: ConfigError naming the file
    (`actstore locate` printed a traceback)."""
    path = tmp_path / "config.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {why}")):
        load_config(path)


@pytest.mark.parametrize("section", ["model", "extract", "saev"])
def test_a_section_that_is_not_a_mapping_is_named(demo, section):
    """A section given as a list: the schema's type error, not an AttributeError from default filling."""
    with pytest.raises(ConfigError, match=re.escape(f"invalid config at {section}: [1] is not of type 'object'")):
        validate_config({**copy.deepcopy(demo), section: [1]})


@pytest.mark.parametrize("name", ["config.yaml", "osc.example.yaml"])
def test_library_validation_fills_what_the_snakefile_validation_fills(name):
    import yaml
    from snakemake.utils import validate

    raw = yaml.safe_load((tiny.REPO / "config" / name).read_text())
    for config in (raw, {"model": raw["model"], "dataset": raw["dataset"]}):
        by_snakemake = copy.deepcopy(config)
        validate(by_snakemake, str(tiny.REPO / "config" / "config.schema.yaml"))
        assert validate_config(copy.deepcopy(config)) == by_snakemake


@pytest.mark.parametrize("section, key, value", [
    ("saev", "jobs", 7), ("lmprobe", "jobs", 3), ("zarr", "merge_jobs", 5), ("zarr", "jobs", 2), ("pickle", "threads", 1),
    ("pickle", "jobs", 3), ("zarr", "threads", 3),
    ("extract", "writer_threads", 2)])
def test_execution_keys_leave_every_hash_alone(demo, section, key, value):
    changed = copy.deepcopy(demo)
    changed[section][key] = value
    assert {s: stage_hash(validate_config(changed), s) for s in STAGES} == {s: stage_hash(demo, s) for s in STAGES}


@pytest.mark.parametrize("n_items", [0, 1, 5, 17])
@pytest.mark.parametrize("jobs", [1, 2, 3, 8])
def test_job_items_cover_every_item_once_in_order_and_balanced(n_items, jobs):
    ranges = [job_items(n_items, jobs, job) for job in range(jobs)]
    assert [i for r in ranges for i in r] == list(range(n_items))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    with pytest.raises(ValueError, match="job 8"):
        job_items(n_items, 8, 8)


@pytest.mark.parametrize("n_items, jobs, other_jobs", [(10, 3, 4), (4096, 64, 7), (5, 8, 2), (64, 64, 64), (7, 2, 5)])
def test_jobs_covering_names_exactly_the_jobs_holding_a_range(n_items, jobs, other_jobs):
    """A zarr chunk-copy job (one split of the parts) waits for exactly the shard jobs (another
    split) that wrote any of its parts."""
    for other in range(other_jobs):
        items = job_items(n_items, other_jobs, other)
        expected = [job for job in range(jobs) if set(job_items(n_items, jobs, job)) & set(items)]
        assert list(jobs_covering(n_items, jobs, items)) == expected


def test_write_jobs_default_to_one_per_extraction_part_up_to_64(demo):
    assert write_jobs(demo, "saev") == demo["extract"]["parts"]
    many = copy.deepcopy(demo)
    many["extract"]["parts"] = 4096
    assert write_jobs(many, "lmprobe") == 64
    assert write_jobs(many, "pickle") == write_jobs(many, "zarr") == write_jobs(many, "zarr", "merge_jobs") == 64
    changed = copy.deepcopy(demo)
    changed["zarr"].update(jobs=3, merge_jobs=5)
    assert write_jobs(changed, "zarr") == 3 and write_jobs(changed, "zarr", "merge_jobs") == 5


@pytest.mark.parametrize("section, key, text, value", [
    ("pickle", "shard_size_mb", ".inf", "inf"), ("sae", "lr", ".nan", "nan"), ("sae", "heldout_fraction", ".NaN", "nan"),
    ("sae", "aux_coef", ".Inf", "inf")])
def test_a_yaml_nan_or_infinity_is_refused_naming_the_key(demo, tmp_path, section, key, text, value):
    """YAML's .nan and .inf passed the schema's bounds and were recorded in the stage config, which
    `actstore verify` then refused as not valid JSON: now the config is refused, naming the key."""
    raw = {"model": {"path": demo["model"]["path"]}, "dataset": {"path": demo["dataset"]["path"]}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw) + f"{section}:\n  {key}: {text}\n")
    with pytest.raises(ConfigError, match=re.escape(f"invalid config at {section}/{key}: {value} is not a finite number")):
        load_config(path)


@pytest.mark.parametrize("section, key, text", [("extract", "parts", "2.0"), ("lmprobe", "shard_bytes", "1.0e+9"),
                                                ("saev", "layers", "[1.0]")])
def test_a_float_for_an_integer_key_is_refused_naming_it(demo, tmp_path, section, key, text):
    """JSON Schema's integer takes 2.0: the Snakefile's parse then failed with a TypeError
    (range(2.0)), and where it ran, the same run hashed apart from the config saying 2."""
    raw = {"model": {"path": demo["model"]["path"]}, "dataset": {"path": demo["dataset"]["path"]}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw) + f"{section}:\n  {key}: {text}\n")
    with pytest.raises(ConfigError, match=f"invalid config at {section}/{key}.*is not of type 'integer'"):
        load_config(path)


@pytest.mark.parametrize("section, seed", [("sae", -1), ("validate", -1), ("sae", 2 ** 64)])
def test_a_seed_numpy_or_torch_refuses_is_refused_with_the_config(demo, section, seed):
    """A negative sae.seed or validate.seed passed the schema, and the stage's job died in numpy's
    default_rng after the extraction and every format were written (torch's manual_seed: over 2^64-1)."""
    config = copy.deepcopy(demo)
    config[section]["seed"] = seed
    with pytest.raises(ConfigError, match=f"invalid config at {section}/seed: {seed} is (less|greater) than"):
        validate_config(config)
    config[section]["seed"] = 0 if seed < 0 else 2 ** 64 - 1
    validate_config(config)
