"""Streaming loss-spike detection with recovery tracking.

:class:`SpikeDetector` is fed one host float per optimizer step (the caller copies the loss to
the host once per logging step; nothing here touches a device) and keeps ``O(window)`` memory:

* **Baseline** = the robust local trend of the last ``window`` *accepted* losses at this step
  (:class:`fp8track.analysis.windows.TrendWindow`: the line through the medians of the window's
  older and newer halves), **scale** = ``1.4826 * MAD`` of the window's residuals about that line
  (the normal-consistent median absolute deviation), floored at ``min_sigma_rel * |baseline|``.
  Detrending keeps a loss that is still falling from counting its own fall as noise (a plain
  median/MAD of the raw window scored a 2.6x peak at z=2.2 early in training). Medians and MAD
  ignore the outliers a plain mean/std would chase, and losses seen during a spike or a pending
  excursion never enter the window.
* **Excursion step**: ``z = (loss - median) / sigma >= z_threshold`` **and**
  ``loss - median >= rel_threshold * |median|`` (the relative margin keeps a tiny late-training
  sigma from turning noise into spikes).
* **Open**: ``confirm_steps`` consecutive excursion steps open a spike; its ``start_step`` is the
  first of them. A single step far above the baseline (``z >= instant_z`` and relative excess
  ``>= instant_rel``) opens at once, so one-batch spikes are caught too.
* **Close**: ``recover_confirm_steps`` consecutive steps with ``loss <= median + max(recover_z *
  sigma, recover_tolerance * |median|)``, using the *pre-spike* median and sigma; ``end_step`` is
  the first of them and ``recover_steps = end_step - start_step``. A spike still open after
  ``max_open_steps`` closes as ``"not_recovered"`` and the window restarts (warm-up again) at the
  new loss level.
* **Non-finite** loss (NaN, ±inf) is its own event kind, one per run of consecutive non-finite
  steps, closed when a finite loss returns; no warm-up applies to it.
* **Grad norm** (optional) has its own robust window; ``grad_norm_spiked`` says whether any grad
  norm from the spike's start to its end had ``z >= grad_z_threshold``.

The configuration and the events are plain data in :mod:`fp8track.analysis.spike_events`.
Detection never stops training: :attr:`SpikeConfig.action` only tells the caller (the Lightning
callback) what to do on a new event. Each event becomes an :class:`fp8track.monitoring.records.EventRecord`
with :meth:`SpikeEvent.to_record`.

The detector's state is plain data (:meth:`SpikeDetector.state_dict`, JSON-able) and resuming from
it mid-spike gives the same events as an uninterrupted run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import fp8track.errors as errors
from fp8track.analysis.spike_events import (
    EVENT_KINDS,
    EVENT_STATUSES,
    NONFINITE_SEVERITY,
    SPIKE_ACTIONS,
    SpikeClassification,
    SpikeConfig,
    SpikeEvent,
)
from fp8track.analysis.windows import RobustWindow, TrendWindow, filled
from fp8track.errors import ConfigError


class SpikeDetector:
    """Streaming loss-spike and non-finite-loss detector (algorithm in the module docstring).

    Args:
        config: thresholds, :class:`SpikeConfig` (defaults documented there).

    Example:
        >>> det = SpikeDetector(SpikeConfig(window=16, warmup=16))
        >>> opened = []
        >>> for step in range(40):
        ...     loss = 2.0 + 0.01 * (-1) ** step + (1.0 if step in (30, 31, 32) else 0.0)
        ...     opened += det.update(step, loss)
        >>> [(e.status, e.start_step, e.peak_step, e.recover_steps) for e in opened]
        [('open', 30, 30, None), ('recovered', 30, 30, 3)]
    """

    def __init__(self, config: SpikeConfig | None = None) -> None:
        self.config = config if config is not None else SpikeConfig()
        if not isinstance(self.config, SpikeConfig):
            raise ConfigError(f"config must be a SpikeConfig, got {type(self.config).__name__}")
        self.events: list[SpikeEvent] = []  # every event in its latest state, in opening order
        self._loss = TrendWindow(self.config.window)
        self._grad = RobustWindow(self.config.window)
        self._last_step: int | None = None
        self._pending: list[tuple[int, float, bool | None]] = []  # excursion steps not yet a spike
        self._open: dict[str, Any] | None = None  # the open spike's accumulators
        self._nonfinite: dict[str, Any] | None = None  # the open run of non-finite losses

    # --- public -----------------------------------------------------------------------------

    @property
    def last_step(self) -> int | None:
        return self._last_step

    @property
    def open_event(self) -> SpikeEvent | None:
        """The spike currently open (as an ``"open"`` event), if any."""
        return self._spike_event("open", None) if self._open is not None else None

    @property
    def warm(self) -> bool:
        """Whether enough accepted losses are in the window for spikes to open."""
        return len(self._loss) >= self.config.warmup

    def baseline(self, step: int | None = None) -> tuple[float, float]:
        """``(trend, sigma)`` of the accepted-loss window at ``step`` (default: the step after the
        last one seen; NaNs when empty)."""
        if step is None:
            step = (self._last_step + 1) if self._last_step is not None else 0
        med = self._loss.trend(step)
        if not math.isfinite(med):
            return med, math.nan
        return med, self._floor_sigma(self._loss.sigma(), med)

    def update(self, step: int, loss: float, grad_norm: float | None = None) -> list[SpikeEvent]:
        """Feed the loss (and optionally the grad norm) of one optimizer step.

        Args:
            step: optimizer step; must increase from call to call.
            loss: host float (use the un-normalised loss, not divided by accumulation steps).
            grad_norm: total grad norm of the step (host float) or ``None``.

        Returns:
            The events that opened or closed at this step (a spike's ``"open"`` event, its
            ``"recovered"``/``"not_recovered"`` event later; same for non-finite runs).

        Raises:
            ValueError: if ``step`` does not increase.
        """
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"SpikeDetector steps must increase: got step {step} after {self._last_step}")
        self._last_step = step
        loss = float(loss)
        out: list[SpikeEvent] = []
        grad_spiked = self._grad_update(grad_norm)

        if not math.isfinite(loss):
            if self._nonfinite is None:
                med, sig = self.baseline(step)
                self._nonfinite = {
                    "start": step,
                    "loss": loss,
                    "baseline": med,
                    "sigma": sig,
                    "grad": grad_spiked,
                }
                out.append(self._nonfinite_event("open", None))
            else:
                self._nonfinite["grad"] = _or(self._nonfinite["grad"], grad_spiked)
            if self._open is not None:
                self._open["grad"] = _or(self._open["grad"], grad_spiked)
            return self._record(out)
        if self._nonfinite is not None:
            out.append(self._nonfinite_event("recovered", step))
            self._nonfinite = None

        if self._open is not None:
            out += self._continue_spike(step, loss, grad_spiked)
        else:
            out += self._check_open(step, loss, grad_spiked)
        return self._record(out)

    def update_many(
        self, steps: Sequence[int], losses: Sequence[float], grad_norms: Sequence[float | None] | None = None
    ) -> list[SpikeEvent]:
        """:meth:`update` for a batch of consecutive records (e.g. one host copy per log interval)."""
        if len(steps) != len(losses) or (grad_norms is not None and len(grad_norms) != len(steps)):
            raise ValueError("steps, losses and grad_norms must have the same length")
        out: list[SpikeEvent] = []
        for i, (s, x) in enumerate(zip(steps, losses, strict=True)):
            out += self.update(s, x, None if grad_norms is None else grad_norms[i])
        return out

    def finalize(self, last_step: int | None = None) -> list[SpikeEvent]:
        """Close whatever is open as ``"not_recovered"`` (end of training); returns those events.

        ``last_step`` defaults to the last step seen. The detector stays usable.
        """
        end = self._last_step if last_step is None else int(last_step)
        out: list[SpikeEvent] = []
        if self._nonfinite is not None:
            out.append(self._nonfinite_event("not_recovered", end))
            self._nonfinite = None
        if self._open is not None:
            out.append(self._spike_event("not_recovered", end))
            self._open = None
        return self._record(out)

    @property
    def spike_count(self) -> int:
        """Number of loss spikes (any status) so far; non-finite runs are not counted."""
        return sum(1 for e in self.events if e.kind == "spike")

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (JSON-able; NaN/inf are Python floats) to resume exactly."""
        return errors.save_state(
            config=asdict(self.config),
            last_step=self._last_step,
            loss_window=[[s, x] for s, x in zip(self._loss.steps, self._loss.values, strict=True)],
            grad_window=list(self._grad.values),
            pending=[list(p) for p in self._pending],
            open=dict(self._open) if self._open is not None else None,
            nonfinite=dict(self._nonfinite) if self._nonfinite is not None else None,
            events=[e.to_dict() for e in self.events],
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (:func:`fp8track.errors.restore_state`: missing keys keep
        their current value, a newer version is a ConfigError).

        The configuration is *not* taken from the state (the constructor's wins), so a resumed run
        may change thresholds; windows longer than the new ``window`` keep their newest values.
        """

        errors.restore_state(
            self,
            state,
            {
                "last_step": ("_last_step", int),
                "loss_window": ("_loss", self._trend_window),
                "grad_window": ("_grad", lambda vs: filled(RobustWindow(self.config.window), vs)),
                "pending": ("_pending", lambda ps: [(int(s), float(x), g) for s, x, g in ps]),
                "open": ("_open", dict),
                "nonfinite": ("_nonfinite", dict),
                "events": ("events", lambda es: [SpikeEvent.from_dict(d) for d in es]),
            },
        )

    # --- internals --------------------------------------------------------------------------

    def _trend_window(self, saved: Sequence[Any]) -> TrendWindow:
        """A saved loss window: ``[step, loss]`` pairs, or plain losses (states of the version
        before detrending), given the consecutive steps up to the last step seen."""
        win = TrendWindow(self.config.window)
        last = self._last_step if self._last_step is not None else len(saved) - 1
        for i, item in enumerate(saved):
            if isinstance(item, (list, tuple)):
                win.append(int(item[0]), float(item[1]))
            else:
                win.append(last - len(saved) + 1 + i, float(item))
        return win

    def _robust(self, win: RobustWindow) -> tuple[float, float]:
        med = win.median()
        if not math.isfinite(med):
            return med, math.nan
        return med, self._floor_sigma(win.sigma(), med)

    def _floor_sigma(self, sig: float, med: float) -> float:
        return max(sig, self.config.min_sigma_rel * abs(med), 1e-12)

    def _grad_update(self, grad_norm: float | None) -> bool | None:
        """Whether this grad norm is a spike of its own window (``None`` if unknown); feeds the window."""
        if grad_norm is None:
            return None
        g = float(grad_norm)
        if not math.isfinite(g):
            return True
        spiked: bool | None = None
        if len(self._grad) >= self.config.warmup:
            med, sig = self._robust(self._grad)
            spiked = (g - med) / sig >= self.config.grad_z_threshold
        if not spiked:
            self._grad.append(g)
        return spiked

    def _check_open(self, step: int, loss: float, grad_spiked: bool | None) -> list[SpikeEvent]:
        cfg = self.config
        if not self.warm:
            self._loss.append(step, loss)
            return []
        med = self._loss.trend(step)
        excess = loss - med
        rel = excess / abs(med) if med != 0 else math.inf
        # The relative test is O(1); the MAD is only computed for losses that pass it.
        sig = self._floor_sigma(self._loss.sigma(), med) if rel >= cfg.rel_threshold else math.inf
        z = excess / sig
        if not (z >= cfg.z_threshold and rel >= cfg.rel_threshold):
            self._pending.clear()
            self._loss.append(step, loss)
            return []
        self._pending.append((step, loss, grad_spiked))
        instant = z >= cfg.instant_z and rel >= cfg.instant_rel
        if len(self._pending) < cfg.confirm_steps and not instant:
            return []
        peak_step, peak_loss, _ = max(self._pending, key=lambda p: p[1])
        self._open = {
            "start": self._pending[0][0],
            "peak_step": peak_step,
            "peak_loss": peak_loss,
            "baseline": med,
            "sigma": sig,
            "grad": _or_all(p[2] for p in self._pending),
        }
        self._pending.clear()
        return [self._spike_event("open", None)]

    def _continue_spike(self, step: int, loss: float, grad_spiked: bool | None) -> list[SpikeEvent]:
        cfg = self.config
        o = self._open
        assert o is not None  # internal invariant, not a user error
        o["grad"] = _or(o["grad"], grad_spiked)
        close_level = o["baseline"] + max(
            cfg.recover_z * o["sigma"], cfg.recover_tolerance * abs(o["baseline"])
        )
        if loss <= close_level:
            back = o.setdefault("back", [])
            back.append([step, loss])
            if len(back) == 1:
                o["back_step"] = step
            if len(back) >= cfg.recover_confirm_steps:
                event = self._spike_event("recovered", int(o["back_step"]))
                self._open = None
                for i, x in enumerate(back):  # [step, loss]; a plain loss in states before detrending
                    s_x, v_x = (x[0], x[1]) if isinstance(x, (list, tuple)) else (step - len(back) + 1 + i, x)
                    self._loss.append(int(s_x), float(v_x))
                return [event]
            return []
        o["back"] = []
        if loss > o["peak_loss"]:
            o["peak_step"], o["peak_loss"] = step, loss
        if cfg.max_open_steps is not None and step - o["start"] >= cfg.max_open_steps:
            event = self._spike_event("not_recovered", step)
            self._open = None
            # The loss settled at a new level: learn it from scratch rather than compare to the old one.
            self._loss.clear()
            self._loss.append(step, loss)
            return [event]
        return []

    def _spike_event(self, status: str, end: int | None) -> SpikeEvent:
        o = self._open
        assert o is not None
        recovered = status == "recovered"
        return SpikeEvent(
            kind="spike",
            start_step=int(o["start"]),
            peak_step=int(o["peak_step"]),
            peak_loss=float(o["peak_loss"]),
            baseline=float(o["baseline"]),
            sigma=float(o["sigma"]),
            z_score=(o["peak_loss"] - o["baseline"]) / o["sigma"],
            recover_steps=(end - o["start"]) if recovered and end is not None else None,
            end_step=end,
            grad_norm_spiked=o["grad"],
            status=status,
        )

    def _nonfinite_event(self, status: str, end: int | None) -> SpikeEvent:
        n = self._nonfinite
        assert n is not None
        return SpikeEvent(
            kind="nonfinite",
            start_step=int(n["start"]),
            peak_step=int(n["start"]),
            peak_loss=float(n["loss"]),
            baseline=float(n["baseline"]),
            sigma=float(n["sigma"]),
            z_score=math.nan,
            recover_steps=(end - n["start"]) if status == "recovered" and end is not None else None,
            end_step=end,
            grad_norm_spiked=n["grad"],
            status=status,
        )

    def _record(self, new: list[SpikeEvent]) -> list[SpikeEvent]:
        """Keep :attr:`events` as one entry per event, in its latest state."""
        for e in new:
            if e.status != "open" and self.events:
                for i in range(len(self.events) - 1, -1, -1):
                    old = self.events[i]
                    if old.kind == e.kind and old.start_step == e.start_step and old.status == "open":
                        self.events[i] = e
                        break
                else:
                    self.events.append(e)
            else:
                self.events.append(e)
        return new


def _or(a: bool | None, b: bool | None) -> bool | None:
    if a is None:
        return b
    if b is None:
        return a
    return a or b


def _or_all(values: Iterable[bool | None]) -> bool | None:
    out: bool | None = None
    for v in values:
        out = _or(out, v)
    return out


def detect_spikes(series: Mapping[int, float], config: SpikeConfig | None = None) -> tuple[SpikeEvent, ...]:
    """Run a fresh :class:`SpikeDetector` over ``{step: loss}`` (sorted by step) and finalize it.

    Returns every event in its final state (open spikes become ``"not_recovered"``).
    """
    det = SpikeDetector(config)
    for step in sorted(series):
        det.update(step, series[step])
    det.finalize()
    return tuple(det.events)


__all__ = [
    "SpikeConfig",
    "SpikeEvent",
    "SpikeClassification",
    "SpikeDetector",
    "RobustWindow",
    "detect_spikes",
    "SPIKE_ACTIONS",
    "EVENT_KINDS",
    "EVENT_STATUSES",
    "NONFINITE_SEVERITY",
]
