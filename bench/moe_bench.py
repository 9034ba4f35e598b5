"""Cost of mixture-of-experts monitoring: per-expert statistics of an 8-expert group on sampled
steps, against the training step, and nothing measurable on unsampled steps.

One Mixtral-style MoE block (hidden 512, expert width 1024, 8 experts, top-2, its router), its
experts converted to emulated FP8 (current scaling), trains on 2048 tokens a step. Variants,
interleaved round by round so machine noise hits them alike (medians over rounds):

* ``plain``: no monitor;
* ``unsampled``: the monitor attached, sampling every 1000 steps (the steps timed are unsampled);
* ``sampled``: sampling every step: per-expert activation/weight/gradient rows of both projections,
  the group aggregates and the router statistics.

Also the statistics themselves on one grouped tensor: one pass over all experts
(``segment_partial_stats``) against one ``partial_stats`` call per expert (the loop it replaces).
Prints JSON; ``--out`` writes it (bench/results_moe.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import fp8track
from fp8track.execution.grouped import segment_ids
from fp8track.numerics.segment_stats import segment_partial_stats
from fp8track.numerics.stats import partial_stats

H, WIDTH, E, K, TOKENS = 512, 1024, 8, 2, 2048


def block() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(hidden_size=H, intermediate_size=WIDTH, num_local_experts=E, num_experts_per_tok=K,
                           num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8)
    initialised = tf.MixtralForCausalLM(cfg).model.layers[0].mlp  # (the model's _init_weights)

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = initialised

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x)

    return Wrapper()


def step_times(variant: str, rounds: int, steps: int, tmp: Path) -> list[float]:
    model = block()
    report = fp8track.apply_fp8(model, "current", backend="emulated")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(1, TOKENS, H)
    mon = None
    if variant != "plain":
        every = 1 if variant == "sampled" else 1000
        mon = fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=every), log_dir=tmp / variant,
                               apply_report=report).attach()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        if mon is not None:
            mon.step(loss=loss)
        opt.zero_grad()
        out.append(time.perf_counter() - t0)
    if mon is not None:
        mon.close()
    return out


def stats_pass(reps: int) -> dict[str, float]:
    """One grouped tensor's per-expert partials: one pass vs one call per expert (ms, median)."""
    torch.manual_seed(1)
    rows = torch.randn(TOKENS * K, H)
    offs = torch.cumsum(torch.full((E,), TOKENS * K // E), 0).to(torch.int32)
    seg = segment_ids(offs, rows.shape[0])
    bounds = [0, *offs.tolist()]
    one, loop = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        segment_partial_stats(rows, seg, E, "e4m3")
        t1 = time.perf_counter()
        for e in range(E):
            partial_stats(rows[bounds[e]:bounds[e + 1]], "e4m3")
        t2 = time.perf_counter()
        one.append(t1 - t0)
        loop.append(t2 - t1)
    return {"one_pass_ms": 1e3 * statistics.median(one), "loop_per_expert_ms": 1e3 * statistics.median(loop)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    variants = ("plain", "unsampled", "sampled")
    med: dict[str, list[float]] = {v: [] for v in variants}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for v in variants:
                times = step_times(v, args.rounds, args.steps + 1, Path(tmp))[1:]  # first step warms up
                med[v].append(statistics.median(times))
    base = statistics.median(med["plain"])
    result = {
        "block": {
            "hidden": H,
            "expert_width": WIDTH,
            "experts": E,
            "top_k": K,
            "tokens": TOKENS,
            "recipe": "current",
        },
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "step_ms": {v: round(1e3 * statistics.median(med[v]), 2) for v in variants},
        "ratio_vs_plain": {v: round(statistics.median(med[v]) / base, 3) for v in variants},
        "ratio_spread": {v: [round(min(med[v]) / base, 3), round(max(med[v]) / base, 3)] for v in variants},
        "statistics_one_grouped_tensor": {k: round(v, 3) for k, v in stats_pass(20).items()},
        # The machine may be shared: the load average (1, 5, 15 min) at the start and the end.
        "load_average": {"cpus": os.cpu_count(), "start": [round(x, 2) for x in load_start],
                         "end": [round(x, 2) for x in os.getloadavg()]},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
