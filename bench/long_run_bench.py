"""Long-run resource bench: synthetic optimizer steps through the real monitor and real trackers.

A two-layer model is trained for real on the sampled steps (forward, backward, hooks, statistics)
and the other steps only report a loss, as a week-long run with ``every_n_steps`` would. The
trackers are MLflow (SQLite store, heatmap on) and W&B (offline). Prints one JSON object: RSS
(resident set size, MiB) at each checkpoint (the trackers' queues drained first; with
tracemalloc on, also the traced Python heap, ``traced_mib``), the run directory's size and bytes
per logged step, and what the trackers missed.

    python bench/long_run_bench.py [--steps 1000000] [--every-n-steps 100] [--no-wandb] [--no-mlflow]
        [--tracemalloc N]

``--no-wandb`` / ``--no-mlflow`` switch a tracker off (both off: the monitor and its run directory
alone), to attribute growth. ``--tracemalloc N`` traces allocations (slow) and prints the N
tracebacks whose live size grew most between the first and the last checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def rss_mib() -> float:
    """Resident set size of this process in MiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def long_run(
    out: Path,
    steps: int,
    every_n_steps: int = 100,
    checkpoints: tuple[int, ...] = (),
    use_wandb: bool = True,
    use_mlflow: bool = True,
    table_every_n_steps: int = 1000,
    on_checkpoint: Callable[[int], None] | None = None,
    trace_from: int | None = None,
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps; measure RSS and run-directory size at each checkpoint step
    (after which ``on_checkpoint(step)`` is called, e.g. to take a tracemalloc snapshot). Both
    trackers write their tables every ``table_every_n_steps`` logged steps.

    ``trace_from`` (a checkpoint step): tracemalloc (one frame) starts there, so each later
    checkpoint's ``traced_mib`` is the Python memory allocated since then and still alive, the
    trackers' queues drained: the growth itself, free of the allocator's and SQLite's page reuse
    that make RSS noisy. Tracing slows the traced steps about tenfold."""
    if trace_from is not None and trace_from not in checkpoints:
        raise ValueError(f"trace_from={trace_from} must be one of the checkpoints {checkpoints}")
    import torch

    from fp8track import MonitorConfig
    from fp8track.frontend import Monitor
    from fp8track.trackers.fanout import read_missed
    from fp8track.trackers.mlflow import MLflowTracker

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    trackers: list[Any] = []
    if use_mlflow:
        trackers.append(MLflowTracker(
            tracking_uri=f"sqlite:///{out}/mlflow.db", experiment_name="long-run",
            artifact_location=(out / "artifacts").as_uri(), table_every_n_steps=table_every_n_steps,
        ))  # fmt: skip
    if use_wandb:
        from fp8track.trackers.wandb import WandbTracker

        trackers.append(
            WandbTracker.create(
                project="long-run", dir=str(out), mode="offline", table_every_n_steps=table_every_n_steps
            )
        )
    config = MonitorConfig(every_n_steps=every_n_steps)
    monitor = Monitor(model, config, log_dir=out / "runs", trackers=trackers).attach()
    x = torch.randn(8, 16)
    points: list[dict[str, float]] = []
    marks = set(checkpoints) | {steps}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            if config.samples(step):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                monitor.step(loss=loss)
                opt.zero_grad()
            else:
                monitor.step(loss=1.0 + 1e-3 * (step % 13))
            if step + 1 in marks:
                for t in trackers:  # what is still queued is backlog, not growth
                    t.flush(timeout_s=60)
                gc.collect()
                logged = (step + 1 + every_n_steps - 1) // every_n_steps
                size = dir_bytes(monitor.run_dir)
                points.append({
                    "step": step + 1, "rss_mib": round(rss_mib(), 1), "run_dir_bytes": size,
                    "bytes_per_logged_step": round(size / logged, 1),
                    "bytes_per_step": round(size / (step + 1), 2),
                    "seconds": round(time.perf_counter() - t0, 1),
                })  # fmt: skip
                if tracemalloc.is_tracing():  # Python objects alive now, the tracker queues drained
                    points[-1]["traced_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 3)
                if step + 1 == trace_from and not tracemalloc.is_tracing():
                    tracemalloc.start(1)
                    points[-1]["traced_mib"] = 0.0
                if on_checkpoint is not None:
                    on_checkpoint(step + 1)
        if trace_from is not None:
            tracemalloc.stop()
        monitor.close()
    return {
        "steps": steps,
        "every_n_steps": every_n_steps,
        "layers": 2,
        "trackers": [t.name for t in trackers],
        "points": points,
        "missed": {t.name: len(read_missed(monitor.run_dir, t.name)) for t in trackers},
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--every-n-steps", type=int, default=100)
    ap.add_argument("--no-wandb", action="store_true")
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--table-every-n-steps", type=int, default=1000, help="logged steps between table writes")
    ap.add_argument(
        "--checkpoints", default="10000,100000,250000,500000,750000", help="comma-separated steps"
    )
    ap.add_argument(
        "--tracemalloc", type=int, default=0, metavar="N", help="print the N most grown tracebacks"
    )
    args = ap.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    checkpoints = tuple(s for s in map(int, args.checkpoints.split(",")) if s < args.steps)
    snapshots: dict[int, Any] = {}
    on_checkpoint = None
    if args.tracemalloc:
        tracemalloc.start(12)
        on_checkpoint = lambda step: snapshots.__setitem__(step, tracemalloc.take_snapshot())  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # MLflow and W&B defaults write to the working directory
        result = long_run(
            Path(tmp), args.steps, args.every_n_steps, checkpoints,
            use_wandb=not args.no_wandb, use_mlflow=not args.no_mlflow,
            table_every_n_steps=args.table_every_n_steps, on_checkpoint=on_checkpoint,
        )  # fmt: skip
    first, last = result["points"][0], result["points"][-1]
    result["rss_growth_mib_first_to_last"] = round(last["rss_mib"] - first["rss_mib"], 1)
    span = (last["step"] - first["step"]) / 1000
    result["rss_mib_per_1000_steps"] = (
        round(result["rss_growth_mib_first_to_last"] / span, 4) if span else None
    )
    if snapshots:
        a, b = snapshots[min(snapshots)], snapshots[max(snapshots)]
        top = b.compare_to(a, "traceback")[: args.tracemalloc]
        result["tracemalloc_growth"] = [
            {
                "kib": round(d.size_diff / 1024, 1), "count": d.count_diff,
                "traceback": d.traceback.format()[-8:],
            }
            for d in top
        ]  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
