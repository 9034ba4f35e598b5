"""``fp8track sweep SWEEP.yaml --trials N [--tracking-uri URI] [--storage URL] [--wandb] [--summary]``.

Ctrl-C, SIGTERM and SIGHUP stop the running trial's program, close the sweep's open MLflow runs
as KILLED, print one line and exit ``128 + signal`` (130, 143, 129); the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _cmd_sweep(args: argparse.Namespace) -> int:
    from fp8track.sweep.executor import SweepOptions, run_sweep, signals_interrupt
    from fp8track.sweep.options import default_out
    from fp8track.sweep.spec import load_sweep
    from fp8track.sweep.summary import format_text

    spec = load_sweep(args.sweep)  # every problem of the YAML is refused here, before any training
    # MLflow draws a progress bar for every small artifact the executor reads (rankings, layer tables)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    trials = args.trials or spec.run_cap or spec.grid_size
    if trials is None:
        from fp8track.errors import ConfigError

        raise ConfigError("--trials is required (the sweep has no run_cap and is not a finite grid)")
    if spec.grid_size is not None and spec.method == "grid":
        trials = min(trials, spec.grid_size)
    options = SweepOptions(
        trials=trials, out=Path(args.out) if args.out else default_out(spec.name),
        tracking_uri=args.tracking_uri,
        storage=args.storage, wandb=args.wandb, seed=args.seed, progress=not args.no_progress,
        tolerance_factor=args.tolerance_factor, tolerance_floor=args.tolerance_floor,
        control_seeds=args.control_seeds, finalists=args.finalists, seed_param=args.seed_param,
        heartbeat_s=args.heartbeat, grace_s=args.grace, threads=args.threads, kill_grace_s=args.kill_grace,
        auto_from=args.auto_from, trial_timeout_s=args.trial_timeout,
    )
    if args.summary:
        return _print_summary(spec.name, options.mlflow_uri)
    t0 = time.perf_counter()
    try:
        with signals_interrupt():
            outcome = run_sweep(spec, options)
    except KeyboardInterrupt as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        print(f"fp8track sweep: interrupted ({signal.Signals(signum).name}): the running program was "
              f"stopped and the sweep's open MLflow runs marked KILLED; the same command resumes it "
              f"({options.out})", file=sys.stderr)
        return 128 + int(signum)
    seconds = time.perf_counter() - t0
    report: dict[str, Any] = {
        "sweep": spec.name, "parent_run_id": outcome.parent_run_id, "trials_run_here": outcome.ran,
        "seconds": round(seconds, 1), "out": str(options.out), "tracking_uri": options.mlflow_uri,
        "storage": options.storage_url,
    }
    if outcome.recommendation is not None:
        print(format_text(outcome.rows, outcome.recommendation))
        report["recommendation"] = outcome.recommendation.to_dict()
    elif outcome.summary_text is not None:
        print(outcome.summary_text)
        report["note"] = "the worker of the last trial wrote the summary"
    else:
        report["note"] = (
            "the worker of the last trial writes the summary; read it with: fp8track sweep "
            f"{args.sweep} --summary"
        )
    print(json.dumps(report, indent=1, default=str))
    try:
        print(_how_to_look(options.mlflow_uri, spec.name))
    except Exception:  # the links are a convenience: the sweep itself has finished
        from fp8track.sweep.links import mlflow_ui_command

        print(f"Look at it: {mlflow_ui_command(options.mlflow_uri)}")
    if options.wandb:
        print(
            f"W&B offline runs: {options.out / 'wandb'}  "
            f"(upload: wandb sync {options.out / 'wandb'}/offline-run-*)"
        )
    return 0


def _print_summary(name: str, mlflow_uri: str) -> int:
    """``--summary``: the finished sweep's table and recommendation, read from its parent run."""
    from mlflow.tracking import MlflowClient

    from fp8track.errors import ConfigError
    from fp8track.sweep.finish import read_summary
    from fp8track.sweep.mlflow_runs import find_parent

    store = mlflow_uri.removeprefix("sqlite:///")
    if store != mlflow_uri and not Path(store).is_file():  # MLflow would create an empty one
        raise ConfigError(
            f"no sweep store at {mlflow_uri}: sweep {name!r} has not run there "
            "(run it first, or pass the --tracking-uri and --out it used)"
        )
    client = MlflowClient(mlflow_uri)
    _exp_id, parent = find_parent(client, name)
    print(f"sweep {name!r}: parent run {parent} at {mlflow_uri}")
    print(read_summary(client, parent) or "the sweep has not finished: no summary yet")
    return 0


def _how_to_look(tracking_uri: str, name: str) -> str:
    """:func:`fp8track.sweep.links.how_to_look` for the sweep's trials, oldest first."""
    from mlflow.tracking import MlflowClient

    from fp8track.sweep.links import how_to_look
    from fp8track.sweep.mlflow_runs import find_parent

    client = MlflowClient(tracking_uri)
    exp_id, parent = find_parent(client, name)
    trials = client.search_runs(
        [exp_id], f"tags.mlflow.parentRunId = '{parent}' and tags.`fp8track.role` = 'trial'", max_results=1000
    )
    trials.sort(key=lambda r: int(r.data.tags.get("fp8track.trial", 0)))
    return how_to_look(tracking_uri, exp_id, [r.info.run_id for r in trials])


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("sweep", help="run a W&B sweep YAML locally with Optuna into MLflow parent/child runs")
    p.add_argument("sweep", help="the sweep YAML (e.g. integrations/wandb/fp8_sweep.yaml)")
    p.add_argument(
        "--trials",
        type=int,
        default=None,
        help="finished trials the sweep needs (default: run_cap or the grid)",
    )
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///<out>/mlflow.db)")
    p.add_argument("--storage", default=None, help="Optuna RDB URL shared by workers (default sqlite:///<out>/optuna.db)")
    p.add_argument(
        "--wandb", action="store_true", help="programs that use W&B log offline, grouped by the sweep name"
    )
    p.add_argument(
        "--summary",
        action="store_true",
        help="print the summary and recommendation from the store, run nothing",
    )
    p.add_argument(
        "--out", default=None,
        help="output folder (default ./fp8track-sweep/<sweep name as a folder name: letters, digits, . _ ->)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampler seed")
    p.add_argument("--tolerance-factor", type=float, default=1.0, help="noise band = factor x seed spread")
    p.add_argument(
        "--tolerance-floor", type=float, default=0.01, help="smallest noise band, in the metric's units"
    )
    p.add_argument(
        "--control-seeds", type=int, default=2, help="seeds of the BF16 control and the finalists' reruns"
    )
    p.add_argument(
        "--finalists", type=int, default=2, help="trials rerun on every control seed before recommending"
    )
    p.add_argument("--seed-param", default="seed", help="the sweep parameter that is the program's seed")
    p.add_argument(
        "--kill-grace", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL for a pruned trial"
    )
    p.add_argument(
        "--trial-timeout", type=float, default=None, metavar="SECONDS",
        help="stop and fail a program run (trial, control, rerun) still running after this long; "
        "the sweep goes on",
    )
    p.add_argument("--heartbeat", type=int, default=5, help="Optuna heartbeat interval, seconds")
    p.add_argument(
        "--grace", type=int, default=20, help="seconds without heartbeat before a trial counts as dead"
    )
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each trial's program")
    p.add_argument(
        "--auto-from",
        default="probe",
        help="auto:K rankings from an all-FP8 'probe' run of the trial's recipe (default) or from its "
        "'whatif' rows in the BF16 control (no FP8 run: NVFP4 without Blackwell; mxfp8, block, nvfp4)",
    )
    p.add_argument("--no-progress", action="store_true", help="no live display")
    p.set_defaults(func=_cmd_sweep)
    return p
