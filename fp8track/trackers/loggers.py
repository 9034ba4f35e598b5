"""Lightning loggers as tracker targets: the one test of what kind a logger is, and the generic
view that serves any other logger (TensorBoard, CSV, ...) through ``log_metrics``.

Decided from public attributes only, without importing wandb, mlflow or Lightning's logger modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fp8track.monitoring.records import StepBatch
from fp8track.trackers.base import scalar_metrics
from fp8track.trackers.queued import QueuedTracker

_LOGGER_MODULES = ("lightning.pytorch.loggers", "pytorch_lightning.loggers")
_NATIVE = {"WandbLogger": "wandb", "MLFlowLogger": "mlflow"}


def logger_kind(logger: Any) -> str | None:
    """How fp8track serves a Lightning logger.

    Returns:
        ``"wandb"`` / ``"mlflow"`` for Lightning's ``WandbLogger`` / ``MLFlowLogger`` (or a
        subclass): native views with tables and figures; ``"generic"`` for any other object with a
        callable ``log_metrics`` (TensorBoard, CSV, ...): scalar metrics only; ``None`` otherwise.
    """
    for cls in type(logger).__mro__:
        if cls.__module__.startswith(_LOGGER_MODULES) and cls.__name__ in _NATIVE:
            return _NATIVE[cls.__name__]
    return "generic" if callable(getattr(logger, "log_metrics", None)) else None


def mlflow_tracking_uri(loggers: Sequence[Any]) -> str | None:
    """Tracking URI of the first ``MLFlowLogger`` among ``loggers`` (its client's public
    ``tracking_uri``), or None. Touching ``experiment`` creates the logger's run: call on rank 0."""
    for logger in loggers:
        if logger_kind(logger) == "mlflow":
            return str(logger.experiment.tracking_uri)
    return None


class LoggerTracker(QueuedTracker):
    """The scalar metrics of each step (``fp8/...``) sent to a Lightning logger's ``log_metrics``.

    Delivered in the training thread (``background=False``): Lightning loggers are not written to
    be called from another thread, and ``log_metrics`` of file-based loggers only buffers.
    Tables and events stay in the run directory (and the W&B/MLflow views).

    Args:
        logger: any object with ``log_metrics(metrics: dict[str, float], step: int)``.
        name: tracker name (missed-step file ``sync/<name>.missed.jsonl``).
    """

    monotonic_steps = True  # WandbLogger's history; CSV and TensorBoard would hold a step twice

    def __init__(self, logger: Any, name: str | None = None) -> None:
        super().__init__(background=False)
        self.logger = logger
        self.name = name or type(logger).__name__

    def _deliver(self, batch: StepBatch) -> None:
        metrics = scalar_metrics(batch.metrics)
        if metrics:
            self.logger.log_metrics(metrics, step=batch.step)


__all__ = ["logger_kind", "mlflow_tracking_uri", "LoggerTracker"]
