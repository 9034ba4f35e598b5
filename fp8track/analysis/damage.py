"""Layers whose FP8 tensors were destroyed on sampled steps: evidence that stands on its own.

A layer's statistics nominate it against the other layers (:mod:`fp8track.analysis.ranking`), and
the loss usually decides whether that matters. Some statistics need no comparison: a tensor the
recipe really quantised (``actual`` rows, never the control's hypothetical ``shadow`` rows) whose
*ordinary* elements were lost is destroyed, whatever the loss did afterwards.

The test is the error of the GEMMs the tensor enters: a destroyed GEMM's output has a relative
error against float32 of at least :data:`DESTROYED_GEMM_ERROR` (0.3, the diagnosis bench's), and an
operand's error power carries over to the output, so nothing is destroyed while the SQNR of its
*ordinary* elements (:func:`~fp8track.analysis.risk_signals.bulk_sqnr_db`: without its largest
element, one huge outlier can keep the plain SQNR high while everything else is lost; from the
flushed share when a few outliers hide the others' energies) is above :data:`DESTROYED_SQNR_DB`
(10.5 dB). At or below it, the tensor is destroyed when it was

* **flushed**: at least :data:`FLUSH_PCT` % of its nonzero elements underflowed to zero;
* **drowned**: at most :data:`DROWNED_SQNR_DB` (3 dB: signal power at most twice the error's), or
  lost without any element saturating (the ordinary elements' own rounding and underflow: a scale
  far too small);
* **clipped**: at least :data:`CLIP_PCT` % of its elements saturated at the format's maximum.

Between 3 and 10.5 dB with a few elements saturated (a handful per thousand) the error is that of
those elements: delayed scaling one step behind an amax jump, back at its usual SQNR at the next
step, and no damage of the tensor's ordinary elements (healthy delayed-scaling runs read 7-10 dB
there on gradients at data spikes). Neither share alone destroys a GEMM: a gradient spanning many
decades flushes 35-99 % of its elements at 25-35 dB (GEMM error 0.02-0.05), a bounded tensor a
little over the range clips 12 % at 29 dB (0.03); a Gaussian 47 % flushed reads 9 dB (0.36), 28 %
clipped 9 dB (0.35). Healthy FP8 tensors sit far from the cut (E4M3 about 31 dB, E5M2 about
25 dB), so it means "the output of this GEMM was replaced by something else" and needs no tuning
per model (``test_destroyed_means_a_destroyed_gemm_against_float32``).

:func:`destroyed_layers` lists such layers with the steps, the first of them (the onset) and the
worst numbers; :func:`loss_excursion` measures how far the FP8/control loss ratio rose in the steps
after an onset, against its level before: a transient excursion after a layer's onset is evidence
of that damage, even when the loss recovers (latent damage).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fp8track.analysis.risk_signals import bulk_sqnr_db, nonzero_underflow_pct

FLUSH_PCT = 50.0
DESTROYED_GEMM_ERROR = 0.3
"""A destroyed GEMM: its output's relative error against float32 at least this (the diagnosis
bench's ``DAMAGE_MIN``; healthy FP8 GEMMs read 0.03 in E4M3 and 0.05 in E5M2)."""
DESTROYED_SQNR_DB = -20.0 * math.log10(DESTROYED_GEMM_ERROR)
"""10.5 dB: an operand whose error power is 9 % of its signal power gives a GEMM output with
relative error ``10^(-SQNR/20)`` = 0.3 (the error of a sum of products is the operand's, for a
generic other operand); 21 dB below E4M3's rounding SQNR (31.5), 15 dB below E5M2's (25.5)."""
DROWNED_SQNR_DB = 3.0
"""Drowned whatever the shares: the ordinary elements' error power at least half their signal's."""
CLIP_PCT = 5.0


@dataclass(frozen=True)
class Destroyed:
    """One layer tensor destroyed on some sampled steps.

    Attributes:
        layer, tensor: which.
        steps: the sampled steps it was destroyed on.
        sampled: how many sampled steps it has in all.
        onset: the first of ``steps``.
        how: per step, the criteria it failed (``flushed``, ``drowned``, ``clipped``).
        worst: the worst values seen (``underflow_pct``, ``bulk_sqnr_db``, ``overflow_pct``).
    """

    layer: str
    tensor: str
    steps: tuple[int, ...]
    sampled: int
    onset: int
    how: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    worst: Mapping[str, float] = field(default_factory=dict)

    @property
    def lag_only(self) -> bool:
        """Saturation alone on one sampled step: delayed scaling's one-step lag behind an amax jump
        (the history catches up at the next step), a note rather than a destroyed GEMM. The step
        clipped (its elements above the stale scale's range saturated) and nothing flushed: either
        many elements clipped (``clipped``) or a few huge ones did and took the SQNR of the rest
        with them (``drowned`` with ``overflow_pct > 0``: a gradient whose amax jumped 18x clips
        0.3 % of its elements at 2 dB, and reads 25 dB again one step later)."""
        saturated = float(self.worst.get("overflow_pct", 0.0)) > 0.0
        return len(self.steps) == 1 and saturated and all(
            set(h) <= {"clipped", "drowned"} for h in self.how.values())

    @property
    def share(self) -> float:
        """Share of its sampled steps on which the tensor was destroyed."""
        return len(self.steps) / self.sampled if self.sampled else 0.0


def destroyed_on(stats: Mapping[str, float]) -> tuple[str, ...]:
    """How one row's tensor was destroyed (see the module docstring): ``flushed``, ``drowned``,
    ``clipped`` in that order; empty when its ordinary elements' SQNR is above
    :data:`DESTROYED_SQNR_DB` (or unknown), whatever its underflow and overflow shares, or when only
    a few saturated elements took it below (a delayed scale's lag)."""
    bulk = bulk_sqnr_db(stats)
    if not (math.isfinite(bulk) and bulk <= DESTROYED_SQNR_DB):
        return ()
    out = []
    under = nonzero_underflow_pct(stats)
    if math.isfinite(under) and under >= FLUSH_PCT:
        out.append("flushed")
    overflow = float(stats.get("overflow_pct", 0.0))
    if bulk <= DROWNED_SQNR_DB or overflow == 0.0:
        out.append("drowned")
    if overflow >= CLIP_PCT:
        out.append("clipped")
    return tuple(out)


def _initial_scale(stats: Mapping[str, float]) -> bool:
    """A delayed scale before its history held an amax: Transformer Engine starts every FP8 scale
    at 1.0 (``init_fp8_meta_tensors`` in ``transformer_engine/pytorch/module/base.py``: ``torch.ones``)
    and the first step quantises with it, so gradients of 1e-5 flush in E5M2 on that one step by
    construction. Not a quantisation decision: never "destroyed"."""
    return float(stats.get("scale", math.nan)) == 1.0 and float(stats.get("current_scale", 1.0)) != 1.0


def judged_steps(rows: Iterable[object]) -> tuple[list[int], int]:
    """The sampled steps that show the recipe at work, and how many were left out: a step on which
    every ``actual`` row was quantised at delayed scaling's initial scale (:func:`_initial_scale`,
    the first sampled step of a delayed-scaling run) shows only the warm-up."""
    steps: set[int] = set()
    real: set[int] = set()
    for r in rows:
        step = int(r.step)  # type: ignore[attr-defined]
        steps.add(step)
        if getattr(r, "variant", "actual") != "actual" or not _initial_scale(r.stats):  # type: ignore[attr-defined]
            real.add(step)
    return sorted(real), len(steps - real)


def destroyed_layers(rows: Iterable[object]) -> list[Destroyed]:
    """Layer tensors destroyed on at least one sampled step (``actual`` rows only, a tensor's first
    sampled step at the initial scale 1.0 left out: :func:`_initial_scale`), the earliest onset
    first."""
    sampled: dict[tuple[str, str], set[int]] = defaultdict(set)
    hits: dict[tuple[str, str], dict[int, tuple[str, ...]]] = defaultdict(dict)
    worst: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    actual = [r for r in rows if getattr(r, "variant", "actual") == "actual"]
    first: dict[tuple[str, str], int] = {}
    for r in actual:
        key = (r.layer, r.tensor)  # type: ignore[attr-defined]
        first[key] = min(first.get(key, int(r.step)), int(r.step))  # type: ignore[attr-defined]
    for r in actual:
        key = (r.layer, r.tensor)  # type: ignore[attr-defined]
        step = int(r.step)  # type: ignore[attr-defined]
        sampled[key].add(step)
        if step == first[key] and _initial_scale(r.stats):  # type: ignore[attr-defined]
            continue
        how = destroyed_on(r.stats)  # type: ignore[attr-defined]
        if not how:
            continue
        hits[key][step] = how
        w = worst[key]
        w["underflow_pct"] = max(w.get("underflow_pct", 0.0), float(r.stats.get("underflow_pct", 0.0)))  # type: ignore[attr-defined]
        w["overflow_pct"] = max(w.get("overflow_pct", 0.0), float(r.stats.get("overflow_pct", 0.0)))  # type: ignore[attr-defined]
        bulk = bulk_sqnr_db(r.stats)  # type: ignore[attr-defined]
        if math.isfinite(bulk):
            w["bulk_sqnr_db"] = min(w.get("bulk_sqnr_db", math.inf), bulk)
    out = [
        Destroyed(layer, tensor, tuple(sorted(h)), len(sampled[(layer, tensor)]), min(h), dict(h),
                  worst[(layer, tensor)])
        for (layer, tensor), h in hits.items()
    ]
    return sorted(out, key=lambda d: (d.onset, -len(d.steps)))


def loss_excursion(
    fp8: Mapping[int, float], control: Mapping[int, float], onset: int, window: int
) -> dict[str, float]:
    """How far the FP8/control loss ratio rose in the ``window`` steps from ``onset`` against its
    median level before ``onset``: ``{"before": median ratio before, "peak": max ratio in the window
    (a 3-step running median, so one noisy step is no excursion), "after": median ratio after the
    window, "rise": peak / before - 1}``; NaNs when either side has no common step."""
    steps = sorted(set(fp8) & set(control))
    ratio = {s: fp8[s] / control[s] for s in steps if control[s] and math.isfinite(fp8[s])}
    before = [ratio[s] for s in steps if s < onset and s in ratio]
    inside = [s for s in steps if onset <= s < onset + window and s in ratio]
    after = [ratio[s] for s in steps if s >= onset + window and s in ratio]
    if not before or not inside:
        return {"before": math.nan, "peak": math.nan, "after": math.nan, "rise": math.nan}
    series = [ratio[s] for s in steps if s in ratio]
    index = {s: i for i, s in enumerate(s for s in steps if s in ratio)}
    smooth = [float(np.median(series[max(0, index[s] - 1): index[s] + 2])) for s in inside]
    level = float(np.median(before))
    peak = max(smooth)
    return {"before": level, "peak": peak, "after": float(np.median(after)) if after else math.nan,
            "rise": peak / level - 1.0}


def damage_summary(d: Destroyed) -> str:
    """One sentence of what happened to the tensor, with the numbers."""
    kinds = sorted({k for how in d.how.values() for k in how})
    words = {
        "flushed": f"up to {d.worst.get('underflow_pct', math.nan):.0f}% of its nonzero elements "
        "flushed to zero",
        "drowned": f"SQNR of its ordinary elements down to {d.worst.get('bulk_sqnr_db', math.nan):.1f} dB",
        "clipped": f"up to {d.worst.get('overflow_pct', math.nan):.1f}% of its elements clipped",
    }
    return (f"{d.layer} ({d.tensor}) was destroyed on {len(d.steps)} of {d.sampled} sampled steps from step "
            f"{d.onset}: " + "; ".join(words[k] for k in kinds))


__all__: Sequence[str] = [
    "CLIP_PCT", "DESTROYED_SQNR_DB", "DROWNED_SQNR_DB", "FLUSH_PCT", "Destroyed", "damage_summary",
    "destroyed_layers", "destroyed_on", "loss_excursion",
]
