"""Rules about layers: a layer outlier while the loss shows trouble, and the healthy verdict."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fp8track.analysis.causality import CONSEQUENCE
from fp8track.analysis.damage import Destroyed, damage_summary
from fp8track.analysis.diagnose.evidence import Evidence
from fp8track.analysis.diagnose.model import (
    Finding,
    confidence,
)
from fp8track.analysis.diagnose.rules_loss import (
    _severity,
)
from fp8track.analysis.loss_gap import GapJudgement
from fp8track.analysis.ranking import (
    LayerRisk,
    separation,
)
from fp8track.analysis.verdict import FP8_KINDS

TROUBLE_KINDS = (
    "fp8_only_spikes",
    "divergence_from_start",
    "mid_training_gap",
    "downstream_drop_with_normal_loss",
)
ERROR_SIGNALS = ("rel_error_db", "cos_loss")
CORROBORATE_Z = 2.0
"""Robust z (against comparable tensors of the other layers) of a layer's relative error (incl. the
error of its non-outlier elements) or cosine loss from which its quantisation error is said to stand
out (reported with the layers to watch)."""

CONSEQUENCE_CONFIDENCE = 0.5
"""A consequence's outlier finding keeps this share of its confidence: the layer stands out, but
it says where the damage arrived, not where it came from."""

CLEAR_SEPARATION = 2.0
"""An outlier scoring less than this many times the best other layer is a near tie: at most
``medium`` severity, whatever its score."""


def _error_stands_out(r: LayerRisk) -> bool:
    return any(math.isfinite(r.z.get(s, math.nan)) and r.z[s] >= CORROBORATE_Z for s in ERROR_SIGNALS)


def _trouble(ev: Evidence, found: Sequence[Finding]) -> bool:
    """The loss or the evaluation shows trouble: a finding of :data:`TROUBLE_KINDS`, or an
    evaluation metric worse than the control's beyond its noise (also when the training loss's own
    level gap explains it, which the per-step noise may hide)."""
    return any(f.kind in TROUBLE_KINDS for f in found) or any(v["dropped"] for v in ev.evals.values())


def _watch(ev: Evidence, found: Sequence[Finding]) -> list[LayerRisk]:
    """Outliers without loss or evaluation trouble: statistics nominate, the loss decides, so they
    are layers to watch under ``healthy``, whatever their error (which the finding reports). A
    consequence of another layer's anomaly is not watched for itself."""
    return [] if _trouble(ev, found) else [r for r in ev.outs if not ev.order.is_consequence(r.layer)]


def downstream_of(ev: Evidence, layer: str) -> list[str]:
    """The anomalous layers the causal order puts downstream of ``layer`` (its consequences), as
    ``"<layer> (from step N)"``."""
    return [f"{n} (from step {role.onset})" for n, role in ev.order.roles.items()
            if role.role == CONSEQUENCE and role.downstream_of == layer]


def _own_shift(ev: Evidence, layer: str, tensor: str) -> dict[str, Any] | None:
    h = next((h for h in ev.shifts if h.layer == layer and h.tensor == tensor), None)
    return h.to_dict() if h is not None and h.z > ev.cfg.history_z else None


def rule_layer_outlier(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """A layer that stands out against comparable tensors of the other layers (beyond the control)
    while the loss or the evaluation shows trouble; its onset from its own history."""
    cfg, watch = ev.cfg, _watch(ev, found)
    out = []
    for r in (r for r in ev.outs if r not in watch):
        own = _own_shift(ev, r.layer, r.tensor)
        st = r.stats.get(r.tensor, {})
        sep = separation(r, ev.ranking, ev.outs)
        sev = _severity(r.score, cfg.outlier_min_score)
        if sev == "high" and sep < CLEAR_SEPARATION:  # a near tie is not a clear culprit
            sev = "medium"
        worst_sig = max(r.z, key=lambda k: r.z[k] if math.isfinite(r.z[k]) else -math.inf)
        base = "the control's same layer" if r.excess else "the model's other layers"
        later = r.layer in ev.order.later
        role = ev.order.role(r.layer)
        consequence = role is not None and role.role == CONSEQUENCE
        conf = confidence(r.score, cfg.outlier_min_score) * (1.0 if sep >= CLEAR_SEPARATION else 0.5)
        if consequence:  # an effect of the damage, never the headline: a note under its cause
            sev, conf = "low", conf * CONSEQUENCE_CONFIDENCE
        wrecked = [damage_summary(d) for d in ev.order.destroyed_of(r.layer)]
        after = downstream_of(ev, r.layer)
        out.append(
            Finding(
                "layer_outlier",
                sev,
                conf,
                f"Layer {r.layer} ({r.tensor}) stands out" + (f" from step {own['step']}" if own else "")
                + (f", downstream of {role.downstream_of}" if consequence and role else ""),
                _outlier_numbers(r, sep, base, worst_sig, st)
                + (
                    f" Against its own history, {own['signal']} worsened from step {own['step']} (z "
                    f"{own['z']:.1f})."
                    if own
                    else ""
                )
                + (
                    f" It broke at step {role.onset if role else r.onset}, after the loss gap opened (step "
                    f"{ev.loss.onset_step}): it does not explain that gap but is a separate, later problem."
                    if later
                    else ""
                )
                + (f" A consequence, not a cause: {role.reason}." if consequence and role else "")
                + (" Destroyed: " + "; ".join(wrecked) + "." if wrecked else "")
                + (f" Downstream of it: {', '.join(after)}." if after else ""),
                steps=(own["step"],) if own else (),
                layers=(r.layer,),
                tensors=(r.tensor,),
                evidence={
                    "score": r.score,
                    "separation": sep,
                    "rank": r.rank,
                    "tied": list(r.tied),
                    "z": dict(r.z),
                    "stats": st,
                    "own_history": own,
                    "excess_over_control": r.excess,
                    "margin": dict(r.margin),
                    "breaks_after_gap": later,
                    "role": role.role if role else None,
                    "downstream_of": role.downstream_of if role else None,
                    "destroyed": [_destroyed_dict(d) for d in ev.order.destroyed_of(r.layer)],
                    "consequences": after,
                },
                next_experiments=(
                    f"look for outlier features entering {r.layer}'s {r.tensor} (amax over steps)",
                    f"rerun with {r.layer} in BF16 (--bf16-layers {r.layer}) and compare the loss gap",
                    "try current or block scaling for this layer's tensors (what-if rows show the expected "
                    "error)",
                    *ev.causes.values(),
                ),
            )
        )
    return out


def _outlier_numbers(r: LayerRisk, sep: float, base: str, worst_sig: str, st: Mapping[str, Any]) -> str:
    """The sentence of numbers behind a layer outlier: its score against its peers and its statistics."""
    return (
        f"Risk score {r.score:.1f}, {sep:.1f}x the next layer's, against comparable {r.tensor} tensors "
        f"({r.fmt}) of the other layers, as excess over {base}; worst signal {worst_sig} "
        f"(z {r.z[worst_sig]:.1f}): SQNR {st.get('sqnr_db', math.nan):.1f} dB (without its largest "
        f"element {st.get('bulk_sqnr_db', math.nan):.1f} dB), underflow "
        f"{st.get('underflow_pct', math.nan):.2f}%, cos {st.get('cos', math.nan):.5f}, "
        f"|drift| {st.get('abs_drift_log2', math.nan):.2f} binades."
    )


def _destroyed_dict(d: Destroyed) -> dict[str, Any]:
    return {"tensor": d.tensor, "onset": d.onset, "steps": list(d.steps), "sampled": d.sampled,
            "how": sorted({k for how in d.how.values() for k in how}), "worst": dict(d.worst)}


def _healthy_confidence(lc: GapJudgement) -> float:
    """How far inside its cut the FP8 run's loss ends: ``confidence(cut / |end|, 1)`` with ``end`` the
    median relative gap where the runs end (``GapJudgement.end_level``) and ``cut`` the gap's
    tolerance, or the seed band for a gap that lasted but ends inside it. A run ending a third of
    the cut from the control reads 0.86, at the cut 0.05.

    The healthy claim is about where the run ends: an excursion that stayed below the cut earlier
    is no finding (spikes and destroyed layers have rules of their own). The largest smoothed gap of
    the whole run, used before, comes near the cut on most healthy pairs by chance alone (the
    maximum of a few hundred noisy steps): the benchmark's 12 healthy verdicts, all right, read
    0.05-0.99 with a mean of 0.34 by it, against 0.54 by where the run ends."""
    cut = lc.seed_band if lc.band_onset_step is not None else lc.tolerance
    end = abs(lc.end_level)
    if not (math.isfinite(end) and math.isfinite(cut)) or cut <= 0:
        return 0.05
    return confidence(cut / max(end, 1e-12), 1.0)


def rule_healthy(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """No rule found anything FP8 caused (at medium severity or above); the layers to watch and the
    observations that are not FP8's doing (spikes both runs share, low-severity notes) are noted."""
    if any(f.kind in FP8_KINDS and f.severity in ("high", "medium") or f.kind == "mismatched_runs"
           for f in found):
        return []
    lc, watch = ev.loss, _watch(ev, found)
    notes = [f.title for f in found]
    best = ev.ranking[0] if ev.ranking else None
    ties = f", tied with {', '.join(best.tied)}" if best and best.tied else ""
    return [
        Finding(
            "healthy",
            "info",
            _healthy_confidence(lc),
            "FP8 matches the BF16 control" if not lc.final_gap < -lc.seed_band else
            f"FP8 caused nothing seen; its loss ends {100 * -lc.final_gap:.1f}% below the control's",
            (
                f"Loss gap {100 * lc.final_gap:+.2f}% at the end: a gap from step {lc.band_onset_step} "
                f"that ends inside the {100 * lc.seed_band:.0f}% band healthy FP8/BF16 pairs drift apart "
                "by on the same batches (rerun another seed to tell drift from damage)"
                if lc.band_onset_step is not None
                else f"Loss gap {100 * lc.final_gap:+.2f}% at the end, within the cut of "
                f"{100 * lc.tolerance:.2f}% ({lc.z_cut:.1f}x {lc.unit_label}, {100 * lc.noise:.2f}%)"
            )
            + "; no FP8-only spikes; no evaluation "
            "drop; no layer destroyed; no layer stands out "
            "against the others more than in the control with an error to show for it"
            + (f" (highest risk score {best.score:.1f}, {best.layer}{ties})." if best else ".")
            + (" Not FP8's doing: " + "; ".join(notes) + "." if notes else "")
            + (
                " To watch: "
                + ", ".join(
                    f"{r.layer} ({r.tensor}, worst signal {max(r.z, key=lambda k: r.z[k])})" for r in watch
                )
                + " stand out against comparable tensors of the other layers"
                + (" with a larger quantisation error" if any(_error_stands_out(r) for r in watch) else "")
                + ", without any loss or evaluation impact: rerun the diagnosis after longer training."
                if watch
                else ""
            ),
            layers=tuple(r.layer for r in watch),
            evidence={
                "final_gap_rel": lc.final_gap,
                "end_gap_rel": lc.end_level,
                "max_gap_rel": lc.max_gap,
                "control_noise_rel": lc.noise,
                "tolerance_rel": lc.tolerance,
                "noise_unit": lc.unit,
                "band_onset_step": lc.band_onset_step,
                "eval": ev.evals,
                "top_layer": best.layer if best else None,
                "top_score": best.score if best else None,
                "top_tied_with": list(best.tied) if best else [],
                "notes": notes,
                "watch": [
                    {
                        "layer": r.layer,
                        "tensor": r.tensor,
                        "score": r.score,
                        "z": dict(r.z),
                        "error_stands_out": _error_stands_out(r),
                    }
                    for r in watch
                ],
            },
            next_experiments=(
                "keep monitoring at a lower sampling rate; rerun the diagnosis after longer training",
            ),
        )
    ]
