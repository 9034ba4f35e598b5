"""``fp8track sweep SWEEP.yaml --trials N [--tracking-uri URI] [--storage URL] [--wandb] [--summary]``:
:func:`fp8track.sweep.executor.run_sweep` on the sweep YAML, then its summary and recommendation.

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

from fp8track.cli.checks import (
    check_count,
    check_number,
    check_out_dir,
    check_seed,
    check_sqlite_folder,
    check_store_uris,
)
from fp8track.errors import ConfigError


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("sweep")
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
    return p


def check(args: argparse.Namespace) -> None:
    check_count("--trials", args.trials)
    check_store_uris(args, "tracking_uri", "storage")
    check_sqlite_folder("--storage", args.storage)
    check_seed("--seed", args.seed)
    check_out_dir("--out", args.out)
    check_number("--tolerance-factor", args.tolerance_factor, 0.0)
    check_number("--tolerance-floor", args.tolerance_floor, 0.0)
    check_number("--kill-grace", args.kill_grace, 0.0)


def _options(args: argparse.Namespace, spec: Any) -> Any:
    """The executor's :class:`~fp8track.sweep.options.SweepOptions` from the command line and the
    sweep YAML (``--trials``, else its ``run_cap``, else its grid's size)."""
    from fp8track.sweep.options import SweepOptions, default_out

    trials = args.trials or spec.run_cap or spec.grid_size
    if trials is None:
        raise ConfigError("--trials is required (the sweep has no run_cap and is not a finite grid)")
    if spec.grid_size is not None and spec.method == "grid":
        trials = min(trials, spec.grid_size)
    return SweepOptions(
        trials=trials, out=Path(args.out) if args.out else default_out(spec.name),
        tracking_uri=args.tracking_uri,
        storage=args.storage, wandb=args.wandb, seed=args.seed, progress=not args.no_progress,
        tolerance_factor=args.tolerance_factor, tolerance_floor=args.tolerance_floor,
        control_seeds=args.control_seeds, finalists=args.finalists, seed_param=args.seed_param,
        heartbeat_s=args.heartbeat, grace_s=args.grace, threads=args.threads, kill_grace_s=args.kill_grace,
        auto_from=args.auto_from, trial_timeout_s=args.trial_timeout,
    )


def run(args: argparse.Namespace) -> int:
    from fp8track.sweep.executor import run_sweep, signals_interrupt
    from fp8track.sweep.finish import stored_summary
    from fp8track.sweep.spec import load_sweep

    spec = load_sweep(args.sweep)  # every problem of the YAML is refused here, before any training
    # MLflow draws a progress bar for every small artifact the executor reads (rankings, layer tables)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    options = _options(args, spec)
    if args.summary:
        parent, summary = stored_summary(options.mlflow_uri, spec.name)
        print(f"sweep {spec.name!r}: parent run {parent} at {options.mlflow_uri}")
        print(summary or "the sweep has not finished: no summary yet")
        return 0
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
    _print_outcome(args, spec.name, options, outcome, time.perf_counter() - t0)
    return 0


def _print_outcome(args: argparse.Namespace, name: str, options: Any, outcome: Any, seconds: float) -> None:
    """The finished sweep: its table and recommendation (when this process wrote the summary), a
    JSON report, and where to look at it."""
    from fp8track.sweep.links import mlflow_ui_command, sweep_links
    from fp8track.sweep.summary import format_text

    report: dict[str, Any] = {
        "sweep": name, "parent_run_id": outcome.parent_run_id, "trials_run_here": outcome.ran,
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
        print(sweep_links(options.mlflow_uri, name))
    except Exception:  # the links are a convenience: the sweep itself has finished
        print(f"Look at it: {mlflow_ui_command(options.mlflow_uri)}")
    if options.wandb:
        print(wandb_runs_line(options.out / "wandb"))


def wandb_runs_line(root: Path) -> str:
    """Where the programs' W&B offline runs are and the ``wandb sync`` line that uploads them.

    The sweep sets ``WANDB_DIR=<out>/wandb``; W&B writes its runs one level deeper, in
    ``$WANDB_DIR/wandb/offline-run-*`` (a program's own ``dir=`` puts them elsewhere), so the
    folders that hold runs are looked up instead of assumed."""
    parents = sorted({p.parent for p in root.rglob("offline-run-*") if p.is_dir()})
    if not parents:
        return f"W&B offline runs: none under {root} (the program opened no W&B run there)"
    globs = " ".join(f"{d}/offline-run-*" for d in parents)
    return f"W&B offline runs: {', '.join(map(str, parents))}  (upload: wandb sync {globs})"
