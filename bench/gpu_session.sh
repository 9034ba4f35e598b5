#!/usr/bin/env bash
# The GPU checks of issue 12 as one command, for a lent GPU machine with no network
# (torch, Lightning and pytest preinstalled; torchao and nvdlfw_inspect carried as wheels in .whl/).
# Writes gpu_kernel_probe.json, gpu_tests.log and gpu_bench.json (+ .err) to $OUT (default ./gpu_out).
# Each part has its own time limit so a failure in one still leaves the others' results.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c 'import torch, torchao; print("torch", torch.__version__, "torchao", torchao.__version__)'
time timeout ${PROBE_LIMIT:-210} python3 bench/gpu_kernel_probe.py --only ${PROBE_VARIANTS:-rows_1024_small_first,max_rows_4096_small_first,max_rows_4096_big_first} > "$OUT/gpu_kernel_probe.json" 2> "$OUT/gpu_kernel_probe.err"
echo "probe rc=$?"; cat "$OUT/gpu_kernel_probe.json"
time timeout ${TEST_LIMIT:-170} python3 -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 180 \
  tests/gpu tests/integration/test_nvdlfw_bridge.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
time timeout ${BENCH_LIMIT:-200} python3 bench/gpu_bench.py > "$OUT/gpu_bench.json" 2> "$OUT/gpu_bench.err"
echo "bench rc=$?"; cat "$OUT/gpu_bench.json"; tail -20 "$OUT/gpu_bench.err"
