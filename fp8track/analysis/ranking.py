"""Which layers does FP8 hurt most? One documented risk score per layer, relative to comparable
tensors of the model's other layers, shared by the sweep's ``auto:K`` fallback and the diagnosis.

No statistic has a universal threshold (an underflow share that is alarming in one model is normal
in another), so each layer is judged against its peers, like with like:

1. **Per-row signals.** Every main row (``actual``, or ``shadow`` for a BF16 layer) gives seven
   larger-is-worse signals (:data:`~fp8track.analysis.risk_signals.SIGNALS`):

   ========================  =====================================================================
   ``rel_error_db``          ``-min(sqnr_db, bulk_sqnr_db)``: quantisation error relative to the
                             tensor's energy, and to the energy *without its largest element*
                             (:func:`~.risk_signals.bulk_sqnr_db`), so one outlier that carries
                             the energy cannot hide that the ordinary elements were flushed
   ``cos_loss``              ``log10(1 - cos)``
   ``underflow_pct``         share of the finite elements flushed to zero, percent
   ``overflow_pct``          share of elements saturated, percent
   ``abs_drift_log2``        ``|scale_drift_log2|``: recipe scale vs the tensor's own, binades
   ``own_shift``             the (layer, tensor)'s strongest lasting worsening against its own
                             history (:func:`~.layer_history.history_shifts`, a z in its own
                             noise unit; 0 if none)
   ``drift_events``          the largest severity of the run's ``drift`` events naming it (0 if none)
   ========================  =====================================================================

2. **Where the layer breaks.** When its own history shifts by more than ``history_z`` the window is
   the steps from that onset on (the layer's own onset, not the loss gap's); otherwise every step.
   Over its window each signal is summarised by its *peak*: the second-largest sample (the largest
   with fewer than 5), so a problem that lasts two samples counts and one odd sample does not.
3. **Like with like.** Signals are compared only within a group of the same tensor kind, element
   format (E4M3 or E5M2, read from the row: ``current_scale * amax`` is the format's maximum, 448
   or 57344, so hybrid's E5M2 gradients losing ~6 dB by format alone are never pooled with E4M3
   tensors) and variant. With a control run (the BF16 control's ``shadow`` rows: what current-
   scaling FP8 would do to the same layer) each signal becomes the *excess* over the same layer's
   peak in the control over the same steps, when every layer of the group has such rows in the same
   format: a layer hard to quantise in every run is the model's property, not this FP8 run's.
4. **Robust z.** Within the group, ``z = (v - median) / max(1.4826 * MAD, floor)`` (floors in
   :data:`~.risk_signals.SIGNAL_FLOORS`, in the signal's units, so a signal on which every layer
   agrees cannot turn tiny differences into huge scores). A (layer, tensor) scores
   ``sum(max(z, 0))``; a layer's risk is the maximum over its tensors, and the tensor that gives it
   is named.
5. **Ties.** Layers are ordered by score, equal scores in model order (never by name); scores
   within :func:`tied` of each other share a rank and are reported as tied.

:func:`outliers` marks layers whose score stands out from the others' by the same robust rule, so a
model whose layers are all alike has none, and says how far each is from the best other layer. A
z-score over a tiny spread is not an outlier: the layer must also be worse than the median of its
group by an amount that matters in absolute terms on a quantisation-error signal
(:data:`MATERIAL_MARGINS`: 6 dB of SQNR, 0.6 decades of ``1 - cos``, one point of underflow or
overflow; :func:`material`). Scale drift and history shifts without an error to show for them
nominate, never decide.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fp8track.analysis.layer_history import HistoryShift, Key, Point, best_shift, layer_series
from fp8track.analysis.risk_signals import (
    ROW_SIGNALS,
    SIGNAL_FLOORS,
    SIGNALS,
    bulk_sqnr_db,
    peak,
    robust_z,
)
from fp8track.numerics.nvfp4 import BLOCK_RANGE_STAT

MATERIAL_MARGINS: Mapping[str, float] = {
    "rel_error_db": 6.0,  # dB: four times the error power of comparable tensors
    "cos_loss": 0.6,  # decades of (1 - cos): the same 6 dB seen through the cosine
    "underflow_pct": 1.0,  # percentage points: E5M2 gradients' natural floor is a few tenths
    "overflow_pct": 1.0,  # percentage points
}
"""How much worse than its group's median a layer's error must be, in the signal's units, to be
an outlier (:func:`material`): the error signals only (drift and history shifts matter through the
error they cause)."""

HISTORY_Z = 4.0
"""An own-history shift above this z sets the layer's window (step 2 of the docstring)."""

TIE_ABS, TIE_REL = 0.5, 0.1
"""Scores within ``max(TIE_ABS, TIE_REL * larger)`` of each other are tied."""


@dataclass(frozen=True)
class LayerRisk:
    """One layer's place in the ranking.

    Attributes:
        layer: the module's qualified name.
        score: ``max`` over its tensors of ``sum(max(z, 0))`` over :data:`SIGNALS` (unitless, >= 0).
        tensor: the tensor kind that gives the score.
        z: per-signal z-scores of that tensor (within its group).
        stats: per tensor kind, the statistics over its window (median over the window's samples;
            ``overflow_pct`` and, on block rows, ``max_blockwise_dynamic_range`` the max), plus
            ``steps`` (samples in the window), ``onset`` and ``fmt``.
        rank: 1-based; tied layers share a rank.
        tied: the other layers with the same rank.
        onset: first step of the window of the scoring tensor (its own-history onset), or ``None``
            when the window is the whole run.
        fmt: element format of the scoring tensor (``"e4m3"``, ``"e5m2"`` or ``"?"``).
        excess: True when the signals were taken as the excess over the control's shadow rows.
        margin: per signal of the scoring tensor, its peak minus the median peak of its group, in
            the signal's units (the absolute counterpart of ``z``; :func:`material`).
    """

    layer: str
    score: float
    tensor: str
    z: Mapping[str, float] = field(default_factory=dict)
    stats: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    rank: int = 1
    tied: tuple[str, ...] = ()
    onset: int | None = None
    fmt: str = "?"
    excess: bool = False
    margin: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "score": self.score,
            "tensor": self.tensor,
            "z": dict(self.z),
            "stats": {t: dict(s) for t, s in self.stats.items()},
            "rank": self.rank,
            "tied": list(self.tied),
            "onset": self.onset,
            "fmt": self.fmt,
            "excess_over_control": self.excess,
            "margin": dict(self.margin),
        }


def tied(a: float, b: float) -> bool:
    """Two scores are tied within ``max(TIE_ABS, TIE_REL * max(a, b))``."""
    return abs(a - b) <= max(TIE_ABS, TIE_REL * max(abs(a), abs(b)))


# --- the ranking -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Summary:
    peaks: dict[str, float]
    stats: dict[str, float]
    fmt: str
    variant: str
    onset: int | None


def _summarise(points: Sequence[Point], shift: HistoryShift | None, history_z: float,
               start: int | None, drift: Mapping[Key, Sequence[tuple[int, float]]], key: Key) -> _Summary:
    """Peaks of the signals and median statistics over the window from ``start`` (or the own onset)."""
    onset = (
        start if start is not None else (shift.step if shift is not None and shift.z > history_z else None)
    )
    win = [p for p in points if onset is None or p.step >= onset] or list(points)
    peaks = {s: peak([p.sig[s] for p in win]) for s in ROW_SIGNALS}
    peaks["own_shift"] = max(shift.z, 0.0) if shift is not None else 0.0
    first = win[0].step
    peaks["drift_events"] = max((sev for step, sev in drift.get(key, ()) if step >= first), default=0.0)
    col = {name: [float(p.stats.get(name, math.nan)) for p in win] for name in
           ("sqnr_db", "cos", "underflow_pct", "overflow_pct", "mse", "amax")}
    stats = {name: _median(vals) for name, vals in col.items()}
    stats["overflow_pct"] = max((v for v in col["overflow_pct"] if math.isfinite(v)), default=math.nan)
    stats["abs_drift_log2"] = _median([p.sig["abs_drift_log2"] for p in win])
    stats["bulk_sqnr_db"] = _median([bulk_sqnr_db(p.stats) for p in win])
    # Block rows' TE LogTensorStats statistic, shown beside the signals (max, as TE reduces it).
    ranges = [v for p in win if math.isfinite(v := float(p.stats.get(BLOCK_RANGE_STAT, math.nan)))]
    if ranges:
        stats[BLOCK_RANGE_STAT] = max(ranges)
    stats["steps"] = float(len(win))
    fmts = [p.fmt for p in win if p.fmt != "?"]
    return _Summary(peaks, stats, max(set(fmts), key=fmts.count) if fmts else "?", win[0].variant, onset)


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


def _drift_by_key(events: Iterable[Any]) -> dict[Key, list[tuple[int, float]]]:
    """``(step, severity)`` of the run's own ``drift`` events per (layer, tensor); events are
    ``(kind, step, data)`` tuples or records with those attributes."""
    out: dict[Key, list[tuple[int, float]]] = {}
    for ev in events:
        kind, step, data = ev if isinstance(ev, tuple) else (ev.kind, ev.step, ev.data)
        if kind != "drift" or not isinstance(data, Mapping) or data.get("source", "recipe") != "recipe":
            continue
        sev = data.get("severity")
        if isinstance(sev, (int, float)) and math.isfinite(sev):
            out.setdefault((str(data.get("layer")), str(data.get("tensor"))), []).append(
                (int(step), float(sev))
            )
    return out


def rank_layers(
    rows: Iterable[Any],
    tensors: Sequence[str] | None = None,
    *,
    control: Iterable[Any] | None = None,
    events: Iterable[Any] = (),
    history_z: float = HISTORY_Z,
    start: int | None = None,
    variant: str | None = None,
) -> list[LayerRisk]:
    """Every monitored layer with its risk score (module docstring), riskiest first.

    Args:
        rows: tensor-statistics rows of one run (any number of steps); what-if rows are ignored
            unless ``variant`` names them.
        tensors: restrict to these tensor kinds (default: every kind present).
        control: the BF16 control's rows: signals become the excess over its shadow rows (step 3).
        events: the run's recorded events (``drift`` events naming a layer add evidence).
        history_z: an own-history shift above this sets the layer's window (step 2).
        start: one window start for every layer instead of their own onsets (``None``: own onsets).
        variant: rank what a what-if recipe would do instead (``"nvfp4"``: the run's ``nvfp4`` and
            ``nvfp4_columnwise`` rows, e.g. of a BF16 control recorded with ``whatif=["nvfp4"]``);
            the main rows (``actual``/``shadow``) are then ignored, never mixed in.
    """
    series = layer_series(rows, variant)
    if tensors is not None:
        series = {k: v for k, v in series.items() if k[1] in tensors}
    if not series:
        return []
    drift = _drift_by_key(events)
    summ = {
        k: _summarise(pts, best_shift(k, pts, 3), history_z, start, drift, k) for k, pts in series.items()
    }
    ctl_series = layer_series(control) if control is not None else {}
    ctl_summ: dict[Key, _Summary] = {}
    for k, s in summ.items():
        pts = ctl_series.get(k)
        if pts:
            # The control over the same steps as this layer's window, and its own shifts there.
            ctl_summ[k] = _summarise(pts, best_shift(k, pts, 3), math.inf, s.onset, {}, k)

    groups: dict[tuple[str, str, str], list[Key]] = {}
    for k, s in summ.items():
        groups.setdefault((k[1], s.fmt, s.variant), []).append(k)
    scored: dict[Key, tuple[float, dict[str, float], bool, dict[str, float]]] = {}
    for keys in groups.values():
        excess = bool(ctl_summ) and all(k in ctl_summ and ctl_summ[k].fmt == summ[k].fmt for k in keys)
        z_by_signal, margin_by_signal = {}, {}
        for sig in SIGNALS:
            vals = [
                _minus(summ[k].peaks[sig], ctl_summ[k].peaks[sig]) if excess else summ[k].peaks[sig]
                for k in keys
            ]
            z_by_signal[sig] = robust_z(vals, SIGNAL_FLOORS[sig])
            margin_by_signal[sig] = _margins(vals)
        for i, k in enumerate(keys):
            z = {sig: z_by_signal[sig][i] for sig in SIGNALS}
            margin = {sig: margin_by_signal[sig][i] for sig in MATERIAL_MARGINS}
            scored[k] = (sum(max(v, 0.0) for v in z.values() if math.isfinite(v)), z, excess, margin)

    order: dict[str, int] = {}
    for k in series:
        order.setdefault(k[0], len(order))
    best: dict[str, Key] = {}
    for k, (score, *_) in scored.items():
        if k[0] not in best or score > scored[best[k[0]]][0]:
            best[k[0]] = k
    risks = []
    for layer, k in best.items():
        score, z, excess, margin = scored[k]
        stats = {kk[1]: {**summ[kk].stats, "onset": summ[kk].onset, "fmt": summ[kk].fmt}
                 for kk in series if kk[0] == layer}
        risks.append(LayerRisk(layer, score, k[1], z, stats, onset=summ[k].onset, fmt=summ[k].fmt,
                               excess=excess, margin=margin))
    risks.sort(key=lambda r: (-r.score, order[r.layer]))
    return _with_ranks(risks)


def _margins(values: Sequence[float]) -> list[float]:
    """Each value minus the median of the finite ones (+-inf clipped to the finite range, as
    :func:`robust_z` does); NaN stays NaN."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return [math.nan] * len(values)
    lo, hi, med = min(finite), max(finite), float(np.median(finite))
    return [math.nan if math.isnan(v) else min(max(v, lo), hi) - med for v in values]


def _minus(a: float, b: float) -> float:
    """``a - b`` where both are finite; otherwise ``a`` (an exact or missing control says nothing)."""
    return a - b if math.isfinite(a) and math.isfinite(b) else a


def _with_ranks(risks: Sequence[LayerRisk]) -> list[LayerRisk]:
    """Ranks with ties: a layer tied with the one before it (:func:`tied`) shares its rank."""
    ranks: list[int] = []
    for i, r in enumerate(risks):
        ranks.append(ranks[-1] if i and tied(risks[i - 1].score, r.score) else i + 1)
    out = []
    for i, r in enumerate(risks):
        mates = tuple(o.layer for j, o in enumerate(risks) if j != i and ranks[j] == ranks[i])
        out.append(replace(r, rank=ranks[i], tied=mates))
    return out


def outliers(
    ranking: Sequence[LayerRisk], z_threshold: float = 3.5, min_score: float = 3.0
) -> list[LayerRisk]:
    """Layers whose risk score stands out from the other layers' scores: robust z of the score
    above ``z_threshold`` (3.5, the usual modified-z cut-off) *and* a score of at least
    ``min_score`` (one signal three robust deviations worse than the typical comparable tensor),
    so a model whose layers are all alike has none. With a control, the scores are already the
    excess over the control (:func:`rank_layers`). The layer's error must also be worse than its
    group's by an amount that matters (:func:`material`)."""
    if len(ranking) < 3:
        return []
    z = robust_z([r.score for r in ranking], floor=1.0)
    return [r for r, zi in zip(ranking, z, strict=True)
            if zi > z_threshold and r.score >= min_score and material(r)]


def material(risk: LayerRisk) -> bool:
    """Whether the layer's scoring tensor is worse than the median of its group by at least
    :data:`MATERIAL_MARGINS` on some quantisation-error signal (its ``margin``). A risk built
    without margins (by hand) counts as material."""
    if not risk.margin:
        return True
    return any(
        math.isfinite(m := risk.margin.get(sig, math.nan)) and m >= floor
        for sig, floor in MATERIAL_MARGINS.items()
    )


def separation(risk: LayerRisk, ranking: Sequence[LayerRisk], others: Sequence[LayerRisk] = ()) -> float:
    """How far ``risk`` stands above the best layer that is not itself among ``others`` (the other
    outliers): ``score / max(that score, 1)``. Near 1 is a near tie, not a clear outlier."""
    skip = {risk.layer, *(o.layer for o in others)}
    rest = max((r.score for r in ranking if r.layer not in skip), default=0.0)
    return risk.score / max(rest, 1.0)


__all__ = [
    "MATERIAL_MARGINS",
    "HISTORY_Z",
    "LayerRisk",
    "tied",
    "rank_layers",
    "outliers",
    "material",
    "separation",
]
