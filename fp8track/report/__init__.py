"""The diagnosis as something people look at: one self-contained HTML report (inline PNG figures,
no network) and its publication to the run's trackers (MLflow artifact, W&B HTML)."""

from fp8track.report.html import render_report, write_report
from fp8track.report.publish import log_report_to_mlflow, log_report_to_wandb
from fp8track.report.run import DiagnosisOutput, diagnose_runs

__all__ = [
    "render_report",
    "write_report",
    "log_report_to_mlflow",
    "log_report_to_wandb",
    "diagnose_runs",
    "DiagnosisOutput",
]
