"""Rules for mixture-of-experts runs: an expert that stands out from its group, and routing that
departs from the control.

``expert_outlier``: the experts of one group (``<experts>.<param>.expert_<e>`` rows of one tensor
kind; module-list and TE forms too: :func:`fp8track.execution.experts.parse_expert_row`) see
different tokens of one distribution, so on a sampled step they should quantise alike. An
expert stands out on a step when its quantisation error is worse than its siblings' median by a
margin that matters in absolute terms **and** in their spread: SQNR at least :data:`SQNR_MARGIN_DB`
lower (ten times the error power) with a robust z of at least :data:`EXPERT_Z`, or an overflow or
underflow share at least :data:`SHARE_MARGIN_PCT` points above theirs with that z. It is an outlier
when it stands out on most of its sampled steps from its onset on (at least :data:`MIN_STEPS`), and
the same expert of the control (shadow rows: what FP8 would do to the same data) does not. Its share
of the group's routed tokens weighs the severity: an expert that sees almost no token cannot move
the loss.

``router_divergence``: the router statistics (:mod:`fp8track.monitoring.router_capture`: the
load-balancing loss, the load's coefficient of variation, the share of top-k choices FP8-rounded
logits would flip) against the control's at the same steps, in the control's own step-to-step noise:
a departure that lasts (most steps from its onset to the end) beyond :data:`ROUTER_K` noise units and
an absolute floor (:data:`ROUTER_FLOORS`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fp8track.analysis.diagnose.evidence import Evidence, relative_noise
from fp8track.analysis.diagnose.model import Finding, confidence
from fp8track.analysis.layer_history import MAIN_VARIANTS
from fp8track.execution.experts import parse_expert_row

SQNR_MARGIN_DB = 10.0
SHARE_MARGIN_PCT = 1.0
EXPERT_Z = 4.0
MIN_STEPS = 2
STAND_OUT_SHARE = 0.5
ROUTER_K = 4.0
ROUTER_FLOORS = {"aux_loss": 0.05, "worst_load_cv": 0.25, "flip_pct": 2.0}
"""Absolute floors of a router departure: the aux loss relative (5 %), the load CV and the flip
share in their own units (CV points, percentage points)."""
ROUTER_STATS = ("aux_loss", "worst_load_cv", "flip_pct")
MOE_NEXT_STEPS = (
    "keep the router in FP32 (Megatron-LM --moe-router-dtype fp32; fp8track keeps it in high precision "
    "unless apply_fp8(..., fp8_routers=True))",
    "run the expert group in BF16 (bf16_layers='<experts>' or the 'experts' keyword) and compare the "
    "loss gap",
    "per-expert current scaling (recipe current) or MXFP8 block scaling for the experts",
    "keep the first and last MoE layers in BF16 (bf16_layers='first_last')",
)


@dataclass(frozen=True)
class ExpertOutlier:
    """One expert that stands out from its group (see the module docstring)."""

    row: str
    group: str
    expert: int
    tensor: str
    onset: int
    steps: tuple[int, ...]
    signal: str
    margin: float
    z: float
    token_share: float
    stats: Mapping[str, float]


def _expert_cells(
    rows: Sequence[Any],
) -> dict[tuple[str, str, int], dict[int, tuple[str, Mapping[str, float]]]]:
    """``(group, tensor, step) -> {expert: (row name, stats)}`` of the main variant's expert rows."""
    out: dict[tuple[str, str, int], dict[int, tuple[str, Mapping[str, float]]]] = defaultdict(dict)
    for r in rows:
        m = parse_expert_row(r.layer)  # every expert row form (fused, module list, TE)
        if m is None or r.variant not in MAIN_VARIANTS:
            continue
        out[(m[0], r.tensor, int(r.step))][m[1]] = (r.layer, r.stats)
    return out


def _signals(stats: Mapping[str, float]) -> dict[str, float]:
    sqnr = stats.get("sqnr_db", math.nan)
    return {
        "error_db": -sqnr if math.isfinite(sqnr) else (math.nan if sqnr > 0 else math.inf),
        "overflow_pct": float(stats.get("overflow_pct", 0.0)),
        "underflow_pct": float(stats.get("underflow_pct", 0.0)),
    }


def _stands_out(
    own: Mapping[str, float], others: Sequence[Mapping[str, float]]
) -> tuple[str, float, float] | None:
    """``(signal, margin, z)`` of the signal by which ``own`` stands out from ``others``, or None."""
    best = None
    for sig, floor in (("error_db", SQNR_MARGIN_DB), ("overflow_pct", SHARE_MARGIN_PCT),
                       ("underflow_pct", SHARE_MARGIN_PCT)):
        vals = np.array([o[sig] for o in others if math.isfinite(o[sig])])
        if len(vals) < 2 or not (math.isfinite(own[sig]) or own[sig] == math.inf):
            continue
        med = float(np.median(vals))
        spread = max(1.4826 * float(np.median(np.abs(vals - med))), floor / EXPERT_Z)
        margin = own[sig] - med
        z = margin / spread
        if margin >= floor and z >= EXPERT_Z and (best is None or z > best[2]):
            best = (sig, margin, z)
    return best


def expert_outliers(rows: Sequence[Any]) -> list[ExpertOutlier]:
    """The experts that stand out from their groups in ``rows`` (see the module docstring)."""
    cells = _expert_cells(rows)
    hits: dict[tuple[str, str, int], list[tuple[int, str, float, float]]] = defaultdict(list)
    seen: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    tokens: dict[tuple[str, str, int], float] = defaultdict(float)
    group_tokens: dict[tuple[str, str], float] = defaultdict(float)
    names: dict[tuple[str, str, int], tuple[str, Mapping[str, float]]] = {}
    for (group, tensor, step), experts in cells.items():
        sig = {e: _signals(st) for e, (_, st) in experts.items()}
        for e, (name, st) in experts.items():
            key = (group, tensor, e)
            seen[key].append(step)
            tokens[key] += float(st.get("tokens", 0.0))
            group_tokens[(group, tensor)] += float(st.get("tokens", 0.0))
            names[key] = (name, st)
            found = _stands_out(sig[e], [s for o, s in sig.items() if o != e])
            if found is not None:
                hits[key].append((step, *found))
    out = []
    for key, hit in hits.items():
        onset = min(h[0] for h in hit)
        after = [s for s in seen[key] if s >= onset]
        if len(hit) < MIN_STEPS or len(hit) < STAND_OUT_SHARE * len(after):
            continue
        group, tensor, e = key
        strongest = max(hit, key=lambda h: h[3])
        share = tokens[key] / group_tokens[(group, tensor)] if group_tokens[(group, tensor)] else math.nan
        name, st = names[key]
        out.append(ExpertOutlier(name, group, e, tensor, onset, tuple(h[0] for h in hit), strongest[1],
                                 strongest[2], strongest[3], share, dict(st)))
    return sorted(out, key=lambda o: -o.z * (o.token_share if math.isfinite(o.token_share) else 1.0))


def rule_expert_outlier(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """An expert that stands out from its group's other experts in the FP8 run and not in the control."""
    in_control = {(o.row, o.tensor) for o in expert_outliers(ev.control_rows)}
    trouble = any(f.severity in ("high", "medium") and f.kind != "healthy" for f in found)
    out = []
    for o in expert_outliers(ev.fp8_rows):
        if (o.row, o.tensor) in in_control:
            continue  # the control's data makes it stand out too: not FP8's doing
        n_experts = 1 + max((m[1] for r in ev.fp8_rows if (m := parse_expert_row(r.layer))
                             and m[0] == o.group), default=o.expert)
        busy = not math.isfinite(o.token_share) or o.token_share >= 0.5 / n_experts
        severity = "high" if trouble and busy else ("medium" if busy else "low")
        what = {
            "error_db": f"its SQNR is {o.margin:.1f} dB below its siblings'",
            "overflow_pct": f"{o.margin:.2f} points more of its elements overflow than its siblings'",
            "underflow_pct": f"{o.margin:.2f} points more of its elements underflow than its siblings'",
        }[o.signal]
        out.append(Finding(
            "expert_outlier", severity, confidence(o.z, 4.0 * EXPERT_Z / 2.0) if busy else 0.3,
            f"Expert {o.expert} of {o.group} ({o.tensor}) stands out from step {o.onset}",
            f"On {len(o.steps)} sampled steps from step {o.onset}, {what} (robust z {o.z:.1f} over the "
            f"group's experts); it saw {100 * o.token_share:.1f}% of the group's routed tokens. The "
            "control's same expert does not stand out on the same data: FP8 does this.",
            steps=(o.onset,), layers=(o.row,), tensors=(o.tensor,),
            evidence={"signal": o.signal, "margin": o.margin, "z": o.z, "token_share": o.token_share,
                      "steps": list(o.steps), "stats": o.stats},
            next_experiments=MOE_NEXT_STEPS,
        ))
    return out


def _series(metrics: Mapping[str, Mapping[int, float]], name: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in metrics.get(f"fp8/router/{name}", {}).items() if math.isfinite(v)}


def router_departures(fp8: Mapping[str, Mapping[int, float]],
                      control: Mapping[str, Mapping[int, float]]) -> list[dict[str, Any]]:
    """Router statistics that depart from the control's lastingly (see the module docstring)."""
    out = []
    for stat in ROUTER_STATS:
        a, b = _series(fp8, stat), _series(control, stat)
        steps = sorted(set(a) & set(b))
        if len(steps) < 4:
            continue
        ctl = [b[s] for s in steps]
        if stat == "aux_loss":
            diff = np.array([(a[s] - b[s]) / abs(b[s]) if b[s] else 0.0 for s in steps])
            noise = relative_noise(ctl)
        else:
            diff = np.array([a[s] - b[s] for s in steps])
            d = np.diff(np.array(ctl))
            noise = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2) if len(d) else math.nan
        cut = max(ROUTER_K * (noise if math.isfinite(noise) else 0.0), ROUTER_FLOORS[stat])
        above = np.abs(diff) >= cut
        onset = next((i for i in range(len(steps)) if above[i:].mean() >= 0.6 and above[i]), None)
        if onset is None or above[onset:].sum() < 2:
            continue
        level = float(np.median(diff[onset:]))
        out.append({"stat": stat, "onset": steps[onset], "level": level, "cut": cut, "noise": noise,
                    "z": abs(level) / max(cut / ROUTER_K, 1e-12), "steps": len(steps) - onset})
    return sorted(out, key=lambda d: -d["z"])


CLEAR_ROUTER_CONFIDENCE = 0.5


def rule_router_divergence(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Routing statistics that depart from the control's beyond its noise and lastingly."""
    dep = router_departures(ev.fp8.metrics, ev.control.metrics)
    if not dep:
        return []
    top = dep[0]
    trouble = any(f.severity in ("high", "medium") and f.kind != "healthy" for f in found)
    unit = {"aux_loss": "relative", "worst_load_cv": "CV", "flip_pct": "points"}
    words = "; ".join(
        f"{d['stat']} {d['level']:+.3g} ({unit[d['stat']]}) from step {d['onset']}" for d in dep
    )
    conf = confidence(top["z"], ROUTER_K)
    # With the loss in trouble routing is a lead; without, a problem of its own when the load
    # balance or the routing decisions themselves departed (collapse) or the departure is clear
    # (confidence >= 0.5: z at least 1.7x the cut); a marginal aux-loss shift alone is a note.
    collapse = any(d["stat"] in ("worst_load_cv", "flip_pct") for d in dep)
    severity = "high" if trouble else ("medium" if collapse or conf >= CLEAR_ROUTER_CONFIDENCE else "low")
    return [Finding(
        "router_divergence", severity, conf,
        f"Routing departs from the control from step {top['onset']} ({top['stat']})",
        f"Router statistics against the control at the same steps: {words}; each beyond "
        f"{ROUTER_K:.0f}x the control's own step-to-step noise and its floor, on most steps to the end.",
        steps=tuple(d["onset"] for d in dep), evidence={"departures": dep},
        next_experiments=MOE_NEXT_STEPS,
    )]
