"""Extra time per sampled step under sharding (CPU ranks on gloo, launched with torchrun).

For each configuration (FSDP2 on 2 ranks; FSDP2 x tensor parallel on a (2, 2) mesh) the worker
times a training step with no monitor, with the monitor on an unsampled step, on a sampled step
(global scales: the two-phase amax all-reduce of every tensor-parallel shard), and on a sampled step
with local scales (no amax all-reduce). Prints JSON: median ms per step of each, the extra time per
sampled step (sampled - unsampled) and the cost of the two-phase amax (global - local).

Usage: python bench/sharded_bench.py [--steps 20] [--width 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
WORKER = TESTS / "integration" / "scripts" / "sharded_monitor.py"
CONFIGS = [("fsdp", 2), ("fsdp_tp", 4)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--width", type=int, default=8, help="model and batch width multiplier (1 = the test model)"
    )
    args = p.parse_args()
    # the worker takes its sizes from the test kit (tests/helpers)
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    results = []
    for mode, world in CONFIGS:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
            cmd += [str(WORKER), out, mode, "--bench", str(args.steps), "--width", str(args.width)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("{"))
            results.append(json.loads(line))
    print(json.dumps({"width": args.width, "threads_per_rank": 1, "results": results}, indent=1))


if __name__ == "__main__":
    main()
