"""The wiring every frontend shares (plain-PyTorch loop, Lightning callback, CLI): the monitoring
core with fp8track's analyzers (spikes, divergence, drift, the BF16 control) and the tracker
fan-out plugged in. ``monitoring`` defines the interfaces; this module picks the implementations,
so no import runs from ``monitoring`` up to ``analysis`` or ``trackers``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from fp8track.analysis.analyzers import DriftAnalyzer, LossAnalyzer
from fp8track.analysis.baseline import Baseline
from fp8track.analysis.ranking import rank_layers
from fp8track.config import MonitorConfig
from fp8track.execution.apply import ApplyReport
from fp8track.monitoring import monitor as core
from fp8track.monitoring.capture import LayerFilter, LayerPlan
from fp8track.monitoring.naming import LOSS_METRIC, run_metric
from fp8track.monitoring.records import EventRecord, RunMeta, RunReader
from fp8track.monitoring.sharding import ShardSpec
from fp8track.trackers.base import Tracker, TrackerFanout


def default_analyzers(baseline: Baseline | None = None, config: MonitorConfig | None = None) -> list[core.StepAnalyzer]:
    """Loss spikes and divergence (against ``baseline`` when given) and scale drift, with the
    thresholds of ``config`` (default :class:`fp8track.MonitorConfig`)."""
    c = config or MonitorConfig()
    return [
        LossAnalyzer(c.spikes, c.divergence, baseline=baseline, classify_window=c.classify_window),
        DriftAnalyzer(c.drift, whatif_history_len=c.whatif_history_len),
    ]


def tracker_sink(trackers: Sequence[Tracker]) -> Callable[[Path], TrackerFanout] | None:
    """A sink factory for :class:`fp8track.monitoring.monitor.Monitor`: the failure-tolerant
    fan-out over ``trackers`` (``None`` when there are none)."""
    trackers = list(trackers)
    if not trackers:
        return None
    return lambda run_dir: TrackerFanout(trackers, run_dir)


_SUMMARY_COUNTS = {
    "spikes": run_metric("spikes", "count"),
    "fp8_only_spikes": run_metric("spikes", "fp8_only"),
    "shared_spikes": run_metric("spikes", "shared"),
    "divergences": run_metric("divergence", "count"),
    "drift_events": run_metric("drift", "count"),
}


def run_summary(run_dir: str | Path, top_k: int = 5) -> dict[str, Any]:
    """A run directory at a glance, read back from its records.

    Returns:
        ``run_dir``; ``last_step`` and ``final_loss`` (the last ``fp8/loss``); ``worst_layers``:
        the ``top_k`` riskiest layers of :func:`fp8track.analysis.ranking.rank_layers` as
        ``{"layer", "score", "tensor"}``; ``spikes``, ``fp8_only_spikes``, ``shared_spikes``
        (the last two only with a control), ``divergences``, ``drift_events``: the analyzers' last
        counts (None when never logged); ``loss_gap_vs_baseline``: the last FP8-minus-control
        loss gap in nats (None without a control).
    """
    reader = RunReader(run_dir)
    last: dict[str, float] = {}
    last_step = None
    for rec in reader.metrics():  # steps are appended in order; a later record wins
        last.update(rec.metrics)
        last_step = rec.step if last_step is None else max(last_step, rec.step)
    risks = rank_layers(reader.tensor_stats())[:top_k]
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "last_step": last_step,
        "final_loss": last.get(LOSS_METRIC),
        "worst_layers": [{"layer": r.layer, "score": r.score, "tensor": r.tensor} for r in risks],
    }
    for key, name in _SUMMARY_COUNTS.items():
        out[key] = int(last[name]) if name in last else None
    out["loss_gap_vs_baseline"] = last.get(run_metric("loss_gap_vs_baseline"))
    return out


class Monitor(core.Monitor):
    """:class:`fp8track.monitoring.monitor.Monitor` for plain PyTorch loops, with the default
    analyzers and the tracker fan-out wired in.

    Args (beyond the core's ``model``, ``layers``, ``plans``, ``log_dir``, ``meta``, ``is_writer``,
    ``sharding``, ``apply_report``: the :class:`~fp8track.execution.apply.ApplyReport` that
    :func:`fp8track.apply_fp8` returned):
        config: :class:`fp8track.MonitorConfig`, a mapping or a YAML path (capture settings and
            the detectors' thresholds).
        trackers: :class:`fp8track.trackers.Tracker` objects fed after the records are written.
        baseline: the BF16 control (a loaded :class:`fp8track.analysis.baseline.Baseline`) for the
            default loss analyzer.
        analyzers: replace the default analyzers (the config's thresholds then do not apply).
    """

    def __init__(
        self,
        model: nn.Module,
        config: MonitorConfig | Mapping[str, Any] | str | Path | None = None,
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
        apply_report: ApplyReport | None = None,
    ) -> None:
        cfg = MonitorConfig.load(config)
        super().__init__(
            model,
            cfg,
            layers=layers,
            plans=plans,
            log_dir=log_dir,
            sink=tracker_sink(trackers),
            meta=meta,
            analyzers=default_analyzers(baseline, cfg) if analyzers is None else analyzers,
            is_writer=is_writer,
            sharding=sharding,
            apply_report=apply_report,
        )

    @property
    def events(self) -> list[EventRecord]:
        """Every event written so far, read from the run directory (empty on ranks > 0)."""
        return list(RunReader(self.run_dir).events()) if self.run_dir is not None else []

    def summary(self, top_k: int = 5) -> dict[str, Any] | None:
        """:func:`run_summary` of this run (None on ranks > 0 or before :meth:`attach`)."""
        return run_summary(self.run_dir, top_k) if self.run_dir is not None else None


__all__ = ["Monitor", "default_analyzers", "tracker_sink", "run_summary"]
