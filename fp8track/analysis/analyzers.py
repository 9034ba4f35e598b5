"""Analyzers the monitor runs on rank 0 at every flush: loss events and scale drift.

They adapt the pure detectors (:mod:`fp8track.analysis.spikes`, :mod:`fp8track.analysis.divergence`,
:mod:`fp8track.analysis.baseline`, :mod:`fp8track.analysis.drift`) to the monitor's
:class:`StepAnalyzer` shape: ``observe(losses, rows) -> (metrics, events)``, plus checkpointable
state.

Logged metrics:
    ``fp8/spikes/count`` (spikes opened so far), ``fp8/spikes/fp8_only`` and ``fp8/spikes/shared``
    (with a control), ``fp8/divergence/count``, ``fp8/loss_gap_vs_baseline`` (FP8 loss minus the
    step-aligned control loss, nats) and ``fp8/loss_gap_vs_baseline_rel`` (that gap over the control
    loss), ``fp8/drift/count`` (drift events so far), ``fp8/worst/whatif_delayed_abs_drift_log2``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fp8track.analysis.baseline import Baseline, classify_spike, loss_gap
from fp8track.analysis.divergence import DivergenceConfig, DivergenceDetector
from fp8track.analysis.drift import DriftConfig, DriftTracker, WhatIfDelayed
from fp8track.analysis.spikes import SpikeConfig, SpikeDetector
from fp8track.monitoring.naming import run_metric, worst_metric
from fp8track.monitoring.records import EventRecord, TensorStatsRow


class LossAnalyzer:
    """Spikes, non-finite losses and divergence, judged against an optional control run.

    Args:
        spike_config: thresholds of the spike detector.
        divergence_config: thresholds of the divergence detector.
        baseline: the control run (:func:`fp8track.analysis.baseline.load_baseline`), or None.
        classify_window: a spike is "shared" when the control spiked within this many steps.
    """

    def __init__(
        self,
        spike_config: SpikeConfig | None = None,
        divergence_config: DivergenceConfig | None = None,
        baseline: Baseline | None = None,
        classify_window: int = 50,
    ) -> None:
        self.spikes = SpikeDetector(spike_config)
        self.divergence = DivergenceDetector(divergence_config)
        self.baseline = baseline
        self.classify_window = classify_window
        self.counts = {"fp8_only": 0, "shared": 0, "divergence": 0}
        self._classified: set[int] = set()

    def _spike_records(self, events: Sequence[Any]) -> list[EventRecord]:
        records = []
        for ev in events:
            cls = None
            if self.baseline is not None and ev.kind == "spike":
                cls = classify_spike(ev, self.baseline, self.classify_window)
                if ev.start_step not in self._classified:  # count each spike once, when it opens
                    self._classified.add(ev.start_step)
                    self.counts[cls.label] += 1
            records.append(ev.to_record(cls))
        return records

    def observe(
        self, losses: Sequence[tuple[int, float, float | None]], rows: Sequence[TensorStatsRow]
    ) -> tuple[dict[str, float], list[EventRecord]]:
        records: list[EventRecord] = []
        gap: tuple[float, float] | None = None
        for step, loss, grad_norm in losses:
            records.extend(self._spike_records(self.spikes.update(step, loss, grad_norm)))
            control = self.baseline.loss_at(step) if self.baseline is not None else None
            for ev in self.divergence.update(step, loss, control):
                self.counts["divergence"] += 1
                records.append(ev.to_record())
            if self.baseline is not None and math.isfinite(loss):
                gap = loss_gap(step, loss, self.baseline) or gap
        metrics = {
            run_metric("spikes", "count"): float(self.spikes.spike_count),
            run_metric("divergence", "count"): float(self.counts["divergence"]),
        }
        if self.baseline is not None:
            metrics[run_metric("spikes", "fp8_only")] = float(self.counts["fp8_only"])
            metrics[run_metric("spikes", "shared")] = float(self.counts["shared"])
            if gap is not None:
                metrics[run_metric("loss_gap_vs_baseline")] = gap[0]
                metrics[run_metric("loss_gap_vs_baseline_rel")] = gap[1]
        return metrics, records

    def close(self, last_step: int) -> list[EventRecord]:
        return self._spike_records(self.spikes.finalize(last_step))

    def state_dict(self) -> dict[str, Any]:
        return {
            "spikes": self.spikes.state_dict(),
            "divergence": self.divergence.state_dict(),
            "counts": dict(self.counts),
            "classified": sorted(self._classified),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "spikes" in state:
            self.spikes.load_state_dict(state["spikes"])
        if "divergence" in state:
            self.divergence.load_state_dict(state["divergence"])
        self.counts.update(state.get("counts", {}))
        self._classified = set(state.get("classified", self._classified))


class DriftAnalyzer:
    """Scale-drift events per (layer, tensor).

    * FP8 layers: the recipe's real scale against the tensor's current scale
      (``scale_drift_log2`` of the ``actual`` rows).
    * Every per-tensor row (FP8 or shadow): what delayed scaling with ``whatif_history_len`` would
      have used, fed with the sampled amaxes (:class:`fp8track.analysis.drift.WhatIfDelayed`), so a
      current-scaling or BF16 run shows where delayed scaling would drift.
    """

    def __init__(self, config: DriftConfig | None = None, whatif_history_len: int | None = 16) -> None:
        self.recipe = DriftTracker(config, source="recipe")
        self.whatif_tracker = DriftTracker(config, source="what_if")
        self.whatif = WhatIfDelayed(history_len=whatif_history_len) if whatif_history_len else None
        self.count = 0

    def observe(
        self, losses: Sequence[tuple[int, float, float | None]], rows: Sequence[TensorStatsRow]
    ) -> tuple[dict[str, float], list[EventRecord]]:
        events = []
        for r in rows:
            if r.variant == "actual":
                events.extend(self.recipe.update(r.step, r.layer, r.tensor, r.stats["scale_drift_log2"]))
        worst_whatif: float | None = None  # none until a what-if drift exists (the history's first step)
        if self.whatif is not None:
            main = [r for r in rows if r.variant in ("actual", "shadow")]
            whatifs = (
                self.whatif.observe_many(main[0].step, {(r.layer, r.tensor): r.stats["amax"] for r in main})
                if main
                else {}
            )
            for r in main:
                w = whatifs[(r.layer, r.tensor)]
                if math.isfinite(w.drift_log2):
                    worst_whatif = max(worst_whatif or 0.0, abs(w.drift_log2))
                    events.extend(self.whatif_tracker.update(r.step, r.layer, r.tensor, w.drift_log2))
        self.count += len(events)
        metrics = {run_metric("drift", "count"): float(self.count)}
        if worst_whatif is not None:
            metrics[worst_metric("whatif_delayed_abs_drift_log2")] = worst_whatif
        return metrics, [e.to_record() for e in events]

    def close(self, last_step: int) -> list[EventRecord]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe.state_dict(),
            "whatif_tracker": self.whatif_tracker.state_dict(),
            "whatif": self.whatif.state_dict() if self.whatif is not None else None,
            "count": self.count,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "recipe" in state:
            self.recipe.load_state_dict(state["recipe"])
        if "whatif_tracker" in state:
            self.whatif_tracker.load_state_dict(state["whatif_tracker"])
        if self.whatif is not None and state.get("whatif"):
            self.whatif.load_state_dict(state["whatif"])
        self.count = int(state.get("count", self.count))
