#!/usr/bin/env bash
# The GPU benchmarks in one device call per phase (see ../shared/docs/gpu-measurement.md).
#   bench/gpu_suite.sh extract DEST  bench_extract: llama-1b 4 layers, all 16 layers, vit-b14; the ViT loader items' pixels
#   bench/gpu_suite.sh sae-lut DEST  bench_lut llama8b-mlp, bench_sae, bench_saev on the node's cores,
#                                    and the CUDA tests
#   bench/gpu_suite.sh writers DEST  bench_writers on the node's NVMe (8 GB, 8 parts, 8 scattered jobs):
#                                    issue 18's 0.8 x cp goal, which the development VM's disk cannot measure;
#                                    bench_verify with 1-8 files checked at once on the node's 16 cores
# Needs torch + transformers (the GPU image); jsonschema, zarr, numcodecs, isal (cp312 wheels, with
# their dependencies) from .whl, which bench/gpu_wheels.sh fetches here: name .whl in the call's carry.
set -uo pipefail
phase=$1 out=$(mktemp -d) dest=$2   # results tarred into $2 (the device tool fetches few files)
PROFILE=${PROFILE---profile}        # env: REPEATS (3), PROFILE ('' to skip), LUT (1: bench_lut after extract)
trap 'tar czf "$dest/$phase.tgz" -C "$out" .' EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
case $phase in
extract)
  # The image's processors are torchvision-backed (the VM's are PIL): the same pixels whole and in loader items?
  python3 bench/bench_extract.py --check-items 2>&1 | grep -v Warn | tee "$out/items.log" | tail -3
  # The last ViT row leaves a core each to the main process and the 2 writer threads (issue 14's next step).
  for args in "--shape llama-1b" "--shape llama-1b --all-layers --limit 128" "--shape vit-b14 --limit 4096" \
      "--shape vit-b14" "--shape vit-b14 --num-workers $(( $(nproc) - 3 ))" \
      "--shape wide-vocab --limit 2048" "--shape wide-vocab --limit 2048 --no-token-logprobs"; do
    name=$(echo "$args" | tr -d ' -' )
    python3 bench/bench_extract.py $args --device cuda --repeats ${REPEATS:-3} $PROFILE --out "$out/$name.json" \
      > "$out/$name.log" 2>&1 || echo "FAILED $args"
    grep -vE "it/s|s/it" "$out/$name.log" | tail -22 | grep -vE "^(cpus|buffers|writer_threads|device) "
    tar czf "$dest/$phase.tgz" -C "$out" .   # after each bench: a run cut off still returns what it did
  done
  [ -n "${LUT:-}" ] && python3 bench/bench_lut.py --device cuda --shape llama8b-mlp 2>&1 | tee "$out/lut.log" | tail -12 ;;
sae-lut)
  python3 bench/bench_lut.py --device cuda --shape llama8b-mlp 2>&1 | tee "$out/lut.log" | tail -15
  python3 bench/bench_sae.py --device cuda --shape gpu --rows 262144 2>&1 | tee "$out/sae.log" | tail -10
  python3 setup.py -q build_ext --inplace > "$out/build_ext.log" 2>&1 || echo "C fill not built"
  python3 bench/bench_saev.py --size-mb 4096 --fill-threads 1 2 4 8 16 --repeat 5 \
    2>&1 | tee "$out/saev.log" | tail -25
  python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_extract.py tests/test_lut.py tests/test_sae.py 2>&1 | tee "$out/pytest.log" | tail -8 ;;
writers)
  python3 setup.py -q build_ext --inplace > "$out/build_ext.log" 2>&1 || echo "C fill not built"
  python3 bench/bench_writers.py --gb 8 --parts 8 --jobs 8 --repeat 3 --work /tmp/writers \
    --only saev lmprobe zarr "pickle (gzip-1), 2" 2>&1 | tee "$out/writers.log" | tail -14
  cp bench/out/writers.json "$out/"
  python3 bench/bench_verify.py --size-mb 8192 --shards 16 --threads 1 2 4 8 2>&1 | tee "$out/verify.log" | tail -6 ;;
esac
