"""Rule lmprobe_dataset: write the extraction as an lmprobe 2.0 dataset, then check it end to end."""
from pathlib import Path

from actstore.errors import FormatError
from actstore.formats import lmprobe
from actstore.workflow import stage_rule

with stage_rule(snakemake, "lmprobe", Path(snakemake.output.stage_config).parent) as config:
    out = Path(snakemake.output.dataset)
    lmprobe.write_dataset(Path(snakemake.input.index).parent, out, config["lmprobe"])
    problems = lmprobe.verify(out)  # every checksum, column and shard header, before declaring success
    if problems:
        raise FormatError(f"{out}: freshly written dataset fails verification:\n" + "\n".join(problems))
