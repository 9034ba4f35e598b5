"""Training overhead of the monitor on the example GPT (CPU): step time and peak memory.

Prints JSON. Configurations are measured side by side, interleaved in rounds so machine noise
hits all of them alike: no monitor, sampling every 10 steps, sampling every step. Two models:
the BF16 control (shadow statistics on plain linears: the cheapest step, so the hardest ratio)
and emulated FP8 with delayed scaling.

Step time: per-step wall time of forward + backward + optimizer step + ``monitor.step``.
``mean`` includes the sampled steps (amortised cost); ``median`` is the typical step.
Peak memory: the growth of the process's max RSS over a training run, in a fresh subprocess per
configuration (CPU has no allocator counter like CUDA's ``max_memory_allocated``).

Usage: python bench/monitor_bench.py [--rounds 6] [--steps-per-round 20]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from fp8track.examples.gpt import GPT, GPTConfig
from fp8track.monitor import Monitor, MonitorConfig

CONFIGS = {"none": None, "every_10": 10, "every_1": 1}


def build(recipe: str, seed: int = 0):
    from fp8track.apply import apply_fp8

    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    apply_fp8(model, recipe, backend="emulated")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    batches = [torch.randint(0, cfg.vocab, (16, cfg.block_size + 1), generator=g) for _ in range(8)]
    return model, opt, batches


def train_steps(model, opt, batches, n, monitor, times):
    for i in range(n):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = model.loss(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        if monitor is not None:
            monitor.step(loss=loss)
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)


def step_times(recipe: str, rounds: int, per_round: int) -> dict:
    model, opt, batches = build(recipe)
    tmp = tempfile.mkdtemp()
    monitors = {
        name: Monitor(model, MonitorConfig(every_n_steps=n), log_dir=tmp) if n else None for name, n in CONFIGS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    # Warm-up: every code path once (compilation of the statistics kernels included).
    for mon in monitors.values():
        if mon is not None:
            mon.attach()
        train_steps(model, opt, batches, 5, mon, [])
        if mon is not None:
            mon.detach()
    for _ in range(rounds):
        for name, mon in monitors.items():
            if mon is not None:
                mon.attach()
                mon.begin_step(0)  # every round starts on a sampled step, like a real run's cadence
            train_steps(model, opt, batches, per_round, mon, times[name])
            if mon is not None:
                mon.detach()
    for mon in monitors.values():
        if mon is not None:
            mon.close()
    base_mean, base_median = statistics.fmean(times["none"]), statistics.median(times["none"])
    out = {}
    for name, ts in times.items():
        out[name] = {
            "mean_ms": 1e3 * statistics.fmean(ts),
            "median_ms": 1e3 * statistics.median(ts),
            "mean_ratio": statistics.fmean(ts) / base_mean,
            "median_ratio": statistics.median(ts) / base_median,
            "steps": len(ts),
        }
    return out


def _memory_child(recipe: str, every: int, steps: int) -> None:
    model, opt, batches = build(recipe)
    train_steps(model, opt, batches, 2, None, [])  # allocator and optimizer state in place
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mon = Monitor(model, MonitorConfig(every_n_steps=every), log_dir=tempfile.mkdtemp()).attach() if every else None
    train_steps(model, opt, batches, steps, mon, [])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss_kb": after, "baseline_rss_kb": before}))


def peak_memory(recipe: str, steps: int) -> dict:
    out = {}
    for name, every in CONFIGS.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-child", recipe, str(every or 0), str(steps)],
            capture_output=True,
            text=True,
            check=True,
        )
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = out["none"]["peak_rss_kb"]
    for v in out.values():
        v["ratio"] = v["peak_rss_kb"] / base
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=20)
    parser.add_argument("--memory-child", nargs=3)
    args = parser.parse_args()
    if args.memory_child:
        recipe, every, steps = args.memory_child
        _memory_child(recipe, int(every), int(steps))
        return
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": "example GPT, GPTConfig() defaults, batch 16",
    }
    for recipe in ("bf16", "delayed"):
        result[recipe] = {
            "step_time": step_times(recipe, args.rounds, args.steps_per_round),
            "peak_memory": peak_memory(recipe, 30),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
