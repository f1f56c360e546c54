"""Load a workflow config, validate it against the schema and fill its defaults."""
from __future__ import annotations

import copy
import functools
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from actstore.errors import ConfigError
from actstore.formats import FORMAT_STAGES

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")
REPO_ROOT = Path(__file__).resolve().parents[2]


def validate_config(config: dict[str, Any]) -> dict[str, Any]:
    """Validate `config` in place against the schema (filling defaults) and return it.

    The same JSON Schema draft and default filling as the Snakefile's `snakemake.utils.validate`
    (tested equal), with jsonschema alone, so the library runs where Snakemake is not installed
    (a GPU node running `run_part`, training code); stricter in what it takes for a number (see
    _default_filling_validator, reject_non_finite), so the Snakefile runs it too (rules/common.smk).
    An unknown, misspelled or mistyped key raises ConfigError naming it.
    """
    check_schema(config)
    reject_non_finite(config)
    check_paths(config)
    resolve_layers(config)
    check_sae_sizes(config["sae"])
    check_lut_targets(config)
    return config


def check_schema(config: dict[str, Any]) -> None:
    """`config` against the schema, its defaults filled in place; ConfigError naming the first key at
    fault in one line (the Snakefile runs it before Snakemake's validate, whose error for a misspelt key
    printed the whole schema, the key on its fourth of 150 lines)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_default_filling_validator().iter_errors(config))
    if error is not None:
        where = _where(error.absolute_path)
        why = error.schema.get("description") if isinstance(error.schema, dict) else None
        raise ConfigError(f"invalid config at {where}: {error.message}" + (f" ({why})" if why else ""))


# The keys holding a path (check_paths).
PATH_KEYS = (("dump_to",), ("model", "path"), ("dataset", "path"), ("saev", "patch_labels", "masks"),
             ("sae", "import", "path"))


def check_paths(config: dict[str, Any]) -> None:
    """ConfigError naming a path key whose value starts with `~`: only a shell expands it, never
    Snakemake or actstore, so `dump_to: ~/results` wrote every stage into a folder named `~` in the
    working directory with no error (where a `rm -rf ~` to tidy it removes the home folder)."""
    for keys in PATH_KEYS:
        value = functools.reduce(lambda node, key: (node or {}).get(key), keys, config)
        if isinstance(value, str) and value.startswith("~"):
            raise ConfigError(f"invalid config at {_where(keys)}: {value!r} starts with ~, which neither Snakemake "
                              f"nor actstore expands (it names a folder `~` in the working directory): write the "
                              f"path out, e.g. {os.path.expanduser(value)}")


def check_sae_sizes(sae: dict[str, Any]) -> None:
    """ConfigError naming both keys when the SAE to train keeps more latents per token than it has:
    the schema cannot relate two keys, and the sae stage refused it only once it started, after the
    extraction's GPU hours. An imported SAE's num_basis is its file's (checked when it is read)."""
    num_basis = sae["num_basis"]
    if sae["enabled"] and not sae["import"] and num_basis is not None and sae["k_active"] > num_basis:
        raise ConfigError(f"sae.k_active {sae['k_active']} is more than sae.num_basis {num_basis}: "
                          f"a TopK SAE keeps at most num_basis latents per token")


def check_lut_targets(config: dict[str, Any]) -> None:
    """ConfigError when the lut stage runs (sae and lut enabled) with no lut.targets: the sae job
    refused it only once it started, after the extraction's GPU hours."""
    if config["sae"]["enabled"] and config["lut"]["enabled"] and not config["lut"]["targets"]:
        raise ConfigError("lut.targets is empty while sae.enabled and lut.enabled are true: list the nn.Linear "
                          "(or transformers Conv1D) module paths that read sae.hook's tensor, or set "
                          "lut.enabled: false")


def reject_non_finite(value: Any, path: tuple[Any, ...] = ()) -> None:
    """ConfigError naming the first NaN or infinity (YAML's .nan, .inf) in `value`. The schema's bounds
    pass them (no comparison with NaN is true; infinity is above any minimum), a stage would run on
    them, and the stage config recording them would not be JSON (`actstore verify` refuses it).
    Called on a config the schema passed, so it recurses no deeper than the schema's sections."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"invalid config at {_where(path)}: {value} is not a finite number")
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        reject_non_finite(child, (*path, key))


def _where(path: Any) -> str:
    return "/".join(str(p) for p in path) or "top level"


def resolve_layers(config: dict[str, Any]) -> None:
    """extract.layers made block indices 0..n-1, in place: `all` = every block in order, a negative
    index counts from the last block (-1 = the last). The model's config.json is read only when one
    of them is used, so a config of plain indices needs no model folder (actstore locate)."""
    layers = config["extract"]["layers"]
    if layers != "all" and all(layer >= 0 for layer in layers):
        return
    from actstore.model_config import num_blocks, run_config

    n_blocks = num_blocks(run_config(config["model"]))
    if layers == "all":
        config["extract"]["layers"] = list(range(n_blocks))
        return
    beyond = [layer for layer in layers if layer < -n_blocks]
    if beyond:
        raise ConfigError(f"extract.layers: {beyond} out of range; the model has blocks 0..{n_blocks - 1} "
                          f"(-1..-{n_blocks} from the last)")
    resolved = [layer % n_blocks if layer < 0 else layer for layer in layers]
    if len(set(resolved)) < len(resolved):
        raise ConfigError(f"extract.layers: {layers} name a block twice (the model has {n_blocks}: {resolved})")
    config["extract"]["layers"] = resolved


def _default_filling_validator():
    """A Draft 2020-12 validator that fills each property's schema default before checking it, and
    whose integers are ints: the draft's integer takes 2.0, which the workflow cannot count with
    (range(parts)) and which hashes apart from 2, so the same run would be made twice."""
    from jsonschema import Draft202012Validator, validators

    check_properties = Draft202012Validator.VALIDATORS["properties"]

    def fill_defaults(validator, properties, instance, schema):
        # Only into an object: a section given as a list or a number is the type error "type" names.
        for name, subschema in properties.items() if validator.is_type(instance, "object") else ():
            if "default" in subschema:
                instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from check_properties(validator, properties, instance, schema)

    ints = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda checker, instance: isinstance(instance, int) and not isinstance(instance, bool))
    filling = validators.extend(Draft202012Validator, {"properties": fill_defaults}, type_checker=ints)
    return filling(config_schema())


@functools.cache
def config_schema() -> dict[str, Any]:
    """config.schema.yaml, read once (a Snakefile parse validates and hashes every stage)."""
    return yaml.safe_load(SCHEMA_PATH.read_text())


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader (YAML 1.1, as Snakemake reads a config), refusing the plain numbers that
    YAML 1.1 reads apart from YAML 1.2 and Python: a zero-padded `010` is octal 8 and `1:30` is
    base 60 (90), so `layers: [010, 011]` would extract blocks 8 and 9 with no error. Hex, binary and
    underscores (0x10, 0b101, 1_000) read the same everywhere and pass; quoted scalars are text.
    A key given twice in one mapping is refused too (_refuse_repeated_keys)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        _refuse_repeated_keys(self, node)
        return super().construct_mapping(node, deep)


def _refuse_repeated_keys(loader: _ConfigLoader, node: yaml.MappingNode) -> None:
    """ConfigError naming the file, lines and key given twice in the mapping `node`: PyYAML and
    Snakemake keep the last, so a second `sae:` appended to a config replaced the whole first section
    (enabled: true gone, no SAE stage) with no error. The keys a merge (`<<: *defaults`) brings may
    be given again: overriding them is what a merge is for."""
    first_lines: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
            continue  # a key that is a list or mapping: SafeLoader refuses it as unhashable
        key, mark = loader.construct_object(key_node), key_node.start_mark
        if key in first_lines:
            raise ConfigError(f"{mark.name}, line {mark.line + 1}: {key!r} is given again (first on line "
                              f"{first_lines[key]}); YAML keeps only the last, dropping the first: merge them")
        first_lines[key] = mark.line + 1


def _refusing_yaml11_spellings(construct):
    """`construct` (SafeLoader's int or float), refusing a plain scalar YAML 1.1 reads apart."""
    def checked(loader: _ConfigLoader, node: yaml.ScalarNode) -> Any:
        value = construct(loader, node)
        if node.style is not None:  # quoted: a number only when tagged !!int or !!float, as asked
            return value
        digits = node.value.lstrip("+-").replace("_", "")
        if ":" in node.value:
            why, fix = "is base 60 to YAML 1.1 (PyYAML, Snakemake), which reads it as", "write the number itself"
        elif digits.isdigit() and len(digits) > 1 and digits[0] == "0":
            why = "has a leading zero, so YAML 1.1 (PyYAML, Snakemake) reads it as octal"
            fix = "write it without the leading zero"
        else:
            return value
        mark = node.start_mark
        raise ConfigError(f"{mark.name}, line {mark.line + 1}: {node.value} {why} {value}; "
                          f"{fix}, or quote it if it is text")
    return checked


_ConfigLoader.add_constructor("tag:yaml.org,2002:int",
                              _refusing_yaml11_spellings(_ConfigLoader.construct_yaml_int))
_ConfigLoader.add_constructor("tag:yaml.org,2002:float",
                              _refusing_yaml11_spellings(_ConfigLoader.construct_yaml_float))


def check_yaml_numbers(paths: Iterable[str | Path]) -> None:
    """ConfigError naming the file, line and number for the first number spelled as YAML 1.1 reads
    apart from YAML 1.2 and Python (_ConfigLoader), or the key given twice in one mapping, of which
    Snakemake kept the last (_refuse_repeated_keys), in the config files Snakemake read
    (workflow.configfiles; the Snakefile, before validating them), each read as Snakemake reads it: JSON first (whose
    numbers mean one thing, and which YAML 1.1 does not always parse), then YAML."""
    for path in paths:
        _read_config_file(Path(path))


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a config file as Snakemake reads one (_read_config_file), validate it and return the
    resolved (defaults filled) dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        config = _read_config_file(path)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML (nested too deeply to parse)") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(config).__name__}")
    return validate_config(copy.deepcopy(config))


def _read_config_file(path: Path) -> Any:
    """The document in `path`, read as Snakemake's load_configfile reads a configfile, whatever its
    name: JSON if it parses as JSON, else YAML. So a JSON config's `2e-3` is the float the workflow
    runs with (YAML 1.1 reads it as text) and a tab-indented one parses. Only YAML goes through
    _ConfigLoader: JSON has no octal or base 60. Read from the file, so a YAML mark names it."""
    with path.open(encoding="utf-8") as fh:
        try:
            return json.load(fh, object_pairs_hook=functools.partial(_unrepeated_json_keys, path))
        except json.JSONDecodeError as json_error:
            fh.seek(0)
            try:
                return yaml.load(fh, Loader=_ConfigLoader) or {}
            except yaml.YAMLError as yaml_error:
                raise ConfigError(f"{path}: not valid YAML ({yaml_error}), nor JSON (line {json_error.lineno}, "
                                  f"column {json_error.colno}: {json_error.msg})") from None


def _unrepeated_json_keys(path: Path, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict; ConfigError naming a key it gives twice (JSON readers keep the last)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ConfigError(f"{path}: {key!r} is given twice in one object; JSON readers keep only the last, "
                              f"dropping the first: merge them")
        seen.add(key)
    return dict(pairs)


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


SAELENS_WEIGHTS = "sae_weights.safetensors"  # in the folder SAELens saves (save_model, the sae stage's saelens/)
SAELENS_CFG = "cfg.json"


def import_files(path: str | Path, style: str) -> list[Path]:
    """The files sae.import reads (`path`, `style`), the checkpoint first: for saelens, the weights (in
    the folder SAELens saves, when `path` is one) and the cfg.json beside them, which decides the
    encoding. The sae stage's hash names their path, not their bytes: rules/sae.smk makes them inputs
    of its rule (a file replaced at its path reruns it) and the stage records their sha256. Here, not
    in actstore.sae, which imports torch: the Snakefile's parse must not."""
    path = Path(path)
    if style == "saelens" and path.is_dir():
        # Without cfg.json whether b_dec is subtracted before encoding is unknown: the weights alone were
        # imported as a bare file (subtracted), silently another SAE than the one saved with apply_b_dec_to_input
        # false (the sae stage's saelens/ copy), as SAELens' own load_from_disk would refuse the folder.
        if not (path / SAELENS_CFG).is_file():
            raise ConfigError(f"sae.import.path {path}: a SAELens folder without {SAELENS_CFG}, which says how its "
                              f"SAE encodes (apply_b_dec_to_input, architecture, k); copy the folder whole, or name "
                              f"{SAELENS_WEIGHTS} itself to import it as a bare SAELens file (b_dec subtracted)")
        path = path / SAELENS_WEIGHTS
    cfg_path = path.with_name(SAELENS_CFG)
    return [path, cfg_path] if style == "saelens" and cfg_path.is_file() else [path]


def resolve_hook(config: dict[str, Any]) -> str:
    """sae.hook, or the first ':input' entry of extract.hooks; must be captured by extract.hooks."""
    hook = config["sae"].get("hook")
    hooks = config["extract"]["hooks"]
    if hook is None:
        inputs = [h for h in hooks if h.endswith(":input")]
        if not inputs:
            raise ConfigError("sae.hook is null and extract.hooks has no '<module>:input' capture; "
                              "add the target modules' input to extract.hooks or set sae.enabled: false")
        return inputs[0]
    if hook not in hooks:
        raise ConfigError(f"sae.hook {hook!r} is not captured: extract.hooks = {hooks}; add it there")
    return hook
