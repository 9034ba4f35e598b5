#!/usr/bin/env bash
# The GPU checks of issue 12 as one command, for a lent GPU machine with no network
# (torch, Lightning and pytest preinstalled; torchao and nvdlfw_inspect carried as wheels in .whl/).
# Writes gpu_tests.log and gpu_bench.json (+ .err) to $OUT (default ./gpu_out). Each part has its own
# time limit so a failure in one still leaves the other's result.
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
time timeout ${TEST_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 180 \
  tests/gpu tests/integration/test_nvdlfw_bridge.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
time timeout ${BENCH_LIMIT:-220} python3 bench/gpu_bench.py > "$OUT/gpu_bench.json" 2> "$OUT/gpu_bench.err"
echo "bench rc=$?"; cat "$OUT/gpu_bench.json"; tail -20 "$OUT/gpu_bench.err"
