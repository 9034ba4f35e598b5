"""Where a monitored GPU step spends its extra time: statistics kernels on the device, or the host.

On the GPT of ``bench/gpu_bench.py`` with the monitor sampling every step, prints JSON with:

* ``step_ms``: median step time (CUDA events) without and with the monitor, interleaved;
* ``device_ms_per_step``: GPU kernel time per step from torch.profiler, split into the statistics
  kernels (Triton kernels: the model runs eager, so every Triton kernel is the monitor's) and the
  rest, with and without the monitor;
* ``host``: ``partial_stats`` calls per step and their host time per call (the call returns once
  its kernels are queued: dynamo's guards, the compiled wrapper, the launches).

If the statistics kernels' device time is near the step's extra time, the GPU work is the cost;
if the host time per step is near it, the launches are.

Without CUDA it prints ``{"skipped": "no CUDA"}`` and exits 0; ``--dry-run`` runs the code on a
tiny CPU model. Usage: python bench/gpu_step_profile.py [--dry-run]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_bench import DRY, FULL, _Clock, _fwd_bwd, build_gpt  # noqa: E402

from fp8track import Monitor, MonitorConfig  # noqa: E402
from fp8track.monitoring import plans  # noqa: E402


def _device_ms(prof: Any, steps: int) -> dict[str, float]:
    """GPU kernel time per step from a profile: Triton kernels (the statistics) and the rest."""
    triton = other = 0.0
    launches = 0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        if e.name.startswith("triton_"):
            triton += us
            launches += 1
        else:
            other += us
    return {
        "stats_kernels_ms": round(triton / 1e3 / steps, 3),
        "other_kernels_ms": round(other / 1e3 / steps, 3),
        "stats_launches": launches // steps,
    }


def run(dry_run: bool) -> dict[str, Any]:
    device = torch.device("cpu" if dry_run else "cuda")
    p = DRY if dry_run else FULL
    model, opt, batches, report, backend = build_gpt(p["gpt"], p["batch"], device)
    clock = _Clock(device)
    mon = Monitor(model, MonitorConfig(every_n_steps=1), log_dir=tempfile.mkdtemp())
    calls: list[float] = []
    real = plans.partial_stats

    def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = time.perf_counter()
        out = real(*args, **kwargs)
        calls.append(time.perf_counter() - t)
        return out

    def step(monitored: bool, i: int) -> None:
        loss = _fwd_bwd(model, report, batches[i % len(batches)])
        opt.step()
        if monitored:
            mon.step(loss=loss)
        opt.zero_grad(set_to_none=True)

    mon.attach()
    for i in range(3):  # compile
        step(True, i)
    mon.detach()
    times: dict[str, list[float]] = {"none": [], "every_1": []}
    for r in range(2 if dry_run else 10):
        for k in ("none", "every_1") if r % 2 == 0 else ("every_1", "none"):
            if k == "every_1":
                mon.attach()
            times[k].append(clock(lambda k=k, r=r: step(k == "every_1", r)))
            if k == "every_1":
                mon.detach()
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "backend": backend,
        "model": vars(p["gpt"]),
        "batch": p["batch"],
    }
    out["step_ms"] = {k: round(statistics.median(v), 3) for k, v in times.items()}
    out["device_ms_per_step"] = {}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        n = 3
        for k in ("none", "every_1"):
            if k == "every_1":
                mon.attach()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(n):
                    step(k == "every_1", i)
                torch.cuda.synchronize()
            if k == "every_1":
                mon.detach()
            out["device_ms_per_step"][k] = _device_ms(prof, n)
    plans.partial_stats = timed
    try:
        mon.attach()
        for i in range(3):
            step(True, i)
        mon.detach()
    finally:
        plans.partial_stats = real
    mon.close()
    out["host"] = {
        "partial_stats_calls_per_step": len(calls) // 3,
        "host_ms_per_call_median": round(1e3 * statistics.median(calls), 4),
        "host_ms_per_step": round(1e3 * sum(calls) / 3, 3),
    }
    return out


def main(argv: list[str]) -> int:
    dry_run = "--dry-run" in argv
    if not dry_run and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    print(json.dumps(run(dry_run), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
