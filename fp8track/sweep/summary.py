"""The sweep's answer: a summary table, the Pareto front (gap vs BF16 layers) and a recommendation.

Recommendation rule (:func:`recommend`): among finished, unpruned trials whose final held-out gap
to the BF16 control is at most the *tolerance*, take the one with the fewest BF16 layers, then the
fastest recipe, then the smallest gap. The tolerance is ``factor * spread`` (``factor`` 1 by
default) where ``spread`` is how much the control's own final held-out loss moves between seeds
(max - min over ``control_seeds`` seeds), floored at ``floor`` nats (0.01) so a sweep with one
control seed still has a tolerance: a gap smaller than the control's seed-to-seed noise is no
evidence that FP8 hurt.

"Fastest recipe" is the order of :data:`RECIPE_SPEED_ORDER`, the expected GPU throughput (CPU
emulation times say nothing about GPU speed): per-tensor scaling needs one scale per tensor
(delayed reuses a history, current adds one amax pass), block recipes compute and apply one scale
per 32 (MXFP8) or 128 (block) elements, and ``fp8_input_bf16_gemm`` runs its GEMM in BF16.
Measured step time breaks ties within one recipe family.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

RECIPE_SPEED_ORDER = ("delayed", "current", "mxfp8", "block", "fp8_input_bf16_gemm", "bf16")
"""Recipe families, fastest first (module docstring)."""
DEFAULT_FLOOR = 0.01
"""Smallest tolerance, nats."""


@dataclass(frozen=True)
class TrialRow:
    """One trial as the summary sees it (read back from its MLflow child run).

    Attributes:
        trial: Optuna trial number.
        state: ``COMPLETE``, ``PRUNED`` or ``FAIL``.
        recipe: the recipe as written; bf16_layers the spec as written.
        n_bf16, n_fp8: linears kept in BF16 / run in FP8.
        gap, gap_best: final and best held-out gap to the control, nats (NaN if unknown).
        spikes_fp8_only, spikes_shared: loss spikes only FP8 had / the control had too.
        worst_underflow_pct: max underflow share over the FP8 layers' tensors, percent.
        fp8_share: FP8 linears / all linears.
        step_time_s: seconds per optimizer step.
        run_id: the MLflow child run.
    """

    trial: int
    state: str
    recipe: str
    bf16_layers: str
    n_bf16: int
    n_fp8: int
    gap: float
    gap_best: float = math.nan
    spikes_fp8_only: float = 0.0
    spikes_shared: float = 0.0
    worst_underflow_pct: float = 0.0
    fp8_share: float = math.nan
    step_time_s: float = math.nan
    run_id: str = ""

    @property
    def recipe_rank(self) -> int:
        family = self.recipe.split(":", 1)[0]
        family = {"tensorwise": "current", "rowwise": "current", "rowwise_with_gw_hp": "current",
                  "blockwise": "block"}.get(family, family)
        return RECIPE_SPEED_ORDER.index(family) if family in RECIPE_SPEED_ORDER else len(RECIPE_SPEED_ORDER)


@dataclass(frozen=True)
class Recommendation:
    """The answer. ``trial`` is ``None`` when no trial stayed within ``tolerance``; ``closest``
    is then the finished trial with the smallest gap."""

    trial: TrialRow | None
    tolerance: float
    spread: float
    reason: str
    closest: TrialRow | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"trial": asdict(self.trial) if self.trial else None, "tolerance": self.tolerance,
                "spread": self.spread, "reason": self.reason,
                "closest": asdict(self.closest) if self.closest else None}


def tolerance(spread: float, factor: float = 1.0, floor: float = DEFAULT_FLOOR) -> float:
    """``max(factor * spread, floor)`` nats (module docstring)."""
    s = spread if math.isfinite(spread) else 0.0
    return max(factor * s, floor)


def recommend(rows: Sequence[TrialRow], spread: float, factor: float = 1.0, floor: float = DEFAULT_FLOOR) -> Recommendation:
    """The recommendation rule of the module docstring.

    Example:
        >>> rows = [TrialRow(0, "COMPLETE", "current", "none", 0, 9, 0.08),
        ...         TrialRow(1, "COMPLETE", "mxfp8", "first:1", 4, 5, 0.004),
        ...         TrialRow(2, "COMPLETE", "delayed:hybrid:h16:max", "auto:1", 1, 8, 0.004),
        ...         TrialRow(3, "COMPLETE", "current", "auto:1", 1, 8, 0.003)]
        >>> r = recommend(rows, spread=0.005, floor=0.001)
        >>> r.trial.trial, r.tolerance
        (2, 0.005)
    """
    tol = tolerance(spread, factor, floor)
    done = [r for r in rows if r.state == "COMPLETE" and math.isfinite(r.gap)]
    ok = [r for r in done if r.gap <= tol]
    if ok:
        best = min(ok, key=lambda r: (r.n_bf16, r.recipe_rank, r.step_time_s if math.isfinite(r.step_time_s) else math.inf, r.gap))
        reason = (f"fewest BF16 layers ({best.n_bf16}) among the {len(ok)} of {len(done)} finished trials whose "
                  f"held-out gap stays within {tol:.4f} nats of the BF16 control (control seed spread "
                  f"{spread:.4f} nats); then the fastest recipe")
        return Recommendation(best, tol, spread, reason)
    closest = min(done, key=lambda r: r.gap) if done else None
    reason = (f"no finished trial stays within {tol:.4f} nats of the BF16 control (control seed spread {spread:.4f}); "
              "keep more layers in BF16 or try other recipes")
    return Recommendation(None, tol, spread, reason, closest)


def pareto_front(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """Finished trials no other beats on both fewer-or-equal BF16 layers and a smaller-or-equal gap
    (strictly on one), sorted by BF16 layers."""
    done = [r for r in rows if r.state == "COMPLETE" and math.isfinite(r.gap)]
    front = [r for r in done
             if not any((o.n_bf16 <= r.n_bf16 and o.gap <= r.gap) and (o.n_bf16 < r.n_bf16 or o.gap < r.gap) for o in done)]
    return sorted(front, key=lambda r: (r.n_bf16, r.gap))


TABLE_COLUMNS = ("trial", "state", "recipe", "bf16_layers", "n_bf16", "gap", "spikes_fp8_only", "spikes_shared",
                 "worst_underflow_pct", "fp8_share")


def summary_table(rows: Sequence[TrialRow]) -> dict[str, list[Any]]:
    """Column -> values (MLflow ``log_table`` form), one entry per trial in trial order."""
    ordered = sorted(rows, key=lambda r: r.trial)
    return {c: [_plain(getattr(r, c)) for r in ordered] for c in TABLE_COLUMNS}


def _plain(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def pareto_figure(rows: Sequence[TrialRow], rec: Recommendation) -> Any:
    """Matplotlib figure: final gap (nats) vs number of BF16 layers, one point per finished trial,
    the Pareto front as a line, the tolerance as a band, the recommendation circled."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    done = [r for r in rows if r.state == "COMPLETE" and math.isfinite(r.gap)]
    families = sorted({r.recipe.split(":")[0] for r in done})
    for fam in families:
        pts = [r for r in done if r.recipe.split(":")[0] == fam]
        ax.scatter([r.n_bf16 for r in pts], [r.gap for r in pts], label=fam, alpha=0.8)
    front = pareto_front(rows)
    if front:
        ax.plot([r.n_bf16 for r in front], [r.gap for r in front], "k--", lw=1, label="Pareto front")
    ax.axhspan(-rec.tolerance, rec.tolerance, color="green", alpha=0.1, label=f"tolerance {rec.tolerance:.3f}")
    if rec.trial is not None:
        ax.scatter([rec.trial.n_bf16], [rec.trial.gap], s=250, facecolors="none", edgecolors="red", lw=2,
                   label=f"recommended: trial {rec.trial.trial}")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("linear layers kept in BF16")
    ax.set_ylabel("held-out loss gap to BF16 control (nats)")
    ax.set_title("FP8 sweep: accuracy cost vs BF16 layers")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def row_from_run(run: Any) -> TrialRow:
    """A :class:`TrialRow` from an MLflow child run the executor logged."""
    p, m, t = run.data.params, run.data.metrics, run.data.tags

    def f(key: str, default: float = math.nan) -> float:
        return float(m[key]) if key in m else default

    return TrialRow(
        trial=int(t.get("fp8track.trial", -1)), state=t.get("fp8track.state", "FAIL"), recipe=p.get("recipe", ""),
        bf16_layers=p.get("bf16_layers", ""), n_bf16=int(p.get("n_bf16_layers", -1)),
        n_fp8=int(p.get("n_fp8_layers", -1)), gap=f("fp8/val_loss_gap"), gap_best=f("fp8/val_loss_gap_best"),
        spikes_fp8_only=f("fp8/spikes/fp8_only", 0.0), spikes_shared=f("fp8/spikes/shared", 0.0),
        worst_underflow_pct=f("fp8/worst/underflow_pct", 0.0), fp8_share=f("fp8/fp8_layer_share"),
        step_time_s=f("fp8/step_time_s"), run_id=run.info.run_id,
    )


def format_text(rows: Sequence[TrialRow], rec: Recommendation) -> str:
    """Plain-text table and recommendation (what ``fp8track sweep --summary`` prints)."""
    head = f"{'trial':>5} {'state':<8} {'recipe':<26} {'bf16_layers':<12} {'#bf16':>5} {'gap':>8} " \
           f"{'spk fp8':>7} {'spk shr':>7} {'underfl%':>8} {'fp8 share':>9}"
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: r.trial):
        gap = f"{r.gap:8.4f}" if math.isfinite(r.gap) else f"{'-':>8}"
        share = f"{r.fp8_share:9.2f}" if math.isfinite(r.fp8_share) else f"{'-':>9}"
        lines.append(f"{r.trial:>5} {r.state:<8} {r.recipe[:26]:<26} {r.bf16_layers[:12]:<12} {r.n_bf16:>5} {gap} "
                     f"{r.spikes_fp8_only:>7.0f} {r.spikes_shared:>7.0f} {r.worst_underflow_pct:>8.3f} {share}")
    lines.append("")
    if rec.trial is not None:
        lines.append(f"Recommendation: recipe {rec.trial.recipe}, bf16_layers {rec.trial.bf16_layers} "
                     f"(trial {rec.trial.trial}, BF16 layers: {rec.trial.n_bf16}, gap {rec.trial.gap:.4f} nats)")
    elif rec.closest is not None:
        lines.append(f"No recommendation; closest: trial {rec.closest.trial} (gap {rec.closest.gap:.4f} nats)")
    lines.append(f"  {rec.reason}")
    return "\n".join(lines)


def as_mapping(rows: Sequence[TrialRow]) -> list[Mapping[str, Any]]:
    return [asdict(r) for r in rows]


__all__ = ["RECIPE_SPEED_ORDER", "TrialRow", "Recommendation", "tolerance", "recommend", "pareto_front",
           "summary_table", "pareto_figure", "row_from_run", "format_text"]
