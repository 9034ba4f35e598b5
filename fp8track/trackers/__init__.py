"""Tracker adapters: views of the local run directory in W&B, MLflow and any Lightning logger.

Public surface:

- :class:`StepBatch`, :class:`Tracker` (``base``), :class:`QueuedTracker` (``queued``),
  :class:`TrackerFanout` (``fanout``)
- :func:`trackers_from_loggers`, :func:`make_trackers` (discovery from Lightning loggers),
  :func:`loop_trackers`, :func:`active_run_trackers` (a plain loop: the MLflow / W&B runs it has open),
  :func:`logger_kind`, :func:`mlflow_tracking_uri`, :class:`LoggerTracker` (any other logger)
- :func:`sync_run` (``fp8track sync``: a run directory's missed steps to a tracker; ``replay``, its
  former name, is a deprecated alias for one release)
- ``fp8track.trackers.wandb.WandbTracker``, ``fp8track.trackers.mlflow.MLflowTracker`` and
  ``fp8track.trackers.nvdlfw.TEStatsBridge`` are imported from their modules (they pull in their
  optional dependency on first use only).
- ``fp8track.trackers.heatmap`` (the per-layer heatmap, shared with the HTML report) and
  ``fp8track.trackers.retry`` (``Backoff``: how a failing delivery or MLflow call is retried).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from fp8track.errors import ConfigError, invalid_choice
from fp8track.trackers.base import StepBatch, Tracker
from fp8track.trackers.fanout import TrackerFanout
from fp8track.trackers.loggers import LoggerTracker, logger_kind, mlflow_tracking_uri
from fp8track.trackers.queued import QueuedTracker

# Imported eagerly: the deprecated function ``replay`` must shadow the submodule of the same name.
from fp8track.trackers.replay import replay, sync_run  # noqa: E402, F401 (replay: deprecated, not in __all__)

TRACKER_NAMES = ("wandb", "mlflow")
"""Tracker names accepted by :func:`make_trackers` besides ``"auto"`` and ``"none"``."""
TRACKER_FORMS = "'auto', 'none', 'mlflow', 'wandb' or a list of those names / fp8track Tracker objects"
"""The valid forms of a tracker spec, as error messages name them."""
MLFLOW_RUN_ID_ENV = "MLFLOW_RUN_ID"
"""MLflow's own variable for the run to log into (``mlflow.start_run()`` resumes it); ``fp8track
sweep`` sets it to each trial's run."""


def trackers_from_loggers(loggers: Sequence[Any], **options: Any) -> list[Tracker]:
    """One tracker per logger of a Lightning trainer (:func:`fp8track.trackers.loggers.logger_kind`).

    ``WandbLogger`` -> ``WandbTracker`` over ``logger.experiment`` (opened on first use); ``MLFlowLogger`` ->
    ``MLflowTracker(client=logger.experiment, run_id=logger.run_id)``; any other logger with
    ``log_metrics`` (TensorBoard, CSV, ...) -> :class:`LoggerTracker` (scalar metrics only).
    Accessing ``experiment`` creates the logger's run, so call this on global rank 0 only. A second
    logger of the same kind gets the name ``wandb-1``, ``mlflow-1``, ``CSVLogger-1``, ...
    ``options`` maps ``"wandb"``/``"mlflow"`` to keyword arguments for that tracker, e.g.
    ``wandb={"table_every_n_steps": 10}``.
    """
    bad = sorted(set(options) - set(TRACKER_NAMES))
    if bad:
        raise invalid_choice("tracker option group", bad[0], TRACKER_NAMES)
    out: list[Tracker] = []
    counts: dict[str, int] = {}
    for logger in loggers:
        kind = logger_kind(logger)
        if kind is None:
            continue
        base = type(logger).__name__ if kind == "generic" else kind
        n = counts.get(base, 0)
        counts[base] = n + 1
        kwargs = dict(options.get(kind, {}))
        kwargs.setdefault("name", base if n == 0 else f"{base}-{n}")
        if kind == "generic":
            out.append(LoggerTracker(logger, **kwargs))
        elif kind == "wandb":
            from fp8track.trackers.wandb import WandbTracker

            # Opened on first use: a failing wandb.init becomes a tracker failure, not a crash here.
            out.append(WandbTracker(lambda logger=logger: logger.experiment, **kwargs))
        else:
            from fp8track.trackers.mlflow import MLflowTracker

            out.append(MLflowTracker(client=logger.experiment, run_id=logger.run_id, **kwargs))
    return out


def validate_tracker_spec(spec: Any) -> None:
    """Check a tracker spec without touching any logger (for a constructor to fail early).

    Raises:
        ConfigError: naming the bad value and the valid ones.
    """
    if spec is None or (isinstance(spec, str) and spec in ("auto", "none", *TRACKER_NAMES)):
        return
    if isinstance(spec, str):
        raise invalid_choice(
            "tracker spec",
            spec,
            ("auto", "none", *TRACKER_NAMES),
            "Or pass a list of names / Tracker objects",
        )
    if not isinstance(spec, (list, tuple)):
        raise ConfigError(f"trackers must be {TRACKER_FORMS}, got {type(spec).__name__} {spec!r}")
    for item in spec:
        if not isinstance(item, Tracker) and (not isinstance(item, str) or item not in TRACKER_NAMES):
            raise invalid_choice("tracker", item, TRACKER_NAMES, "Or pass a Tracker object")


def make_trackers(
    spec: str | Sequence[str | Tracker] | None, loggers: Sequence[Any] = (), **options: Any
) -> list[Tracker]:
    """Resolve a tracker spec.

    Args:
        spec: ``"auto"`` (one tracker per logger in ``loggers``: native W&B/MLflow views, scalar
            metrics for any other logger), ``"none"`` or None
            (no tracker), a name, or a list whose items are tracker names (``"wandb"``,
            ``"mlflow"``: built from the matching loggers) or :class:`Tracker` objects (used as given).
        loggers: the trainer's loggers (``trainer.loggers``).
        options: per-kind keyword arguments, see :func:`trackers_from_loggers`.

    Raises:
        ConfigError: an unknown spec or name (listing the valid ones), or a name whose logger is
            not among ``loggers``.
    """
    validate_tracker_spec(spec)
    if spec is None or spec == "none":
        return []
    if spec == "auto":
        return trackers_from_loggers(loggers, **options)
    items = [spec] if isinstance(spec, str) else list(spec)
    wanted = {i for i in items if isinstance(i, str)}
    for name in sorted(wanted):
        if not any(logger_kind(lg) == name for lg in loggers):
            logger_cls, tracker_cls = {
                "wandb": ("WandbLogger", "WandbTracker"),
                "mlflow": ("MLFlowLogger", "MLflowTracker"),
            }[name]
            raise ConfigError(
                f"tracker {name!r} was requested but trainer.loggers has no {logger_cls}; add one to the "
                f"Trainer, or pass a tracker object such as fp8track.trackers.{name}.{tracker_cls}(...)"
            )
    built = trackers_from_loggers([lg for lg in loggers if logger_kind(lg) in wanted], **options)
    out: list[Tracker] = [i for i in items if isinstance(i, Tracker)]
    out.extend(built)
    return out


def active_mlflow_tracker(**options: Any) -> Tracker | None:
    """An :class:`~fp8track.trackers.mlflow.MLflowTracker` logging into the MLflow run this process
    already logs to: the active fluent run (``mlflow.start_run()``), else the run named by
    ``MLFLOW_RUN_ID`` (a sweep trial's run); at the active tracking URI (``mlflow.set_tracking_uri``
    / ``MLFLOW_TRACKING_URI``). The run stays the user's: the tracker never ends it. ``None`` when
    there is no such run; MLflow is not imported unless it already is or ``MLFLOW_RUN_ID`` is set."""
    if "mlflow" not in sys.modules and not os.environ.get(MLFLOW_RUN_ID_ENV):
        return None
    import mlflow

    active = mlflow.active_run()
    run_id = active.info.run_id if active is not None else os.environ.get(MLFLOW_RUN_ID_ENV)
    if not run_id:
        return None
    from fp8track.trackers.mlflow import MLflowTracker

    return MLflowTracker(client=mlflow.MlflowClient(mlflow.get_tracking_uri()), run_id=run_id, **options)


def active_wandb_tracker(**options: Any) -> Tracker | None:
    """A :class:`~fp8track.trackers.wandb.WandbTracker` over the W&B run this process opened
    (``wandb.run``, set by ``wandb.init``); ``None`` when there is none (W&B is not imported unless
    it already is). The run stays the user's: the tracker never finishes it."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:
        return None
    from fp8track.trackers.wandb import WandbTracker

    return WandbTracker(run, **options)


_ACTIVE = {"mlflow": active_mlflow_tracker, "wandb": active_wandb_tracker}
_HOW_TO_OPEN = {
    "mlflow": "call mlflow.start_run() before building the monitor, or pass "
    "fp8track.trackers.mlflow.MLflowTracker(tracking_uri=..., run_id=...)",
    "wandb": "call wandb.init(...) before building the monitor, or pass "
    "fp8track.trackers.wandb.WandbTracker.create(...)",
}


def active_run_trackers(names: Sequence[str] = TRACKER_NAMES, **options: Any) -> list[Tracker]:
    """One tracker per run of ``names`` this process has open (:func:`active_mlflow_tracker`,
    :func:`active_wandb_tracker`), in the order of ``names``. ``options`` maps ``"wandb"`` /
    ``"mlflow"`` to keyword arguments for that tracker."""
    out = []
    for name in names:
        tracker = _ACTIVE[name](**options.get(name, {}))
        if tracker is not None:
            out.append(tracker)
    return out


def loop_trackers(spec: str | Sequence[str | Tracker] | None, **options: Any) -> list[Tracker]:
    """Resolve the tracker spec of a loop without Lightning loggers (the plain monitor).

    Args:
        spec: ``"auto"`` (the MLflow and W&B runs this process has open, see
            :func:`active_run_trackers`; none when no run is open), ``"none"`` / None / an empty
            list (no tracker), a name or a list whose items are names (``"mlflow"``, ``"wandb"``:
            the open run of that kind, which must exist) or :class:`Tracker` objects (used as given).
        options: per-kind keyword arguments, as for :func:`active_run_trackers`.

    Raises:
        ConfigError: a spec in none of these forms (naming the valid ones), or a named tracker
            whose run is not open (saying how to open one).
    """
    validate_tracker_spec(spec)
    if spec is None or spec == "none":
        return []
    if spec == "auto":
        return active_run_trackers(TRACKER_NAMES, **options)
    out: list[Tracker] = []
    for item in [spec] if isinstance(spec, str) else list(spec):
        if isinstance(item, Tracker):
            out.append(item)
            continue
        found = active_run_trackers((item,), **options)
        if not found:
            raise ConfigError(f"trackers names {item!r} but no {item} run is open: {_HOW_TO_OPEN[item]}")
        out.extend(found)
    return out


__all__ = [
    "StepBatch",
    "Tracker",
    "QueuedTracker",
    "TrackerFanout",
    "TRACKER_NAMES",
    "trackers_from_loggers",
    "logger_kind",
    "mlflow_tracking_uri",
    "LoggerTracker",
    "make_trackers",
    "validate_tracker_spec",
    "loop_trackers",
    "active_run_trackers",
    "active_mlflow_tracker",
    "active_wandb_tracker",
    "TRACKER_FORMS",
    "sync_run",
]
