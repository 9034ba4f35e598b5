"""Each (layer, tensor)'s series of signals, and its lasting shifts against its own history
(step 2 of :mod:`fp8track.analysis.ranking`'s docstring: where a layer breaks).

:func:`layer_series` groups a run's main rows (or one what-if variant's) per (layer, tensor),
sorted by step, each sample with its :func:`~fp8track.analysis.risk_signals.row_signals`;
:func:`history_shifts` finds each series' strongest lasting worsening (an L1 change point).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8track.analysis.risk_signals import ROW_SIGNALS, SIGNAL_FLOORS, element_format, row_signals
from fp8track.analysis.windows import MAD_TO_SIGMA

MAIN_VARIANTS = ("actual", "shadow")
# The column-wise copies of block recipes (the dgrad/wgrad operands, TE's ``_columnwise``
# statistics) are ranked as tensors of their own, ``<tensor>_columnwise``, beside the row-wise ones.
COLUMNWISE_VARIANTS = tuple(f"{v}_columnwise" for v in MAIN_VARIANTS)

Key = tuple[str, str]


@dataclass(frozen=True)
class Point:
    """One step of a (layer, tensor)'s series: its signals, statistics, element format and variant."""

    step: int
    sig: Mapping[str, float]
    stats: Mapping[str, float]
    fmt: str
    variant: str


def layer_series(rows: Iterable[Any], variant: str | None = None) -> dict[Key, list[Point]]:
    """Main rows per (layer, tensor), sorted by step, in first-seen (model) order; with ``variant``
    that what-if variant's rows (and its ``_columnwise`` rows) instead, and no others."""
    main = MAIN_VARIANTS if variant is None else (variant,)
    columnwise = COLUMNWISE_VARIANTS if variant is None else (f"{variant}_columnwise",)
    out: dict[Key, list[Point]] = {}
    for r in rows:
        if r.variant in main:
            out.setdefault((r.layer, r.tensor), []).append(
                Point(int(r.step), row_signals(r.stats), r.stats, element_format(r.stats), r.variant))
        elif r.variant in columnwise:  # a tensor of its own
            out.setdefault((r.layer, f"{r.tensor}_columnwise"), []).append(Point(
                int(r.step), row_signals(r.stats), r.stats, element_format(r.stats),
                r.variant.removesuffix("_columnwise")))
    for pts in out.values():
        pts.sort(key=lambda p: p.step)
    return out


@dataclass(frozen=True)
class HistoryShift:
    """A lasting change in one layer's statistics against its own history.

    Attributes:
        layer, tensor: where.
        signal: which of :data:`ROW_SIGNALS` changed.
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


def best_shift(key: Key, points: Sequence[Point], min_segment: int) -> HistoryShift | None:
    if len(points) < 2 * min_segment:
        return None
    steps = [p.step for p in points]
    best: HistoryShift | None = None
    for sig in ROW_SIGNALS:
        v = np.array([p.sig[sig] for p in points], dtype=np.float64)
        if not np.isfinite(v).all():
            finite = v[np.isfinite(v)]
            if finite.size == 0:
                continue
            v = np.clip(np.nan_to_num(v, nan=float(np.median(finite))), finite.min(), finite.max())
        # The split is where the two segments fit their medians best (least absolute residual, the
        # L1 change point); the z of the difference is judged there.
        fits = []
        for k in range(min_segment, len(v) - min_segment + 1):
            a, b = v[:k], v[k:]
            ma, mb = float(np.median(a)), float(np.median(b))
            resid = np.concatenate([a - ma, b - mb])
            fits.append((float(np.abs(resid).sum()), k, ma, mb, resid))
        _, k, ma, mb, resid = min(fits, key=lambda f: (f[0], f[1]))
        scale = max(MAD_TO_SIGMA * float(np.median(np.abs(resid))), SIGNAL_FLOORS[sig])
        z = (mb - ma) / scale
        if best is None or z > best.z:
            best = HistoryShift(key[0], key[1], sig, steps[k], ma, mb, z)
    return best


def history_shifts(rows: Iterable[Any], min_segment: int = 3) -> list[HistoryShift]:
    """Per (layer, tensor), the strongest lasting worsening of a signal against its own history.

    For each of :data:`ROW_SIGNALS`' per-step series (main rows, sorted by step) the split leaving
    at least ``min_segment`` samples on each side where the two segments fit their medians best
    (least total absolute residual; the earliest among equals) is the change point; its z is the
    difference of the segment medians over the pooled robust scale of the residuals around them
    (floored by :data:`SIGNAL_FLOORS`, so a flat series cannot yield a huge z). The signal with
    the largest z per (layer, tensor) is returned, strongest first (equal z in model order);
    series shorter than ``2 * min_segment`` are skipped.
    """
    shifts = (best_shift(key, pts, min_segment) for key, pts in layer_series(rows).items())
    out = [h for h in shifts if h is not None]
    return sorted(out, key=lambda h: -h.z)

