"""What bursts and dumps cost on the example GPT or a Hugging Face Llama built from a config (CPU,
emulated FP8 with delayed scaling).

Prints JSON (``bench/results_burst.json``). Configurations run side by side in interleaved rounds
(the order rotates each round) so machine noise hits all alike:

* ``none``: no monitor;
* ``every_10``: the default sampling with bursts switched off (``burst_steps=0``);
* ``every_10_bursts``: the default sampling with the default bursts (opened only by what the
  analyzers see in this healthy run);
* ``every_10_bursts_drift``: the same with drift events opening bursts too (opt-in);
* ``forced_bursts``: every 10, plus a burst of K steps opened every 40 steps (as if a spike were
  seen), to time steps inside a burst.

Reported: mean / median step time and their ratio to ``none``; the median of unsampled, scheduled
and burst steps; bytes of one dump of every layer (the first burst step after an event).

Usage: python bench/burst_bench.py [--model gpt|llama] [--rounds 6] [--steps-per-round 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from fp8track import Monitor, MonitorConfig
from fp8track.examples.gpt import GPT, GPTConfig
from fp8track.execution.apply import apply_fp8
from fp8track.monitoring.records import EventRecord, RunReader
from fp8track.monitoring.schedule import BURST_TRIGGERS, BurstPolicy

BATCH = 16


LLAMA = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
"""The Llama of ``--model llama``: random weights from a config (no download), GQA like Llama's."""


def build(model_name: str = "gpt", seed: int = 0):
    """``(model, optimizer, batches, loss_fn)`` with the model's linears in emulated delayed FP8."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if model_name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
        vocab, length = LLAMA["vocab_size"], LLAMA["max_position_embeddings"]

        def loss_fn(b):
            return model(input_ids=b[:, :-1], labels=b[:, :-1]).loss
    else:
        model = GPT(GPTConfig())
        vocab, length = model.config.vocab, model.config.block_size

        def loss_fn(b):
            return model.loss(b[:, :-1], b[:, 1:])
    apply_fp8(model, "delayed", backend="emulated")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [torch.randint(0, vocab, (BATCH, length + 1), generator=g) for _ in range(8)]
    return model, opt, batches, loss_fn


def force_burst(mon: Monitor) -> None:
    """Open a burst after the current step as a loss spike would (bench only: the analyzers open
    bursts in a real run)."""
    step = mon.global_step - 1
    mon._sampler.burst.open(step, [EventRecord("spike", step, {"status": "open"})])


def run(loss_fn, opt, batches, mon, n, times, kinds, period=None):
    for i in range(n):
        b = batches[i % len(batches)]
        kind = "none"
        if mon is not None:
            step = mon.global_step
            kind = "burst" if (mon.sampling and mon._sampler.why == "burst") else (
                "scheduled" if mon.config.samples(step) else "unsampled"
            )
        t0 = time.perf_counter()
        loss = loss_fn(b)
        loss.backward()
        opt.step()
        if mon is not None:
            mon.step(loss=loss)
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        kinds.append(kind)
        if period is not None and mon is not None and mon.global_step % period == 1:
            force_burst(mon)


def step_times(model_name: str, rounds: int, per_round: int, burst_steps: int) -> dict:
    model, opt, batches, loss_fn = build(model_name)
    tmp = tempfile.mkdtemp()
    configs = {
        "none": (None, None),
        "every_10": (MonitorConfig(every_n_steps=10, burst_steps=0, max_dumps=0), None),
        "every_10_bursts": (MonitorConfig(every_n_steps=10, burst_steps=burst_steps, max_dumps=0), None),
        "every_10_bursts_drift": (
            MonitorConfig(every_n_steps=10, burst_steps=burst_steps, max_dumps=0, burst_on=BURST_TRIGGERS),
            None,
        ),
        "forced_bursts": (MonitorConfig(every_n_steps=10, burst_steps=burst_steps, max_dumps=0), 40),
    }
    monitors = {k: (Monitor(model, c, log_dir=tmp) if c else None) for k, (c, _) in configs.items()}
    times = {k: [] for k in configs}
    kinds = {k: [] for k in configs}

    def go(name, n, t, k):
        mon = monitors[name]
        if mon is not None:
            mon.attach()
        run(loss_fn, opt, batches, mon, n, t, k, configs[name][1])
        if mon is not None:
            mon.detach()

    for name in configs:  # warm-up: every code path once
        go(name, 12, [], [])
    names = list(configs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            go(name, per_round, times[name], kinds[name])
    bursts = {}
    for name, mon in monitors.items():
        if mon is not None:
            mon.close()
            bursts[name] = sum(1 for e in RunReader(mon.run_dir).events() if e.kind == "burst")
    base_mean, base_median = statistics.fmean(times["none"]), statistics.median(times["none"])
    out = {}
    for name, ts in times.items():
        row = {
            "mean_ms": 1e3 * statistics.fmean(ts),
            "median_ms": 1e3 * statistics.median(ts),
            "mean_ratio": statistics.fmean(ts) / base_mean,
            "median_ratio": statistics.median(ts) / base_median,
            "steps": len(ts),
        }
        for kind in ("unsampled", "scheduled", "burst"):
            sel = [t for t, k in zip(ts, kinds[name], strict=True) if k == kind]
            if sel:
                row[f"{kind}_step_ms"] = 1e3 * statistics.median(sel)
                row[f"{kind}_steps"] = len(sel)
        if name in bursts:
            row["bursts_opened"] = bursts[name]
        out[name] = row
    return out


def dump_bytes(model_name: str) -> dict:
    model, opt, batches, loss_fn = build(model_name)
    tmp = tempfile.mkdtemp()
    mon = Monitor(model, MonitorConfig(every_n_steps=10, burst_steps=2, max_dumps=1), log_dir=tmp)
    run(loss_fn, opt, batches, mon, 3, [], [])
    force_burst(mon)
    mon._post.dumps.request(None)  # every layer, as a loss event asks
    run(loss_fn, opt, batches, mon, 4, [], [])
    mon.close()
    ev = next(e for e in RunReader(mon.run_dir).events() if e.kind == "dump")
    return {"layers": len(ev.data["files"]), "bytes": ev.data["bytes"], "left_out": ev.data["left_out"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps-per-round", type=int, default=40)
    p.add_argument("--burst-steps", type=int, default=BurstPolicy().steps)
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1min_at_start": os.getloadavg()[0],
        "model": {"name": a.model, **(LLAMA if a.model == "llama" else GPTConfig().__dict__), "batch": BATCH,
                  "recipe": "delayed (emulated)"},
        "burst_steps": a.burst_steps,
        "step_time": step_times(a.model, a.rounds, a.steps_per_round, a.burst_steps),
        "dump_all_layers": dump_bytes(a.model),
    }
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
