"""Which layers does FP8 hurt most? One documented risk score per layer, relative to the model's
other layers, shared by the sweep's ``auto:K`` fallback and the diagnosis's layer ranking.

No statistic has a universal threshold (an underflow share that is alarming in one model is normal
in another), so each layer is judged against its peers in the same run:

1. For every (layer, tensor) the statistics of the ``actual`` (or ``shadow``) rows are summarised
   over the sampled steps by their median (robust to one odd step) and, for overflow, by their
   maximum (one saturating step already loses information).
2. Five *signals* per (layer, tensor), each oriented so that larger is worse:

   ========================  =====================================================================
   ``rel_error_db``          ``-sqnr_db``: quantisation error relative to the tensor's own energy
                             (raw MSE scales with the tensor's magnitude and is not comparable
                             across layers; SQNR is)
   ``cos_loss``              ``-log10(max(1 - cos, 1e-12))`` negated, i.e. ``log10(1 - cos)``
   ``underflow_pct``         share of nonzero elements flushed to zero, percent
   ``overflow_pct``          share of elements saturated, percent (max over steps)
   ``abs_drift_log2``        ``|scale_drift_log2|``: how far the recipe's scale is from the
                             tensor's current scale, binades
   ========================  =====================================================================

3. Each signal becomes a robust z-score across all (layer, tensor) pairs of the run:
   ``z = (v - median) / max(1.4826 * MAD, floor)``, where ``floor`` keeps a signal on which every
   layer agrees (MAD = 0, e.g. no overflow anywhere) from turning tiny differences into huge scores
   (floors in :data:`SIGNAL_FLOORS`, in the signal's own units).
4. A (layer, tensor) scores ``sum(max(z, 0))`` over the signals; a layer's risk is the maximum over
   its tensors (one badly quantised tensor is enough to hurt), and the tensor that gives it is named.

The score is unitless: 0 means "no worse than the typical layer of this model" on every signal.
:func:`outliers` marks layers whose score stands out from the others' scores by the same robust
rule, so a model where every layer is equally fine yields no outlier.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fp8track.analysis.windows import MAD_TO_SIGMA
from fp8track.errors import ConfigError
from fp8track.monitoring.records import TensorStatsRow

SIGNALS: tuple[str, ...] = ("rel_error_db", "cos_loss", "underflow_pct", "overflow_pct", "abs_drift_log2")
"""The five per-tensor signals of the risk score, each larger-is-worse (module docstring)."""

SIGNAL_FLOORS: Mapping[str, float] = {
    "rel_error_db": 1.0,  # dB: SQNR differences under ~1 dB are within sampling noise
    "cos_loss": 0.25,  # decades of (1 - cos)
    "underflow_pct": 0.5,  # percentage points
    "overflow_pct": 0.01,  # percentage points: any real saturation stands out
    "abs_drift_log2": 0.5,  # half a binade
}
"""Lower bound of the robust scale per signal, in the signal's units (step 3 of the docstring)."""

MAIN_VARIANTS = ("actual", "shadow")


@dataclass(frozen=True)
class LayerRisk:
    """One layer's place in the ranking.

    Attributes:
        layer: the module's qualified name.
        score: ``max`` over its tensors of ``sum(max(z, 0))`` over :data:`SIGNALS` (unitless, >= 0).
        tensor: the tensor kind that gives the score.
        z: per-signal z-scores of that tensor.
        stats: per tensor kind, the summarised statistics behind the signals (median over steps;
            ``overflow_pct`` is the max), plus ``steps`` (sampled steps seen).
    """

    layer: str
    score: float
    tensor: str
    z: Mapping[str, float] = field(default_factory=dict)
    stats: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "score": self.score, "tensor": self.tensor, "z": dict(self.z),
                "stats": {t: dict(s) for t, s in self.stats.items()}}


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


def summarise(rows: Iterable[TensorStatsRow]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (layer, tensor): statistics of the main rows (``actual``/``shadow``) summarised over steps."""
    grouped: dict[tuple[str, str], list[Mapping[str, float]]] = {}
    for r in rows:
        if r.variant in MAIN_VARIANTS:
            grouped.setdefault((r.layer, r.tensor), []).append(r.stats)
    out: dict[tuple[str, str], dict[str, float]] = {}
    for key, stats in grouped.items():
        col = {name: [float(s.get(name, math.nan)) for s in stats] for name in
               ("sqnr_db", "cos", "underflow_pct", "overflow_pct", "scale_drift_log2", "mse", "amax")}
        out[key] = {
            "sqnr_db": _median(col["sqnr_db"]),
            "cos": _median(col["cos"]),
            "underflow_pct": _median(col["underflow_pct"]),
            "overflow_pct": max((v for v in col["overflow_pct"] if math.isfinite(v)), default=math.nan),
            "abs_drift_log2": _median([abs(v) for v in col["scale_drift_log2"]]),
            "mse": _median(col["mse"]),
            "amax": _median(col["amax"]),
            "steps": float(len(stats)),
        }
    return out


def signals(summary: Mapping[str, float]) -> dict[str, float]:
    """The five larger-is-worse signals of one summarised (layer, tensor)."""
    sqnr = summary["sqnr_db"]
    one_minus_cos = 1.0 - summary["cos"] if math.isfinite(summary["cos"]) else math.nan
    return {
        # An exact quantisation (sqnr = inf) is the best possible: -inf, clipped below by the median.
        "rel_error_db": -sqnr if not math.isnan(sqnr) else math.nan,
        "cos_loss": math.log10(max(one_minus_cos, 1e-12)) if math.isfinite(one_minus_cos) else math.nan,
        "underflow_pct": summary["underflow_pct"],
        "overflow_pct": summary["overflow_pct"],
        "abs_drift_log2": summary["abs_drift_log2"],
    }


def row_signals(stats: Mapping[str, float]) -> dict[str, float]:
    """The five signals of one step's statistics (one :class:`TensorStatsRow`'s ``stats``)."""
    return signals({
        "sqnr_db": float(stats.get("sqnr_db", math.nan)),
        "cos": float(stats.get("cos", math.nan)),
        "underflow_pct": float(stats.get("underflow_pct", math.nan)),
        "overflow_pct": float(stats.get("overflow_pct", math.nan)),
        "abs_drift_log2": abs(float(stats.get("scale_drift_log2", math.nan))),
    })


def robust_z(values: Sequence[float], floor: float) -> list[float]:
    """``(v - median) / max(1.4826 * MAD, floor)`` over the finite values; NaN stays NaN, +-inf
    becomes +-inf-clipped to the finite range's extremes (an exact tensor is simply the best)."""
    if floor <= 0:
        raise ConfigError(f"floor must be > 0, got {floor!r}")
    finite = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    if finite.size == 0:
        return [math.nan] * len(values)
    lo, hi = float(finite.min()), float(finite.max())
    med = float(np.median(finite))
    scale = max(MAD_TO_SIGMA * float(np.median(np.abs(finite - med))), floor)
    out = []
    for v in values:
        if math.isnan(v):
            out.append(math.nan)
        else:
            out.append((min(max(v, lo), hi) - med) / scale)
    return out


def rank_layers(rows: Iterable[TensorStatsRow], tensors: Sequence[str] | None = None) -> list[LayerRisk]:
    """Every monitored layer with its risk score (module docstring), riskiest first.

    Args:
        rows: tensor-statistics rows of one run (any number of steps); what-if rows are ignored.
        tensors: restrict to these tensor kinds (default: every kind present).

    Ties are broken by layer name, so the order is deterministic.
    """
    summary = summarise(rows)
    if tensors is not None:
        summary = {k: v for k, v in summary.items() if k[1] in tensors}
    keys = sorted(summary)
    if not keys:
        return []
    sig = {k: signals(summary[k]) for k in keys}
    z_by_signal = {s: robust_z([sig[k][s] for k in keys], SIGNAL_FLOORS[s]) for s in SIGNALS}
    per_key: dict[tuple[str, str], tuple[float, dict[str, float]]] = {}
    for i, k in enumerate(keys):
        z = {s: z_by_signal[s][i] for s in SIGNALS}
        per_key[k] = (sum(max(v, 0.0) for v in z.values() if math.isfinite(v)), z)
    layers: dict[str, LayerRisk] = {}
    for (layer, tensor), (score, z) in per_key.items():
        best = layers.get(layer)
        stats = dict(best.stats) if best else {}
        stats[tensor] = summary[(layer, tensor)]
        if best is None or score > best.score:
            layers[layer] = LayerRisk(layer, score, tensor, z, stats)
        else:
            layers[layer] = LayerRisk(layer, best.score, best.tensor, best.z, stats)
    return sorted(layers.values(), key=lambda r: (-r.score, r.layer))


def outliers(
    ranking: Sequence[LayerRisk],
    z_threshold: float = 3.5,
    min_score: float = 3.0,
    control: Sequence[LayerRisk] | None = None,
) -> list[LayerRisk]:
    """Layers whose risk score stands out from the other layers' scores: robust z of the score
    above ``z_threshold`` (3.5, the usual modified-z cut-off) *and* a score of at least
    ``min_score`` (one signal three robust deviations worse than the typical layer), so a model
    whose layers are all alike has none.

    With ``control`` (the ranking of the BF16 control's shadow rows, i.e. what FP8 would do to the
    control's tensors) a layer also has to stand out *more* than it does there, by at least
    ``min_score``: a layer that is hard to quantise in every run is a property of the model, not
    of this FP8 run."""
    if len(ranking) < 3:
        return []
    scores = [r.score for r in ranking]
    z = robust_z(scores, floor=1.0)
    ref = {r.layer: r.score for r in control or ()}
    return [
        r for r, zi in zip(ranking, z, strict=True)
        if zi > z_threshold and r.score >= min_score and r.score - ref.get(r.layer, 0.0) >= min_score
    ]


@dataclass(frozen=True)
class HistoryShift:
    """A lasting change in one layer's statistics against its own history.

    Attributes:
        layer, tensor: where.
        signal: which of :data:`SIGNALS` changed.
        step: first sampled step of the changed segment (the onset).
        before, after: the signal's median before / from the onset on (signal units).
        z: ``(after - before) / max(1.4826 * pooled MAD, floor)``, larger is worse.
    """

    layer: str
    tensor: str
    signal: str
    step: int
    before: float
    after: float
    z: float

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "tensor": self.tensor, "signal": self.signal, "step": self.step,
                "before": self.before, "after": self.after, "z": self.z}


def history_shifts(rows: Iterable[TensorStatsRow], min_segment: int = 3) -> list[HistoryShift]:
    """Per (layer, tensor), the strongest lasting worsening of a signal against its own history.

    For each signal's per-step series (main rows, sorted by step) every split leaving at least
    ``min_segment`` samples on each side is tried; the split's score is the difference of the
    segment medians over the pooled robust scale of the residuals around them (floored by
    :data:`SIGNAL_FLOORS`, so a flat series cannot yield a huge z). The best split per
    (layer, tensor) is returned, strongest first; series shorter than ``2 * min_segment`` are skipped.
    """
    series: dict[tuple[str, str], list[tuple[int, dict[str, float]]]] = {}
    for r in rows:
        if r.variant in MAIN_VARIANTS:
            series.setdefault((r.layer, r.tensor), []).append((int(r.step), row_signals(r.stats)))
    out: list[HistoryShift] = []
    for (layer, tensor), points in series.items():
        points.sort(key=lambda p: p[0])
        if len(points) < 2 * min_segment:
            continue
        steps = [p[0] for p in points]
        best: HistoryShift | None = None
        for sig in SIGNALS:
            v = np.array([p[1][sig] for p in points], dtype=np.float64)
            if not np.isfinite(v).all():
                finite = v[np.isfinite(v)]
                if finite.size == 0:
                    continue
                v = np.clip(np.nan_to_num(v, nan=float(np.median(finite))), finite.min(), finite.max())
            for k in range(min_segment, len(v) - min_segment + 1):
                a, b = v[:k], v[k:]
                ma, mb = float(np.median(a)), float(np.median(b))
                resid = np.concatenate([a - ma, b - mb])
                scale = max(MAD_TO_SIGMA * float(np.median(np.abs(resid))), SIGNAL_FLOORS[sig])
                z = (mb - ma) / scale
                if best is None or z > best.z:
                    best = HistoryShift(layer, tensor, sig, steps[k], ma, mb, z)
        if best is not None:
            out.append(best)
    return sorted(out, key=lambda h: (-h.z, h.layer, h.tensor))


__all__ = [
    "SIGNALS",
    "SIGNAL_FLOORS",
    "LayerRisk",
    "HistoryShift",
    "summarise",
    "signals",
    "row_signals",
    "robust_z",
    "rank_layers",
    "outliers",
    "history_shifts",
]
