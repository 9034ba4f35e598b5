"""``fp8track demo``: the example GPT as a BF16 control and as emulated FP8, monitored and compared.

Everything lands in one folder (default ``./fp8track-demo``):

* ``mlflow.db``: an MLflow SQLite store, experiment ``fp8track-demo``, one run per recipe
  (look at it with ``mlflow ui --backend-store-uri sqlite:///<folder>/mlflow.db``), its artifacts
  (tables, the per-layer heatmap) in ``mlartifacts/``;
* ``runs/<run_id>/``: fp8track's own run directories (the source of truth, replayable);
* ``wandb/``: W&B offline runs with ``--wandb`` (``wandb sync`` uploads them later).

The FP8 run takes the control's run directory as its baseline, so it logs the loss gap and
classifies its spikes as shared or FP8-only.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError


@dataclass(frozen=True)
class DemoRun:
    """One finished demo run: its name, recipe, fp8track run directory, and MLflow run id."""

    name: str
    recipe: str
    run_dir: Path
    mlflow_run_id: str | None
    final_loss: float
    seconds: float


def run_one(
    out: Path,
    name: str,
    recipe: str,
    *,
    steps: int,
    every_n_steps: int,
    baseline: Path | None,
    use_wandb: bool,
    progress: bool,
    seed: int = 0,
) -> DemoRun:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import MLFlowLogger

    from fp8track.examples.gpt import build_example
    from fp8track.lightning import FP8Monitor
    from fp8track.monitoring.records import RunReader

    module, data, _report = build_example(recipe=recipe, seed=seed)
    loggers: list[Any] = [
        MLFlowLogger(
            experiment_name="fp8track-demo",
            run_name=name,
            tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
            # MLflow's default artifact root is ./mlruns in the working directory; keep it here.
            artifact_location=(out / "mlartifacts").as_uri(),
        )
    ]
    if use_wandb:
        from lightning.pytorch.loggers import WandbLogger

        # mode="offline" goes to wandb.init for this run only (offline=True would set WANDB_MODE
        # for the whole process).
        loggers.append(WandbLogger(project="fp8track-demo", name=name, save_dir=str(out), mode="offline"))
    monitor = FP8Monitor(every_n_steps=every_n_steps, log_dir=out / "runs", baseline=baseline, config={"run_name": name})
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=loggers,
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=progress,
        log_every_n_steps=every_n_steps,
        limit_val_batches=20,
        val_check_interval=steps // 2 if steps >= 2 else None,
        default_root_dir=out,
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - t0
    run_dir = monitor.run_dir
    if run_dir is None:
        raise RuntimeError("the monitor did not open a run directory")
    losses = RunReader(run_dir).series()
    return DemoRun(name, recipe, run_dir, loggers[0].run_id, losses[max(losses)], seconds)


def run_demo(
    out: str | Path = "fp8track-demo",
    *,
    steps: int = 300,
    recipe: str = "delayed:hybrid:h16:max",
    every_n_steps: int = 10,
    use_wandb: bool = False,
    progress: bool = True,
) -> list[DemoRun]:
    """Train the BF16 control and the FP8 run; return both runs (control first)."""
    from fp8track.execution.recipes import Recipe

    Recipe.parse(recipe)  # a bad recipe fails here, before any training
    if steps < 2:
        raise ConfigError(f"steps must be >= 2, got {steps!r}")
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    control = run_one(
        out, "bf16-control", "bf16", steps=steps, every_n_steps=every_n_steps, baseline=None,
        use_wandb=use_wandb, progress=progress,
    )
    fp8 = run_one(
        out, f"fp8-{recipe.split(':')[0]}", recipe, steps=steps, every_n_steps=every_n_steps,
        baseline=control.run_dir, use_wandb=use_wandb, progress=progress,
    )
    return [control, fp8]


def _cmd_demo(args: argparse.Namespace) -> int:
    runs = run_demo(
        args.out, steps=args.steps, recipe=args.recipe, every_n_steps=args.every_n_steps,
        use_wandb=args.wandb, progress=not args.no_progress,
    )
    out = Path(args.out).resolve()
    summary = {
        "runs": [
            {
                "name": r.name,
                "recipe": r.recipe,
                "run_dir": str(r.run_dir),
                "mlflow_run_id": r.mlflow_run_id,
                "final_loss": r.final_loss,
                "seconds": round(r.seconds, 1),
            }
            for r in runs
        ],
        "final_loss_gap": runs[1].final_loss - runs[0].final_loss,
    }
    print(json.dumps(summary, indent=2))
    print(f"\nfp8track run directories: {out / 'runs'}")
    print(f"MLflow store:              sqlite:///{out / 'mlflow.db'}")
    print(f"Look at it:                mlflow ui --backend-store-uri sqlite:///{out / 'mlflow.db'}")
    if args.wandb:
        print(f"W&B offline runs:          {out / 'wandb'}  (upload: wandb sync {out / 'wandb'}/offline-run-*)")
    return 0


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="BF16 control vs emulated FP8 on the example GPT, monitored and logged")
    p.add_argument("--out", default="fp8track-demo", help="output folder (default ./fp8track-demo)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    p.add_argument("--recipe", default="delayed:hybrid:h16:max", help="FP8 recipe (fp8track.execution.recipes grammar)")
    p.add_argument("--every-n-steps", type=int, default=10, help="monitor sampling interval")
    p.add_argument("--wandb", action="store_true", help="also log to W&B in offline mode")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_demo)
    return p
