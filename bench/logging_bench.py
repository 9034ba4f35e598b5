"""Logging benchmark: how long the training thread is blocked by tracker logging.

Shape (the issue's): M metrics per step for S steps (default 1,000 x 100) through the fp8track
adapters, into MLflow on SQLite and into an offline W&B run. Between two log calls the "training
thread" runs a fixed CPU matmul workload, so the background worker competes for the machine as
it would in training. Measured side by side in one process:

- ``tracker``: ``TrackerFanout.log`` with the default background adapter: blocking time per step,
  time for ``finish`` to drain, and the number of points the store holds afterwards.
- ``sync_batch``: the same adapter with ``background=False`` (one synchronous ``log_batch`` /
  ``run.log`` per step in the training thread).
- ``per_metric`` (MLflow only): ``mlflow.log_metric`` once per metric, the naive baseline,
  timed over ``--baseline-steps`` steps (it is slow) and reported per step.

Prints one JSON object. ``ratio_*`` = baseline blocking per step / tracker blocking per step.

    python bench/logging_bench.py [--steps 100] [--metrics 1000] [--baseline-steps 2] [--only mlflow|wandb]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fp8track.monitoring.records import RunMeta
from fp8track.trackers import TrackerFanout
from fp8track.trackers.base import StepBatch


def _work(a: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        a = (a @ a).clamp_(-1, 1)


def _calibrate(target_ms: float) -> tuple[torch.Tensor, int]:
    a = torch.rand(256, 256) / 256
    t0 = time.perf_counter()
    _work(a, 20)
    per = (time.perf_counter() - t0) / 20
    return a, max(1, round(target_ms / 1000 / per))


def _batches(steps: int, n_metrics: int) -> list[StepBatch]:
    names = [
        f"fp8/blocks.{i // 12}.l{i % 4}/{('activation', 'weight', 'gradient')[i % 3]}/stat{i}"
        for i in range(n_metrics)
    ]
    return [
        StepBatch(step=s, metrics={n: (s * 7 + j) % 101 / 100 for j, n in enumerate(names)})
        for s in range(steps)
    ]


def _summ(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1000 for t in times)
    return {
        "mean_ms": round(statistics.fmean(ms), 4),
        "p50_ms": round(ms[len(ms) // 2], 4),
        "p95_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 4),
        "max_ms": round(ms[-1], 4),
    }


def _drive(
    fan: TrackerFanout, batches: list[StepBatch], work: tuple[torch.Tensor, int]
) -> tuple[list[float], float]:
    blocked = []
    t_loop = time.perf_counter()
    for b in batches:
        _work(*work)
        t0 = time.perf_counter()
        fan.log(b)
        blocked.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - t_loop
    return blocked, loop_s


def bench_mlflow(args, tmp: Path, work) -> dict:
    import mlflow
    from mlflow import MlflowClient

    from fp8track.trackers.mlflow import MLflowTracker

    db = tmp / "bench.db"
    uri = f"sqlite:///{db}"
    client = MlflowClient(uri)
    exp = client.create_experiment("bench", artifact_location=str(tmp / "art"))
    batches = _batches(args.steps, args.metrics)

    def count(run_id: str) -> int:
        with sqlite3.connect(db) as con:
            return con.execute("SELECT COUNT(*) FROM metrics WHERE run_uuid = ?", (run_id,)).fetchone()[0]

    out: dict = {"store": "sqlite"}
    t_base = time.perf_counter()
    _drive(TrackerFanout([], tmp / "r0"), batches, work)
    out["loop_without_logging_s"] = round(time.perf_counter() - t_base, 3)

    for label, background in (("tracker", True), ("sync_batch", False)):
        run_id = client.create_run(exp).info.run_id
        tracker = MLflowTracker(client=client, run_id=run_id, heatmap=False, background=background)
        fan = TrackerFanout([tracker], tmp / f"run-{label}")
        fan.start(RunMeta(recipe={"name": "delayed"}))
        blocked, loop_s = _drive(fan, batches, work)
        t0 = time.perf_counter()
        fan.finish()
        out[label] = {
            "blocking_per_step": _summ(blocked),
            "loop_s": round(loop_s, 3),
            "finish_drain_s": round(time.perf_counter() - t0, 3),
            "points_stored": count(run_id),
            "points_expected": args.steps * args.metrics,
            "failures": fan.failures[tracker.name],
        }

    # naive baseline: the fluent API, one call per metric
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as run:
        blocked = []
        for b in batches[: args.baseline_steps]:
            t0 = time.perf_counter()
            for k, v in b.metrics.items():
                mlflow.log_metric(k, v, step=b.step)
            blocked.append(time.perf_counter() - t0)
        out["per_metric"] = {
            "blocking_per_step": _summ(blocked),
            "steps_timed": len(blocked),
            "points_stored": count(run.info.run_id),
        }
    mlflow.set_tracking_uri(None)
    t = out["tracker"]["blocking_per_step"]["mean_ms"]
    out["ratio_per_metric_vs_tracker"] = round(out["per_metric"]["blocking_per_step"]["mean_ms"] / t, 1)
    out["ratio_sync_batch_vs_tracker"] = round(out["sync_batch"]["blocking_per_step"]["mean_ms"] / t, 1)
    return out


def _wandb_points(run_dir: Path) -> tuple[int, int]:
    exe = Path(sys.executable).with_name("wandb")
    res = subprocess.run(
        [str(exe), "leet", "inspect", str(run_dir), "--json"], check=True, capture_output=True, text=True
    )
    rows = [
        json.loads(x)["history"]["item"]
        for x in res.stdout.splitlines()
        if '"type": "history"' in x or '"type":"history"' in x
    ]
    return len(rows), sum(sum(1 for k in r if k.startswith("fp8/")) for r in rows)


def bench_wandb(args, tmp: Path, work) -> dict:
    import wandb

    from fp8track.trackers.wandb import WandbTracker

    batches = _batches(args.steps, args.metrics)
    out: dict = {"mode": "offline"}
    for label, background in (("tracker", True), ("sync_batch", False)):
        run = wandb.init(project="fp8track-bench", dir=str(tmp / label), mode="offline", reinit="create_new")
        tracker = WandbTracker(run, own_run=True, background=background)
        fan = TrackerFanout([tracker], tmp / f"wrun-{label}")
        fan.start(RunMeta(recipe={"name": "delayed"}))
        blocked, loop_s = _drive(fan, batches, work)
        t0 = time.perf_counter()
        fan.finish()
        drain = time.perf_counter() - t0
        rows, points = _wandb_points(Path(run.dir).parent)
        out[label] = {
            "blocking_per_step": _summ(blocked),
            "loop_s": round(loop_s, 3),
            "finish_drain_s": round(drain, 3),
            "history_rows": rows,
            "points_stored": points,
            "points_expected": args.steps * args.metrics,
            "failures": fan.failures[tracker.name],
        }
    out["ratio_sync_batch_vs_tracker"] = round(
        out["sync_batch"]["blocking_per_step"]["mean_ms"] / out["tracker"]["blocking_per_step"]["mean_ms"], 1
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--metrics", type=int, default=1000)
    p.add_argument("--baseline-steps", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=20.0, help="simulated training compute per step")
    p.add_argument("--only", choices=("mlflow", "wandb"))
    args = p.parse_args()
    torch.set_num_threads(1)
    work = _calibrate(args.step_ms)
    result: dict = {
        "steps": args.steps,
        "metrics_per_step": args.metrics,
        "simulated_step_ms": args.step_ms,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.only in (None, "mlflow"):
            result["mlflow"] = bench_mlflow(args, tmp, work)
        if args.only in (None, "wandb"):
            result["wandb"] = bench_wandb(args, tmp, work)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
