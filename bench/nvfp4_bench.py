"""Emulated NVFP4 vs BF16 and MXFP8 (CPU): final held-out loss gaps on the example GPT and on a
Hugging Face Llama built from a config, beside the BF16 seed spread; and the cost of the NVFP4
statistics against one read of the tensor.

    python bench/nvfp4_bench.py --part loss  --out bench/results_nvfp4_loss.json
    python bench/nvfp4_bench.py --part stats --out bench/results_nvfp4_stats.json
    python bench/nvfp4_bench.py --part range --out bench/results_block_range.json

``range``: what the monitor's ``max_blockwise_dynamic_range`` (TE's LogTensorStats statistic, on
block rows of sampled steps) adds: per tensor against the block row's own statistics, and per
sampled step of a small MLP (MXFP8 with what-if NVFP4, every step sampled) with and without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import torch

from fp8track.examples.gpt import CharData
from fp8track.examples.gpt_lightning import build_example, train_loop

GPT_RUNS = [("bf16", "none", 0), ("bf16", "none", 1), ("mxfp8", "none", 0), ("nvfp4", "none", 0),
            ("nvfp4", "last:50%,head", 0), ("nvfp4:no_rht:no_sr", "none", 0)]
LLAMA_RUNS = [("bf16", "none", 0), ("bf16", "none", 1), ("mxfp8", "none", 0), ("nvfp4", "none", 0),
              ("nvfp4", "last:50%,head", 0)]


def _llama(recipe: str, bf16_layers: str, seed: int, steps: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp8track import apply_fp8

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    apply_fp8(model, recipe, bf16_layers=bf16_layers, backend="emulated")
    data = CharData(None, block_size=64, batch_size=16, seed=seed)
    data.setup()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    t0 = time.perf_counter()
    for x, _y in itertools.islice(data.endless_batches(), steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    sec = (time.perf_counter() - t0) / steps
    model.eval()
    vals = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i, (x, _) in enumerate(data.val_dataloader()):
            if i == 16:
                break
            vals.append(model(input_ids=x, labels=x).loss.item())
    return {"val_loss": statistics.mean(vals), "seconds_per_step": sec}


def loss_part(steps: int, llama_steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, runs, fn in (
        (
            "gpt",
            GPT_RUNS,
            lambda r, b, s: train_loop(
                *build_example(recipe=r, bf16_layers=b, seed=s)[:2], steps, eval_batches=16
            ),
        ),
        ("llama", LLAMA_RUNS, lambda r, b, s: _llama(r, b, s, llama_steps)),
    ):
        res = {}
        for recipe, keep, seed in runs:
            t0 = time.perf_counter()
            r = fn(recipe, keep, seed)
            res[f"{recipe}|{keep}|seed{seed}"] = {"val_loss": round(r["val_loss"], 4),
                                                   "ms_per_step": round(1e3 * r["seconds_per_step"], 1)}
            print(
                name,
                recipe,
                keep,
                seed,
                res[f"{recipe}|{keep}|seed{seed}"],
                f"{time.perf_counter() - t0:.0f}s",
                flush=True,
            )
        base = res["bf16|none|seed0"]["val_loss"]
        for v in res.values():
            v["gap_vs_bf16_seed0"] = round(v["val_loss"] - base, 4)
        out[name] = {"steps": steps if name == "gpt" else llama_steps, "runs": res,
                     "bf16_seed_spread": round(abs(res["bf16|none|seed1"]["val_loss"] - base), 4)}
    return out


def _best(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def stats_part(n: int, reps: int) -> dict[str, Any]:
    from fp8track.numerics.nvfp4 import NVFP4Options
    from fp8track.numerics.stats import block_partial_stats, nvfp4_partial_stats, partial_stats

    torch.manual_seed(0)
    x = torch.randn(n, n, dtype=torch.bfloat16)
    cases = {
        "amax (one read)": lambda: x.abs().amax(),
        "e4m3 current scaling, fused kernel": lambda: partial_stats(x, "e4m3"),
        "mxfp8 blocks": lambda: block_partial_stats(x, "mxfp8", "e4m3"),
        "nvfp4 row-wise 1x16": lambda: nvfp4_partial_stats(x),
        "nvfp4 weight 16x16": lambda: nvfp4_partial_stats(x, NVFP4Options(tile_2d=True)),
        "nvfp4 column-wise + RHT": lambda: nvfp4_partial_stats(x, NVFP4Options(rht=True), columnwise=True),
        "nvfp4 gradient, stochastic rounding": lambda: nvfp4_partial_stats(
            x, NVFP4Options(stochastic=True), generator=torch.Generator().manual_seed(0)),
    }
    times = {k: _best(f, reps) for k, f in cases.items()}
    # Not used by the monitor (a compile per shape, below): what a compiled NVFP4 kernel would cost.
    compiled = torch.compile(nvfp4_partial_stats, dynamic=False)
    t0 = time.perf_counter()
    compiled(x)
    compile_s = time.perf_counter() - t0
    times["nvfp4 row-wise 1x16, torch.compile (not used by the monitor)"] = _best(lambda: compiled(x), reps)
    base = times["amax (one read)"]
    return {
        "shape": [n, n],
        "dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        "reps": reps,
        "nvfp4_compile_seconds": round(compile_s, 1),
        "cases": {
            k: {"ms_best": round(1e3 * t, 2), "x_one_read": round(t / base, 1)} for k, t in times.items()
        },
    }


def range_part(n: int, reps: int, steps: int) -> dict[str, Any]:
    from fp8track.monitoring import capture
    from fp8track.numerics.nvfp4 import blockwise_dynamic_range
    from fp8track.numerics.stats import block_partial_stats, nvfp4_partial_stats

    torch.manual_seed(0)
    x = torch.randn(n, n, dtype=torch.bfloat16)
    cases = {
        "amax (one read)": lambda: x.abs().amax(),
        "mxfp8 block statistics (one row)": lambda: block_partial_stats(x, "mxfp8", "e4m3"),
        "nvfp4 row-wise statistics (one row)": lambda: nvfp4_partial_stats(x),
        "range 1x32, both orientations (mxfp8 activation row)": (
            lambda: blockwise_dynamic_range(x, 32, 1, True)
        ),
        "range 1x32, one orientation (gradient / _columnwise row)": lambda: blockwise_dynamic_range(x, 32, 1),
        "range 1x16, one orientation (nvfp4 gradient row)": lambda: blockwise_dynamic_range(x, 16, 1),
        "range 16x16 tiles (nvfp4 weight row)": lambda: blockwise_dynamic_range(x, 16, 2),
        "range 128x128 tiles (block weight row)": lambda: blockwise_dynamic_range(x, 128, 2),
    }
    times = {k: _best(f, reps) for k, f in cases.items()}
    base = times["amax (one read)"]
    out: dict[str, Any] = {
        "shape": [n, n], "dtype": "bfloat16", "threads": torch.get_num_threads(), "reps": reps,
        "cases": {
            k: {"ms_best": round(1e3 * t, 2), "x_one_read": round(t / base, 1)} for k, t in times.items()
        },
    }
    step = {}
    spec = capture.block_range_spec
    for label, fn in (("with", spec), ("without", lambda *a: None)):
        capture.block_range_spec = fn  # type: ignore[assignment]
        try:
            step[label] = _monitor_step_seconds(steps)
        finally:
            capture.block_range_spec = spec  # type: ignore[assignment]
    out["monitor_sampled_step"] = {
        "model": "Linear(512,1024)-ReLU-Linear(1024,512), batch 256, emulated mxfp8, "
        "whatif nvfp4, every step sampled",
        "steps": steps,
        "ms_per_step_with_range": round(1e3 * step["with"], 1),
        "ms_per_step_without_range": round(1e3 * step["without"], 1),
        "ratio": round(step["with"] / step["without"], 3),
    }
    return out


def _monitor_step_seconds(steps: int) -> float:
    import tempfile

    from torch import nn

    from fp8track import Monitor, apply_fp8

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    report = apply_fp8(model, "mxfp8", backend="emulated")
    xs = [torch.randn(256, 512) for _ in range(steps + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        mon = Monitor(model, {"every_n_steps": 1, "whatif": ["nvfp4"]}, log_dir=tmp, trackers=[],
                      apply_report=report).attach()
        mon.begin_step(0)
        times = []
        for x in xs:
            t0 = time.perf_counter()
            model(x).pow(2).mean().backward()
            mon.step(loss=torch.tensor(0.0))
            times.append(time.perf_counter() - t0)
        mon.close()
    return statistics.median(times[1:])  # the first step warms up


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=("loss", "stats", "range"), required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--llama-steps", type=int, default=200)
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.part == "loss":
        res = loss_part(args.steps, args.llama_steps)
    elif args.part == "range":
        res = range_part(args.size, args.reps, min(args.steps, 12))
    else:
        res = stats_part(args.size, args.reps)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
