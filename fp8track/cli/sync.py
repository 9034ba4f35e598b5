"""``fp8track sync RUN_DIR [--mlflow-uri URI [--mlflow-run-id ID]] [--wandb-dir DIR] [--all]``:
send a run directory's missed (or all) steps to MLflow and/or W&B
(:func:`fp8track.trackers.replay.sync_mlflow`, :func:`~fp8track.trackers.replay.sync_wandb`);
prints what was sent as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fp8track.cli.checks import bound_mlflow_retries, check_out_dir, check_store_uris
from fp8track.errors import ConfigError


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``fp8track sync`` on an ``argparse`` sub-parsers object."""
    p = sub.add_parser(
        "sync", description="Replay a local run directory into a tracker: the ``fp8track sync`` command."
    )
    p.add_argument("run_dir", help="fp8track run directory (holds meta.json, metrics.jsonl, ...)")
    p.add_argument("--mlflow-uri", help="MLflow tracking URI, e.g. sqlite:///mlflow.db or http://127.0.0.1:5000")
    p.add_argument(
        "--mlflow-run-id",
        help="existing run to complete (default: the run already tagged with this "
        "run directory's fp8track.run_id, else a new run with every step)",
    )
    p.add_argument("--mlflow-experiment", default="fp8track", help="experiment for a new MLflow run")
    p.add_argument("--mlflow-name", default="mlflow", help="tracker name whose missed file to read")
    p.add_argument(
        "--wandb-dir", help="directory of the W&B run (a folder; upload it later with `wandb sync`)"
    )
    p.add_argument(
        "--wandb-run-id",
        help="existing online run to resume and complete (default: the run fp8track-<run id> of this run "
        "directory, every step the first time, what is still missed after)",
    )
    p.add_argument("--wandb-project", default="fp8track")
    p.add_argument("--wandb-mode", default="offline", choices=("online", "offline"))
    p.add_argument("--wandb-name", default="wandb", help="tracker name whose missed file to read")
    p.add_argument("--all", action="store_true", help="send every step, not only the missed ones")
    return p


def check(args: argparse.Namespace) -> None:
    check_store_uris(args, "mlflow_uri")
    check_out_dir("--wandb-dir", args.wandb_dir)


def run(args: argparse.Namespace) -> int:
    from fp8track.monitoring.records import RunReader
    from fp8track.trackers.replay import sync_mlflow, sync_wandb

    bound_mlflow_retries()
    run_dir = Path(args.run_dir)
    RunReader(run_dir)  # fails early with a clear message if this is not a run directory
    if not args.mlflow_uri and not args.wandb_dir:
        raise ConfigError("nothing to sync to: give --mlflow-uri (with --mlflow-run-id) and/or --wandb-dir")
    report: dict[str, Any] = {}
    if args.mlflow_uri:
        report["mlflow"] = sync_mlflow(
            run_dir, args.mlflow_uri, run_id=args.mlflow_run_id, experiment=args.mlflow_experiment,
            tracker_name=args.mlflow_name, all_steps=args.all,
        )
    if args.wandb_dir:
        report["wandb"] = sync_wandb(
            run_dir, args.wandb_dir, run_id=args.wandb_run_id, project=args.wandb_project,
            mode=args.wandb_mode, tracker_name=args.wandb_name, all_steps=args.all,
        )
    print(json.dumps(report, indent=2))
    return 0
