"""Training overhead of the monitor on a compiled model (``torch.compile``, inductor), CPU.

The example GPT (small config) is compiled three times, side by side in one process: without the
monitor, with it sampling every 10 steps, and every step. Each configuration has its own model
instance (same seed), optimizer and monitor, so attaching one never touches another's compiled
graphs. After a warm-up that compiles both sampling states, the configurations run in rounds in
an order that rotates each round, so machine noise hits all of them alike.

Step time: wall time of forward + backward + optimizer step + ``monitor.step``. ``median_ratio``
compares the typical step with the compiled model's without the monitor (the goal for every 10
steps: <= 1.05); ``mean_ratio`` includes the sampled steps. ``recompiles_measured``: frames
dynamo compiled during the measured rounds (0: no step, sampled or not, recompiles once warm).
``graphs_after_warmup``: dynamo's unique graphs after the warm-up (the statistics kernels
included). ``rows_per_sampled_step``: statistics rows each sampled step recorded (every GEMM
layer's tensors: proof that the compiled model was observed).

Usage: python bench/compile_bench.py [--rounds 6] [--steps-per-round 20] [--recipes bf16,current]
Writes bench/results_compile.json (``--out``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).parent))
from monitor_bench import MODELS, build  # noqa: E402  (the same GPT, batches and optimizer)

from fp8track import Monitor, MonitorConfig  # noqa: E402
from fp8track.monitoring.records import RunReader  # noqa: E402

CONFIGS = {"none": None, "every_10": 10, "every_1": 1}  # name: every_n_steps (None: no monitor)
MODEL = "small"


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


class Run:
    """One configuration: its own compiled model, optimizer, batches and monitor."""

    def __init__(self, recipe: str, every: int | None, log_dir: str) -> None:
        self.model, self.opt, self.batches = build(recipe, MODEL)
        self.compiled = torch.compile(self.model)
        self.monitor = None
        if every is not None:
            self.monitor = Monitor(
                self.compiled, MonitorConfig(every_n_steps=every), log_dir=log_dir
            ).attach()
        self.i = 0

    def steps(self, n: int, times: list[float], sampled: list[bool]) -> None:
        for _ in range(n):
            b = self.batches[self.i % len(self.batches)]
            self.i += 1
            mon = self.monitor
            sampled.append(mon is not None and mon.config.samples(mon.global_step))
            t0 = time.perf_counter()
            logits = self.compiled(b[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
            loss.backward()
            self.opt.step()
            if mon is not None:
                mon.step(loss=loss)
            self.opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)


def measure(recipe: str, rounds: int, per_round: int) -> dict:
    torch._dynamo.reset()
    counters.clear()
    tmp = tempfile.mkdtemp()
    t0 = time.perf_counter()
    runs = {name: Run(recipe, every, tmp) for name, every in CONFIGS.items()}
    for run in runs.values():  # warm-up: a sampled and an unsampled step compile, twice over
        run.steps(21, [], [])
    warmup_s = time.perf_counter() - t0
    graphs_warm = _graphs()
    times: dict[str, list[float]] = {name: [] for name in runs}
    sampled: dict[str, list[bool]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].steps(per_round, times[name], sampled[name])
    recompiles = _graphs() - graphs_warm
    rows = {}
    for name, run in runs.items():
        if run.monitor is not None:
            run.monitor.close()
            # a sanity check that the compiled model was observed: rows per sampled step
            per_step = Counter(r.step for r in RunReader(run.monitor.run_dir).tensor_stats())
            rows[name] = sorted(set(per_step.values()))
    base_mean, base_median = statistics.fmean(times["none"]), statistics.median(times["none"])
    out: dict = {
        "warmup_s": round(warmup_s, 1),
        "graphs_after_warmup": graphs_warm,
        "recompiles_measured": recompiles,
        "rows_per_sampled_step": rows,
    }
    for name, ts in times.items():
        row = {
            "median_ms": 1e3 * statistics.median(ts),
            "mean_ms": 1e3 * statistics.fmean(ts),
            "median_ratio": statistics.median(ts) / base_median,
            "mean_ratio": statistics.fmean(ts) / base_mean,
            "steps": len(ts),
        }
        hits = [t for t, hit in zip(ts, sampled[name], strict=True) if hit]
        misses = [t for t, hit in zip(ts, sampled[name], strict=True) if not hit]
        if hits:
            row["sampled_step_ms"] = 1e3 * statistics.median(hits)
            row["sampled_steps"] = len(hits)
        if hits and misses:
            row["unsampled_step_ms"] = 1e3 * statistics.median(misses)
        out[name] = row
    out["graph_breaks"] = sum(counters["graph_break"].values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=20)
    parser.add_argument("--recipes", default="bf16,current")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results_compile.json"))
    args = parser.parse_args()
    cfg, batch = MODELS[MODEL]
    result: dict = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "model": {"config": vars(cfg), "batch": batch},
    }
    for recipe in args.recipes.split(","):
        result[recipe] = measure(recipe, args.rounds, args.steps_per_round)
    result["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=2)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
