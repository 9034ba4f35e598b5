"""``fp8track demo [--out DIR] [--steps N] [--recipe R] [--every-n-steps N] [--wandb] [--no-plant]``:
:func:`fp8track.demo.run_and_diagnose`, then where everything is, each diagnosis and one answer line
per FP8 run."""

from __future__ import annotations

import argparse
from typing import Any

from fp8track.cli.checks import check_count, check_out_dir


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("demo")
    p.add_argument("--out", default="fp8track-demo", help="output folder (default ./fp8track-demo)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    p.add_argument(
        "--recipe", default="delayed:hybrid:h16:max", help="FP8 recipe (fp8track.execution.recipes grammar)"
    )
    p.add_argument("--every-n-steps", type=int, default=10, help="monitor sampling interval")
    p.add_argument(
        "--wandb", action="store_true", help="also log to W&B in offline mode (one run per training run)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plant", action="store_true", help="skip the planted-problem run")
    return p


def check(args: argparse.Namespace) -> None:
    check_out_dir("--out", args.out)
    check_count("--steps", args.steps)
    check_count("--every-n-steps", args.every_n_steps)


def run(args: argparse.Namespace) -> int:
    from fp8track.config import DEFAULT_LOG_DIR
    from fp8track.demo import run_and_diagnose
    from fp8track.sweep.links import mlflow_ui_command

    res = run_and_diagnose(args.out, steps=args.steps, recipe=args.recipe, every_n_steps=args.every_n_steps,
                           use_wandb=args.wandb, progress=not args.no_progress, plant=not args.no_plant)
    out, uri = res.out, res.tracking_uri
    print(f"\nfp8track run directories: {out / DEFAULT_LOG_DIR}")
    print(f"MLflow store:              {uri}")
    print(f"Look at it:                {mlflow_ui_command(uri)}")
    print(f"  then open the runs:      {res.runs_url}")
    print(f"  and compare them:        {res.compare_url}")
    print(f"Inference chain:           fp8track check-inference {out / 'fp8.ckpt'}")
    if args.wandb:
        print(
            f"W&B offline runs:          {out / 'wandb'}  (upload: wandb sync {out / 'wandb'}/offline-run-*)"
        )
    print(f"Summary (JSON):            {res.summary_path}")
    _print_diagnoses(res, args.steps)
    return 0


def _print_diagnoses(res: Any, steps: int) -> None:
    """Each FP8 run's diagnosis against the control, then one answer line per run: its verdict,
    the causal finding and the top-ranked layer."""
    from fp8track.analysis.pairing import run_label, run_name
    from fp8track.demo import PLANT_AMAX, PLANT_FRACTION, PLANT_LAYER
    from fp8track.report.console import print_diagnosis

    for label, diag in res.results.items():
        print(f"\n== {label} run vs the BF16 control ==")
        if label == "planted":
            print(
                f"planted problem: from step {int(PLANT_FRACTION * steps)}, "
                f"an outlier of {PLANT_AMAX:g} "
                f"enters the activation amax history of {PLANT_LAYER} every step"
            )
        print_diagnosis(diag.diagnosis, diag.html_path, runs=(run_label(diag.fp8), run_label(diag.control)))
    print("\n== answers ==")
    control = res.runs[0]
    by_name = {r.name: r for r in res.runs}
    for diag in res.results.values():
        d = diag.diagnosis
        name = run_name(diag.fp8)
        loss = (
            f"final loss {by_name[name].final_loss:.3f} vs {control.final_loss:.3f}"
            if name in by_name
            else ""
        )
        top = f"; top-ranked layer {d.layer_ranking[0].layer}" if d.layer_ranking else ""
        v = d.verdict
        what = f"{v.cause} ({d.top.severity})" if v.cause else d.top.kind
        print(f"{name}: {v.verdict}: {what}: {v.reason} ({loss}{top})")
