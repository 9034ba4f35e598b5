"""What the writer rank makes of a flush's host copy and where it goes: the statistics rows
(:func:`stats_rows`), the scalar metrics (per layer, worst over layers, loss and grad norm, eval),
and :func:`emit`, which writes one logging step to the run directory and then hands it to the
trackers' sink as one batch (the run directory is written before any tracker sees a step)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8track.monitoring.capture_config import WORST_MAX, WORST_MIN, CaptureConfig, StepAnalyzer, StepSink
from fp8track.monitoring.naming import LOSS_METRIC, metric_name, run_metric, worst_metric
from fp8track.monitoring.plans import variant_format
from fp8track.monitoring.records import (
    EventRecord,
    MetricsRecord,
    RunMeta,
    RunWriter,
    StepBatch,
    TensorStatsRow,
)
from fp8track.monitoring.reduce import Key, PendingStep
from fp8track.numerics.nvfp4 import BLOCK_RANGE_STAT
from fp8track.numerics.stats import NUM_SUM, PARTIAL_SIZE, finalize_many

LossPoint = tuple[int, float, float | None]
"""``(step, loss, grad norm or None)``: what the analyzers receive per buffered step."""


def stats_rows(
    step: int,
    keys: Sequence[Key],
    flat: Sequence[float],
    ranges: Mapping[Key, float],
    captures: Mapping[str, Any],
) -> list[TensorStatsRow]:
    """The statistics rows of ``step`` from the reduced partials ``flat`` (``[len(keys), 13]``
    flattened), finalised in one call; a key with nothing observed (an unused layer) has no row.
    Expert rows add their routed tokens; block rows their ``max_blockwise_dynamic_range``."""
    live = []
    for i, key in enumerate(keys):
        part = flat[i * PARTIAL_SIZE : (i + 1) * PARTIAL_SIZE]
        if not (part[0] == 0 and part[NUM_SUM] == -math.inf):  # else nothing observed (an unused layer)
            live.append((key, part))
    if not live:
        return []
    plans = [captures[fqn].plan for (fqn, _, _), _ in live]
    fmts = [variant_format(plan, t, v) for plan, ((_, t, v), _) in zip(plans, live, strict=True)]
    stats = finalize_many([part for _, part in live], fmts, [plan.margin for plan in plans])
    for (key, _), st in zip(live, stats, strict=True):
        extra = getattr(captures[key[0]], "extra_stats", None)
        if extra is not None:  # expert rows: routed tokens
            extra(key[1], st)
        r = ranges.get(key, -math.inf)
        if r != -math.inf:  # a block row observed this step (TE's LogTensorStats statistic)
            st[BLOCK_RANGE_STAT] = r
    return [
        TensorStatsRow(step, fqn, tensor, s, variant)
        for ((fqn, tensor, variant), _), s in zip(live, stats, strict=True)
    ]


def scalar_metrics(
    rows: Sequence[TensorStatsRow], config: CaptureConfig, captures: Mapping[str, Any]
) -> dict[str, float]:
    """Per-layer scalars (``config.scalar_stats`` of the actual/shadow rows, unless
    ``per_layer_scalars`` is off; never one expert's rows) and the worst over layers."""
    out: dict[str, float] = {}
    main = [r for r in rows if r.variant in ("actual", "shadow")]
    if config.per_layer_scalars:
        # One expert's rows go to the tables only (E experts x layers would flood the scalars).
        for r in (r for r in main if getattr(captures.get(r.layer), "expert", None) is None):
            for s in config.scalar_stats:
                out[metric_name(r.layer, r.tensor, s)] = r.stats[s]
    if main:
        for s in WORST_MAX:
            out[worst_metric(s)] = max(r.stats[s] for r in main)
        for s in WORST_MIN:
            out[worst_metric(s)] = min(r.stats[s] for r in main)
        out[worst_metric("abs_scale_drift_log2")] = max(abs(r.stats["scale_drift_log2"]) for r in main)
    return out


def loss_series(
    pending: Sequence[PendingStep], losses: Sequence[float], gnorms: Sequence[float]
) -> list[LossPoint]:
    """``(step, loss, grad norm or None)`` of the pending steps that had a loss. A step given no
    loss (manual optimisation returning nothing, ``step()`` without ``loss=``) has none: no
    record, nothing for the analyzers, so no false non-finite alarm. A NaN loss that was given is
    kept (it is the problem the analyzers look for)."""
    return [
        (p.step, losses[i], None if math.isnan(gnorms[i]) else gnorms[i])
        for i, p in enumerate(pending)
        if p.loss is not None
    ]


def loss_metrics(loss: float | None, grad_norm: float | None) -> dict[str, float]:
    """``fp8/loss`` and ``fp8/grad_norm`` of one step (each only when given)."""
    out = {LOSS_METRIC: loss} if loss is not None else {}
    if grad_norm is not None:
        out[run_metric("grad_norm")] = grad_norm
    return out


def step_metrics(
    pending: Sequence[PendingStep], losses: Sequence[float], gnorms: Sequence[float]
) -> dict[str, float]:
    """The logging step's (the last pending step's) loss and grad-norm metrics; its grad norm is
    recorded even when it was given no loss."""
    if not pending:
        return {}
    loss = losses[-1] if pending[-1].loss is not None and not math.isnan(losses[-1]) else None
    return loss_metrics(loss, None if math.isnan(gnorms[-1]) else gnorms[-1])


def earlier_metrics(series: Sequence[LossPoint], step: int) -> list[tuple[int, dict[str, float]]]:
    """Every earlier buffered step's loss metrics, under its own step number (trackers then hold
    the loss of every optimizer step, not only of the sampled ones). A NaN loss is not written as
    a value: the analyzers' non-finite event records it."""
    return [(s, loss_metrics(loss, gnorm)) for s, loss, gnorm in series if s != step and not math.isnan(loss)]


def eval_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``fp8/eval/<name>`` for each numeric, finite value (``val/acc`` becomes ``fp8/eval/val/acc``)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        try:
            v = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(v):
            out[run_metric("eval", *str(name).split("/"))] = v
    return out


class RunOutput:
    """The writer rank's outputs: the run directory (written first) and the sink fed after it.

    Args:
        log_dir: parent of the run directory; ``None`` writes nothing.
        sink: factory called with the run directory once it exists (the tracker fan-out).
    """

    def __init__(self, log_dir: Path | None, sink: Callable[[Path], StepSink] | None) -> None:
        self.log_dir = log_dir
        self.sink_factory = sink
        self.writer: RunWriter | None = None
        self.sink: StepSink | None = None

    @property
    def run_dir(self) -> Path | None:
        return self.writer.run_dir if self.writer else None

    def open(self, meta: RunMeta, resume_step: int | None) -> None:
        """Create (or, resumed from ``resume_step``, reopen) the run directory, then start the sink
        with the steps a resumed run's trackers already hold. Once."""
        if self.log_dir is None or self.writer is not None:
            return
        self.writer = RunWriter.create(self.log_dir, meta, resume_step)
        if self.sink_factory is not None:
            self.sink = self.sink_factory(self.writer.run_dir)
            self.sink.start(meta, self.writer.recorded_before_resume)

    def emit(
        self,
        step: int,
        metrics: dict[str, float],
        rows: Sequence[TensorStatsRow],
        events: Sequence[EventRecord],
        earlier: Sequence[tuple[int, dict[str, float]]] = (),
    ) -> None:
        """One logging step (:func:`emit`)."""
        emit(self.writer, self.sink, step, metrics, rows, events, earlier=earlier)

    def finish(self, analyzers: Sequence[StepAnalyzer], last: int) -> None:
        """The end of the run: the analyzers' closing events and ``run_end`` at step ``last`` (no
        metrics), then the sink and the run directory closed."""
        events = [e for a in analyzers for e in a.close(last)]
        events.append(EventRecord("run_end", last, {}))
        emit(self.writer, self.sink, last, {}, [], events, write_metrics=False)
        if self.sink is not None:
            self.sink.finish()
        if self.writer is not None:
            self.writer.close()


def emit(
    writer: RunWriter | None,
    sink: StepSink | None,
    step: int,
    metrics: dict[str, float],
    rows: Sequence[TensorStatsRow],
    events: Sequence[EventRecord],
    write_metrics: bool = True,
    earlier: Sequence[tuple[int, dict[str, float]]] = (),
) -> None:
    """Write one logging step (and the loss-only ``earlier`` steps of its flush) to the run
    directory, then hand it to the sink as one batch (one MLflow ``log_batch`` per flush)."""
    if writer is not None:
        for s, m in earlier:
            writer.write_metrics(MetricsRecord(s, m))
        if write_metrics and metrics:
            writer.write_metrics(MetricsRecord(step, metrics))
        writer.write_tensor_stats(rows)
        writer.write_events(events)
    if sink is not None:
        batch = StepBatch(step, metrics, tuple(rows), tuple(events), tuple(earlier))
        # A sink that does not say it takes a batch's earlier steps gets one batch per step.
        for b in [batch] if getattr(sink, "coalesces", False) else batch.split():
            sink.log(b)
