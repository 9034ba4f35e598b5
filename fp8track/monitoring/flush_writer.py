"""The writer rank's part of each flush, after the reduction: the statistics rows of the host copy,
the analyzers, what their events set off (the ``sampled`` event of a burst step, the tensor dump,
a burst an event opens and the dump it asks for, the checkpoint guard), the FP8 FLOP share, then
one emission holding every buffered step's loss under its own step number.

No collective runs here (this is rank-0-only code); every rank's part is in
:mod:`fp8track.monitoring.reduce`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fp8track.execution.apply import ApplyReport
from fp8track.monitoring.capture_config import CaptureConfig, StepAnalyzer, run_analyzers
from fp8track.monitoring.dumps import DumpControl
from fp8track.monitoring.emit import (
    RunOutput,
    earlier_metrics,
    loss_series,
    scalar_metrics,
    stats_rows,
    step_metrics,
)
from fp8track.monitoring.flop_share import FlopShare
from fp8track.monitoring.grad_scaler import ScalerVerdict, ScalerWatch, without_skipped
from fp8track.monitoring.guard import CheckpointGuard
from fp8track.monitoring.naming import run_metric
from fp8track.monitoring.records import EventRecord
from fp8track.monitoring.reduce import DeviceTake, HostCopy, PendingStep
from fp8track.monitoring.schedule import Sampler


class FlushWriter:
    """Holds what outlives a flush on the writer: the tensor dumps, the checkpoint guard and the
    loss scaler's watch, the FP8 share, the analyzers that already failed once, the last flush's events.

    Args:
        config: the capture configuration (scalars, guard actions, dump bounds, share warning).
        captures: the monitor's captures (their plans finalise the rows).
        sampler: the monitor's sampler (why this step was sampled, its burst).
        out: where the step goes (run directory, then the sink).
        apply_report: for the FP8 share's warning (why layers are not in FP8).
        is_writer: whether this process warns.
    """

    def __init__(
        self,
        config: CaptureConfig,
        captures: Mapping[str, Any],
        sampler: Sampler,
        out: RunOutput,
        apply_report: ApplyReport | None,
        is_writer: bool,
    ) -> None:
        self.config, self.captures, self.sampler, self.out = config, captures, sampler, out
        self.dumps = DumpControl(config.dump_policy())
        self.guard = CheckpointGuard(config.on_nonfinite, config.on_divergence)
        self.scaler = ScalerWatch(config.min_loss_scale)
        self.share = FlopShare(config.fp8_share_warn_below, apply_report, is_writer)
        self.last_events: list[EventRecord] = []
        self._warned: set[str] = set()  # analyzer types that failed once (warned once)

    def write(
        self,
        step: int,
        take: DeviceTake,
        pending: Sequence[PendingStep],
        host: HostCopy,
        analyzers: Sequence[StepAnalyzer],
        with_stats: bool,
        router_metrics: Mapping[str, float],
    ) -> None:
        """Rows, analyzers, reactions, FP8 share and router metrics of the flush logged at ``step``,
        then one emission (the buffered steps' losses under their own steps)."""
        ranges = dict(zip(take.range_keys, host.ranges, strict=True))
        rows = stats_rows(step, take.keys, host.partials, ranges, self.captures)
        scaler = self.scaler.observe(pending, host.scales or [float("nan")] * len(pending))
        # A step the loss scaler skipped: its overflowed gradients are no grad norm, spike or halt.
        pending, gnorms = without_skipped(pending, host.gnorms, scaler.skipped)
        series = loss_series(pending, host.losses, gnorms)
        metrics, events = run_analyzers(analyzers, step, series, rows, self._warned)
        events.extend(self._react(step, pending, host.losses, gnorms, events, with_stats, scaler))
        if with_stats:
            metrics.update(self.share.measure(step, self.captures, self.sampler.full, events))
        metrics.update(router_metrics)
        self.last_events = events
        own = step_metrics(pending, host.losses, gnorms)
        if host.scales and host.scales[-1] == host.scales[-1]:  # not NaN: a scaler is watched
            own[run_metric("loss_scale")] = host.scales[-1]
        scalars = {**own, **scalar_metrics(rows, self.config, self.captures), **metrics}
        self.out.emit(step, scalars, rows, events, earlier=earlier_metrics(series, step))

    def _react(
        self,
        step: int,
        pending: Sequence[PendingStep],
        losses: Sequence[float],
        gnorms: Sequence[float],
        events: Sequence[EventRecord],
        with_stats: bool,
        scaler: ScalerVerdict,
    ) -> list[EventRecord]:
        """The events the flush adds: why the step was sampled (a burst step), its tensor dump, the
        burst an event opens (and the dump it asks for), the loss scaler's skips and collapse, the
        guard's decision."""
        out: list[EventRecord] = list(scaler.events)
        burst = self.sampler.burst
        if self.sampler.why == "burst" and with_stats:
            out.append(EventRecord("sampled", step, burst.reason(step)))
        if self.dumps.armed:
            out.append(self.dumps.write(step, self.out.run_dir))
        opened = burst.open(step, events) if with_stats else None
        if opened is not None:
            out.append(opened)
            # one dump per new burst (never one spent on an extension), so dumps spread over events
            if opened.data.get("new") and self.out.writer is not None:
                self.dumps.request(burst.layers)
        out.extend(self.guard.after_flush(step, pending, losses, gnorms, events, scaler.collapse))
        return out
