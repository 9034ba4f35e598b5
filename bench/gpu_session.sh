#!/usr/bin/env bash
# The GPU checks of issue 12 as one command, for a lent GPU machine with no network
# (torch, Lightning and pytest preinstalled; torchao and nvdlfw_inspect carried as wheels in .whl/).
# PARTS picks what runs, in this order (default: all five, about 9 minutes on one H200):
#   probe    bench/gpu_kernel_probe.py: kernel speed vs the size first compiled (fresh processes)
#   tests    the gpu-marked tests
#   bench    bench/gpu_bench.py: kernel vs amax, monitor overhead, sync counts
#   profile  bench/gpu_step_profile.py: device kernel time vs host time of a monitored step
#   aot      bench/aot_bench.py --device cuda: host time per call, torch.compile vs AOTInductor
# Writes <part>.json / .log (+ .err) to $OUT (default ./gpu_out). Each part has its own time limit,
# so a failure in one still leaves the others' results.
set -u
OUT=${OUT:-gpu_out}
PARTS=${PARTS:-probe tests bench profile aot}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 FP8TRACK_CACHE_DIR=${FP8TRACK_CACHE_DIR:-/tmp/fp8track-cache}
nvidia-smi -L; python3 -c 'import torch, torchao; print("torch", torch.__version__, "torchao", torchao.__version__)'
for part in $PARTS; do
  case $part in
    probe) time timeout ${PROBE_LIMIT:-150} python3 bench/gpu_kernel_probe.py \
             --only ${PROBE_VARIANTS:-rows_1024_small_first,max_rows_4096_small_first,max_rows_4096_big_first} \
             > "$OUT/gpu_kernel_probe.json" 2> "$OUT/gpu_kernel_probe.err"
           echo "probe rc=$?"; cat "$OUT/gpu_kernel_probe.json" ;;
    tests) time timeout ${TEST_LIMIT:-170} python3 -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 180 \
             tests/gpu tests/integration/test_nvdlfw_bridge.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    bench) time timeout ${BENCH_LIMIT:-170} python3 bench/gpu_bench.py > "$OUT/gpu_bench.json" 2> "$OUT/gpu_bench.err"
           echo "bench rc=$?"; cat "$OUT/gpu_bench.json"; tail -20 "$OUT/gpu_bench.err" ;;
    profile) time timeout ${PROFILE_LIMIT:-90} python3 bench/gpu_step_profile.py > "$OUT/gpu_step_profile.json" 2> "$OUT/gpu_step_profile.err"
           echo "profile rc=$?"; cat "$OUT/gpu_step_profile.json" ;;
    aot)   time timeout ${AOT_LIMIT:-120} python3 bench/aot_bench.py --device cuda --sizes 1048576,8388608 --reps 100 \
             > "$OUT/aot_bench.json" 2> "$OUT/aot_bench.err"
           echo "aot rc=$?"; cat "$OUT/aot_bench.json"; grep -i "warn\|error" "$OUT/aot_bench.err" | tail -5 ;;
    *) echo "unknown part $part (valid: probe tests bench profile aot)"; exit 2 ;;
  esac
done
