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

Detection never stops training: :attr:`SpikeConfig.action` only tells the caller (the Lightning
callback) what to do on a new event. Each event becomes an :class:`fp8track.monitoring.records.EventRecord`
with :meth:`SpikeEvent.to_record`.

The detector's state is plain data (:meth:`SpikeDetector.state_dict`, JSON-able) and resuming from
it mid-spike gives the same events as an uninterrupted run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import fp8track.errors as errors
from fp8track.analysis.windows import RobustWindow, TrendWindow, filled
from fp8track.errors import ConfigError, FromDict, check_float, check_int, dataclass_from_dict, invalid_choice
from fp8track.monitoring.records import EventRecord

SPIKE_ACTIONS = ("log", "stop", "checkpoint")
EVENT_KINDS = ("spike", "nonfinite")
EVENT_STATUSES = ("open", "recovered", "not_recovered")
NONFINITE_SEVERITY = 10.0  # ranks a NaN/inf loss above any spike under a 10x relative excess


@dataclass(frozen=True)
class SpikeConfig(FromDict):
    """Thresholds of :class:`SpikeDetector` (all validated at construction).

    Attributes:
        window: number of accepted losses in the rolling median/MAD baseline. 128 follows OLMo-core.
        warmup: accepted losses needed before spikes can open (non-finite events need none).
        z_threshold: robust z-score an excursion step must reach (6, as OLMo-core's 6 sigma).
        rel_threshold: relative excess over the median an excursion step must also reach (0.05).
        confirm_steps: consecutive excursion steps that open a spike (2: one-step heavy-tailed
            noise does not open one; see ``instant_*`` for one-step spikes).
        instant_z, instant_rel: a single step with ``z >= instant_z`` and relative excess
            ``>= instant_rel`` opens a spike at once (defaults 12 and 1.0: one step at twice the
            baseline; Lightning uses 3x).
        recover_z, recover_tolerance: a loss is "back" when within
            ``max(recover_z * sigma, recover_tolerance * |median|)`` of the pre-spike median.
        recover_confirm_steps: consecutive steps back before the spike closes (3: a slowly
            decaying tail crosses the level back and forth; one lucky step must not end it).
            ``end_step`` is the first of them.
        max_open_steps: a spike open this long closes as ``"not_recovered"`` and the baseline
            restarts; ``None`` keeps it open until :meth:`SpikeDetector.finalize`.
        grad_z_threshold: robust z of the grad norm that counts as "grad norm spiked too".
        min_sigma_rel: floor of sigma relative to ``|median|`` (guards a constant loss).
        action: what the caller should do on a new event: ``"log"`` (default, never interrupts),
            ``"stop"`` or ``"checkpoint"``. The detector itself only reports.
    """

    window: int = 128
    warmup: int = 64
    z_threshold: float = 6.0
    rel_threshold: float = 0.05
    confirm_steps: int = 2
    instant_z: float = 12.0
    instant_rel: float = 1.0
    recover_z: float = 3.0
    recover_tolerance: float = 0.02
    recover_confirm_steps: int = 3
    max_open_steps: int | None = 2000
    grad_z_threshold: float = 6.0
    min_sigma_rel: float = 1e-4
    action: str = "log"

    def __post_init__(self) -> None:
        check_int("window", self.window, 8)
        check_int("warmup", self.warmup, 8)
        if self.warmup > self.window:
            raise ConfigError(f"warmup ({self.warmup}) must not exceed window ({self.window})")
        check_float("z_threshold", self.z_threshold, 0.0, strict=True)
        check_float("rel_threshold", self.rel_threshold, 0.0)
        check_int("confirm_steps", self.confirm_steps, 1)
        check_float("instant_z", self.instant_z, 0.0, strict=True, allow_inf=True)
        check_float("instant_rel", self.instant_rel, 0.0, allow_inf=True)
        check_float("recover_z", self.recover_z, 0.0)
        check_float("recover_tolerance", self.recover_tolerance, 0.0)
        check_int("recover_confirm_steps", self.recover_confirm_steps, 1)
        if self.recover_z >= self.z_threshold:
            raise ConfigError(
                f"recover_z ({self.recover_z}) must be below z_threshold ({self.z_threshold}), "
                "otherwise a spike could close at the step that opens it"
            )
        if self.max_open_steps is not None:
            check_int("max_open_steps", self.max_open_steps, 1)
        check_float("grad_z_threshold", self.grad_z_threshold, 0.0, strict=True)
        check_float("min_sigma_rel", self.min_sigma_rel, 0.0)
        if self.action not in SPIKE_ACTIONS:
            raise invalid_choice("spike action", self.action, SPIKE_ACTIONS)


@dataclass(frozen=True)
class SpikeClassification:
    """An FP8 spike compared with the control's spikes.

    Attributes:
        label: ``"shared"`` (the control had a spike of the same kind starting within ``window``
            steps) or ``"fp8_only"``.
        window: the matching window in steps.
        control_start_step: start of the matched control spike (``None`` if FP8-only).
        step_offset: FP8 start minus control start.
        recover_steps, control_recover_steps: steps to recover (``None`` = not recovered or no match).
        recover_ratio: ``recover_steps / control_recover_steps`` when both recovered (control
            recovery of 0 counts as 1 step).
        slower_recovery: FP8 recovered ``slower_factor`` times slower than the control or not at
            all while the control did; ``None`` without a match.
    """

    label: str
    window: int
    control_start_step: int | None = None
    step_offset: int | None = None
    recover_steps: int | None = None
    control_recover_steps: int | None = None
    recover_ratio: float | None = None
    slower_recovery: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "control": self.label,
            "control_window": self.window,
            "control_start_step": self.control_start_step,
            "control_step_offset": self.step_offset,
            "control_recover_steps": self.control_recover_steps,
            "recover_ratio": self.recover_ratio,
            "slower_recovery": self.slower_recovery,
        }


@dataclass(frozen=True)
class SpikeEvent:
    """One loss spike or run of non-finite losses.

    Attributes:
        kind: ``"spike"`` or ``"nonfinite"``.
        start_step: first step above the excursion thresholds (first non-finite step).
        peak_step, peak_loss: step and value of the highest loss (first non-finite value for
            ``"nonfinite"``).
        baseline: rolling median before the spike (NaN if there was none yet).
        sigma: robust scale (1.4826 MAD) before the spike (NaN if none).
        z_score: ``(peak_loss - baseline) / sigma`` (NaN for ``"nonfinite"``).
        recover_steps: ``end_step - start_step`` when recovered, else ``None``.
        end_step: first step back within tolerance (recovered), the last step seen
            (not recovered), or ``None`` while open.
        grad_norm_spiked: whether the grad norm spiked between start and end; ``None`` if no grad
            norm was given during the event (or before the grad-norm window warmed up).
        status: ``"open"``, ``"recovered"`` or ``"not_recovered"``.
    """

    kind: str
    start_step: int
    peak_step: int
    peak_loss: float
    baseline: float
    sigma: float
    z_score: float
    recover_steps: int | None
    end_step: int | None
    grad_norm_spiked: bool | None
    status: str

    @property
    def rel_excess(self) -> float:
        """``(peak_loss - baseline) / |baseline|`` (NaN if unknown)."""
        if not (math.isfinite(self.baseline) and self.baseline != 0 and math.isfinite(self.peak_loss)):
            return math.nan
        return (self.peak_loss - self.baseline) / abs(self.baseline)

    @property
    def duration(self) -> int | None:
        """Steps from start to end (``None`` while open)."""
        return None if self.end_step is None else self.end_step - self.start_step

    @property
    def severity(self) -> float:
        """Unitless rank, higher = worse: relative excess x (1 + log10(1 + duration)), +1 if not recovered.

        Non-finite events use a relative excess of :data:`NONFINITE_SEVERITY`.
        """
        excess = NONFINITE_SEVERITY if self.kind == "nonfinite" else self.rel_excess
        if not math.isfinite(excess):
            excess = 0.0
        sev = max(excess, 0.0) * (1.0 + math.log10(1 + (self.duration or 0)))
        return sev + (1.0 if self.status == "not_recovered" else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpikeEvent:
        """The event stored by :meth:`to_dict` (unknown keys of another version dropped)."""
        return dataclass_from_dict(cls, d, strict=False)

    def to_record(self, classification: SpikeClassification | None = None) -> EventRecord:
        """The :class:`EventRecord` (``kind`` = :attr:`kind`, ``step`` = :attr:`start_step`).

        ``data`` holds every field plus ``severity``, ``rel_excess``, ``duration``. With a
        ``classification`` against a control (:func:`fp8track.analysis.baseline.classify_spike`) it adds
        ``control`` (``"shared"``/``"fp8_only"``) and the recovery comparison; FP8-only spikes and
        non-finite losses carry ``alert=True`` with ``title``, ``text`` and ``level``.
        """
        data: dict[str, Any] = self.to_dict()
        data.update(severity=self.severity, rel_excess=self.rel_excess, duration=self.duration)
        if self.kind == "nonfinite":
            data.update(
                alert=True,
                level="ERROR",
                title="Non-finite loss",
                text=f"loss was {self.peak_loss} at step {self.start_step}"
                + (
                    f"; finite again after {self.recover_steps} steps"
                    if self.recover_steps is not None
                    else ""
                ),
            )
        if classification is not None:
            data.update(classification.to_dict())
            if classification.label == "fp8_only":
                data.update(
                    alert=True,
                    level="WARN",
                    title="FP8-only loss spike",
                    text=(
                        f"loss spiked to {self.peak_loss:.4g} ({100 * self.rel_excess:+.1f}% over baseline "
                        f"{self.baseline:.4g}) at step {self.peak_step}; the control did not spike within "
                        f"{classification.window} steps. Recovery: "
                        + ("none" if self.recover_steps is None else f"{self.recover_steps} steps")
                    ),
                )
        return EventRecord(kind=self.kind, step=self.start_step, data=data)


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
    "SpikeDetector",
    "RobustWindow",
    "detect_spikes",
    "SPIKE_ACTIONS",
]
