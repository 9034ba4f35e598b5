"""The one per-layer heatmap: layer/tensor rows by sampled steps, one panel per statistic.

Both views draw it from here: the MLflow tracker's ``fp8_heatmap.png`` (from a bounded
:class:`HeatmapSummary` filled as steps arrive) and the HTML report's heatmaps (from a run's
rows read back). On the same rows they hold the same matrix and the same colour limits
(:func:`colour_limits`: step 0, the warm-up, is left out of the colour scale).

Each statistic's panel (:data:`PANELS`) says which recorded statistic it reads and how it is
shown: relative error as ``-sqnr_db`` (raw MSE scales with each tensor's magnitude), ``1 - cos``
in decades, MSE in decades, scale drift on a scale symmetric around 0. Figures are
``matplotlib.figure.Figure`` objects: no pyplot, no global backend.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fp8track.errors import check_int
from fp8track.monitoring.records import TensorStatsRow
from fp8track.optional import require

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LABEL_PT = 9
"""Heatmap row labels in points: 9 pt at the report's 90 dpi is 11 px, readable at 1400 px window width."""
MARK_COLOR = "#d62728"
"""Colour of the marked rows' labels (the report's FP8 colour: the top-ranked layers)."""


def _log10_positive(m: np.ndarray) -> np.ndarray:
    import numpy as np

    return np.log10(np.where(m > 0, m, np.nan))


def _negate(m: np.ndarray) -> np.ndarray:
    return -m


def _log10_one_minus(m: np.ndarray) -> np.ndarray:
    import numpy as np

    return np.log10(np.clip(1.0 - m, 1e-12, None))


@dataclass(frozen=True)
class Panel:
    """How one statistic is shown.

    Attributes:
        stat: the name asked for (a recorded statistic or a derived one).
        source: the recorded statistic it reads.
        label: its short name in a title.
        transform: applied to the matrix of ``source`` (``None``: shown as recorded).
        symmetric: colour scale symmetric around 0 (diverging colour map).
    """

    stat: str
    source: str
    label: str
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    symmetric: bool = False


PANELS: Mapping[str, Panel] = {
    p.stat: p
    for p in (
        Panel("mse", "mse", "log10(mse)", _log10_positive),
        Panel("rel_error_db", "sqnr_db", "rel_error_db", _negate),
        Panel("log10_one_minus_cos", "cos", "log10_one_minus_cos", _log10_one_minus),
        Panel("scale_drift_log2", "scale_drift_log2", "scale_drift_log2", symmetric=True),
    )
}
"""Statistics shown other than as recorded; any other statistic is shown as recorded."""


def panel(stat: str) -> Panel:
    """The :class:`Panel` of ``stat`` (:data:`PANELS`, else the recorded statistic itself)."""
    return PANELS.get(stat) or Panel(stat, stat, stat)


class HeatmapSummary:
    """A fixed-size layer-by-step summary of some statistics, for the heatmap.

    Memory stays bounded over any number of steps: at most ``max_columns`` columns per
    ``"<layer>/<tensor>"`` label. Each column holds consecutive sampled steps (one at first); when
    a step would open one column too many, neighbouring columns are merged pairwise, so each then
    holds twice as many sampled steps. A cell keeps the value of its latest step (the last row
    wins if a step repeats). Only the rows of the recipe really used (``actual``) and of BF16 layers
    judged in shadow mode (``shadow``) are kept; what-if variants are left out.

    Args:
        stats: recorded statistics to keep.
        max_columns: the most columns kept (>= 2).
    """

    VARIANTS = ("actual", "shadow")

    def __init__(self, stats: Sequence[str], max_columns: int = 256) -> None:
        check_int("max_columns", max_columns, 2)
        self.stats = tuple(stats)
        self.max_columns = max_columns
        self.starts: list[int] = []  # first step of each column, increasing
        self.span = 1  # sampled steps per column
        self._fill = 0  # sampled steps in the last column so far
        self._last = -1  # largest step seen
        self.labels: dict[str, None] = {}
        self.cells: dict[
            tuple[str, str, int], tuple[int, float]
        ] = {}  # (stat, label, start) -> (step, value)

    def _column(self, step: int) -> int:
        """The start of the column ``step`` belongs to (opening or merging columns as needed)."""
        if step > self._last:
            self._last = step
            if self.starts and self._fill < self.span:
                self._fill += 1
                return self.starts[-1]
            self.starts.append(step)
            self._fill = 1
        elif step < self.starts[0]:  # older than anything shown (a replay): a column in front
            self.starts.insert(0, step)
        if len(self.starts) > self.max_columns:
            self._merge()
        return self.starts[bisect.bisect_right(self.starts, step) - 1]

    def _merge(self) -> None:
        paired = len(self.starts) % 2 == 0
        new = {old: self.starts[i - i % 2] for i, old in enumerate(self.starts)}
        merged: dict[tuple[str, str, int], tuple[int, float]] = {}
        for (stat, label, start), (step, v) in self.cells.items():
            key = (stat, label, new[start])
            if key not in merged or step >= merged[key][0]:  # the later step of a pair wins
                merged[key] = (step, v)
        self.cells = merged
        self._fill = self._fill + self.span if paired else self._fill
        self.starts = self.starts[::2]
        self.span *= 2

    def add(self, rows: Iterable[TensorStatsRow]) -> None:
        for r in rows:
            if r.variant not in self.VARIANTS:
                continue
            step = int(r.step)
            start = self._column(step)
            label = f"{r.layer}/{r.tensor}"
            for stat in self.stats:
                if stat not in r.stats:
                    continue
                self.labels.setdefault(label, None)
                v = r.stats[stat]
                key = (stat, label, start)
                if key not in self.cells or step >= self.cells[key][0]:
                    self.cells[key] = (step, float(v) if v is not None else math.nan)

    def matrix(self, stat: str) -> tuple[list[str], list[int], np.ndarray]:
        """``(labels, steps, m)``: the labels with a value of ``stat`` in order of first
        appearance, the first step of each column, and ``m[i, j]`` (NaN where nothing was sampled)."""
        import numpy as np

        used = {label for (st, label, _s) in self.cells if st == stat}
        labels = [lab for lab in self.labels if lab in used]
        row = {lab: i for i, lab in enumerate(labels)}
        col = {s: j for j, s in enumerate(self.starts)}
        m = np.full((len(labels), len(self.starts)), np.nan)
        for (st, label, start), (_step, v) in self.cells.items():
            if st == stat:
                m[row[label], col[start]] = v
        return labels, list(self.starts), m


def heatmap_matrix(
    rows: Iterable[TensorStatsRow], stat: str, max_columns: int = 256
) -> tuple[list[str], list[int], np.ndarray]:
    """Layer-by-step matrix of one recorded statistic over ``rows`` (see :class:`HeatmapSummary`)."""
    summary = HeatmapSummary((stat,), max_columns)
    summary.add(rows)
    return summary.matrix(stat)


def summary_for(stats: Sequence[str], max_columns: int = 256) -> HeatmapSummary:
    """An empty :class:`HeatmapSummary` of the recorded statistics the panels of ``stats`` read."""
    return HeatmapSummary(tuple(dict.fromkeys(panel(s).source for s in stats)), max_columns)


def summarize(rows: Iterable[TensorStatsRow] | HeatmapSummary, stats: Sequence[str]) -> HeatmapSummary:
    """``rows`` as a summary for the panels of ``stats`` (a summary is taken as given)."""
    if isinstance(rows, HeatmapSummary):
        return rows
    summary = summary_for(stats)
    summary.add(rows)
    return summary


def panel_matrix(summary: HeatmapSummary, stat: str) -> tuple[list[str], list[int], np.ndarray]:
    """``(labels, steps, m)`` of the panel of ``stat``: its recorded statistic transformed
    (:data:`PANELS`), non-finite values as NaN (blank cells)."""
    import numpy as np

    p = panel(stat)
    labels, steps, m = summary.matrix(p.source)
    if p.transform is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            m = p.transform(m)
    return labels, steps, np.where(np.isfinite(m), m, np.nan)


def colour_limits(m: np.ndarray, steps: Sequence[int], symmetric: bool = False) -> tuple[float, float]:
    """``(vmin, vmax)`` of a heatmap's colour scale: the finite values of every column except step 0
    (the warm-up: delayed scaling has no amax history yet, its extreme values would wash out every
    later step), unless step 0 is the only column; ``symmetric`` gives ``(-L, L)`` around 0.
    A flat or empty matrix gets a small non-empty range.

    Example:
        >>> import numpy as np
        >>> colour_limits(np.array([[100.0, 1.0, 3.0], [-50.0, 2.0, 2.0]]), [0, 10, 20])
        (1.0, 3.0)
    """
    import numpy as np

    cols = [i for i, s in enumerate(steps) if s != 0] or list(range(len(steps)))
    vals = m[:, cols] if m.ndim == 2 and m.size else np.empty(0)
    vals = vals[np.isfinite(vals)]
    if symmetric:
        lim = max(float(np.abs(vals).max()) if vals.size else 1.0, 1e-3)
        return -lim, lim
    if not vals.size:
        return 0.0, 1.0
    lo, hi = float(vals.min()), float(vals.max())
    return (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5)


def heatmap_figure(
    rows: Iterable[TensorStatsRow] | HeatmapSummary,
    stats: Sequence[str] = ("underflow_pct", "mse"),
    titles: Mapping[str, str] | None = None,
    mark: Sequence[str] = (),
) -> Figure | None:
    """One heatmap panel per statistic of ``stats`` with any value (rows: layer/tensor, columns:
    steps), stacked; ``None`` when no row has any of them.

    Args:
        rows: tensor-statistics rows, or a :class:`HeatmapSummary` of them.
        stats: statistics to show (:func:`panel`).
        titles: a panel's title by statistic (default ``"<label> by layer over steps"``).
        mark: layers whose row labels are drawn in :data:`MARK_COLOR`, bold.
    """
    require("matplotlib", "the heatmap figure")
    from matplotlib.figure import Figure

    summary = summarize(rows, stats)
    panels = [(s, *panel_matrix(summary, s)) for s in stats]
    panels = [p for p in panels if p[1] and p[2]]
    if not panels:
        return None
    fig = Figure(figsize=(10, sum(1.4 + 0.25 * len(p[1]) for p in panels)), layout="constrained")
    ratios = [1.4 + 0.25 * len(p[1]) for p in panels]
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=ratios)
    for ax, (stat, labels, steps, m) in zip(axes[:, 0], panels, strict=True):
        title = (titles or {}).get(stat) or f"{panel(stat).label} by layer over steps"
        _draw(fig, ax, title, labels, steps, m, panel(stat).symmetric, mark)
    return fig


def _draw(fig: Figure, ax: Axes, title: str, labels: list[str], steps: list[int], m: np.ndarray,
          symmetric: bool, mark: Sequence[str]) -> None:
    """One panel: the matrix, its colour scale (:func:`colour_limits`), marked labels, step ticks."""
    import numpy as np

    vmin, vmax = colour_limits(m, steps, symmetric=symmetric)
    cmap = "coolwarm" if symmetric else "viridis"
    im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax)
    ax.set_title(title, fontsize=10)
    ax.set_yticks(range(len(labels)), labels, fontsize=LABEL_PT)
    for tick in ax.get_yticklabels():
        if tick.get_text().rsplit("/", 1)[0] in mark:
            tick.set_color(MARK_COLOR)
            tick.set_fontweight("bold")
    ticks = np.linspace(0, len(steps) - 1, num=min(len(steps), 10)).round().astype(int)
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=8)
    warm_up = 0 in steps[:1] and len(steps) > 1
    ax.set_xlabel("step" + (" (step 0, the warm-up, is left out of the colour scale)" if warm_up else ""))
    finite = m[np.isfinite(m)]
    below, above = bool(finite.size and finite.min() < vmin), bool(finite.size and finite.max() > vmax)
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}
    fig.colorbar(im, ax=ax, extend=extend[(below, above)])


__all__ = ["PANELS", "Panel", "panel", "HeatmapSummary", "heatmap_matrix", "summary_for", "summarize",
           "panel_matrix", "colour_limits", "heatmap_figure", "LABEL_PT", "MARK_COLOR"]
