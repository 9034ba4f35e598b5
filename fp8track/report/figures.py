"""The report's figures, drawn on ``matplotlib.figure.Figure`` (no pyplot, no global backend) and
returned as base64 PNG text for ``<img src="data:image/png;base64,...">``. The per-layer heatmaps
are the one heatmap of :mod:`fp8track.trackers.heatmap` (also MLflow's ``fp8_heatmap.png``)."""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fp8track.analysis.baseline import RunData
from fp8track.analysis.diagnose import Diagnosis, spike_config_for
from fp8track.optional import require
from fp8track.trackers.heatmap import LABEL_PT, MARK_COLOR
from fp8track.trackers.heatmap import heatmap_figure as shared_heatmap_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FP8_COLOR, CONTROL_COLOR, BAD_COLOR = MARK_COLOR, "#1f77b4", "#ff7f0e"

HEATMAPS: tuple[tuple[str, str], ...] = (
    ("underflow_pct", "underflow (% of nonzero elements flushed to zero)"),
    ("rel_error_db", "relative error (dB) = -SQNR: error energy over the tensor's own energy"),
    ("log10_one_minus_cos", "log10(1 - cosine similarity)"),
    ("scale_drift_log2", "scale drift (binades): log2(scale used / current scale)"),
)
"""Per-layer heatmaps (:data:`fp8track.trackers.heatmap.PANELS`): relative error rather than raw MSE,
which scales with each tensor's magnitude."""

DPI = 90
"""Pixels per inch of the PNGs; a 10-inch figure is 900 px wide, shown at that size in the report."""

def to_png_base64(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(width: float, height: float) -> Figure:
    require("matplotlib", "the HTML report")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def loss_figure(d: Diagnosis) -> Figure:
    """Loss of both runs over steps, spikes marked, the gap's onset as a line; below, the smoothed
    relative gap with the tolerance band (the control's own noise times ``noise_k``)."""
    lc = d.loss
    fig = _figure(10, 6)
    ax, gx = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    steps = np.array(lc.steps)
    ax.plot(steps, lc.control, color=CONTROL_COLOR, lw=1, label="BF16 control")
    ax.plot(steps, lc.fp8, color=FP8_COLOR, lw=1, alpha=0.85, label="FP8")
    index = {s: i for i, s in enumerate(lc.steps)}
    warm = spike_config_for(len(steps)).warmup
    if 1 < warm <= len(steps):  # the detector cannot mark a spike before it has a baseline: say so
        ax.axvspan(steps[0], steps[warm - 1], color="grey", alpha=0.12, lw=0,
                   label=f"spike detection warming up (first {warm} steps)")
    for events, color, label in (
        (d.fp8_spikes, FP8_COLOR, "FP8 spike"),
        (d.control_spikes, CONTROL_COLOR, "control spike"),
    ):
        xs = [e.peak_step for e in events if e.peak_step in index]
        ys = [lc.fp8[index[s]] if color == FP8_COLOR else lc.control[index[s]] for s in xs]
        if xs:
            ax.scatter(xs, ys, marker="v", s=50, color=color, edgecolor="black", zorder=3, label=label)
    if lc.onset_step is not None:
        for a in (ax, gx):
            a.axvline(lc.onset_step, color=BAD_COLOR, ls="--", lw=1.2)
        # In axes height, on the side of the line with more room: the label stays inside the plot.
        right_half = lc.onset_step > (steps[0] + steps[-1]) / 2
        ax.text(
            lc.onset_step,
            0.97,
            f" gap opens (step {lc.onset_step}, {lc.phase}) "
            if right_half
            else f" gap opens (step {lc.onset_step}, {lc.phase})",
            transform=ax.get_xaxis_transform(),
            color=BAD_COLOR,
            ha="right" if right_half else "left",
            va="top",
            fontsize=8,
            clip_on=True,
        )
    ax.set_ylabel("training loss")
    ax.set_title("Training loss: FP8 vs BF16 control (triangles: spikes detected after the warm-up)")
    ax.legend(fontsize=8)
    finite = np.isfinite(np.array(lc.smooth_gap))
    gx.plot(
        steps,
        100 * np.where(np.isfinite(lc.rel_gap), lc.rel_gap, np.nan),
        color="grey",
        lw=0.6,
        label="per step",
    )
    gx.plot(
        steps[finite], 100 * np.array(lc.smooth_gap)[finite], color=FP8_COLOR, lw=1.5, label="running median"
    )
    unit = "paired gap noise" if lc.unit == "paired" else "control noise"
    gx.axhspan(-100 * lc.tolerance, 100 * lc.tolerance, color=CONTROL_COLOR, alpha=0.15,
               label=f"±{100 * lc.tolerance:.2f}% ({unit} x k)")
    if lc.seed_band > lc.tolerance:  # a lasting gap must also end beyond this (loss_gap.GapConfig.seed_band)
        gx.axhline(100 * lc.seed_band, color=CONTROL_COLOR, ls=":", lw=1,
                   label=f"+{100 * lc.seed_band:.0f}% seed band")
    gx.axhline(0, color="black", lw=0.5)
    gx.set_ylabel("gap to control (%)")
    gx.set_xlabel("step")
    gx.legend(fontsize=8)
    return fig


def eval_figure(fp8: RunData, control: RunData) -> Figure | None:
    """One panel per evaluation metric both runs recorded (``fp8/eval/<name>``)."""
    a, b = fp8.eval_metrics(), control.eval_metrics()
    names = sorted(set(a) & set(b))
    if not names:
        return None
    fig = _figure(10, 2.6 * len(names))
    axes = fig.subplots(len(names), 1, squeeze=False)[:, 0]
    for axis, name in zip(axes, names, strict=True):
        for series, color, label in ((b[name], CONTROL_COLOR, "BF16 control"), (a[name], FP8_COLOR, "FP8")):
            xs = sorted(series)
            axis.plot(xs, [series[s] for s in xs], marker="o", color=color, label=label)
        axis.set_title(f"evaluation: {name}")
        axis.set_xlabel("step")
        axis.legend(fontsize=8)
    return fig


def heatmap_figure(rows: Sequence[Any], stat: str, title: str, mark: Sequence[str] = ()) -> Figure | None:
    """Layer/tensor x step heatmap of one statistic; labels in ``mark`` (the top-ranked) in red. The
    one heatmap (:func:`fp8track.trackers.heatmap.heatmap_figure`, also MLflow's ``fp8_heatmap.png``)
    with one panel."""
    require("matplotlib", "the HTML report")
    return shared_heatmap_figure(rows, (stat,), titles={stat: title}, mark=mark)


def ranking_figure(d: Diagnosis, top: int = 15) -> Figure | None:
    """Bar chart of the risk score of the ``top`` riskiest layers."""
    ranking = list(d.layer_ranking)[:top]
    if not ranking:
        return None
    fig = _figure(10, 1.0 + 0.28 * len(ranking))
    ax = fig.subplots()
    names = [f"{r.layer} ({r.tensor})" for r in ranking][::-1]
    scores = [r.score for r in ranking][::-1]
    flagged = {f.layers[0] for f in d.findings if f.kind in ("layer_outlier", "latent_damage") and f.layers}
    colors = [FP8_COLOR if r.layer in flagged else CONTROL_COLOR for r in ranking][::-1]
    ax.barh(names, scores, color=colors)
    ax.tick_params(axis="y", labelsize=LABEL_PT)
    ax.set_xlabel("risk score (sum of positive robust z against the other layers; 0 = typical)")
    ax.set_title("Layer ranking, causal order (red: layer outliers and destroyed layers)")
    return fig


def all_figures(d: Diagnosis, fp8: RunData, control: RunData) -> list[tuple[str, str, str]]:
    """``(id, caption, base64 png)`` of every figure the report shows, in order."""
    out: list[tuple[str, str, str]] = []

    def add(fig_id: str, caption: str, fig: Figure | None) -> None:
        if fig is not None:
            out.append((fig_id, caption, to_png_base64(fig)))

    add(
        "fig-loss",
        "Training loss of the FP8 run and its BF16 control, and the gap between them.",
        loss_figure(d),
    )
    add("fig-eval", "Validation / downstream metrics per evaluation.", eval_figure(fp8, control))
    add("fig-ranking", "Layer risk scores.", ranking_figure(d))
    mark = [r.layer for r in d.layer_ranking[:3]]
    for stat, title in HEATMAPS:
        add(f"fig-heatmap-{stat}", f"FP8 run: {title}, per layer/tensor over the sampled steps.",
            heatmap_figure(fp8.tensor_rows, stat, title, mark))
    return out


def finite_or(value: Any, default: str = "n/a") -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.4g}" if math.isfinite(value) else default
    return default if value is None else str(value)


def stats_line(stats: Mapping[str, float]) -> str:
    keys = ("sqnr_db", "cos", "underflow_pct", "overflow_pct", "abs_drift_log2")
    line = ", ".join(f"{k} {finite_or(stats.get(k))}" for k in keys)
    if "max_blockwise_dynamic_range" in stats:  # block rows only
        line += f", max_blockwise_dynamic_range {finite_or(stats['max_blockwise_dynamic_range'])}"
    return line
