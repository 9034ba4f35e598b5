"""Put the report and diagnosis.json on the runs' trackers: MLflow artifacts of the FP8 run, and
an HTML panel in its W&B run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8track.optional import require

ARTIFACT_DIR = "fp8track-diagnosis"


def log_report_to_mlflow(
    run_id: str, tracking_uri: str, files: Sequence[str | os.PathLike[str]]
) -> list[str]:
    """Log ``files`` (report.html, diagnosis.json) as artifacts of MLflow run ``run_id`` under
    ``fp8track-diagnosis/``; returns their artifact paths."""
    require("mlflow", "logging the report to MLflow")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    out = []
    for f in files:
        client.log_artifact(run_id, str(f), ARTIFACT_DIR)
        out.append(f"{ARTIFACT_DIR}/{Path(f).name}")
    client.set_tag(run_id, "fp8track.diagnosis", "fp8track-diagnosis/report.html")
    return out


def log_report_to_wandb(
    report: str | os.PathLike[str],
    *,
    project: str,
    run_id: str,
    dir: str | os.PathLike[str],
    mode: str = "offline",
    key: str = "fp8track/report",
) -> Any:
    """Add ``report`` as a ``wandb.Html`` panel (``key``) to W&B run ``run_id`` (resumed with
    ``resume="allow"``; offline runs merge on ``wandb sync``); returns the finished run's directory."""
    wandb = require("wandb", "logging the report to W&B")
    run = wandb.init(project=project, id=run_id, resume="allow", dir=str(dir), mode=mode, reinit="create_new")
    try:
        run.log({key: wandb.Html(Path(report).read_text(encoding="utf-8"), inject=False)})
    finally:
        run.finish()
    return Path(run.dir).parent


__all__ = ["log_report_to_mlflow", "log_report_to_wandb", "ARTIFACT_DIR"]
