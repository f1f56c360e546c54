"""Review 63 of the config and its stage hashes: a part count that stalled the parse, a `~` that no
one expands, and a stage directory copied under another stage's folder."""
from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tiny
from actstore.config import validate_config
from actstore.errors import ConfigError
from actstore.hashing import stage_dir, stage_problems, write_stage_config

BASE = {"dump_to": "dump", "model": {"path": "model"}, "dataset": {"path": "docs.jsonl"},
        "extract": {"layers": [0], "hooks": ["a.c:input"]}}
ACTSTORE = str(Path(sys.executable).with_name("actstore"))
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def config_with(**sections: dict) -> dict:
    config = copy.deepcopy(BASE)
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


@pytest.mark.parametrize("section, key", [("extract", "parts"), ("saev", "jobs"), ("pickle", "jobs"),
                                          ("lmprobe", "jobs"), ("zarr", "jobs"), ("zarr", "merge_jobs")])
def test_a_part_or_job_count_that_would_stall_the_parse_is_refused_naming_it(section, key):
    """The Snakefile lists every part and writer job at parse time (PARTS, SAEV_JOBS...): 10^11 of them
    held the parse for hours and all the memory, where a named error was due. 100,000 (25x the 4,096
    parts docs/scale.md plans, 10x the jobs a Slurm cluster queues by default) still passes."""
    validate_config(config_with(**{section: {key: 100_000}}))
    with pytest.raises(ConfigError, match=f"invalid config at {section}/{key}: 100000000000 is greater than "
                                          f"the maximum of 100000"):
        validate_config(config_with(**{section: {key: 10**11}}))


@pytest.mark.parametrize("where, value", [
    ("dump_to", "~/results"), ("model/path", "~/models/bert"), ("dataset/path", "~user/docs.jsonl"),
    ("saev/patch_labels/masks", "~/masks"), ("sae/import/path", "~/sae.safetensors")])
def test_a_path_starting_with_a_tilde_is_refused_naming_the_key(where, value):
    """Neither Snakemake nor actstore expands `~`: `dump_to: ~/results` wrote every stage into a folder
    named `~` in the working directory (where `rm -rf ~` removes the home folder), with no error."""
    config = copy.deepcopy(BASE) | {"saev": {"patch_labels": {"masks": "masks"}},
                                    "sae": {"import": {"path": "sae.safetensors", "style": "saelens"}}}
    *sections, key = where.split("/")
    node = config
    for section in sections:
        node = node[section]
    node[key] = value
    with pytest.raises(ConfigError, match=f"invalid config at {where}: {value!r} starts with ~, which"):
        validate_config(config)


def test_a_tilde_inside_a_path_is_a_plain_character():
    validate_config(config_with(dump_to="runs/~old", dataset={"path": "data/a~b.jsonl"}))


def test_a_stage_directory_copied_under_another_stages_folder_is_a_problem(tmp_path):
    """A stage directory keeps its hash as its name when copied, so the stage config's hash check
    passed an sae stage found at {dump_to}/lut/<hash>/ (or a pickle store at saev/<hash>/), and
    `actstore verify` said OK of a folder holding another stage than its path says."""
    config = validate_config(config_with(dump_to=str(tmp_path / "dump")))
    sae = stage_dir(config, "sae")
    sae.mkdir(parents=True)
    write_stage_config(config, "sae", sae, sealed={})
    assert stage_problems(sae) == []
    copied = tmp_path / "dump" / "lut" / sae.name
    shutil.copytree(sae, copied)
    problems = stage_problems(copied)
    assert len(problems) == 1 and "the config of stage 'sae', found in lut/" in problems[0], problems
    verify = subprocess.run([ACTSTORE, "verify", str(copied)], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 1 and "found in lut/" in verify.stdout, verify.stdout + verify.stderr


def test_a_dump_to_holding_a_brace_is_refused_naming_it(tmp_path, model_dir, text_jsonl):
    """Every rule's paths are {dump_to}/...: a brace in dump_to made a Snakemake wildcard of it, and the
    parse stopped with a bare "WildcardError in rules/extract.smk: No values given for wildcard 'x'"."""
    config = tiny.make_config(tmp_path, model_dir("bert"), text_jsonl, sae={"enabled": False})
    config["dump_to"] = str(tmp_path / "runs" / "{x}")
    configfile = tiny.save_config(config, tmp_path / "config.yaml")
    proc = subprocess.run([SNAKEMAKE, "-s", str(tiny.REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
                           str(configfile), "--cores", "1", "-n"], capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "WildcardError" not in output, output[-2000:]
    assert f"ConfigError in file \"{tiny.REPO / 'rules' / 'common.smk'}\"" in output, output[-2000:]
    assert f"dump_to {config['dump_to']!r}: a brace is a wildcard" in output, output[-2000:]


def test_a_misspelt_key_is_named_in_one_line_by_the_parse(tmp_path):
    """extract.max_seq_lenght: Snakemake's validate printed the whole schema, the key on its fourth of
    ~150 lines; the parse names it in one line first."""
    import yaml
    from test_workflow import REPO, demo_config

    config = demo_config(tmp_path / "dump")
    config["extract"]["max_seq_lenght"] = 64
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--configfile",
                           str(tmp_path / "c.yaml"), "-n"], capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "invalid config at extract: Additional properties are not allowed ('max_seq_lenght' was unexpected)" \
        in output
    assert len(output.splitlines()) < 20, output
