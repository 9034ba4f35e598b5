"""Statistics kernel vs one ``abs().amax()`` pass at 4096^2 and 1e6..1e8 bf16 elements, interleaved.

Prints JSON. Run it against any checkout to compare kernels side by side on a busy machine:
``OMP_NUM_THREADS=1 PYTHONPATH=<checkout> python bench/kernel_compare.py <label>``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from fp8track.numerics import stats


def main() -> None:
    stats.set_compile("compiled")
    out: dict = {"threads": torch.get_num_threads(), "code": sys.argv[1] if len(sys.argv) > 1 else "here"}
    for n in (4096 * 4096, 10**6, 10**7, 10**8):
        x = torch.randn(n).to(torch.bfloat16)
        cands = {
            "amax": lambda x=x: x.abs().amax().item(),
            "stats": lambda x=x: stats.partial_stats(x).tolist(),
        }
        for fn in cands.values():
            fn()
        t: dict[str, list[float]] = {k: [] for k in cands}
        for _ in range(5 if n < 10**8 else 3):
            for k, fn in cands.items():
                s = time.perf_counter()
                fn()
                t[k].append(1e3 * (time.perf_counter() - s))
        m = {k: statistics.median(v) for k, v in t.items()}
        out[str(n)] = {
            "amax_ms": round(m["amax"], 2),
            "stats_ms": round(m["stats"], 2),
            "ratio": round(m["stats"] / m["amax"], 3),
            "min_ratio": round(min(t["stats"]) / min(t["amax"]), 3),
        }
        del x
    out["load"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
