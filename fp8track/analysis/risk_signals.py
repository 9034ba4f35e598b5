"""The per-row signals of the layer risk score (:mod:`fp8track.analysis.ranking`, step 1 of its
docstring) and the robust statistics the score is built from.

Every main row (``actual``, or ``shadow`` for a BF16 layer) gives the five :data:`ROW_SIGNALS`
(:func:`row_signals`), each larger-is-worse; the relative error takes the worse of the tensor's
SQNR and the SQNR of its ordinary elements (:func:`bulk_sqnr_db`), so one outlier that carries
the energy cannot hide that the others were flushed. :func:`element_format` reads a row's element
format back from its statistics (like with like); :func:`robust_z` and :func:`peak` are the
robust z-score and the peak over a window the ranking uses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fp8track.analysis.windows import MAD_TO_SIGMA
from fp8track.errors import ConfigError
from fp8track.numerics.formats import get_format

SIGNALS: tuple[str, ...] = (
    "rel_error_db",
    "cos_loss",
    "underflow_pct",
    "overflow_pct",
    "abs_drift_log2",
    "own_shift",
    "drift_events",
)
"""The per-tensor signals of the risk score, each larger-is-worse (the table of
:mod:`fp8track.analysis.ranking`'s docstring)."""

ROW_SIGNALS: tuple[str, ...] = SIGNALS[:5]
"""The signals one row's statistics give (the others come from the row series and the events)."""

SIGNAL_FLOORS: Mapping[str, float] = {
    "rel_error_db": 1.0,  # dB: SQNR differences under ~1 dB are within sampling noise
    "cos_loss": 0.25,  # decades of (1 - cos)
    "underflow_pct": 0.5,  # percentage points
    # percentage points, as underflow: delayed scaling saturates a few elements routinely
    "overflow_pct": 0.5,
    "abs_drift_log2": 0.5,  # half a binade
    "own_shift": 2.0,  # a history z: shifts of a few own-noise units are ordinary training drift
    "drift_events": 1.0,  # severity is |peak drift| / threshold (>= 1 when an event fired)
}
"""Lower bound of the robust scale per signal, in the signal's units (step 4 of the ranking's docstring)."""

PEAK_MIN_SAMPLES = 5
"""From this many samples on, the peak is the second-largest sample (step 2 of the ranking's docstring)."""

E5M2_MIN_LOG2 = 12.0
"""``log2(current_scale * amax)`` is log2(448) = 8.8 for E4M3 and log2(57344) = 15.8 for E5M2 (less
the margin); the midpoint tells them apart."""


def element_format(stats: Mapping[str, float]) -> str:
    """``"e4m3"`` or ``"e5m2"`` from a row's ``current_scale * amax`` (the format's maximum less
    the margin, :data:`E5M2_MIN_LOG2`), ``"?"`` when either is missing or zero."""
    cur, amax = float(stats.get("current_scale", math.nan)), float(stats.get("amax", math.nan))
    if not (math.isfinite(cur) and math.isfinite(amax)) or cur <= 0 or amax <= 0:
        return "?"
    if abs(math.log2(cur * amax) - math.log2(6.0)) < 1e-3:  # NVFP4's E2M1
        return "e2m1"
    return "e5m2" if math.log2(cur * amax) >= E5M2_MIN_LOG2 else "e4m3"


BULK_MIN_SHARE = 1e-5
"""The energy without the largest element is trusted from this share of the total on: the kernel
sums rows of squares in float32 (~1e-7 relative), so a smaller remainder is rounding."""

FLUSHED_MAJORITY_PCT = 50.0
"""From this underflow share on, the tensor's median element is flushed (:func:`bulk_sqnr_db`)."""

ROUNDING_SQNR_DB: Mapping[str, float] = {"e4m3": 31.5, "e5m2": 25.5}
"""The SQNR rounding alone gives ordinary (Gaussian-like) elements in each format: about 6 dB per
mantissa bit (3 and 2), measured 31.5 and 25.5 dB (docs/statistics.md)."""

HIDDEN_MARGIN_DB = 10.0
"""Ordinary elements cannot read more than this above their format's :data:`ROUNDING_SQNR_DB`: their
rounding error alone is ten times larger. An SQNR of "the elements besides the largest" above it is
that of a few more outliers, exact at the scale they set, which hide the ordinary elements as the
largest one did (:func:`bulk_sqnr_db`)."""


def largest_element_error(stats: Mapping[str, float]) -> float:
    """Squared quantisation error of the tensor's largest element, ``(amax - q(amax))^2``, from the
    row's ``amax``, ``scale`` and element format alone: the largest element *is* ``+-amax``, so its
    rounding (saturating at the format's maximum, as the kernel does) can be redone exactly. NaN when
    the row lacks one of them, and for NVFP4 rows (E2M1): their ``scale`` is the extreme block scale,
    not the one of the largest element's block (and torch cannot cast to its packed dtype)."""
    amax, scale = float(stats.get("amax", math.nan)), float(stats.get("scale", math.nan))
    fmt = element_format(stats)
    if fmt in ("?", "e2m1") or not (math.isfinite(amax) and math.isfinite(scale)) or scale <= 0:
        return math.nan
    f = get_format(fmt)
    v = torch.tensor(amax, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)
    q = float(v.clamp(max=f.max).to(f.dtype).to(torch.float32)) / scale
    return (amax - q) ** 2


def nonzero_underflow_pct(stats: Mapping[str, float]) -> float:
    """The share of the tensor's *nonzero* elements that underflowed, in percent: ``underflow_pct``
    (counted over all finite elements) over the nonzero share ``100 - zero_pct``. A post-ReLU input
    with half its elements exactly zero reads at most 50 % ``underflow_pct`` even when every nonzero
    element flushed. Rows without ``zero_pct`` (recorded before it existed) give ``underflow_pct``."""
    under = float(stats.get("underflow_pct", math.nan))
    zero = float(stats.get("zero_pct", math.nan))
    if not (math.isfinite(under) and math.isfinite(zero)) or zero >= 100.0:
        return under
    return min(100.0, 100.0 * under / (100.0 - zero))


def bulk_sqnr_db(stats: Mapping[str, float]) -> float:
    """SQNR of the tensor's ordinary elements, those besides its largest one, in dB; NaN when the
    row does not tell.

    * From the energies: ``10 log10((E - amax^2) / (err - e_max))``, with ``E = sum x^2`` and
      ``err = sum (x - q(x))^2`` recovered from the row's ``mse`` (``err / n``), ``sqnr_db`` and
      ``numel`` (``n`` = finite elements), and ``e_max`` the largest element's own error
      (:func:`largest_element_error`; 0 when the row lacks its scale, which charges all of the
      error to the others: pessimistic). Only when both remainders are at least
      :data:`BULK_MIN_SHARE` of their totals (below, they are float32 rounding of the kernel's sums).
    * When at least half of the nonzero elements are flushed (:func:`nonzero_underflow_pct` >= 50):
      ``10 log10(100 / u)`` dB, the SQNR the ordinary elements have if the flushed share ``u``
      carried its share of their energy (3 dB at 50 %, 0.07 dB at 98.5 %): the worst case a count
      allows, for when the energies cannot tell.

    The energies tell when they were resolved and read at most :data:`HIDDEN_MARGIN_DB` above the
    format's :data:`ROUNDING_SQNR_DB`: then they are the ordinary elements' own, and the count is
    not used. A flushed majority costs the energy its flushed elements carried, which the count
    alone does not know: a gradient spanning many decades (log-normal magnitudes, a softmax's
    probabilities) flushes 35-99 % of its elements at 25-35 dB, and its GEMMs are as exact as a
    Gaussian's (relative error 0.02-0.05 against float32), while a Gaussian bulk flushed by a
    majority reads under 9 dB from its energies alone. Otherwise (no energies, float32 could not
    resolve them, or they read above that ceiling: a few more outliers, exact at the scale they
    set, hide the ordinary elements as the largest one did; an element format other than E4M3 and
    E5M2) the smaller of the two applies.
    """
    mse, sqnr, amax = (float(stats.get(k, math.nan)) for k in ("mse", "sqnr_db", "amax"))
    numel, under = float(stats.get("numel", math.nan)), nonzero_underflow_pct(stats)
    flushed = (
        10.0 * math.log10(100.0 / under)
        if math.isfinite(under) and under >= FLUSHED_MAJORITY_PCT
        else math.nan
    )
    energy = math.nan
    if all(math.isfinite(v) for v in (mse, amax, numel, sqnr)) and numel > 1 and mse > 0:
        n = numel * (1.0 - float(stats.get("nonfinite_pct", 0.0) or 0.0) / 100.0)
        err = mse * n
        total = err * 10.0 ** (sqnr / 10.0)
        own = largest_element_error(stats)
        bulk, bulk_err = total - amax * amax, err - (own if math.isfinite(own) else 0.0)
        if bulk >= BULK_MIN_SHARE * total and bulk_err >= BULK_MIN_SHARE * err:
            energy = 10.0 * math.log10(bulk / bulk_err)
    ceiling = ROUNDING_SQNR_DB.get(element_format(stats), -math.inf) + HIDDEN_MARGIN_DB
    if math.isfinite(energy) and energy <= ceiling:
        return energy
    vals = [v for v in (energy, flushed) if not math.isnan(v)]
    return min(vals) if vals else math.nan


def row_signals(stats: Mapping[str, float]) -> dict[str, float]:
    """The :data:`ROW_SIGNALS` of one step's statistics (one :class:`TensorStatsRow`'s ``stats``)."""
    sqnr = float(stats.get("sqnr_db", math.nan))
    bulk = bulk_sqnr_db(stats)
    worst = min(sqnr, bulk) if not math.isnan(bulk) else sqnr
    cos = float(stats.get("cos", math.nan))
    one_minus_cos = 1.0 - cos if math.isfinite(cos) else math.nan
    return {
        # An exact quantisation (sqnr = inf) is the best possible: -inf, clipped by robust_z.
        "rel_error_db": -worst if not math.isnan(worst) else math.nan,
        "cos_loss": math.log10(max(one_minus_cos, 1e-12)) if math.isfinite(one_minus_cos) else math.nan,
        "underflow_pct": float(stats.get("underflow_pct", math.nan)),
        "overflow_pct": float(stats.get("overflow_pct", math.nan)),
        "abs_drift_log2": abs(float(stats.get("scale_drift_log2", math.nan))),
    }


def robust_z(values: Sequence[float], floor: float) -> list[float]:
    """``(v - median) / max(1.4826 * MAD, floor)`` over the finite values; NaN stays NaN, +-inf
    is clipped to the finite range's extremes (an exact tensor is simply the best)."""
    if floor <= 0:
        raise ConfigError(f"floor must be > 0, got {floor!r}")
    finite = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    if finite.size == 0:
        return [math.nan] * len(values)
    lo, hi = float(finite.min()), float(finite.max())
    med = float(np.median(finite))
    scale = max(MAD_TO_SIGMA * float(np.median(np.abs(finite - med))), floor)
    return [math.nan if math.isnan(v) else (min(max(v, lo), hi) - med) / scale for v in values]


def peak(values: Sequence[float]) -> float:
    """The second-largest finite value (the largest with fewer than :data:`PEAK_MIN_SAMPLES`);
    ``+inf`` counts as the largest finite value's ceiling, NaN is skipped."""
    v = sorted(x for x in values if not math.isnan(x))
    if not v:
        return math.nan
    return v[-2] if len(v) >= PEAK_MIN_SAMPLES else v[-1]

