"""Rule lmprobe_dataset: the finishing job. Moves the scatter jobs' tensor files into the dataset,
streams the index, writes README.md and SHA256SUMS, then checks what it can without re-reading the
tensor bytes (the validate stage and `actstore verify` hash everything)."""
import os
from pathlib import Path

# Before pyarrow loads: arrow's default allocator (mimalloc) held 6-13 MB more while the index was
# written, at random, and more the longer the index; the C library's malloc 1-3.5 MB (docs/scale.md).
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

from actstore.workflow import setup_logging, stage_rule

setup_logging(snakemake)  # before the other imports: one failing (torch, CUDA) is logged too

from actstore.errors import FormatError
from actstore.formats import lmprobe
from actstore.model_config import trusted

with stage_rule(snakemake, "lmprobe", Path(snakemake.output.stage_config).parent) as config:
    out = Path(snakemake.output.dataset)
    lmprobe.finish_dataset(Path(snakemake.input.index).parent, list(snakemake.input.jobs), out, config["lmprobe"],
                           trust_remote_code=trusted(config["model"]))
    problems = lmprobe.verify(out, checksums=False)  # sizes, headers, index columns, card and index hashes
    if problems:
        raise FormatError(f"{out}: freshly written dataset fails verification:\n" + "\n".join(problems))
