"""Benchmark of fp8track.numerics.stats: fused statistics vs one amax pass vs a naive eager composition.

Prints one JSON object. Times are medians (``*_ms``) and minima (``*_min_ms``) over interleaved
repetitions: other processes may share the CPU, so candidates are measured side by side in the same
loop, and the minima show the uncontended cost. ``sweep`` reports the same ratio (statistics over
one ``abs().amax()`` pass) on 1e6..1e8-element bf16 tensors and ``--plot`` draws it
(``bench/stats_cost_curve.png``). Run: ``python bench/stats_bench.py [--plot bench/stats_cost_curve.png]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from fp8track.numerics import stats
from fp8track.numerics.scaling import current_scale


def naive_quant_stats(x: torch.Tensor, fmt: str = "e4m3") -> dict[str, float]:
    """One torch op chain per statistic, each computed separately the obvious way (re-quantising)."""
    f = stats.get_format(fmt)
    xf = x.float()
    finite = torch.isfinite(xf)
    xv = xf[finite]

    def scale() -> torch.Tensor:
        return current_scale(xv.abs().amax(), f)

    def deq() -> torch.Tensor:
        s = scale()
        return (xv * s).clamp(-f.max, f.max).to(f.dtype).float() / s

    amax = xv.abs().amax().item()
    amin = xv.abs()[xv != 0].amin().item()
    out = {
        "amax": amax,
        "amin": amin,
        "dynamic_range_log2": math.log2(amax) - math.log2(amin),
        "underflow_pct": 100.0 * (torch.count_nonzero(xv) - torch.count_nonzero(deq())).item() / xv.numel(),
        "overflow_pct": 100.0 * ((xv * scale()).abs() > f.max).sum().item() / xv.numel(),
        "mse": ((xv - deq()) ** 2).mean().item(),
        "cos": torch.nn.functional.cosine_similarity(xv, deq(), dim=0).item(),
        "sqnr_db": 10 * math.log10((xv**2).sum().item() / ((xv - deq()) ** 2).sum().item()),
        "scale": scale().item(),
        "current_scale": scale().item(),
        "scale_drift_log2": 0.0,
        "nonfinite_pct": 100.0 * (~finite).sum().item() / x.numel(),
        "numel": float(x.numel()),
    }
    return out


def _interleaved(cands: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    for fn in cands.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(reps):
        for k, fn in cands.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out.update({k.replace("_ms", "_min_ms"): min(v) * 1e3 for k, v in times.items()})
    return out


def _case(shape: tuple[int, int], reps: int, with_naive: bool) -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.randn(shape).to(torch.bfloat16)

    def run(mode: str) -> Callable[[], object]:
        def fn() -> object:
            stats.set_compile(mode)
            return stats.quant_stats(x)

        return fn

    # amax and quant_stats side by side; the slow eager runs apart (their full-size temporaries
    # evict caches and would slow whatever runs next).
    cands: dict[str, Callable[[], object]] = {
        "amax_pass_ms": lambda: x.abs().amax().item(),
        "quant_stats_compiled_ms": run("compiled"),
    }
    if not with_naive:
        cands["quant_stats_eager_ms"] = run("eager")
    res = _interleaved(cands, reps)
    if with_naive:
        few = max(3, reps // 3)
        res.update(_interleaved({"naive_ms": lambda: naive_quant_stats(x)}, few))
        res.update(_interleaved({"quant_stats_eager_ms": run("eager")}, few))
    stats.set_compile("auto")
    res.update(_interleaved({"quant_stats_auto_ms": lambda: stats.quant_stats(x)}, reps))
    return res


SWEEP_NUMEL = (10**6, 3 * 10**6, 10**7, 3 * 10**7, 10**8)


def sweep(reps: int) -> list[dict[str, float]]:
    """Median ms of one amax pass and of ``partial_stats`` (compiled) per size, interleaved."""
    stats.set_compile("compiled")
    rows = []
    for n in SWEEP_NUMEL:
        x = torch.randn(n).to(torch.bfloat16)
        res = _interleaved(
            {
                "amax_pass_ms": lambda x=x: x.abs().amax().item(),
                "partial_stats_ms": lambda x=x: stats.partial_stats(x).tolist(),
            },
            reps,
        )
        rows.append(
            {
                "numel": n,
                **{k: round(v, 3) for k, v in res.items()},
                "ratio": round(res["partial_stats_ms"] / res["amax_pass_ms"], 3),
            }
        )
        del x
    stats.set_compile("auto")
    return rows


def plot(rows: list[dict[str, float]], path: str, load: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["numel"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.loglog(n, [r["amax_pass_ms"] for r in rows], "o-", label="x.abs().amax() (one read)")
    a.loglog(n, [r["partial_stats_ms"] for r in rows], "s-", label="partial_stats (all 13 statistics)")
    a.set_xlabel("elements (bf16)")
    a.set_ylabel("median ms")
    a.legend()
    b.semilogx(n, [r["ratio"] for r in rows], "o-")
    b.axhline(1.15, color="grey", ls="--", label="goal 1.15x")
    b.set_xlabel("elements (bf16)")
    b.set_ylabel("statistics / amax pass")
    b.legend()
    fig.suptitle(f"fp8track statistics cost, {torch.get_num_threads()} CPU threads, 1-min load {load:.1f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sweep-reps", type=int, default=5)
    parser.add_argument("--plot", default=None, help="write the cost curve PNG here")
    args = parser.parse_args()
    torch.manual_seed(0)
    # First-call compile cost in this process (includes inductor start-up unless already warm).
    stats.set_compile("compiled")
    xb = torch.randn(4096, 4096).to(torch.bfloat16)
    t = time.perf_counter()
    stats.quant_stats(xb)
    first_compile_s = time.perf_counter() - t
    t = time.perf_counter()
    stats.quant_stats(torch.randn(1000, 3000).to(torch.bfloat16))
    other_shape_s = time.perf_counter() - t

    big = _case((4096, 4096), args.reps, with_naive=True)
    small = _case((64, 256), args.reps * 20, with_naive=False)
    out = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1min_at_end": None,
        "compile_min_numel": stats.COMPILE_MIN_NUMEL,
        "first_call_compile_s": round(first_compile_s, 2),
        "new_shape_after_compile_s": round(other_shape_s, 3),
        "large_4096x4096_bf16": {k: round(v, 3) for k, v in big.items()},
        "small_64x256_bf16": {k: round(v, 4) for k, v in small.items()},
        "ratio_compiled_over_amax": round(big["quant_stats_compiled_ms"] / big["amax_pass_ms"], 2),
        "ratio_compiled_over_amax_best": round(
            big["quant_stats_compiled_min_ms"] / big["amax_pass_min_ms"], 2
        ),
        "ratio_naive_over_compiled": round(big["naive_ms"] / big["quant_stats_compiled_ms"], 1),
        "ratio_eager_over_amax": round(big["quant_stats_eager_ms"] / big["amax_pass_ms"], 2),
        "small_ratio_compiled_over_eager": round(
            small["quant_stats_compiled_ms"] / small["quant_stats_eager_ms"], 2
        ),
    }
    out["sweep"] = sweep(args.sweep_reps)
    out["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    if args.plot:
        plot(out["sweep"], args.plot, out["load_average_1min_at_end"])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
