"""Train the example GPT with Lightning under an FP8 recipe (CPU emulation), watched by FP8Monitor,
logging to W&B and MLflow at once. Then print the run at a glance.

    python examples/lightning_wandb_mlflow.py --recipe delayed --steps 300
    python examples/lightning_wandb_mlflow.py --recipe bf16 --out fp8track-example/bf16   # the BF16 control
    python examples/lightning_wandb_mlflow.py --control fp8track-example/bf16/fp8track-runs/<run id>

W&B runs offline unless you pass --wandb-mode online; MLflow writes to fp8track-example/mlflow.db (SQLite):
    mlflow ui --backend-store-uri sqlite:///fp8track-example/mlflow.db
fp8track's run directories are <out>/fp8track-runs/<run id> (the Trainer's default_root_dir is --out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import wandb
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

import fp8track
from fp8track.demo import quiet_libraries
from fp8track.examples.gpt_lightning import build_example


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--recipe", default="delayed", help="FP8 recipe string, e.g. delayed:hybrid:h16:max, mxfp8, bf16"
    )
    p.add_argument(
        "--bf16-layers", default="none", help="fallback spec: none, first_last, last:2, re:lm_head, ..."
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every-n-steps", type=int, default=10)
    p.add_argument("--control", "--baseline", dest="control", default=None,
                   help="the BF16 control's run directory (or mlflow:<run_id>); --baseline: the former name")
    p.add_argument(
        "--out",
        default="fp8track-example",
        help="folder for checkpoints, run directories, W&B files, mlflow.db",
    )
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the example's tiny GEMMs run best on one thread
    L.seed_everything(args.seed, verbose=False)
    module, data, report = build_example(recipe=args.recipe, bf16_layers=args.bf16_layers, seed=args.seed)
    print(
        f"recipe={report.recipe} fp8 layers={len(report.fp8_layers)} "
        f"bf16={[n for n, _ in report.bf16_layers]}"
    )

    # Library info logs and warnings (Lightning's tips, MLflow/alembic set-up, W&B banners) are
    # silenced while training: the console keeps fp8track's answers.
    with quiet_libraries():
        # The W&B run is opened here and handed to the logger: WandbLogger's own wandb.init passes
        # anonymous=None, which W&B 0.31 answers with a deprecation line on the console.
        run = wandb.init(
            project="fp8track-example",
            name=str(report.recipe),
            dir=str(out),
            mode=args.wandb_mode,
            settings=wandb.Settings(silent=True),
        )
        loggers = [
            WandbLogger(experiment=run, save_dir=str(out)),
            MLFlowLogger(experiment_name="fp8track-example", run_name=str(report.recipe),
                         tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}",
                         artifact_location=(out / "mlartifacts").resolve().as_uri()),
        ]
        monitor = fp8track.FP8Monitor(
            every_n_steps=args.every_n_steps, control=args.control, apply_report=report
        )
        trainer = L.Trainer(
            max_steps=args.steps, accelerator="cpu", devices=1, precision="bf16-mixed", logger=loggers,
            callbacks=[monitor], default_root_dir=str(out), log_every_n_steps=args.every_n_steps,
            val_check_interval=min(100, args.steps), limit_val_batches=8, enable_model_summary=False,
            enable_progress_bar=False,
        )
        trainer.fit(module, datamodule=data)
        if args.wandb_mode != "disabled":
            loggers[0].experiment.finish()
    summary = monitor.summary()
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
