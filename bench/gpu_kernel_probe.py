"""Which inductor settings make the statistics kernel fast on a GPU (one short run on a lent GPU).

For each variant (inductor options, row length of the kernel's ``[R, C]`` view) it compiles
``partial_stats`` afresh and prints, as JSON: median ms against one ``x.abs().amax()`` pass on
4096x4096 and 16384x16384 bf16 (CUDA events), the number of GPU kernels one call
launches (torch.profiler), and the largest relative difference of every statistic from the CPU
reference on a wide-range tensor (``scale_drift_log2`` must be exactly 0: the scale is TE's
correctly rounded ``max / amax``).

Without CUDA it prints ``{"skipped": "no CUDA"}`` and exits 0.

Measured on one H200 (torch 2.11, torchao 0.18; two runs, the second in reverse order, gave the same):
thresholds 0.24 / 2.1 ms (5.5x / 5.0x the amax pass of 0.044 / 0.43 ms); default 0.91 / 12.8 ms
(21x / 30x); no persistent reductions 0.25-0.27 / 2.1 ms; default with rows of 8192 0.25-0.41 /
1.3-1.4 ms (3.1-3.4x on the large tensor). Nine GPU kernels per call in every variant;
scale_drift_log2 exactly 0 and every statistic within 1.2e-7 of the CPU reference in all.

Usage: python bench/gpu_kernel_probe.py
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Any

import torch

from fp8track.numerics import stats

VARIANTS: dict[str, tuple[dict[str, Any], int]] = {
    "thresholds": (dict(stats._INDUCTOR_OPTIONS), 1024),
    "default": ({}, 1024),
    "no_persistent_reductions": ({"triton.persistent_reductions": False}, 1024),
    "default_rows_8192": ({}, 8192),
}


def _time(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _kernels_per_call(x: torch.Tensor) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stats.partial_stats(x, "e4m3")
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def _max_rel_diff(x: torch.Tensor) -> dict[str, float]:
    ref = stats.quant_stats(x, "e4m3")
    got = stats.quant_stats(x.cuda(), "e4m3")
    worst = max(
        (abs(got[k] - r) / abs(r) for k, r in ref.items() if r and math.isfinite(r) and k != "scale_drift_log2"),
        default=0.0,
    )
    return {"max_rel_diff": worst, "scale_drift_log2": got["scale_drift_log2"]}


def probe() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    wide = (torch.randn(512, 384, generator=g) * torch.logspace(-6, 4, 384)).to(torch.bfloat16)
    shapes = [(4096, 4096), (16384, 16384)]
    xs = {f"{r}x{c}": torch.randn(r, c, device="cuda").to(torch.bfloat16) for r, c in shapes}
    out: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    out["amax_pass_ms"] = {k: round(_time(lambda x=x: x.abs().amax(), 10), 4) for k, x in xs.items()}
    stats.set_compile("compiled")
    chunk, options0 = stats._CHUNK, stats._INDUCTOR_OPTIONS
    for name, (options, rows) in VARIANTS.items():
        torch._dynamo.reset()
        stats._POLICY.kernels.clear()
        stats._POLICY.failed = False
        stats._INDUCTOR_OPTIONS = options
        stats._CHUNK = rows
        row: dict[str, Any] = {}
        try:
            t = time.perf_counter()
            for x in xs.values():
                stats.partial_stats(x, "e4m3")
            torch.cuda.synchronize()
            row["compile_s"] = round(time.perf_counter() - t, 1)
            for k, x in xs.items():
                ms = _time(lambda x=x: stats.partial_stats(x, "e4m3"), 10)
                row[k] = {"ms": round(ms, 4), "ratio": round(ms / out["amax_pass_ms"][k], 2)}
            row["kernels_per_call"] = _kernels_per_call(xs["4096x4096"])
            row.update(_max_rel_diff(wide))
            row["fell_back_to_eager"] = stats._POLICY.failed
        except Exception as exc:  # report every variant
            row["error"] = repr(exc)[:500]
        finally:
            stats._CHUNK, stats._INDUCTOR_OPTIONS = chunk, options0
        out[name] = row
        print(json.dumps({name: row}), file=sys.stderr, flush=True)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    print(json.dumps(probe(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
