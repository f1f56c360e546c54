"""Stage hashes of equivalent spellings of a config: a cosmetic edit must not re-run a stage."""
from __future__ import annotations

import copy

import pytest
import yaml

import tiny
from actstore import hashing
from actstore.config import load_config
from actstore.hashing import stage_hashes

DEMO = tiny.REPO / "config" / "config.yaml"


def hashes_of(tmp_path, name: str, section: str, key: str, value) -> dict[str, str]:
    """Stage hashes of the demo config with section.key set to `value`, loaded from a YAML file as the
    Snakefile loads it (so 50.0 is the float YAML reads)."""
    config = yaml.safe_load(DEMO.read_text())
    config.setdefault(section, {})[key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return stage_hashes(load_config(path))


@pytest.mark.parametrize("section, key, whole", [("pickle", "shard_size_mb", 50), ("sae", "lr", 1),
                                                 ("sae", "aux_coef", 0)])
def test_a_whole_float_in_a_number_key_hashes_as_the_int(tmp_path, section, key, whole):
    as_int = hashes_of(tmp_path, "int", section, key, whole)
    assert hashes_of(tmp_path, "float", section, key, float(whole)) == as_int


def test_a_default_spelled_as_a_float_hashes_as_the_default(tmp_path):
    """pickle.shard_size_mb's default is 100: `shard_size_mb: 100.0` is the same pickle stage."""
    assert hashes_of(tmp_path, "float", "pickle", "shard_size_mb", 100.0) == stage_hashes(load_config(DEMO))


@pytest.mark.parametrize("section, key, value", [(None, None, None), ("pickle", "shard_size_mb", 250),
                                                 ("pickle", "shard_size_mb", 0.5), ("sae", "lr", 0.002),
                                                 ("sae", "aux_coef", 1), ("sae", "heldout_fraction", 0.25)])
def test_configs_without_a_whole_float_keep_their_hashes(monkeypatch, section, key, value):
    """The demo config, and it with number keys spelled as ints or fractions, hash as before
    (hashed without the whole-float normalisation: the payload earlier releases hashed)."""
    config = load_config(DEMO)
    if section is not None:
        config[section][key] = value
    now = stage_hashes(copy.deepcopy(config))
    monkeypatch.setattr(hashing, "_integral_numbers_as_ints", lambda section, values: values)
    assert now == stage_hashes(config)
