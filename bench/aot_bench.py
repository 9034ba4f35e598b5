"""Host cost of one statistics call: torch.compile (JIT) against the AOTInductor package ("aot").

For each tensor size, side by side in one process: the median host time of ``partial_stats``
(wall time of the call; on a GPU the kernels are only queued, so this is the host's share),
the device time per call (CUDA events over a batch of calls, GPU only), the package build time,
and whether the packaged kernel agrees with the JIT one (counts exactly, sums to 1e-6). The
package is built the way a training run builds it: in a background process, which loads and
checks it before publishing it.

Prints JSON. Runs on CPU, or on CUDA with ``--device cuda``.
Usage: python bench/aot_bench.py [--device cuda] [--sizes 4096,65536,1048576]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from fp8track.numerics import stats


def _host_ms(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


def _device_ms(fn, reps: int) -> float | None:
    if not torch.cuda.is_available():
        return None
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def run(device: str, sizes: list[int], reps: int) -> dict:
    out: dict = {"torch": torch.__version__, "device": device, "threads": torch.get_num_threads()}
    for n in sizes:
        x = torch.randn(n, device=device).to(torch.bfloat16)
        c = stats.row_length(n, device.split(":")[0])
        row: dict = {"row_length": c}
        t = time.perf_counter()
        stats.set_compile("aot")
        stats.partial_stats(x, "e4m3")  # starts the background build (or loads the cached package)
        row["built"] = stats.wait_for_aot_kernels(600)
        row["build_s"] = round(time.perf_counter() - t, 1)
        if not all(row["built"].values()):
            row["error"] = "no package; the statistics stay on torch.compile (see the warning)"
            out[str(n)] = row
            continue
        results = {}
        for mode in ("auto", "aot"):
            stats.set_compile(mode)
            for _ in range(3):
                results[mode] = stats.partial_stats(x, "e4m3")
        host = {m: [] for m in ("auto", "aot")}
        for r in range(4):  # interleaved rounds
            for mode in (("auto", "aot") if r % 2 == 0 else ("aot", "auto")):
                stats.set_compile(mode)
                host[mode].append(_host_ms(lambda x=x: stats.partial_stats(x, "e4m3"), reps))
        for mode in ("auto", "aot"):
            stats.set_compile(mode)
            row[f"{mode}_host_ms"] = round(statistics.median(host[mode]), 4)
            dev = _device_ms(lambda x=x: stats.partial_stats(x, "e4m3"), reps)
            if dev is not None:
                row[f"{mode}_device_ms"] = round(dev, 4)
        row["host_ratio_jit_over_aot"] = round(row["auto_host_ms"] / row["aot_host_ms"], 2)
        a, j = results["aot"].cpu(), results["auto"].cpu()
        row["agree"] = bool(
            torch.equal(a[:5], j[:5])
            and torch.allclose(a[5:9], j[5:9], rtol=1e-6)
            and torch.equal(a[9:], j[9:])
        )
        row["packaged_kernel_used"] = any(
            k[2] == c and r is not None for k, r in stats._POLICY.aot_runners.items()
        )
        out[str(n)] = row
        stats.set_compile("auto")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="4096,65536,1048576")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return
    result = run(args.device, [int(s) for s in args.sizes.split(",")], args.reps)
    if args.device == "cpu":
        result["load_average_1min"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
