"""Does the statistics kernel's speed on a GPU depend on the size it was first compiled for?

The kernel is compiled with a dynamic number of rows. Inductor chooses how to split a reduction
over a dynamic length from the size it first sees, and keeps that choice (also on disk, in its FX
graph cache). So a process that first observes a small tensor (a test, a small layer) could get a
kernel that is slow on large ones. The fix under test (``stats.MAX_ROWS``): bound the rows, so
every reduction over rows is short and the per-row work is parallel at every size.

Each variant runs in a fresh process with an empty inductor cache: it compiles on the ``first``
tensors, then times ``partial_stats`` against one ``x.abs().amax()`` pass on 4096x4096 and
16384x16384 bf16 (CUDA events, medians), counts GPU kernels per call (torch.profiler) and
compares every statistic with the CPU eager reference on a wide-range tensor.

Variants: rows of 1024 (``MAX_ROWS`` without ``cuda``, the kernel before the fix) or at most 4096
or 1024 rows, each compiled first on a 64x1024 tensor or on the 4096x4096 one.

Without CUDA it prints ``{"skipped": "no CUDA"}`` and exits 0; ``--dry-run`` runs the same code
on small CPU tensors (rows bounded at 16 there), for the code paths, not the numbers.

Usage: python bench/gpu_kernel_probe.py [--only NAME,NAME] [--dry-run]
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

VARIANTS: dict[str, tuple[int | None, str]] = {  # (most rows, None = unbounded; first tensor)
    "rows_1024_small_first": (None, "small"),
    "rows_1024_big_first": (None, "big"),
    "max_rows_4096_small_first": (4096, "small"),
    "max_rows_4096_big_first": (4096, "big"),
    "max_rows_1024_small_first": (1024, "small"),
    "max_rows_1024_big_first": (1024, "big"),
}
SHAPES = {"4096x4096": (4096, 4096), "16384x16384": (16384, 16384)}
DRY_SHAPES = {"4096x4096": (64, 2048), "16384x16384": (128, 4096)}  # --dry-run: CPU, small


def _time(fn, reps: int = 10) -> float:
    if not torch.cuda.is_available():
        return 1e3 * statistics.median(_perf(fn) for _ in range(reps))
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _perf(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _kernels_per_call(x: torch.Tensor) -> int | None:
    if x.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    from fp8track.numerics import stats

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stats.partial_stats(x, "e4m3")
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def one_variant(max_rows: int | None, first: str, dry_run: bool = False) -> dict[str, Any]:
    """Run in a fresh process: compile on ``first``, then time both shapes."""
    from fp8track.numerics import stats

    device = "cpu" if dry_run else "cuda"
    if max_rows is None:
        stats.MAX_ROWS.pop(device, None)
    else:
        stats.MAX_ROWS[device] = max(1, max_rows // 256) if dry_run else max_rows
    g = torch.Generator().manual_seed(0)
    wide = (torch.randn(512, 384, generator=g) * torch.logspace(-6, 4, 384)).to(torch.bfloat16)
    stats.set_compile("eager")
    ref = stats.quant_stats(wide, "e4m3")
    shapes = DRY_SHAPES if dry_run else SHAPES
    xs = {k: torch.randn(shape, device=device).to(torch.bfloat16) for k, shape in shapes.items()}
    stats.set_compile("compiled")
    small = torch.randn(4 if dry_run else 64, 1024, device=device).to(torch.bfloat16)
    firsts = [small] if first == "small" else [xs["4096x4096"]]
    row: dict[str, Any] = {}
    t = time.perf_counter()
    for x in firsts + list(xs.values()):
        stats.partial_stats(x, "e4m3")
    if device == "cuda":
        torch.cuda.synchronize()
    row["compile_s"] = round(time.perf_counter() - t, 1)
    for k, x in xs.items():
        amax_ms = _time(lambda x=x: x.abs().amax())
        ms = _time(lambda x=x: stats.partial_stats(x, "e4m3"))
        row[k] = {"ms": round(ms, 4), "amax_pass_ms": round(amax_ms, 4), "ratio": round(ms / amax_ms, 2)}
    row["row_lengths"] = sorted(c for _, c in stats._POLICY.kernels)
    row["kernels_per_call_4096"] = _kernels_per_call(xs["4096x4096"])
    got = stats.quant_stats(wide.to(device), "e4m3")
    row["max_rel_diff"] = max(
        (
            abs(got[k] - r) / abs(r)
            for k, r in ref.items()
            if r and math.isfinite(r) and k != "scale_drift_log2"
        ),
        default=0.0,
    )
    row["scale_drift_log2"] = got["scale_drift_log2"]
    row["fell_back_to_eager"] = stats._POLICY.failed
    return row


def probe(names: list[str], limit_s: float = 60.0, dry_run: bool = False) -> dict[str, Any]:
    device = "cpu" if dry_run else torch.cuda.get_device_name()
    out: dict[str, Any] = {"torch": torch.__version__, "device": device, "dry_run": dry_run}
    for name in names:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            try:
                proc = subprocess.run(
                    [sys.executable, __file__, "--variant", name] + (["--dry-run"] if dry_run else []),
                    env=env, capture_output=True, text=True, timeout=limit_s,
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                out[name] = json.loads(lines[-1]) if lines else {"error": proc.stderr[-500:]}
            except subprocess.TimeoutExpired:
                out[name] = {"error": f"over {limit_s} s"}
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    return out


def main(argv: list[str]) -> int:
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    names = list(VARIANTS)
    if len(argv) == 2 and argv[0] == "--only":
        names, argv = argv[1].split(","), []
    if not dry_run and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    if len(argv) == 2 and argv[0] == "--variant":
        print(json.dumps(one_variant(*VARIANTS[argv[1]], dry_run=dry_run)))
        return 0
    print(json.dumps(probe(names, limit_s=300.0 if dry_run else 60.0, dry_run=dry_run), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
