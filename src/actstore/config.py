"""Load a workflow config, validate it against the schema and fill its defaults."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from actstore.errors import ConfigError
from actstore.formats import FORMAT_STAGES

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")
REPO_ROOT = Path(__file__).resolve().parents[2]


def validate_config(config: dict[str, Any]) -> dict[str, Any]:
    """Validate `config` in place against the schema (filling defaults) and return it.

    An unknown, misspelled or mistyped key raises ConfigError naming it.
    """
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    try:
        validate(config, str(SCHEMA_PATH), set_default=True)
    except WorkflowError as exc:
        raise ConfigError(f"invalid config: {exc}") from None
    return config


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file, validate it and return the resolved (defaults filled) dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with path.open() as fh:
        config = yaml.safe_load(fh) or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(config).__name__}")
    return validate_config(copy.deepcopy(config))


def enabled_stages(config: dict[str, Any]) -> list[str]:
    """Stages the config produces, in chain order."""
    stages = ["extract"] + [s for s in FORMAT_STAGES if config[s].get("enabled", True)]
    if config["sae"].get("enabled", True):
        stages.append("sae")
        if config["lut"].get("enabled", True):
            stages.append("lut")
    if config["validate"].get("enabled", True):
        stages.append("validate")
    return stages
