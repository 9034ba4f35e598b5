"""Divergence detection: a sustained loss rise, or a sustained gap to the control run.

:class:`DivergenceDetector` is fed one host float per optimizer step, keeps ``O(window)`` memory
and reports one :class:`DivergenceEvent` per excursion, for three reasons:

* ``"rise"``: over the last ``window`` finite losses, the lower quartile (``quantile``) of the
  newer half exceeds that of the older half by ``rise_threshold`` (relative), for ``patience``
  consecutive steps. Lower quartiles ignore spikes (a spike must lift three quarters of the newer
  half to count) and a healthy, decaying loss always gives a negative rise.
* ``"gap"`` (with a control): the median of the last ``gap_window`` relative gaps
  ``(loss - control) / |control|`` reaches ``gap_tolerance``.
* ``"nonfinite"``: ``nonfinite_patience`` consecutive non-finite losses.

**Start step.** Losses (and gaps) of the last ``lookback`` steps are kept and smoothed with a
centred running median of ``smooth`` points at detection time. For ``"rise"`` the start is the
step of the smoothed minimum (the turning point); for ``"gap"`` it is the first step after the last
smoothed gap below ``gap_tolerance / 2``; for ``"nonfinite"`` the first non-finite step.

**Phase** (the troubleshooting path's failure kinds 3 and 4): ``"start"`` when the divergence
started within ``start_phase_steps`` of the first step, or before training made progress (the
smoothed loss at the start was not at least ``min_progress`` below the initial loss, the median
of the first ``smooth`` losses); otherwise ``"mid"``. Start-phase divergence points at software
and configuration first (new options, FP8 weights, offloading); mid-training at numerics.

A reason re-arms after its condition clears (rise below half the threshold, gap median below half
the tolerance, a finite loss), so a later divergence is reported again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fp8track.analysis.windows import HalvesWindow, RobustWindow, centred_median, filled
from fp8track.errors import (
    ConfigError,
    FromDict,
    check_float,
    check_int,
    dataclass_from_dict,
    restore_state,
    save_state,
)
from fp8track.monitoring.records import EventRecord

DIVERGENCE_REASONS = ("rise", "gap", "nonfinite")
PHASES = ("start", "mid")


@dataclass(frozen=True)
class DivergenceConfig(FromDict):
    """Thresholds of :class:`DivergenceDetector` (validated at construction).

    Attributes:
        window: finite losses compared half against half (200: long enough that the median of
            100 noisy losses moves less than 1% under 2% per-step noise).
        rise_threshold: relative rise of the newer half's ``quantile`` that counts (0.05).
        quantile: which quantile of each half is compared (0.25, the lower quartile: a spike
            lifts the upper values of a half, a divergence lifts all of them, so a spike must
            cover three quarters of the newer half to look like a rise).
        patience: consecutive steps the rise must hold (50).
        min_samples: losses needed before the rise rule runs (default ``window // 2``).
        gap_window: relative gaps to the control in the rolling median (100).
        gap_tolerance: median relative gap that counts as divergence from the control (0.05).
        nonfinite_patience: consecutive non-finite losses that count as divergence (20).
        lookback: steps of history kept to find the start (default ``4 * window``).
        smooth: points of the centred running median used to find the start (9, odd).
        start_phase_steps: divergences starting this close to the first step are ``"start"``.
        min_progress: relative drop below the initial loss that marks "training made progress".
    """

    window: int = 200
    rise_threshold: float = 0.05
    quantile: float = 0.25
    patience: int = 50
    min_samples: int | None = None
    gap_window: int = 100
    gap_tolerance: float = 0.05
    nonfinite_patience: int = 20
    lookback: int | None = None
    smooth: int = 9
    start_phase_steps: int = 1000
    min_progress: float = 0.1

    def __post_init__(self) -> None:
        check_int("window", self.window, 4)
        check_float("rise_threshold", self.rise_threshold, 0.0, strict=True)
        check_int("patience", self.patience, 1)
        check_float("quantile", self.quantile, 0.0)
        if self.quantile > 1.0:
            raise ConfigError(f"quantile must be in [0, 1], got {self.quantile!r}")
        if self.min_samples is not None:
            check_int("min_samples", self.min_samples, 4)
            if self.min_samples > self.window:
                raise ConfigError(f"min_samples ({self.min_samples}) must not exceed window ({self.window})")
        check_int("gap_window", self.gap_window, 1)
        check_float("gap_tolerance", self.gap_tolerance, 0.0, strict=True)
        check_int("nonfinite_patience", self.nonfinite_patience, 1)
        if self.lookback is not None:
            check_int("lookback", self.lookback, self.window)
        check_int("smooth", self.smooth, 1)
        if self.smooth % 2 == 0:
            raise ConfigError(f"smooth must be odd (a centred median), got {self.smooth}")
        check_int("start_phase_steps", self.start_phase_steps, 0)
        check_float("min_progress", self.min_progress, 0.0)

    @property
    def effective_min_samples(self) -> int:
        return self.min_samples if self.min_samples is not None else max(4, self.window // 2)

    @property
    def effective_lookback(self) -> int:
        return self.lookback if self.lookback is not None else 4 * self.window


@dataclass(frozen=True)
class DivergenceEvent:
    """A detected divergence.

    Attributes:
        reason: ``"rise"``, ``"gap"`` or ``"nonfinite"``.
        start_step: estimated step the divergence started (see module docstring).
        detect_step: step at which it was detected.
        phase: ``"start"`` (failure kind 3: suspect software/config) or ``"mid"`` (kind 4).
        magnitude: relative rise of the halves' quantiles (``"rise"``), median relative gap
            (``"gap"``) or the number of non-finite steps (``"nonfinite"``).
        loss_at_start: smoothed loss at ``start_step`` (NaN if unknown).
        loss_at_detect: median of the newest ``smooth`` finite losses at detection.
        initial_loss: median of the first ``smooth`` finite losses.
    """

    reason: str
    start_step: int
    detect_step: int
    phase: str
    magnitude: float
    loss_at_start: float
    loss_at_detect: float
    initial_loss: float

    @property
    def severity(self) -> float:
        """Unitless rank, higher = worse: 10 for non-finite, else 1 + 10 x relative magnitude."""
        if self.reason == "nonfinite":
            return 10.0
        return 1.0 + 10.0 * max(self.magnitude, 0.0) if math.isfinite(self.magnitude) else 10.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DivergenceEvent:
        """The event stored by :meth:`to_dict` (unknown keys of another version dropped)."""
        return dataclass_from_dict(cls, d, strict=False)

    def to_record(self) -> EventRecord:
        """``EventRecord(kind="divergence", step=detect_step)`` with an alert (level ``"ERROR"``)."""
        what = {
            "rise": f"the loss rose {100 * self.magnitude:.1f}% "
            "(lower quartile of recent steps vs the steps before)",
            "gap": f"the loss is {100 * self.magnitude:.1f}% above the control (median over recent steps)",
            "nonfinite": f"the loss was non-finite for {int(self.magnitude)} consecutive steps",
        }[self.reason]
        hint = (
            "It started at the beginning of training: suspect software and configuration first "
            "(switch off newly added options such as FP8 weights or CPU offloading, re-enable one at a time)."
            if self.phase == "start"
            else "It started mid-training: try current or block scaling, FP8 inputs with a BF16 GEMM, "
            "or keeping the most sensitive layers in BF16."
        )
        data = self.to_dict()
        data.update(
            severity=self.severity,
            alert=True,
            level="ERROR",
            title=f"Loss divergence ({self.phase} of training)",
            text=f"At step {self.detect_step} {what}; it started near step {self.start_step}. {hint}",
        )
        return EventRecord(kind="divergence", step=self.detect_step, data=data)


class DivergenceDetector:
    """Sustained-rise / control-gap / non-finite divergence detector (see the module docstring).

    Example:
        >>> det = DivergenceDetector(DivergenceConfig(window=20, patience=5, smooth=3, start_phase_steps=10))
        >>> losses = [4.0 - 0.01 * s for s in range(100)] + [3.0 + 0.02 * s for s in range(60)]
        >>> events = [e for s, x in enumerate(losses) for e in det.update(s, x)]
        >>> [(e.reason, e.phase, e.start_step) for e in events]
        [('rise', 'mid', 99)]
    """

    def __init__(self, config: DivergenceConfig | None = None) -> None:
        self.config = config if config is not None else DivergenceConfig()
        if not isinstance(self.config, DivergenceConfig):
            raise ConfigError(f"config must be a DivergenceConfig, got {type(self.config).__name__}")
        c = self.config
        self.events: list[DivergenceEvent] = []
        self._losses = HalvesWindow(c.window)
        self._hist: deque[tuple[int, float]] = deque(maxlen=c.effective_lookback)
        self._gaps = RobustWindow(c.gap_window)
        self._gap_hist: deque[tuple[int, float]] = deque(maxlen=c.effective_lookback)
        self._first: list[float] = []  # the first `smooth` finite losses
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._rise_run = 0
        self._armed = {r: True for r in DIVERGENCE_REASONS}
        self._nonfinite_run = 0
        self._nonfinite_start: int | None = None

    @property
    def initial_loss(self) -> float:
        return float(np.median(self._first)) if self._first else math.nan

    def update(self, step: int, loss: float, baseline_loss: float | None = None) -> list[DivergenceEvent]:
        """Feed one step's loss and, with a control, the control's loss aligned to this step.

        Returns the divergence events detected at this step (usually none).

        Raises:
            ValueError: if ``step`` does not increase.
        """
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"DivergenceDetector steps must increase: got step {step} after {self._last_step}"
            )
        self._last_step = step
        if self._first_step is None:
            self._first_step = step
        loss = float(loss)
        out: list[DivergenceEvent] = []
        if not math.isfinite(loss):
            if self._nonfinite_run == 0:
                self._nonfinite_start = step
            self._nonfinite_run += 1
            if self._nonfinite_run >= self.config.nonfinite_patience and self._armed["nonfinite"]:
                self._armed["nonfinite"] = False
                start = self._nonfinite_start if self._nonfinite_start is not None else step
                out.append(
                    self._event(
                        "nonfinite", start, step, float(self._nonfinite_run), self._level_before(start)
                    )
                )
            return self._record(out)
        self._nonfinite_run = 0
        self._armed["nonfinite"] = True

        if len(self._first) < self.config.smooth:
            self._first.append(loss)
        self._losses.append(loss)
        self._hist.append((step, loss))
        out += self._check_rise(step)
        if baseline_loss is not None and math.isfinite(float(baseline_loss)) and float(baseline_loss) != 0.0:
            b = float(baseline_loss)
            gap = (loss - b) / abs(b)
            self._gaps.append(gap)
            self._gap_hist.append((step, gap))
            out += self._check_gap(step)
        return self._record(out)

    def _check_rise(self, step: int) -> list[DivergenceEvent]:
        c = self.config
        n = len(self._losses)
        if n < c.effective_min_samples:
            return []
        older, newer = self._losses.quantiles(c.quantile)
        rise = (newer - older) / abs(older) if older != 0 else 0.0
        if rise >= c.rise_threshold:
            self._rise_run += 1
        else:
            self._rise_run = 0
            if rise < c.rise_threshold / 2:
                self._armed["rise"] = True
        if self._rise_run >= c.patience and self._armed["rise"]:
            self._armed["rise"] = False
            steps, vals = self._history(self._hist)
            smooth = centred_median(vals, c.smooth)
            i = int(np.argmin(smooth))
            return [self._event("rise", int(steps[i]), step, rise, float(smooth[i]))]
        return []

    def _check_gap(self, step: int) -> list[DivergenceEvent]:
        c = self.config
        if len(self._gaps) < c.gap_window:
            return []
        med = self._gaps.median()
        if med < c.gap_tolerance / 2:
            self._armed["gap"] = True
        if med < c.gap_tolerance or not self._armed["gap"]:
            return []
        self._armed["gap"] = False
        steps, gaps = self._history(self._gap_hist)
        below = np.nonzero(centred_median(gaps, c.smooth) < c.gap_tolerance / 2)[0]
        i = int(below[-1]) + 1 if len(below) else 0
        i = min(i, len(steps) - 1)
        start = int(steps[i])
        return [self._event("gap", start, step, med, self._level_at(start))]

    @staticmethod
    def _history(hist: deque[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
        arr = np.asarray(hist, dtype=np.float64).reshape(-1, 2)
        return arr[:, 0].astype(np.int64), arr[:, 1]

    def _level_at(self, step: int) -> float:
        """Smoothed loss at ``step`` (NaN if it has left the lookback)."""
        if not self._hist:
            return math.nan
        steps, vals = self._history(self._hist)
        i = int(np.searchsorted(steps, step))
        if i >= len(steps) or steps[i] != step:
            return math.nan
        return float(centred_median(vals, self.config.smooth)[i])

    def _level_before(self, step: int) -> float:
        """Median of the last ``smooth`` finite losses before ``step``."""
        vals = [x for s, x in list(self._hist)[-self.config.smooth :] if s < step]
        return float(np.median(vals)) if vals else math.nan

    def _event(self, reason: str, start: int, step: int, magnitude: float, level: float) -> DivergenceEvent:
        c = self.config
        first = self._first_step if self._first_step is not None else start
        initial = self.initial_loss
        no_progress = (
            math.isfinite(level)
            and math.isfinite(initial)
            and level > initial - c.min_progress * abs(initial)
        )
        phase = "start" if (start - first <= c.start_phase_steps or no_progress) else "mid"
        recent = [x for _, x in list(self._hist)[-c.smooth :]]
        return DivergenceEvent(
            reason=reason,
            start_step=start,
            detect_step=step,
            phase=phase,
            magnitude=float(magnitude),
            loss_at_start=float(level),
            loss_at_detect=float(np.median(recent)) if recent else math.nan,
            initial_loss=initial,
        )

    def _record(self, new: list[DivergenceEvent]) -> list[DivergenceEvent]:
        self.events += new
        return new

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (JSON-able) to resume exactly."""
        return save_state(
            config=asdict(self.config),
            losses=list(self._losses.values),
            hist=[list(p) for p in self._hist],
            gaps=list(self._gaps.values),
            gap_hist=[list(p) for p in self._gap_hist],
            first=list(self._first),
            first_step=self._first_step,
            last_step=self._last_step,
            rise_run=self._rise_run,
            armed=dict(self._armed),
            nonfinite_run=self._nonfinite_run,
            nonfinite_start=self._nonfinite_start,
            events=[e.to_dict() for e in self.events],
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (:func:`fp8track.errors.restore_state`: missing keys keep
        their current value, a newer version is a ConfigError)."""
        c = self.config

        def steps(pairs: Any) -> deque[tuple[int, float]]:
            return deque(((int(s), float(x)) for s, x in pairs), maxlen=c.effective_lookback)

        restore_state(
            self,
            state,
            {
                "losses": ("_losses", lambda vs: filled(HalvesWindow(c.window), vs)),
                "hist": ("_hist", steps),
                "gaps": ("_gaps", lambda vs: filled(RobustWindow(c.gap_window), vs)),
                "gap_hist": ("_gap_hist", steps),
                "first": ("_first", lambda xs: [float(x) for x in xs]),
                "first_step": ("_first_step", int),
                "last_step": ("_last_step", int),
                "nonfinite_start": ("_nonfinite_start", int),
                "rise_run": ("_rise_run", int),
                "nonfinite_run": ("_nonfinite_run", int),
                "armed": lambda a: self._armed.update({k: bool(v) for k, v in a.items() if k in self._armed}),
                "events": ("events", lambda es: [DivergenceEvent.from_dict(d) for d in es]),
            },
        )


__all__ = [
    "DivergenceConfig",
    "DivergenceEvent",
    "DivergenceDetector",
    "DIVERGENCE_REASONS",
    "PHASES",
    "centred_median",
]
