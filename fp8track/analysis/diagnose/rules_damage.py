"""Latent damage: a layer whose FP8 output was destroyed on sampled steps is a finding of its own.

Layer evidence stands on its own. A tensor the recipe quantised whose ordinary elements were lost
(flushed to zero, drowned in their error, clipped: :mod:`fp8track.analysis.damage`) means the
layer's GEMM computed something else on those steps, whatever the loss did afterwards; a loss that
recovers makes the damage latent, not harmless. Each destroyed layer that is a candidate cause
(:mod:`fp8track.analysis.diagnose.causal`: not downstream of an earlier anomaly) and that no
``layer_outlier`` finding already reports gets one ``latent_damage`` finding:

* **severity** from the loss's response (:func:`fp8track.analysis.damage.loss_excursion` over the
  destroyed span plus the onsets' resolution, against at least the resolution's steps of the ratio
  before the onset): ``high`` when the FP8/control loss ratio rose beyond its own noise (at least
  :data:`FELT_K` standard errors of the 3-step median and
  :data:`FELT_MIN` relative) or a lasting gap names the layer first, else ``medium``; clipping alone on one
  sampled step (delayed scaling's one-step lag behind an amax jump) is ``low``, ``medium`` when
  the loss felt it with an FP8-only spike finding within the onsets' resolution of it and no layer
  destroyed for real within that resolution explains the rise, never ``high``;
* **confidence** from how often it was seen: :data:`CONFIDENCE_ONE` on one sampled step (a single
  observation), :data:`CONFIDENCE_MANY` on two or more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fp8track.analysis.damage import damage_summary, loss_excursion
from fp8track.analysis.diagnose.evidence import Evidence
from fp8track.analysis.diagnose.model import Finding
from fp8track.analysis.diagnose.rules_layers import downstream_of

FELT_K = 3.0
FELT_MIN = 0.01
"""The loss felt the damage when the FP8/control ratio's 3-step median rose by at least ``FELT_K``
of its standard errors (``1.2533 x noise / sqrt 3``) and by at least 1 %."""
CONFIDENCE_ONE = 0.8
CONFIDENCE_MANY = 0.95
REPORTED_SEVERITIES = ("high", "medium")


def _felt(rise: float, noise: float) -> bool:
    if not math.isfinite(rise):
        return False
    sem = 1.2533 * noise / math.sqrt(3.0) if math.isfinite(noise) and noise > 0 else 0.0
    return rise >= max(FELT_K * sem, FELT_MIN)


def _lag_rise_is_its_own(ev: Evidence, found: Sequence[Finding], layer: str, onset: int) -> bool:
    """Whether a loss rise felt around ``layer``'s one-step clip (delayed scaling's lag from
    ``onset``) is evidence of that clip: only when the diagnosis reports a loss symptom of its own
    there (an FP8-only spike within the onsets' resolution: a rise of a few standard errors, which
    healthy pairs' paired ratios show too, is not one), and no layer destroyed for real (not a lag)
    within that resolution explains it (the jump that made the others' delayed scales lag came
    from there, so the loss's response is that layer's evidence)."""
    spiked = any(f.kind == "fp8_only_spikes" and f.severity in REPORTED_SEVERITIES
                 and any(abs(s - onset) <= ev.resolution for s in f.steps) for f in found)
    return spiked and not any(abs(d.onset - onset) <= ev.resolution for d in ev.order.destroyed
                              if d.layer != layer and not d.lag_only)


def rule_latent_damage(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """One finding per destroyed candidate-cause layer not already reported as a layer outlier."""
    covered = {f.layers[0] for f in found
               if f.kind == "layer_outlier" and f.layers and f.severity in REPORTED_SEVERITIES}
    gap_first = next((f.layers[0] for f in found if f.kind in ("mid_training_gap", "divergence_from_start")
                      and f.layers), None)
    fl = ev.fp8.metrics[ev.fp8.loss_key()]
    cl = ev.control.metrics[ev.control.loss_key()]
    out = []
    layers = dict.fromkeys(r.layer for r in ev.ranking if ev.order.destroyed_of(r.layer))
    for layer in layers:
        if ev.order.is_consequence(layer) or layer in covered:
            continue
        ds = ev.order.destroyed_of(layer)
        onset = min(d.onset for d in ds)
        steps = sorted({s for d in ds for s in d.steps})
        sampled = max(d.sampled for d in ds)
        window = steps[-1] - onset + ev.resolution + 1
        ex = loss_excursion(fl, cl, onset, window)
        # The rise is measured against the ratio's level before the onset: with fewer steps before
        # it than the onsets' resolution (an onset in the first steps, where delayed scaling's
        # warm-up moves the ratio by itself) there is no level to measure against.
        baseline = sum(1 for s in fl if s < onset and s in cl)
        felt = baseline >= ev.resolution and _felt(ex["rise"], ev.loss.noise)
        # Clipping alone on one sampled step, unfelt, is delayed scaling's one-step lag behind an
        # amax jump (the history catches up at the next step): a note, not a destroyed GEMM.
        lag_only = len(steps) == 1 and all(d.lag_only for d in ds)
        # Felt or not, one sampled step of clipping alone is no destroyed GEMM (its ordinary elements
        # keep their SQNR): a loss rise around it belongs to whatever raised the amax, so it is
        # never a high finding that would outrank the layer that did.
        if lag_only:
            own = felt and _lag_rise_is_its_own(ev, found, layer, onset)
            sev = "medium" if own or gap_first == layer else "low"
        else:
            sev = "high" if felt or gap_first == layer else "medium"
        conf = CONFIDENCE_MANY if len(steps) >= 2 else CONFIDENCE_ONE
        after = downstream_of(ev, layer)
        tensors = tuple(dict.fromkeys(d.tensor for d in ds))
        loss_words = _loss_words(ex, felt, window)
        out.append(Finding(
            "latent_damage", sev, conf,
            f"Layer {layer}'s FP8 output destroyed on {len(steps)} of {sampled} sampled steps from step "
            f"{onset}" + ("" if felt or gap_first == layer else " (the loss did not show it)"),
            "; ".join(damage_summary(d) for d in ds) + ". " + loss_words
            + (f" Downstream of it: {', '.join(after)}." if after else "")
            + " A destroyed GEMM output is damage whatever the loss did afterwards: it can recur and "
            "grow with longer training or another batch.",
            steps=tuple(steps), layers=(layer,), tensors=tensors,
            evidence={"destroyed": [{"tensor": d.tensor, "onset": d.onset, "steps": list(d.steps),
                                     "sampled": d.sampled, "worst": dict(d.worst),
                                     "how": sorted({k for how in d.how.values() for k in how})} for d in ds],
                      "loss_excursion": ex, "excursion_window": window, "loss_felt_it": felt,
                      "noise_rel": ev.loss.noise, "consequences": after},
            next_experiments=_experiments(layer, tensors, steps) + tuple(ev.causes.values()),
        ))
    return out


def _loss_words(ex: dict[str, float], felt: bool, window: int) -> str:
    if not math.isfinite(ex["rise"]):
        return "The loss has no common steps on both sides of the onset to compare."
    after = (f", {ex['after']:.3f} after" if math.isfinite(ex["after"]) else "")
    return (f"The FP8/control loss ratio went from {ex['before']:.3f} before the onset to a peak of "
            f"{ex['peak']:.3f} within {window} steps{after} "
            + ("(the loss felt it)." if felt else "(within the ratio's own noise: latent)."))


def _experiments(layer: str, tensors: Sequence[str], steps: Sequence[int]) -> tuple[str, ...]:
    t = "/".join(tensors)
    return (
        f"rerun with {layer} in BF16 (--bf16-layers {layer}) and compare the loss around step {steps[0]}",
        f"look at what entered {layer}'s {t} at steps {', '.join(map(str, steps[:5]))}: an outlier "
        "token or feature sets a per-tensor scale the ordinary elements cannot live with (tensor dumps "
        "after an event: max_dumps)",
        "block scaling (recipes mxfp8, block) confines one outlier to its block; current scaling "
        "removes a stale delayed scale",
        "sample every step around the onset (bursts, every_n_steps) to see how often it happens",
    )


__all__ = ["rule_latent_damage", "FELT_K", "FELT_MIN"]
