#!/usr/bin/env bash
# Fetch into .whl/ the cp312 wheels bench/gpu_suite.sh installs on the GPU machine, whose image lacks
# them: the versions pyproject.toml pins, and what they need beyond the image (torch, transformers,
# numpy, pyyaml, packaging, typing_extensions are there). Run here, then name .whl in the device
# call's carry (git ignores it through .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
pin() { grep -oE "\"$1==[^\"]+\"" pyproject.toml | tr -d '"'; }
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .whl "$@"
}
fetch "$(pin zarr)" "$(pin numcodecs)" "$(pin jsonschema)" "$(pin isal)" "$(pin zstandard)"
# zarr's and jsonschema's own needs, at the versions `make install` resolves here
# (unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist lists them)
fetch donfig==0.8.1.post1 google-crc32c==1.9.0 attrs==26.1.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1
# the sampler gpu_suite.sh runs the rows named in SPY under (bench/spy_summary.py reads what it records)
fetch py-spy==0.4.3
ls .whl
