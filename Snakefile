# actstore: extraction -> sharding -> indexing -> LUT precomputation -> validation.
# Every stage writes under {dump_to}/{stage}/{hash}/ (see rules/common.smk and README.md).
from snakemake.utils import min_version, validate

from actstore.config import check_schema, check_yaml_numbers

min_version("9.0")


# The demo config is the default; a --configfile replaces it instead of being merged into it, so a
# key left out of a user's config takes the schema default, never the demo's value.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"



# Snakemake read the config files as YAML 1.1, to which a zero-padded 010 is octal 8 and 1:30 is 90:
# refuse such numbers, naming the file and line, before the config they made is validated or used.
check_yaml_numbers(workflow.configfiles)
# A key at fault named in one line first: Snakemake's own error prints the whole schema around it.
check_schema(config)
validate(config, "config/config.schema.yaml")


include: "rules/common.smk"


rule all:
    input:
        all_targets,
    default_target: True


include: "rules/extract.smk"
include: "rules/saev.smk"
include: "rules/zarr.smk"
include: "rules/pickle.smk"
include: "rules/lmprobe.smk"
include: "rules/sae.smk"
include: "rules/lut.smk"
include: "rules/validate.smk"
