"""Rules read from the loss and evaluation curves: shared and FP8-only spikes, divergence from the
start, a mid-training gap, a downstream drop with normal loss."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fp8track.analysis.diagnose.evidence import (
    OPTION_LABELS,
    Evidence,
    newly_enabled,
)
from fp8track.analysis.diagnose.model import (
    DiagnosisConfig,
    Finding,
    confidence,
)
from fp8track.analysis.layer_history import MAIN_VARIANTS
from fp8track.analysis.risk_signals import ROW_SIGNALS, SIGNAL_FLOORS, robust_z, row_signals


def _severity(z: float, cut: float) -> str:
    if not math.isfinite(z) or z >= 3 * cut:
        return "high"
    return "medium" if z >= 1.5 * cut else "low"


def _layers_near(
    rows: Sequence[Any], step: int, spacing: int, history_z: float
) -> list[tuple[str, str, str, float]]:
    """``(layer, tensor, signal, z)`` of (layer, tensor) pairs whose statistics at the sampled step
    nearest ``step`` (within ``spacing``) jump against their own other samples, strongest first."""
    by_key: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for r in rows:
        if r.variant in MAIN_VARIANTS:
            by_key.setdefault((r.layer, r.tensor), {})[int(r.step)] = row_signals(r.stats)
    hits = []
    for (layer, tensor), per_step in by_key.items():
        near = [s for s in per_step if step - spacing <= s <= step + 1]
        if not near or len(per_step) < 4:
            continue
        s0 = max(near)
        order = sorted(per_step)
        for sig in ROW_SIGNALS:
            z = robust_z([per_step[s][sig] for s in order], SIGNAL_FLOORS[sig])[order.index(s0)]
            if math.isfinite(z) and z > history_z:
                hits.append((layer, tensor, sig, float(z)))
    best: dict[tuple[str, str], tuple[str, str, str, float]] = {}
    for h in hits:
        if (h[0], h[1]) not in best or h[3] > best[(h[0], h[1])][3]:
            best[(h[0], h[1])] = h
    return sorted(best.values(), key=lambda h: -h[3])


def rule_shared_spikes(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 2: FP8 spikes with a control spike within ``classify_window`` steps."""
    shared = ev.shared_spikes
    if not shared:
        return []
    zs = [e.z_score for e, _ in shared if math.isfinite(e.z_score)]
    return [
        Finding(
            "shared_spikes",
            "low",
            confidence(len(shared) + 1.0, 1.0),
            f"{len(shared)} loss spike(s) also in the BF16 control: a general training problem, not FP8",
            "The FP8 run spiked where the control did (within "
            f"{ev.cfg.classify_window} steps). Look at data, learning rate and optimizer state first.",
            steps=tuple(e.start_step for e, _ in shared),
            evidence={
                "spikes": [
                    {
                        "start_step": e.start_step,
                        "control_start_step": c.control_start_step,
                        "rel_excess": e.rel_excess,
                        "recover_steps": e.recover_steps,
                        "control_recover_steps": c.control_recover_steps,
                        "z": e.z_score,
                    }
                    for e, c in shared
                ],
                "max_z": max(zs) if zs else math.inf,
            },
            next_experiments=(
                "inspect the batches at these steps (data quality, sequence lengths) and the learning-rate "
                "schedule",
                "lower the learning rate or add warm-up / gradient clipping; the same change should help "
                "the control",
                "only if FP8 recovers much more slowly than the control, treat them as FP8 spikes",
            ),
        )
    ]


def rule_fp8_only_spikes(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 2: FP8 spikes without a control spike nearby; the layers that jump at them."""
    only = ev.only_spikes
    if not only:
        return []
    cfg = ev.cfg
    slow = [e for e, c in only if e.status == "not_recovered"]
    ctl_rec = sorted(e.recover_steps for e in ev.control_base.spikes if e.recover_steps is not None)
    fp8_rec = sorted(e.recover_steps for e, _ in only if e.recover_steps is not None)
    zmax = max((e.z_score for e, _ in only if math.isfinite(e.z_score)), default=math.inf)
    layer_hits: dict[tuple[str, str], float] = {}
    for e, _ in only:
        for layer, tensor, _sig, z in _layers_near(ev.fp8_rows, e.start_step, ev.row_spacing, cfg.history_z):
            layer_hits[(layer, tensor)] = layer_hits.get((layer, tensor), 0.0) + z
    hits = sorted(layer_hits.items(), key=lambda kv: -kv[1])
    # Cause before consequence: a layer that jumps at the spike because the damage reached it (its
    # anomaly started later than the causes') is named after them, never first.
    layers = tuple(sorted(dict.fromkeys(k[0] for k, _ in hits), key=lambda n: _causal_key(ev, n)))
    layers = tuple(n for n in layers if not ev.order.is_consequence(n))[: cfg.top_k]
    tensors = tuple(dict.fromkeys(k[1] for k, _ in hits if k[0] in layers))
    # A layer destroyed from within one sampling interval of a spike is the spike's direct
    # evidence: when the damage starts between two samples, only the sampled step after the spike
    # shows it, while the step before may show unrelated jumps. It is named first.
    struck = _destroyed_near(ev, [e.start_step for e, _ in only])
    if struck:
        layers = (struck + tuple(n for n in layers if n not in struck))[: cfg.top_k]
        tensors = tuple(dict.fromkeys(
            [d.tensor for d in ev.order.destroyed if d.layer in struck]
            + [k[1] for k, _ in hits if k[0] in layers]))
    # A layer broken for most of the run does not jump at a spike against its own history; the
    # layers that stand out against the others (and the control) are then the suspects, and so are
    # the layers destroyed on sampled steps.
    if not layers and ev.order.destroyed:
        layers = tuple(dict.fromkeys(r.layer for r in ev.ranking if ev.order.destroyed_of(r.layer)
                                     and not ev.order.is_consequence(r.layer)))[: cfg.top_k]
        tensors = tuple(dict.fromkeys(d.tensor for d in ev.order.destroyed if d.layer in layers))
    standing = () if layers else tuple(r.layer for r in ev.outs
                                       if not ev.order.is_consequence(r.layer))[: cfg.top_k]
    if standing:
        layers, tensors = standing, tuple(dict.fromkeys(r.tensor for r in ev.outs if r.layer in standing))
    sev = "high" if slow or len(only) >= 3 else "medium"
    conf = confidence(zmax, 6.0) if len(only) == 1 else max(confidence(zmax, 6.0), 0.8)
    return [Finding(
        "fp8_only_spikes", sev, conf,
        f"{len(only)} loss spike(s) only in FP8, first at step {only[0][0].start_step}",
        f"The control did not spike within {cfg.classify_window} steps of these. Median FP8 recovery "
        f"{_median_or_none(fp8_rec)} steps vs control spikes {_median_or_none(ctl_rec)}; "
        f"{len(slow)} did not recover. "
        + (f"Layers whose statistics jump at the spikes: {', '.join(layers)}." if layers and not standing
           else f"No layer's statistics jump at the spikes; standing out over the run: {', '.join(layers)}."
           if standing else ""),
        steps=tuple(e.start_step for e, _ in only), layers=layers, tensors=tensors,
        evidence={"spikes": [{"start_step": e.start_step, "rel_excess": e.rel_excess, "z": e.z_score,
                              "recover_steps": e.recover_steps, "status": e.status} for e, _ in only],
                  "fp8_median_recover_steps": _median_or_none(fp8_rec),
                  "control_median_recover_steps": _median_or_none(ctl_rec),
                  "layer_jumps": [{"layer": k[0], "tensor": k[1], "z_sum": v} for k, v in hits[:10]],
                  "layers_standing_out": list(standing),
                  "known_causes": sorted(ev.causes)},
        next_experiments=_numerics_experiments(layers, (), cfg) + tuple(ev.causes.values()),
    )]


def rule_divergence_from_start(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 3: a lasting gap from the start; software first (what the FP8 run newly enabled)."""
    lc = ev.loss
    if lc.onset_step is None or lc.phase != "start":
        return []
    new = newly_enabled(ev.fp8.meta, ev.control.meta)
    evidence = {**ev.loss_evidence(), "newly_enabled": new, "known_causes": sorted(ev.causes)}
    exps = [f"switch off {OPTION_LABELS.get(k, k)} ({k}={v})" for k, v in new.items() if k != "recipe"]
    exps.extend(ev.causes.values())
    exps.append("re-enable the options one at a time and rerun the first steps against the control")
    top = ev.ranking[0].layer if ev.ranking else "n/a"
    exps.append(f"compare the first sampled step's tensor statistics (non-finite, overflow) layer by layer: "
                f"top of the ranking is {top}")
    if "recipe" in new:
        exps.insert(0, f"keep everything as in the control except the FP8 recipe ({new['recipe']}): "
                       "if that alone diverges, go to the numerics experiments")
    return [Finding(
        "divergence_from_start", "high" if lc.severity == "high" else "medium",
        confidence(ev.gap_z, lc.z_cut),
        f"FP8 diverges from the start (gap opens at step {lc.onset_step})",
        f"The FP8 loss departs from the control from step {lc.onset_step} on and never comes back: "
        f"{100 * lc.final_gap:+.1f}% at the end, {ev.gap_z:.0f}x {lc.unit_label} "
        f"({100 * lc.noise:.2f}%). Suspect software first. Newly enabled relative to the control: "
        + (", ".join(f"{k}={v}" for k, v in new.items()) or "nothing recorded") + ".",
        steps=(lc.onset_step,), layers=tuple(ev.named[:1]), evidence=evidence, next_experiments=tuple(exps),
    )]


def rule_mid_training_gap(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 4: a lasting gap that opens later; the numerics experiments on the named layers."""
    lc, cfg = ev.loss, ev.cfg
    if lc.onset_step is None or lc.phase != "mid":
        return []
    named = ev.named
    return [Finding(
        "mid_training_gap", "high" if lc.severity == "high" else "medium", confidence(ev.gap_z, lc.z_cut),
        f"FP8 falls behind the control mid-training (from step {lc.onset_step})",
        f"The FP8 loss tracked the control until step {lc.onset_step}, then stayed above it: "
        f"{100 * lc.level:+.1f}% since then, {ev.gap_z:.0f}x {lc.unit_label} "
        f"({100 * lc.noise:.2f}%). Top-ranked layers: {', '.join(named)}."
        + (f" The gap ends inside the {100 * lc.seed_band:.0f}% seed band, but {lc.corroborated_by} broke "
           "on its own just before it opened: damage, not drift." if lc.corroborated_by else ""),
        steps=(lc.onset_step,), layers=named,
        tensors=tuple(dict.fromkeys(r.tensor for r in ev.ranking if r.layer in named)),
        evidence={**ev.loss_evidence(), "known_causes": sorted(ev.causes)},
        next_experiments=_numerics_experiments(named, ev.model_order, cfg) + tuple(ev.causes.values()),
    )]


def rule_downstream_drop(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 5: an evaluation metric worse than the control's while the loss is normal. A drop
    no larger than the training loss's own level gap (plus ``noise_k`` of the metric's noise) is
    the training gap seen again, not a problem of the inference path."""
    lc, cfg = ev.loss, ev.cfg
    level = max(lc.level, 0.0) if math.isfinite(lc.level) else 0.0
    dropped = {k: v for k, v in ev.evals.items()
               if v["dropped"] and v["worse_rel"] - level > cfg.noise_k * v["noise_rel"]}
    if not dropped or lc.onset_step is not None or ev.nonfinite:
        return []
    worst_name, worst = max(dropped.items(), key=lambda kv: kv[1]["z"])
    inference = (
        "check the inference chain: fp8track check-inference CKPT (trained vs fresh scales vs BF16, "
        "per-layer output error, checkpoint reload of weights and amax histories)",
        "verify inference loads the trained scaling state (amax histories, scales) and the final "
        "weights",
        "use FP8 training + FP8 inference as the control: BF16 inference of an FP8-trained model "
        "can add error",
    )
    damaged = _destroyed_before(ev, int(worst["step"]))
    trained = ""
    if damaged is not None:
        layer, onset = damaged
        trained = (f" {layer}'s FP8 output was destroyed in training from step {onset}, before this "
                   "evaluation: the drop can be that damage learned into the weights rather than the "
                   "inference path.")
        inference = (f"rerun with {layer} in BF16 (--bf16-layers {layer}) and compare {worst_name}: its "
                     f"FP8 output was destroyed in training from step {onset}, before the drop",
                     *inference)
    return [
        Finding(
            "downstream_drop_with_normal_loss",
            "high" if worst["z"] >= 3 * cfg.noise_k else "medium",
            confidence(worst["z"], cfg.noise_k),
            f"Evaluation drops ({', '.join(dropped)}) while the training loss matches the control",
            f"{worst_name}: {worst['fp8']:.4g} vs control {worst['control']:.4g} at step {worst['step']} "
            f"({100 * worst['worse_rel']:.1f}% worse, {worst['z']:.0f}x the {worst['noise_source']}), while "
            f"the "
            f"training loss stays within {100 * lc.tolerance:.2f}% of the control. Loss alone misses "
            "problems in the inference path: scaling factors, weight loading, precision mix." + trained,
            steps=(int(worst["step"]),),
            layers=(damaged[0],) if damaged else tuple(ev.named[:1]),
            evidence={"eval": dropped, "loss_final_gap_rel": lc.final_gap,
                      "destroyed_before": {"layer": damaged[0], "onset": damaged[1]} if damaged else None},
            next_experiments=inference,
        )
    ]


def _destroyed_before(ev: Evidence, step: int) -> tuple[str, int] | None:
    """The first named layer whose FP8 output was destroyed in training at or before ``step`` (not
    delayed scaling's one-step clip), with its onset: a training cause of a later evaluation drop."""
    for layer in ev.order.named:
        onsets = [d.onset for d in ev.order.destroyed_of(layer) if not d.lag_only]
        if onsets and min(onsets) <= step:
            return layer, min(onsets)
    return None


def _destroyed_near(ev: Evidence, steps: Sequence[int]) -> tuple[str, ...]:
    """Candidate-cause layers (causal order) whose destroyed onset lies within one sampling
    interval of one of ``steps``."""
    return tuple(dict.fromkeys(
        r.layer for r in ev.ranking if not ev.order.is_consequence(r.layer) and any(
            s - ev.row_spacing <= d.onset <= s + ev.row_spacing
            for d in ev.order.destroyed_of(r.layer) for s in steps)))


def _causal_key(ev: Evidence, layer: str) -> int:
    """A layer's position in the diagnosis's causal order (unranked layers last)."""
    return next((i for i, r in enumerate(ev.ranking) if r.layer == layer), len(ev.ranking))


def _median_or_none(xs: Sequence[int]) -> float | None:
    return float(np.median(xs)) if xs else None


def _numerics_experiments(
    top_layers: Sequence[str], all_layers: Sequence[str], cfg: DiagnosisConfig
) -> tuple[str, ...]:
    """Step 4 of the path, in its order; first/last layers only where they are among the top."""
    exps = [
        "FP8 inputs with a BF16 GEMM (recipe fp8_input_bf16_gemm): separates quantisation of the "
        "operands from the FP8 GEMM itself",
        "current scaling (recipe current): removes the delayed scale's lag behind the amax",
        "block scaling (recipes mxfp8, block): one scale per 32/128 elements absorbs outliers",
    ]
    if top_layers:
        names = ",".join(top_layers[: cfg.top_k])
        hint = ""
        if all_layers and (
            all_layers[0] in top_layers[: cfg.top_k] or all_layers[-1] in top_layers[: cfg.top_k]
        ):
            hint = " (the first/last layer is among them, as is often the case)"
        exps.append(
            f"keep the top-ranked layers in BF16: --bf16-layers {names}{hint}; measurement decides the set"
        )
    else:
        exps.append(
            "keep the top-ranked layers of layer_ranking in BF16 (auto:K); measurement decides the set"
        )
    return tuple(exps)
