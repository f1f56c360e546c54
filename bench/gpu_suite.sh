#!/usr/bin/env bash
# The GPU benchmarks, each step under its own time limit, results tarred into DEST after every step
# (a call cut off still returns what ran). See ../shared/docs/gpu-measurement.md.
#   bench/gpu_suite.sh all DEST      what a 15-minute lease holds, in priority order: the CUDA tests, the
#                                    issues' extraction rows, lut, sae, writers with pickle/zarr threads
#   bench/gpu_suite.sh changes DEST  what sessions 53-54 left to find out, the issues' open goals first: the
#                                    CUDA tests (extract.image_pipeline gpu's among them, never yet run on a
#                                    GPU); the 1,024-image ViT row with 13 workers on the gpu pipeline, then on
#                                    the cpu one (0.79-0.80 of the loading rate in session 52, goal 0.8); the
#                                    zarr shard jobs at 1, 4 and 8 threads with every module byte-compiled
#                                    first and one 8-thread job under py-spy (zarrspy: how much of its
#                                    threads' time is a wait for the GIL); the Llama-1B 4-layer row on 2,048
#                                    texts (llama4long: 17 GB, the disk bound measured on 16 GiB, so the
#                                    startup before the first output is a part's share, not a third of it);
#                                    bench_image_decode (the pipelines' rates and pixel difference, and the
#                                    cpu pipeline with the processor's PIL backend)
#   bench/gpu_suite.sh extract DEST  bench_extract: llama-1b 4 layers, all 16 layers, vit-b14, wide-vocab
#                                    (log-probs in chunks of 2**26 and 2**28 logits, and none);
#                                    the ViT processors' pixels whole and in loader items; the ViT write pattern;
#                                    and (this phase only) vit-b14 on 4 CPUs
#   bench/gpu_suite.sh sae-lut DEST  bench_lut llama8b-mlp, bench_sae, bench_saev on the node's cores,
#                                    and the CUDA tests
#   bench/gpu_suite.sh writers DEST  bench_writers on the node's disk (8 GB, 8 parts, 8 scattered jobs,
#                                    pickle and zarr shard jobs of 1 and 4 threads):
#                                    issue 18's 0.8 x cp goal; bench_verify with 1-8 files checked at once
# Needs torch + transformers (the GPU image); jsonschema, zarr, numcodecs, isal (cp312 wheels, with
# their dependencies) from .whl, which bench/gpu_wheels.sh fetches here: name .whl in the call's carry.
# env: FROM (skip the steps before this one: resume a call cut at its limit); BUDGET (seconds, default 590: no
# step runs past it, each cut to what is left); REPEATS (rounds per extraction row, default 2); PROFILE (rows
# also run under cProfile: the main thread's Python) and TRACE (rows also run under torch.profiler: how busy the GPU was, its top
# kernels): by default the ViT row, whose gap session 36's run left open; SPY (rows run under py-spy,
# which samples every thread, running or waiting, with native frames: bench/spy_summary.py).
set -uo pipefail
phase=$1 dest=$2 out=$(mktemp -d) t0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl 2>&1 | grep -v "already exists" || true
  export PYTHONPATH=/tmp/site
fi
# Byte-compiled before any row: on session 52's node no job reused a .pyc (the zarr shard job under
# py-spy compiled zarr's sources on its import thread, after ten jobs had imported zarr), so each job
# paid its imports' compiling, holding the GIL its chunk threads waited on
python3 -m compileall -q -j 0 src ${PYTHONPATH:+/tmp/site} > /dev/null 2>&1 || true
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
# what the rows import, named before any runs (a module missing here fails every row that needs it)
python3 -c "
import importlib.metadata as m, importlib.util as u, sys
def have(module, dist):
    try:
        return m.version(dist) if u.find_spec(module) else 'MISSING'
    except Exception as exc:  # a module without its distribution's metadata
        return type(exc).__name__
print('python', sys.version.split()[0], *(f'{n}={have(n, d)}' for n, d in (('torch', 'torch'),
      ('transformers', 'transformers'), ('torchvision', 'torchvision'), ('pyarrow', 'pyarrow'), ('zarr', 'zarr'),
      ('numcodecs', 'numcodecs'), ('jsonschema', 'jsonschema'), ('isal', 'isal'), ('zstandard', 'zstandard'),
      ('PIL', 'pillow'), ('pytest', 'pytest'), ('setuptools', 'setuptools'), ('triton', 'triton'))))" \
  2>&1 | tee -a "$out/device.txt"
SHOW='^(shape|layers_digest|memory_available|model_|logprob_elements|write_bytes|bare_forward_s|first_output_s|extract_s|bytes_written|.*rounds_s|extract_waits|bare_loop|gpu_only|disk_bound|floor|ratio|fraction|trace_|bound_by|synthetic|hashed|image_|.*peak_gpu)|equal|DIFFER|Error|FAILED|passed|failed|^ *[0-9]+ |^(dense|lookup|encode|A\+B|A: |B triton|candidate)|^(on device|prefetched|inline)|images_per_s|^pixels_|^processor|^warm|^\||chunk files of|GB of memory|GB a row|FSTYPE|ext4|xfs|transaction|scheduler'
reached=${FROM:+no}  # FROM=NAME: skip the steps before NAME (a second call resuming one cut at its limit)
step() {  # step NAME SECONDS COMMAND...: its log in the tarball, the lines worth reading printed
  local name=$1 limit=$2 started=$(date +%s); shift 2
  [[ $reached == no && $name != "${FROM-}" ]] && { echo "== $name: skipped (FROM=$FROM)"; return 0; }
  reached=yes
  # no step past BUDGET seconds of the call (default 590, under the device call's 600 s limit): one cut by
  # its own timeout still leaves its log in the tarball, one cut by the call's limit leaves nothing
  local left=$(( ${BUDGET:-590} - ($(date +%s) - t0) ))
  (( left < 10 )) && { echo "== $name: skipped (${left} s left of BUDGET ${BUDGET:-590})"; return 0; }
  (( left < limit )) && limit=$left
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - started )) s (at $(( $(date +%s) - t0 )) s)"
  grep -vE 'it/s|s/it|[Ww]arn|\.py:[0-9]|\{(built-in|method)' "$out/$name.log" | grep -E "$SHOW" | head -40
  # written aside, then renamed: a call cut at its limit while tar runs keeps the last whole tarball
  tar czf "$dest/.$phase.tgz.part" -C "$out" . && mv -f "$dest/.$phase.tgz.part" "$dest/$phase.tgz"
}
E="python3 bench/bench_extract.py --device cuda --repeats ${REPEATS:-2}"
row() {  # row NAME SECONDS ARGS...: one bench_extract row, profiled when NAME is in PROFILE
  local name=$1 limit=$2; shift 2
  local extra=
  [[ " ${PROFILE-} " == *" $name "* ]] && extra+=" --profile"
  [[ " ${TRACE-vit13} " == *" $name "* ]] && extra+=" --trace"
  local spy=
  [[ " ${SPY-} " == *" $name "* && -x /tmp/site/bin/py-spy ]] &&
    spy="/tmp/site/bin/py-spy record -r 100 --idle --native --threads --format raw -o $out/$name.spy.txt --"
  step "$name" "$limit" $spy $E "$@" $extra --out "$out/$name.json"
  [[ -n $spy && -f $out/$name.spy.txt ]] && python3 bench/spy_summary.py "$out/$name.spy.txt" > "$out/$name.spy-summary.txt" 2>&1
}
extract() {
  step items 60 python3 bench/bench_extract.py --check-items
  row llama4 90 --shape llama-1b
  row vit13 90 --shape vit-b14 --num-workers $(( $(nproc) - 3 ))  # a core each: main process, 2 writers
  row wide 90 --shape wide-vocab --limit 2048
  row widenl 60 --shape wide-vocab --limit 2048 --no-token-logprobs
  row widechunk 60 --shape wide-vocab --limit 2048 --logprob-elements $(( 1 << 28 ))  # a batch's log-probs: 1 head rerun, not 4
  row llama16 90 --shape llama-1b --all-layers --limit 128 --repeats 3
  row vit4k 90 --shape vit-b14 --limit 4096 --num-workers $(( $(nproc) - 3 ))
  # the ViT rows' write pattern alone (257-token samples, 2 files) on this host's disk and cores
  step synvit 60 python3 bench/bench_extract.py --device cuda --synthetic --synthetic-shape vit-b14 --synthetic-gb 3 \
    --repeats 2 --out "$out/synvit.json"
}
LUT="python3 bench/bench_lut.py --device cuda --shape llama8b-mlp"
SAE="python3 bench/bench_sae.py --device cuda --shape gpu --rows 262144"
CUDA_TESTS="python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_extract.py tests/test_lut.py tests/test_sae.py \
  tests/test_sae_divergence_import_memory.py tests/test_device_images.py"
lut_sae() { step lut 90 $LUT; step sae 60 $SAE; step pytest 120 $CUDA_TESTS; }
build_ext() { python3 setup.py -q build_ext --inplace > "$out/build_ext.log" 2>&1 || echo "C extensions not built"; }
case $phase in
all)  # the issues' goals, the CUDA tests first (sessions 37-39 added some that had not run on a GPU)
  step pytest 120 $CUDA_TESTS
  row llama4 90 --shape llama-1b
  row vit13 90 --shape vit-b14 --num-workers $(( $(nproc) - 3 ))
  row vit4k 90 --shape vit-b14 --limit 4096 --num-workers $(( $(nproc) - 3 ))
  row llama16 90 --shape llama-1b --all-layers --limit 128 --repeats 3
  row widenl 60 --shape wide-vocab --limit 2048 --no-token-logprobs
  step lut 90 $LUT
  step sae 60 $SAE
  build_ext
  step writers 200 python3 bench/bench_writers.py --gb 4 --parts 4 --jobs 4 --work /tmp/writers \
    --thread-counts 1 2 4 --only saev lmprobe zarr "pickle (gzip-1, isal)" ;;
changes)  # the open goals first: issue 14's ViT row on the gpu pipeline, issue 18's zarr shard, the Llama
  # row at a size where its first output's startup is amortised; then the image-decode questions
  step pytest 150 $CUDA_TESTS
  row vit13gpu 90 --shape vit-b14 --num-workers $(( $(nproc) - 3 )) --repeats 3 --image-pipeline gpu
  row vit13 90 --shape vit-b14 --num-workers $(( $(nproc) - 3 )) --repeats 3
  build_ext
  step writers 150 python3 bench/bench_writers.py --gb 6 --parts 3 --jobs 3 --work /tmp/writers \
    --thread-counts 1 4 8 --only "zarr shard"
  # one 8-thread zarr shard job (a 2 GB part) under py-spy: where its threads wait (GIL, mkdir, write, hash)
  [[ -x /tmp/site/bin/py-spy ]] && step zarrspy 60 bash -c "sync; /tmp/site/bin/py-spy record -r 100 --idle --native \
    --threads --format raw -o $out/zarrspy.spy.txt -- python3 bench/bench_writers.py --job zarr --threads 8 --part 0 \
    --extract /tmp/writers/extract-6gb-3p-d1024/float32 --out /tmp/writers/spy-\$RANDOM; \
    python3 bench/spy_summary.py $out/zarrspy.spy.txt --top 6 > $out/zarrspy.spy-summary.txt"
  rm -rf /tmp/writers  # the disk's room for llama4long's 17 GB part and 16 GiB bandwidth file
  row llama4long 150 --shape llama-1b --limit 2048 --bandwidth-gb 16 --repeats 1  # its last --repeats counts
  step imgdec 90 python3 bench/bench_image_decode.py --repeat 2 --out "$out/imgdec.json" ;;
extract) extract
  # an image part's Slurm job before 2026-11-26 (4 CPUs: 4 decoding workers) against vit13's 16
  step vit4cpu 90 taskset -c 0-3 $E --shape vit-b14 --out "$out/vit4cpu.json" ;;
sae-lut) lut_sae; build_ext
  step saev 120 python3 bench/bench_saev.py --size-mb 4096 --fill-threads 1 2 4 8 16 --repeat 5 ;;
writers) build_ext
  step writers 400 python3 bench/bench_writers.py --gb 8 --parts 8 --jobs 8 --repeat 3 --work /tmp/writers \
    --thread-counts 1 4 --only saev lmprobe zarr "pickle (gzip-1, isal)"
  step verify 120 python3 bench/bench_verify.py --size-mb 8192 --shards 16 --threads 1 2 4 8 ;;
*) echo "phase: all | changes | extract | sae-lut | writers"; exit 2 ;;
esac
echo "total $(( $(date +%s) - t0 )) s"
