"""The wiring every frontend shares (plain-PyTorch loop, Lightning callback, CLI): the monitoring
core with fp8track's analyzers (spikes, divergence, drift, the BF16 control) and the tracker
fan-out plugged in. ``monitoring`` defines the interfaces; this module picks the implementations,
so no import runs from ``monitoring`` up to ``analysis`` or ``trackers``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from torch import nn

from fp8track.analysis.analyzers import DriftAnalyzer, LossAnalyzer
from fp8track.analysis.baseline import Baseline
from fp8track.monitoring import monitor as core
from fp8track.monitoring.capture import LayerFilter, LayerPlan
from fp8track.monitoring.records import RunMeta
from fp8track.monitoring.sharding import ShardSpec
from fp8track.trackers.base import Tracker, TrackerFanout


def default_analyzers(baseline: Baseline | None = None) -> list[core.StepAnalyzer]:
    """Loss spikes and divergence (against ``baseline`` when given) and scale drift."""
    return [LossAnalyzer(baseline=baseline), DriftAnalyzer()]


def tracker_sink(trackers: Sequence[Tracker]) -> Callable[[Path], TrackerFanout] | None:
    """A sink factory for :class:`fp8track.monitoring.monitor.Monitor`: the failure-tolerant
    fan-out over ``trackers`` (``None`` when there are none)."""
    trackers = list(trackers)
    if not trackers:
        return None
    return lambda run_dir: TrackerFanout(trackers, run_dir)


class Monitor(core.Monitor):
    """:class:`fp8track.monitoring.monitor.Monitor` for plain PyTorch loops, with the default
    analyzers and the tracker fan-out wired in.

    Args (beyond the core's ``model``, ``config``, ``layers``, ``plans``, ``log_dir``, ``meta``,
    ``is_writer``, ``sharding``):
        trackers: :class:`fp8track.trackers.Tracker` objects fed after the records are written.
        baseline: the BF16 control (a loaded :class:`fp8track.analysis.baseline.Baseline`) for the
            default loss analyzer.
        analyzers: replace the default analyzers.
    """

    def __init__(
        self,
        model: nn.Module,
        config: core.MonitorConfig | None = None,
        *,
        layers: str | Sequence[str] | LayerFilter | None = None,
        plans: Mapping[str, LayerPlan] | None = None,
        log_dir: str | Path | None = "fp8track-runs",
        trackers: Sequence[Tracker] = (),
        meta: RunMeta | None = None,
        analyzers: Sequence[core.StepAnalyzer] | None = None,
        baseline: Baseline | None = None,
        is_writer: bool | None = None,
        sharding: ShardSpec | None = None,
    ) -> None:
        super().__init__(
            model,
            config,
            layers=layers,
            plans=plans,
            log_dir=log_dir,
            sink=tracker_sink(trackers),
            meta=meta,
            analyzers=default_analyzers(baseline) if analyzers is None else analyzers,
            is_writer=is_writer,
            sharding=sharding,
        )


__all__ = ["Monitor", "default_analyzers", "tracker_sink"]
