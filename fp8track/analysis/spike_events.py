"""What loss-spike detection produces and how it is configured: :class:`SpikeConfig` (the
thresholds of :class:`fp8track.analysis.spikes.SpikeDetector`, whose module docstring gives the
algorithm), :class:`SpikeEvent` (one spike or run of non-finite losses, and its
:class:`~fp8track.monitoring.records.EventRecord`) and :class:`SpikeClassification` (an FP8 spike
compared with the control's spikes). Plain frozen data, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

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


__all__ = [
    "SPIKE_ACTIONS",
    "EVENT_KINDS",
    "EVENT_STATUSES",
    "NONFINITE_SEVERITY",
    "SpikeConfig",
    "SpikeClassification",
    "SpikeEvent",
]
