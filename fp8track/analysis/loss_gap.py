"""The FP8-vs-control loss gap, judged in the right noise unit.

Two runs compare step by step on the steps both logged, through the relative gap
``g_s = (fp8_s - control_s) / |control_s|``. How much of ``g`` is noise depends on the data:

* **paired** (``unit="paired"``): both runs saw the same batches in the same order
  (:func:`same_batches` on their metadata). Each step's batch noise then cancels in the ratio, and
  ``g`` of a healthy FP8 run stays within ~1-2 % of zero (measured 0.9-1.6 % on the example GPT).
  The noise unit is the paired gap's own step-to-step noise, ``1.4826 x MAD(diff(g)) / sqrt(2)``
  (differencing removes a lasting level, so the gap being judged does not inflate its own unit).
  The gap is smoothed by a centred running median of ``w`` steps and the cut is
  ``max(noise_k x noise, min_gap)``: the paired gap's slow wander does not average out over a
  window, so the cut is in per-step sigmas, never below the healthy band ``min_gap``.
* **control noise** (``unit="control_noise"``): different batches (or unknown). The noise unit is
  the control's relative step-to-step noise ``1.4826 x MAD(d) / sqrt(2)``, ``d`` the relative
  step-to-step changes of the control loss (trend-free, spike-proof). The cut on the smoothed gap
  is the standard error of a ``w``-step running median of that noise, ``noise_k x 1.2533 x noise /
  sqrt(w)``, never below ``min_gap``.

**Lasting gap and onset.** The smoothed gap is fitted by two constant segments (least squares,
the split that lowers the squared error most, the later segment worse); the split is the onset
of the change. The gap is *lasting* when at least ``sustain`` of the smoothed gap from the onset to
the end is above the cut, its last value is, and at least ``w // 2`` steps follow the onset. A
gradual rise is followed back from the split while the smoothed gap stays above the cut and above
the midpoint of the two segments' levels; when the earlier segment is itself above the cut (the
split marks a growth of a gap that was already there), the onset is the first step from which at
least ``sustain`` of the smoothed gap stays above the cut.

**Seed band.** A lasting gap that ends below ``seed_band`` (5 %, median over the last fifth of
the run) is no finding: healthy
FP8/BF16 pairs of small models drift apart by that much on the same batches (the trajectories
diverge as two seeds' would), so one pair cannot tell it from damage; ``band_onset_step`` keeps it.

**Severity.** ``z`` is the gap's level (median relative gap from the onset to the end) in noise
units; ``z_cut`` is the cut in the same unit. ``"high"`` when ``z >= 2 z_cut`` (or the FP8 loss
went non-finite), ``"medium"`` for a lasting gap below that, ``"none"`` without a lasting gap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8track.analysis.windows import MAD_TO_SIGMA, centred_median
from fp8track.errors import ConfigError, FromDict, check_float, check_int

UNITS = ("paired", "control_noise")
SEVERITIES = ("none", "medium", "high")
MEDIAN_SE = math.sqrt(math.pi / 2)  # standard error of a median of w normal values: 1.2533 sigma / sqrt(w)
DATA_KEY = "data"
"""Key of the data fingerprint in a run's ``meta["config"]`` (see :func:`same_batches`)."""


@dataclass(frozen=True)
class GapConfig(FromDict):
    """Knobs of :func:`judge_gap` (module docstring).

    Attributes:
        noise_k: the cut in noise units (3).
        smooth: width of the centred running median (odd; default ``max(5, n // 25)``, at most
            :data:`MAX_SMOOTH`, n the number of common steps).
        sustain: share of the smoothed gap from the onset on that must be above the cut (0.8).
        start_fraction: an onset within this share of the run has phase ``"start"`` (0.1).
        min_gap: relative gap below which the smoothed gap is never above the cut (0.02): the
            band a healthy FP8 run's per-step wander keeps against the control on the same batches
            (0.9-1.6 % measured on the example GPT).
        seed_band: a lasting gap that ends below this (median gap over the last fifth of the
            common steps) is not a finding (0.05): healthy FP8/BF16 pairs of small models drift
            apart by that much on the same batches, as two seeds would (the diagnosis benchmark's 5
            healthy pairs end between -8.5 % and +3.8 % and peak at +8.2 %), and one pair cannot
            tell such a gap from damage.
            It is kept as ``band_onset_step`` / ``level`` for the report.
    """

    noise_k: float = 3.0
    smooth: int | None = None
    sustain: float = 0.8
    start_fraction: float = 0.1
    min_gap: float = 0.02
    seed_band: float = 0.05

    def __post_init__(self) -> None:
        check_float("noise_k", self.noise_k, 0.0, strict=True)
        if self.smooth is not None:
            check_int("smooth", self.smooth, 1)
        check_float("sustain", self.sustain, 0.0, strict=True)
        if self.sustain > 1.0:
            raise ConfigError(f"sustain must be in (0, 1], got {self.sustain!r}")
        check_float("start_fraction", self.start_fraction, 0.0)
        check_float("min_gap", self.min_gap, 0.0)
        check_float("seed_band", self.seed_band, 0.0)


@dataclass(frozen=True)
class GapJudgement:
    """The FP8 loss against the control's on their common steps (module docstring).

    Attributes:
        unit: ``"paired"`` (same batches: the paired gap's own noise) or ``"control_noise"``.
        steps: common steps, ascending.
        fp8, control: the two losses at those steps.
        rel_gap: ``(fp8 - control) / |control|`` per step (``inf`` where FP8 is non-finite).
        smooth_gap: ``rel_gap`` through the centred running median of ``smooth`` steps.
        noise: the noise unit's sigma, relative (per step).
        tolerance: the cut on ``smooth_gap`` (relative).
        lasting: whether a lasting gap was found.
        onset_step: first step of the lasting gap (``None`` without one).
        phase: ``"start"`` / ``"mid"`` for an onset, else ``None``.
        level: median relative gap from the onset to the end (over all steps without an onset).
        z: ``level / noise``; z_cut: ``tolerance / noise``.
        severity: ``"none"``, ``"medium"`` or ``"high"``.
        smooth: the running median's width.
        band_onset_step: the onset of a gap that lasts but ends inside
            ``GapConfig.seed_band`` (not a lasting gap then: ``lasting`` is False), else ``None``.
        seed_band: that band (relative).
        corroborated_by: set by the diagnosis when a layer's own break explains a gap that would
            end inside the band, and the gap was judged without it (``None`` otherwise).
    """

    unit: str
    steps: tuple[int, ...]
    fp8: tuple[float, ...]
    control: tuple[float, ...]
    rel_gap: tuple[float, ...]
    smooth_gap: tuple[float, ...]
    noise: float
    tolerance: float
    lasting: bool
    onset_step: int | None
    phase: str | None
    level: float
    z: float
    z_cut: float
    severity: str
    smooth: int
    band_onset_step: int | None = None
    seed_band: float = 0.0
    corroborated_by: str | None = None

    @property
    def end_level(self) -> float:
        """The median relative gap where the runs end (:func:`end_median`); NaN without steps."""
        if not self.rel_gap:
            return math.nan
        return end_median(np.asarray(self.rel_gap, dtype=np.float64), self.smooth)

    @property
    def unit_label(self) -> str:
        """Words for reports: which noise the gap was judged in."""
        return describe_unit(self.unit)

    @property
    def final_gap(self) -> float:
        """Smoothed relative gap at the last common step."""
        return self.smooth_gap[-1] if self.smooth_gap else math.nan

    @property
    def max_gap(self) -> float:
        return max(self.smooth_gap, default=math.nan)

    def to_dict(self) -> dict[str, Any]:
        """Summary without the per-step series (JSON-able; non-finite numbers as ``None``)."""

        def num(x: float) -> float | None:
            return float(x) if math.isfinite(x) else None

        return {
            "unit": self.unit, "unit_label": self.unit_label, "common_steps": len(self.steps),
            "noise_rel": num(self.noise), "tolerance_rel": num(self.tolerance), "lasting": self.lasting,
            "onset_step": self.onset_step, "phase": self.phase, "level_rel": num(self.level),
            "z": num(self.z), "z_cut": num(self.z_cut), "severity": self.severity, "smooth": self.smooth,
            "final_gap_rel": num(self.final_gap), "max_gap_rel": num(self.max_gap),
            "band_onset_step": self.band_onset_step, "seed_band_rel": self.seed_band,
            "corroborated_by": self.corroborated_by,
        }


def describe_unit(unit: str) -> str:
    """Words for reports: which noise a gap judged in ``unit`` (``"paired"`` or
    ``"control_noise"``) was measured in."""
    if unit == "paired":
        return "the paired FP8/control gap's own step-to-step noise (same batches)"
    return "the control's step-to-step noise (different or unknown batches)"


def data_fingerprint_of(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The data fingerprint a run recorded (``meta["config"]["data"]``, else ``meta["data"]``);
    ``{}`` when it recorded none."""
    if not meta:
        return {}
    config = meta.get("config")
    found = config.get(DATA_KEY) if isinstance(config, Mapping) else None
    if found is None:
        found = meta.get(DATA_KEY)
    return dict(found) if isinstance(found, Mapping) else {}


def same_batches(fp8_meta: Mapping[str, Any] | None, control_meta: Mapping[str, Any] | None) -> bool:
    """Whether two runs recorded the same data fingerprint (data seed and batch-order hash, see
    :func:`fp8track.monitoring.monitor.data_fingerprint`): both recorded one, and they are equal.

    Example:
        >>> a = {"config": {"data": {"seed": 1, "order_sha256": "ab"}}}
        >>> b = {"config": {"data": {"seed": 2, "order_sha256": "ab"}}}
        >>> same_batches(a, a), same_batches(a, b), same_batches(a, {})
        (True, False, False)
    """
    a, b = data_fingerprint_of(fp8_meta), data_fingerprint_of(control_meta)
    return bool(a) and a == b


def step_noise(values: np.ndarray, relative: bool) -> float:
    """Robust step-to-step noise of a series: ``1.4826 x MAD(d) / sqrt(2)`` over consecutive finite
    values, ``d`` their differences (divided by the earlier value when ``relative``). For independent
    per-step noise of sigma ``s``, ``d`` has sigma ``s sqrt(2)``; differencing removes a smooth
    trend or a level shift, the MAD ignores spikes. NaN with fewer than 3 finite values."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size < 3:
        return math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.diff(v) / np.abs(v[:-1]) if relative else np.diff(v)
    d = d[np.isfinite(d)]
    if not d.size:
        return math.nan
    return MAD_TO_SIGMA * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2.0)


MAX_SMOOTH = 201
"""Widest default running median: a long run (every step's loss) is smoothed over at most 201 steps."""


def _width(n: int, smooth: int | None) -> int:
    w = smooth if smooth is not None else min(max(5, n // 25), MAX_SMOOTH)
    w = min(w, max(1, n))
    return w if w % 2 else w + 1


def _median_at(x: np.ndarray, i: int, w: int) -> float:
    """The centred running median of ``w`` points at index ``i`` (shrinking at the ends), as
    :func:`fp8track.analysis.windows.centred_median` gives it there; NaN for an all-NaN window."""
    part = x[max(0, i - w // 2) : i + w // 2 + 1]
    return float(np.nanmedian(part)) if np.isfinite(part).any() else math.nan


def change_point(values: np.ndarray) -> int:
    """Index ``t`` splitting ``values`` into two constant segments with the least squared error
    where the later segment's mean is higher (0: no split helps, one segment)."""
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    if n < 2:
        return 0
    cs, cs2 = np.cumsum(x), np.cumsum(x * x)
    t = np.arange(1, n)  # split before index t
    left_n, right_n = t, n - t
    left_s, right_s = cs[t - 1], cs[-1] - cs[t - 1]
    left_q, right_q = cs2[t - 1], cs2[-1] - cs2[t - 1]
    sse = (left_q - left_s**2 / left_n) + (right_q - right_s**2 / right_n)
    worse = right_s / right_n > left_s / left_n
    total = cs2[-1] - cs[-1] ** 2 / n
    sse = np.where(worse, sse, np.inf)
    i = int(np.argmin(sse))
    return int(t[i]) if sse[i] < total else 0


def _common_series(
    fp8: Mapping[int, float], control: Mapping[int, float]
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The steps both runs logged (ascending) and the two losses there, as float64 arrays.

    Raises:
        ConfigError: fewer than 3 common steps.
    """
    steps = sorted(set(int(s) for s in fp8) & set(int(s) for s in control))
    if len(steps) < 3:
        raise ConfigError(
            f"the FP8 run and the control share {len(steps)} logged loss steps; "
            "judging the gap needs at least 3"
        )
    f = np.array([float(fp8[s]) for s in steps], dtype=np.float64)
    c = np.array([float(control[s]) for s in steps], dtype=np.float64)
    return steps, f, c


def relative_gap(f: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``(f - c) / |c|`` per step: ``+inf`` where the FP8 loss is non-finite, 0 where the gap is
    undefined (both non-finite, or both zero)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = (f - c) / np.abs(c)
    gap = np.where(np.isfinite(f), gap, np.inf)
    return np.where(np.isnan(gap), 0.0, gap)


def _infinite_as_worst(gap: np.ndarray) -> np.ndarray:
    """``gap`` with every infinite value as ``+inf``: a median counts an infinite gap as worse than
    any finite one (and never meets ``-inf`` and ``+inf`` in one window, whose mean is NaN)."""
    return np.where(np.isinf(gap), np.inf, gap)


def _median(gap: np.ndarray) -> float:
    return float(np.median(_infinite_as_worst(gap)))


def end_median(gap: np.ndarray, smooth: int) -> float:
    """The median of the relative gap ``gap`` over where the runs end: their last fifth, at least
    ``smooth`` steps (one smoothing width); an infinite gap (FP8 non-finite) counts as the worst."""
    return _median(gap[-max(smooth, gap.size // 5):])


def _noise_unit(gap: np.ndarray, c: np.ndarray, paired: bool) -> float:
    """The noise unit's sigma (module docstring): the paired gap's own step-to-step noise, else the
    control's relative step-to-step noise; floored at 1e-6."""
    if paired:
        noise = step_noise(np.where(np.isfinite(gap), gap, np.nan), relative=False)
    else:
        noise = step_noise(c, relative=True)
    # A deterministic or synthetic series still has float rounding: floor the unit.
    return max(noise if math.isfinite(noise) else 0.0, 1e-6)


def _onset(smooth: np.ndarray, tol: float, w: int, sustain: float) -> int | None:
    """Index of the lasting gap's onset on the smoothed gap (module docstring), ``None`` when the
    gap does not last."""
    n = smooth.size
    # Change point on the smoothed gap, clipped so one non-finite stretch cannot own the fit.
    clip = np.clip(np.where(np.isfinite(smooth), smooth, 1.0), -1.0, 1.0)
    t = change_point(clip)
    above = smooth > tol
    tail = above[t:]
    if not (above[-1] and tail.size >= max(1, w // 2) and tail.mean() >= sustain):
        return None
    pre = float(np.median(clip[:t])) if t > 0 else 0.0
    if pre > tol:
        # The gap was already there before the split (which marks a growth): the onset is the
        # first step from which the gap stays above the cut.
        share = np.cumsum(above[::-1])[::-1] / np.arange(n, 0, -1)
        i = int(np.argmax(above & (share >= sustain)))
    else:
        mid = (pre + float(np.median(clip[t:]))) / 2
        i = t
        while i > 0 and above[i - 1] and clip[i - 1] > mid:
            i -= 1
    while i < n and not above[i]:
        i += 1
    return i if i < n else None


def _phase(
    steps: list[int], f: np.ndarray, c: np.ndarray, onset_i: int, w: int, start_fraction: float
) -> str:
    """``"start"`` when the onset is within ``start_fraction`` of the run or the FP8 run made less
    than half the control's progress before it, else ``"mid"``."""
    early = (steps[onset_i] - steps[0]) <= start_fraction * (steps[-1] - steps[0])
    f_nan = np.where(np.isfinite(f), f, np.nan)
    # Progress made before the trouble: half a window before the onset, where the running
    # median does not see the steps after it yet.
    j = max(0, onset_i - w // 2 - 1)
    ctl_progress = _median_at(c, 0, w) - _median_at(c, j, w)
    f_j = _median_at(f_nan, j, w)
    fp8_progress = _median_at(f_nan, 0, w) - f_j if np.isfinite(f_j) else -math.inf
    return "start" if early or fp8_progress < 0.5 * ctl_progress else "mid"


def judge_gap(
    fp8: Mapping[int, float],
    control: Mapping[int, float],
    paired: bool,
    config: GapConfig | None = None,
) -> GapJudgement:
    """Judge the FP8 run's loss against the control's (module docstring).

    Args:
        fp8, control: ``{step: loss}`` of each run (every optimizer step ideally; common steps are
            compared).
        paired: both runs saw the same batches (:func:`same_batches` of their metadata).
        config: :class:`GapConfig`.

    Raises:
        ConfigError: fewer than 3 common steps.

    Example:
        >>> ctl = {s: 4.0 - 0.005 * s + 0.01 * ((s * 7) % 5 - 2) for s in range(300)}
        >>> fp8 = {s: v * (1.06 if s >= 180 else 1.0) for s, v in ctl.items()}
        >>> j = judge_gap(fp8, ctl, paired=True)
        >>> j.unit, j.lasting, j.onset_step, j.severity
        ('paired', True, 180, 'high')
    """
    cfg = config or GapConfig()
    steps, f, c = _common_series(fp8, control)
    n = len(steps)
    w = _width(n, cfg.smooth)
    gap = relative_gap(f, c)
    smooth = centred_median(_infinite_as_worst(gap), w)
    noise = _noise_unit(gap, c, paired)
    stat_cut = cfg.noise_k * noise if paired else cfg.noise_k * MEDIAN_SE * noise / math.sqrt(w)
    tol = max(stat_cut, cfg.min_gap)
    onset_i = _onset(smooth, tol, w, cfg.sustain)
    phase = _phase(steps, f, c, onset_i, w, cfg.start_fraction) if onset_i is not None else None
    level = _median(gap[onset_i:] if onset_i is not None else gap)
    band_onset: int | None = None
    if onset_i is not None and end_median(gap, w) < cfg.seed_band:
        # Lasting but ending inside the seed band: what two healthy trajectories drift apart by.
        band_onset, onset_i, phase = steps[onset_i], None, None
    z, z_cut = level / noise, tol / noise
    if onset_i is None:
        severity = "none"
    else:
        severity = "high" if (not math.isfinite(z) or z >= 2 * z_cut) else "medium"
    return GapJudgement(
        unit="paired" if paired else "control_noise",
        steps=tuple(steps),
        fp8=tuple(f.tolist()),
        control=tuple(c.tolist()),
        rel_gap=tuple(gap.tolist()),
        smooth_gap=tuple(smooth.tolist()),
        noise=noise,
        tolerance=tol,
        lasting=onset_i is not None,
        onset_step=steps[onset_i] if onset_i is not None else None,
        phase=phase,
        level=level,
        z=z,
        z_cut=z_cut,
        severity=severity,
        smooth=w,
        band_onset_step=band_onset,
        seed_band=cfg.seed_band,
    )


__all__ = [
    "GapConfig",
    "GapJudgement",
    "judge_gap",
    "relative_gap",
    "same_batches",
    "data_fingerprint_of",
    "step_noise",
    "change_point",
    "UNITS",
    "SEVERITIES",
    "DATA_KEY",
]
