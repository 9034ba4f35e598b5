"""Emulated FP8 vs BF16 on the default example GPT (CPU): step-time ratio and final loss gap.

Recipes are timed in interleaved rounds in one process so machine load hits them alike.
Prints JSON: per recipe, median ms/step, ratio to BF16, and val-loss gap after ``--steps``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from fp8track.examples.gpt_lightning import build_example, train_loop

RECIPES = ["bf16", "delayed", "current", "mxfp8", "block", "fp8_input_bf16_gemm"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--timing-steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {r: [] for r in RECIPES}
    for _ in range(args.rounds):
        for r in RECIPES:
            module, data, _ = build_example(recipe=r, seed=0)
            times[r].append(train_loop(module, data, args.timing_steps, eval_batches=1)["seconds_per_step"])
    losses = {}
    for r in RECIPES:
        module, data, _ = build_example(recipe=r, seed=0)
        losses[r] = train_loop(module, data, args.steps, eval_batches=16)["val_loss"]
    base_t = statistics.median(times["bf16"])
    out = {
        "model": "GPT n_layer=2 n_embd=64 block_size=64 batch=16, stdlib text, CPU bf16 autocast",
        "threads": args.threads,
        "steps": args.steps,
        "recipes": {
            r: {
                "ms_per_step": round(statistics.median(times[r]) * 1e3, 2),
                "time_ratio_vs_bf16": round(statistics.median(times[r]) / base_t, 2),
                "val_loss": round(losses[r], 4),
                "val_loss_gap_vs_bf16": round(losses[r] - losses["bf16"], 4),
            }
            for r in RECIPES
        },
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
