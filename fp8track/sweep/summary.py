"""The sweep's answer: a summary table, the Pareto front (gap vs FP8 FLOP share) and a
recommendation judged in the noise it is measured in.

* **Gap**: the trial's final ``metric`` minus the BF16 control's at the same seed, signed so that
  a positive gap is worse than BF16 (``goal: maximize`` flips the sign), in the metric's units.
* **Cost**: the share of the step's GEMM FLOPs that stays in FP8 (:func:`fp8track.trial.fp8_flop_share`,
  from the layers' shapes: every layer of a dense model sees the step's tokens, so a kept
  ``lm_head`` weighs what its ``in * out`` weighs, not "one layer"); more FP8 is cheaper.
* **Finalists**: the finished trials within the tolerance at the trials' seed (``factor *`` the
  control's seed spread, at least ``floor``), cheapest first (highest FP8 FLOP share, then the
  fastest recipe, :data:`RECIPE_SPEED_ORDER`), at most ``k``; with none within it, the ``k`` with
  the smallest gaps. The executor reruns them on the control's other seeds.
* **Judgement** (:func:`judge`): the paired gaps ``d_s = finalist_s - control_s`` over the control's
  seeds; ``band = max(factor * max(control spread, spread of d), floor)`` (spread = max - min over
  seeds). Mean gap ``> band``: worse than BF16; ``< -band``: better than BF16 beyond noise; else
  "no measurable difference" (a negative gap inside the band is not a win).
* **Recommendation**: the cheapest finalist that is not worse; it names the layers kept in BF16,
  the ``apply_fp8(...)`` call and the YAML values that reproduce it, and, as information only, the
  FP8 layers torchao's auto filter would keep in BF16 for speed (:func:`torchao_small`).

"Fastest recipe" (:data:`RECIPE_SPEED_ORDER`) is the expected GPU throughput, not CPU emulation
time: ``nvfp4`` first (on Blackwell, the only GPUs that run it in hardware, its E2M1 GEMMs have
twice the FP8 rate); per-tensor scaling needs one scale per tensor (delayed reuses a history, current adds one
amax pass), block recipes one per 32 (MXFP8) or 128 (block) elements, ``fp8_input_bf16_gemm`` runs
its GEMM in BF16.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

RECIPE_SPEED_ORDER = ("nvfp4", "delayed", "current", "mxfp8", "block", "fp8_input_bf16_gemm", "bf16")
"""Recipe families, fastest first (module docstring)."""
DEFAULT_FLOOR = 0.01
"""Smallest noise band, in the metric's units."""
VERDICTS = ("worse than BF16", "no measurable difference", "better than BF16")


@dataclass(frozen=True)
class TrialRow:
    """One trial as the summary sees it (read back from its MLflow child run).

    Attributes:
        trial: Optuna trial number.
        state: ``COMPLETE``, ``PRUNED`` or ``FAIL``.
        recipe: the recipe as written; bf16_layers the spec as written.
        n_bf16: GEMM layers kept in BF16 (-1 unknown).
        gap: final metric minus the control's at the same seed, positive = worse (NaN if unknown).
        fp8_flop_share: share of the step's GEMM FLOPs in FP8, 0..1 (NaN if the program did not
            record its layers).
        bf16_names: the layers kept in BF16, by name.
        value: the final metric as logged.
        step_time_s: seconds per optimizer step when the program logged it.
        run_id: the MLflow child run.
        params: the trial's varying parameters as written (name -> text).
        error: why it failed (``fp8track.error`` tag of its run, or the trial's reason when it
            failed before its run existed, e.g. its control failed).
    """

    trial: int
    state: str
    recipe: str
    bf16_layers: str
    n_bf16: int
    gap: float
    fp8_flop_share: float = math.nan
    bf16_names: tuple[str, ...] = ()
    value: float = math.nan
    step_time_s: float = math.nan
    run_id: str = ""
    params: Mapping[str, str] = field(default_factory=dict)
    error: str = ""

    @property
    def recipe_rank(self) -> int:
        family = self.recipe.split(":", 1)[0]
        family = {"tensorwise": "current", "rowwise": "current", "rowwise_with_gw_hp": "current",
                  "blockwise": "block"}.get(family, family)
        return RECIPE_SPEED_ORDER.index(family) if family in RECIPE_SPEED_ORDER else len(RECIPE_SPEED_ORDER)

    @property
    def finished(self) -> bool:
        return self.state == "COMPLETE" and math.isfinite(self.gap)

    def cost_key(self) -> tuple[float, int, int, float]:
        """Cheapest first: most FP8 FLOPs, fastest recipe, fewest BF16 layers, smallest gap."""
        share = self.fp8_flop_share if math.isfinite(self.fp8_flop_share) else -1.0
        return (-share, self.recipe_rank, self.n_bf16, self.gap)


@dataclass(frozen=True)
class Judged:
    """A finalist measured on every control seed: ``gaps`` seed -> gap, their mean, the noise
    ``band`` and the verdict (:data:`VERDICTS`)."""

    row: TrialRow
    gaps: Mapping[int, float]
    mean_gap: float
    band: float
    verdict: str


@dataclass(frozen=True)
class Recommendation:
    """The answer. ``trial`` is ``None`` when every finalist is worse than BF16 beyond noise;
    ``closest`` is then the finalist with the smallest mean gap."""

    trial: TrialRow | None
    tolerance: float
    spread: float
    reason: str
    closest: TrialRow | None = None
    finalists: tuple[Judged, ...] = ()
    verdict: str = ""
    mean_gap: float = math.nan
    band: float = math.nan
    apply_call: str = ""
    yaml_values: Mapping[str, str] = field(default_factory=dict)
    info: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("finalists",)}
        d["finalists"] = [{"trial": j.row.trial, "recipe": j.row.recipe, "bf16_layers": j.row.bf16_layers,
                           "gaps_by_seed": {str(s): g for s, g in j.gaps.items()}, "mean_gap": j.mean_gap,
                           "band": j.band, "verdict": j.verdict} for j in self.finalists]
        return _finite(d)


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def signed_gap(value: float, control: float, goal: str) -> float:
    """``value - control`` for ``minimize``, ``control - value`` for ``maximize``: positive = worse.

    Example:
        >>> signed_gap(2.5, 2.4, "minimize"), signed_gap(0.7, 0.8, "maximize")
        (0.10000000000000009, 0.10000000000000009)
    """
    return value - control if goal == "minimize" else control - value


def spread(values: Sequence[float]) -> float:
    """max - min of the finite values (0 with fewer than two)."""
    xs = [v for v in values if math.isfinite(v)]
    return max(xs) - min(xs) if len(xs) > 1 else 0.0


def tolerance(spread_: float, factor: float = 1.0, floor: float = DEFAULT_FLOOR) -> float:
    """``max(factor * spread, floor)``."""
    s = spread_ if math.isfinite(spread_) else 0.0
    return max(factor * s, floor)


def pick_finalists(rows: Sequence[TrialRow], tol: float, k: int) -> list[TrialRow]:
    """Finalists (module docstring): one per parameter set, cheapest first."""
    seen: set[tuple[tuple[str, str], ...]] = set()
    done = []
    for r in sorted((r for r in rows if r.finished), key=lambda r: r.trial):
        key = tuple(sorted(r.params.items())) or (("recipe", r.recipe), ("bf16_layers", r.bf16_layers))
        if key not in seen:
            seen.add(key)
            done.append(r)
    ok = sorted((r for r in done if r.gap <= tol), key=TrialRow.cost_key)
    return ok[:k] if ok else sorted(done, key=lambda r: r.gap)[:k]


def judge(row: TrialRow, gaps: Mapping[int, float], control_spread: float, factor: float = 1.0,
          floor: float = DEFAULT_FLOOR) -> Judged:
    """The verdict on paired per-seed gaps (module docstring).

    Example:
        >>> judge(TrialRow(0, "COMPLETE", "current", "none", 0, -0.02), {0: -0.02, 1: 0.01}, 0.05).verdict
        'no measurable difference'
        >>> judge(TrialRow(0, "COMPLETE", "current", "none", 0, 0.3), {0: 0.3, 1: 0.28}, 0.05).verdict
        'worse than BF16'
    """
    vals = [g for g in gaps.values() if math.isfinite(g)]
    mean = statistics.fmean(vals) if vals else math.nan
    band = tolerance(
        max(control_spread if math.isfinite(control_spread) else 0.0, spread(vals)), factor, floor
    )
    verdict = VERDICTS[0] if mean > band else VERDICTS[2] if mean < -band else VERDICTS[1]
    return Judged(row, dict(gaps), mean, band, verdict)


def torchao_small(layers: Sequence[Mapping[str, Any]], recipe: str) -> list[str]:
    """FP8 layers torchao's auto filter would keep in BF16 because FP8 is not faster there
    (``torchao/float8/float8_linear_utils.py``: tensorwise skips ``K <= 4096 and N <= 1024``;
    rowwise skips ``N <= 2048``, ``K <= 1024``, or ``N <= 4096 and K <= 2048``; both skip dims
    not divisible by 16; K = in_features, N = out_features, H100 measurements)."""
    rowwise = recipe.split(":")[0] in ("rowwise", "rowwise_with_gw_hp", "mxfp8", "block")
    out = []
    for lay in layers:
        if not lay.get("fp8"):
            continue
        k, n = int(lay["in"]), int(lay["out"])
        if k % 16 or n % 16:
            small = True
        elif rowwise:
            small = n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
        else:
            small = k <= 4096 and n <= 1024
        if small:
            out.append(str(lay["layer"]))
    return out


def apply_call(row: TrialRow) -> str:
    """The ``apply_fp8(...)`` line that keeps exactly the recommended layers in BF16."""
    names = list(row.bf16_names)
    spec = repr(names) if names else '"none"'
    return f'apply_fp8(model, "{row.recipe}", bf16_layers={spec}, backend="auto")'


def recommend(
    judged: Sequence[Judged],
    control_spread: float,
    factor: float = 1.0,
    floor: float = DEFAULT_FLOOR,
    layers: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> Recommendation:
    """The cheapest finalist not worse than BF16 beyond noise (module docstring). ``layers`` maps a
    run id to its layer table (for the torchao information)."""
    tol = tolerance(control_spread, factor, floor)
    ok = sorted((j for j in judged if j.verdict != VERDICTS[0]), key=lambda j: j.row.cost_key())
    if not ok:
        closest = min(judged, key=lambda j: j.mean_gap, default=None)
        reason = ("every finalist is worse than the BF16 control beyond the noise band"
                  if judged else "no trial finished") + "; keep more layers in BF16 or try other recipes"
        return Recommendation(
            None, tol, control_spread, reason, closest.row if closest else None, tuple(judged)
        )
    best = ok[0]
    r = best.row
    seeds = len(best.gaps)
    share = f"{100 * r.fp8_flop_share:.1f} % of GEMM FLOPs in FP8" if math.isfinite(r.fp8_flop_share) else \
        f"{r.n_bf16} BF16 layers"
    reason = (f"cheapest of {len(judged)} finalists ({share}) whose mean gap over {seeds} control seed(s), "
              f"{best.mean_gap:+.4f}, is {best.verdict} (noise band +-{best.band:.4f})")
    info = ()
    table = (layers or {}).get(r.run_id)
    if table:
        small = torchao_small(table, r.recipe)
        if small:
            info = (
                f"information: torchao's auto filter would also keep {len(small)} of the FP8 layers in BF16 "
                f"as too small to run faster in FP8 on H100: {', '.join(small[:6])}"
                f"{' ...' if len(small) > 6 else ''}",
            )
    return Recommendation(
        r,
        tol,
        control_spread,
        reason,
        None,
        tuple(judged),
        best.verdict,
        best.mean_gap,
        best.band,
        apply_call(r),
        {"recipe": r.recipe, "bf16_layers": r.bf16_layers},
        info,
    )


def pareto_front(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """Finished trials no other beats on both a larger-or-equal FP8 FLOP share (fewer-or-equal BF16
    layers when unknown) and a smaller-or-equal gap (strictly on one), cheapest first."""
    done = [r for r in rows if r.finished]

    def cost(r: TrialRow) -> float:
        return -r.fp8_flop_share if math.isfinite(r.fp8_flop_share) else float(r.n_bf16)

    front = [
        r
        for r in done
        if not any(
            cost(o) <= cost(r) and o.gap <= r.gap and (cost(o) < cost(r) or o.gap < r.gap) for o in done
        )
    ]
    return sorted(front, key=lambda r: (cost(r), r.gap))


TABLE_COLUMNS = (
    "trial",
    "state",
    "recipe",
    "bf16_layers",
    "fp8_flop_share",
    "gap",
    "n_bf16",
    "value",
    "run_id",
    "error",
)


def summary_table(rows: Sequence[TrialRow]) -> dict[str, list[Any]]:
    """Column -> values (MLflow ``log_table`` form), one entry per trial in trial order."""
    ordered = sorted(rows, key=lambda r: r.trial)
    return {c: [_finite(getattr(r, c)) for r in ordered] for c in TABLE_COLUMNS}


def pareto_figure(rows: Sequence[TrialRow], rec: Recommendation) -> Any:
    """Matplotlib figure: gap vs FP8 FLOP share (percent), one labelled point per trial (pruned ones
    as open grey markers at their last gap), the Pareto front as a line, the noise band shaded,
    the recommendation circled; legend outside the axes."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9, 4.8))
    ax = fig.add_subplot()
    use_share = any(math.isfinite(r.fp8_flop_share) for r in rows)

    def x(r: TrialRow) -> float:
        return 100 * r.fp8_flop_share if use_share else float(r.n_bf16)

    done = [r for r in rows if r.finished]
    band = rec.band if math.isfinite(rec.band) else rec.tolerance
    ax.axhspan(-band, band, color="green", alpha=0.12, label=f"noise band +-{band:.3f}")
    ax.axhline(0.0, color="grey", lw=0.6)
    for fam in sorted({r.recipe.split(":")[0] for r in done}):
        pts = [r for r in done if r.recipe.split(":")[0] == fam]
        ax.scatter([x(r) for r in pts], [r.gap for r in pts], label=fam, alpha=0.85, zorder=3)
    pruned = [r for r in rows if r.state == "PRUNED" and math.isfinite(r.gap)]
    if pruned:
        ax.scatter([x(r) for r in pruned], [r.gap for r in pruned], marker="x", color="grey", zorder=3,
                   label=f"pruned ({len(pruned)})")
    front = pareto_front(rows)
    if len(front) > 1:
        ax.plot([x(r) for r in front], [r.gap for r in front], "k--", lw=1, label="Pareto front", zorder=2)
    if rec.trial is not None:
        ax.scatter(
            [x(rec.trial)],
            [rec.trial.gap],
            s=260,
            facecolors="none",
            edgecolors="red",
            lw=2,
            zorder=4,
            label=f"recommended: trial {rec.trial.trial}",
        )
    if use_share:
        ax.set_xlabel("GEMM FLOPs in FP8 (%)")
    else:
        ax.set_xlabel("layers kept in BF16")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("gap to BF16 control (metric units, + = worse)")
    ax.set_title("FP8 sweep: accuracy cost vs FP8 share (labels: trial: bf16_layers)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    ax.margins(0.2)  # room for the labels inside the axes
    fig.tight_layout()  # before the labels: their places are measured on the final layout
    label_points(fig, ax, _labels([(x(r), r.gap, r) for r in done + pruned]))
    return fig


def _labels(points: Sequence[tuple[float, float, TrialRow]]) -> list[tuple[float, float, str]]:
    """One label per drawn position: trials at the same point share it (``"2, 5: last:1"``)."""
    at: dict[tuple[float, float], list[TrialRow]] = {}
    for px, py, r in points:
        at.setdefault((round(px, 9), round(py, 9)), []).append(r)
    out = []
    for (px, py), rs in at.items():
        by_spec: dict[str, list[str]] = {}
        for r in sorted(rs, key=lambda r: r.trial):
            by_spec.setdefault(r.bf16_layers, []).append(str(r.trial))
        out.append((px, py, " / ".join(f"{', '.join(ts)}: {spec}" for spec, ts in by_spec.items())))
    return out


LABEL_RADII = (5, 11, 18, 27, 38, 52, 70, 92)
"""Distances (points) tried for a label from its point, nearest first."""
LABEL_ANGLES = (0, 180, 30, -30, 150, -150, 60, -60, 120, -120, 90, -90)
"""Directions tried (degrees): level with the point first, so a label reads as its point's."""


def label_points(fig: Any, ax: Any, labels: Sequence[tuple[float, float, str]]) -> list[Any]:
    """Annotate each ``(x, y, text)`` where its text overlaps no other label, no drawn point and
    stays inside the axes: offsets tried nearest first (:data:`LABEL_RADII` x
    :data:`LABEL_ANGLES`), measured with the renderer; a label set away from its point gets a thin
    leader line. Where nothing fits, the place overlapping least. Hand-written with matplotlib
    alone: the usual helper (``adjustText``) is another dependency for one figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import Bbox

    renderer = FigureCanvasAgg(fig).get_renderer()
    axbox = ax.get_window_extent(renderer)
    px_per_pt = fig.dpi / 72.0
    centres = [ax.transData.transform((lx, ly)) for lx, ly, _ in labels]
    taken = [Bbox.from_bounds(cx - 4 * px_per_pt, cy - 4 * px_per_pt, 8 * px_per_pt, 8 * px_per_pt)
             for cx, cy in centres]
    placed = []
    for (lx, ly, text), _ in sorted(zip(labels, centres, strict=True), key=lambda lc: -lc[1][1]):
        best: tuple[float, Any] | None = None
        for radius in LABEL_RADII:
            for angle in LABEL_ANGLES:
                ann = _annotation(ax, lx, ly, text, radius, angle)
                box = ann.get_window_extent(renderer).padded(1.5)
                cost = sum(_overlap(box, o) for o in taken) + _outside(box, axbox)
                if best is not None and cost >= best[0]:
                    ann.remove()
                    continue
                if best is not None:
                    best[1].remove()
                best = (cost, ann)
                if cost == 0:
                    break
            if best is not None and best[0] == 0:
                break
        assert best is not None
        taken.append(best[1].get_window_extent(renderer).padded(1.5))
        placed.append(best[1])
    return placed


def _annotation(ax: Any, x: float, y: float, text: str, radius: float, angle: float) -> Any:
    dx, dy = radius * math.cos(math.radians(angle)), radius * math.sin(math.radians(angle))
    ha = "left" if dx > 1e-6 else "right" if dx < -1e-6 else "center"
    va = "bottom" if dy > 1e-6 else "top" if dy < -1e-6 else "center"
    arrow = {"arrowstyle": "-", "color": "0.5", "lw": 0.5, "shrinkA": 0, "shrinkB": 3}
    arrow = arrow if radius > 12 else None
    return ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va, fontsize=7,
                       arrowprops=arrow, zorder=5)


def _overlap(a: Any, b: Any) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _outside(box: Any, frame: Any) -> float:
    """Area of ``box`` outside ``frame`` (display units)."""
    return box.width * box.height - _overlap(box, frame)


def format_text(rows: Sequence[TrialRow], rec: Recommendation) -> str:
    """Plain-text table and recommendation (what ``fp8track sweep --summary`` prints); columns
    sized to their contents so nothing is cut."""
    cols = ("trial", "state", "recipe", "bf16_layers", "fp8 FLOPs", "gap", "#bf16")
    body = []
    for r in sorted(rows, key=lambda r: r.trial):
        share = f"{100 * r.fp8_flop_share:.1f}%" if math.isfinite(r.fp8_flop_share) else "-"
        gap = f"{r.gap:+.4f}" if math.isfinite(r.gap) else "-"
        body.append((str(r.trial), r.state, r.recipe, r.bf16_layers, share, gap, str(r.n_bf16)))
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    lines = [line, "-" * len(line)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)).rstrip() for b in body]
    lines.append("")
    failed = [r for r in sorted(rows, key=lambda r: r.trial) if r.state == "FAIL"]
    if failed:
        lines.append("Failed trials:")
        for r in failed:
            why = " ".join(r.error.split()) or "see its run"
            lines.append(f"  trial {r.trial}: {why[:200]}{' ...' if len(why) > 200 else ''}")
        lines.append("")
    if rec.finalists:
        lines.append("Finalists (paired gaps on the control's seeds):")
        for j in rec.finalists:
            gaps = ", ".join(f"seed {s}: {g:+.4f}" for s, g in sorted(j.gaps.items()))
            lines.append(
                f"  trial {j.row.trial} {j.row.recipe} / {j.row.bf16_layers}: mean {j.mean_gap:+.4f} "
                f"(+-{j.band:.4f}) -> {j.verdict}  [{gaps}]"
            )
    if rec.trial is not None:
        t = rec.trial
        lines.append(f"Recommendation: recipe {t.recipe}, bf16_layers {t.bf16_layers} (trial {t.trial})")
        lines.append(f"  BF16 layers: {', '.join(t.bf16_names) or 'none'}")
        lines.append(f"  {rec.apply_call}")
        lines.append(f"  YAML: recipe: {t.recipe}   bf16_layers: {t.bf16_layers}")
    elif rec.closest is not None:
        lines.append(f"No recommendation; closest: trial {rec.closest.trial} ({rec.closest.recipe} / "
                     f"{rec.closest.bf16_layers}, gap {rec.closest.gap:+.4f})")
    lines.append(f"  {rec.reason}")
    lines += [f"  {i}" for i in rec.info]
    return "\n".join(lines)


__all__ = ["RECIPE_SPEED_ORDER", "VERDICTS", "TrialRow", "Judged", "Recommendation", "signed_gap", "spread",
           "tolerance", "pick_finalists", "judge", "torchao_small", "apply_call", "recommend", "pareto_front",
           "summary_table", "pareto_figure", "label_points", "format_text"]
