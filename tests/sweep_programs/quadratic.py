"""A sweep program with no model, for fast executor tests: it logs a known curve into the trial's
MLflow run the way any training script would (MLflow's own ``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI``).

Final value of ``--metric`` (default ``val/loss``) = ``2 + penalty(recipe) * fp8 share(bf16_layers)
+ noise(seed)``; the n-th of ``--steps`` values is the final one plus ``1 / (n + 1)``, so every run
improves with steps. ``--hang`` ignores SIGTERM (a pruned run must then be SIGKILLed);
``--metric none`` logs nothing (a program that never logs the sweep's metric). It writes its pid
to ``<MLFLOW_RUN_ID>.pid`` in ``--pid_dir`` so a test can check the process is gone.
``--fail_on``, ``--hang_on``, ``--silent_on``, ``--refuse_on``: comma lists of ``recipe`` or
``recipe@seed``; a run matching one exits 1 at once, sleeps for an hour (a hung trial), logs no
``--metric``, or refuses its parameters with fp8track's ``ConfigError`` (as ``apply_fp8`` refuses a
``bf16_layers`` term that names no layer of the model).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

PENALTY = {"bf16": 0.0, "current": 0.004, "mxfp8": 0.006, "block": 0.012, "delayed": 0.3}
# Four layers of 64 x 64 and a head of 64 x 256 (the head is half the GEMM FLOPs).
LAYERS = {"l0": 4096, "l1": 4096, "l2": 4096, "l3": 4096, "head": 16384}
KEEP = {"none": [], "first:1": ["l0"], "last:1": ["head"], "first_last": ["l0", "head"]}


def final_value(recipe: str, bf16_layers: str, seed: int) -> float:
    kept = KEEP[bf16_layers]
    share = sum(v for k, v in LAYERS.items() if k not in kept) / sum(LAYERS.values())
    penalty = PENALTY[recipe.split(":")[0]] * (share if recipe != "bf16" else 0.0)
    return 2.0 + penalty + 0.002 * ((seed * 7919) % 5 - 2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="current")
    p.add_argument("--bf16_layers", default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--metric", default="val/loss")
    p.add_argument("--hang", default="False")
    p.add_argument("--pid_dir", default="")
    p.add_argument("--fail_on", default="")
    p.add_argument("--hang_on", default="")
    p.add_argument("--silent_on", default="")
    p.add_argument("--refuse_on", default="")
    args, _ = p.parse_known_args()

    def matches(option: str) -> bool:
        return bool({args.recipe, f"{args.recipe}@{args.seed}"} & set(option.split(",")))

    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    rid = os.environ["MLFLOW_RUN_ID"]
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    if args.pid_dir:
        Path(args.pid_dir, f"{rid}.pid").write_text(str(os.getpid()))
    if args.hang == "True":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if matches(args.refuse_on):
        from fp8track.errors import ConfigError

        raise ConfigError(f"planted refusal: {args.recipe} names no layer of this model")
    if matches(args.fail_on):
        raise SystemExit(f"planted failure for {args.recipe}@{args.seed}")
    if matches(args.hang_on):
        time.sleep(3600)
    if matches(args.silent_on):
        args.metric = "none"
    kept = [] if args.recipe == "bf16" else KEEP[args.bf16_layers]
    fp8 = [k for k in LAYERS if k not in kept] if args.recipe != "bf16" else []
    now = int(time.time() * 1000)
    client.log_batch(
        rid,
        metrics=[
            Metric("fp8_flop_share", sum(LAYERS[k] for k in fp8) / sum(LAYERS.values()), now, 0),
            Metric("n_bf16_layers", float(len(kept)), now, 0),
        ],
        tags=[RunTag("fp8track.bf16_layer_names", ",".join(kept) or "none")],
    )
    final = final_value(args.recipe, args.bf16_layers, args.seed)
    for n in range(args.steps):
        if args.metric != "none":
            client.log_metric(rid, args.metric, final + 1.0 / (n + 1) - 1.0 / args.steps, step=n)
        else:
            client.log_metric(rid, "train/loss", final, step=n)
        time.sleep(args.sleep)


if __name__ == "__main__":
    main()
