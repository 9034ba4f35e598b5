"""Per-expert views for the trackers: experts x steps heatmaps of one statistic and of the load.

Fed with the records' tensor rows (one expert's rows, any form
:func:`fp8track.execution.experts.parse_expert_row` reads), the view keeps per expert group
(``<experts>.<param>``) and sampled step one value per expert of a chosen statistic of a chosen
tensor kind (default: the activation's ``sqnr_db``) and its ``tokens``. Its figure shows, for the
groups whose experts differ most (the spread of the experts' median statistic), two panels side by
side: the statistic, and the load (each expert's share of the group's tokens, in %), experts down,
steps across. The MLflow tracker logs it as ``fp8_experts_heatmap.png`` and the W&B tracker as the
image ``fp8/experts_heatmap`` when the run finishes.

Memory is bounded: at most ``max_steps`` steps per group (when full, every other step is dropped
and later steps are kept at that spacing), one float per expert and step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fp8track.execution.experts import parse_expert_row
from fp8track.monitoring.naming import run_metric

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from fp8track.monitoring.records import TensorStatsRow

EXPERT_HEATMAP_FILE = "fp8_experts_heatmap.png"
EXPERT_HEATMAP_KEY = run_metric("experts_heatmap")
EXPERT_HEATMAP_CAPTION = "per expert group: a statistic and the load (share of the group's tokens) over steps"
MAIN_VARIANTS = ("actual", "shadow")


def layer_rows(rows: Iterable[TensorStatsRow]) -> list[TensorStatsRow]:
    """``rows`` without one expert's rows (which a per-layer view would multiply by the experts)."""
    return [r for r in rows if parse_expert_row(r.layer) is None]


class ExpertHeatmap:
    """Experts x steps of one statistic and of the load, per expert group (see the module docstring).

    Args:
        stat: the statistic shown (any of the rows' statistics).
        tensor: the tensor kind whose rows are read (``activation`` and ``gradient`` rows carry
            ``tokens``; the load panel comes from them).
        max_steps: steps kept per group.
        max_groups: groups in the figure.
    """

    def __init__(
        self, stat: str = "sqnr_db", tensor: str = "activation", max_steps: int = 128, max_groups: int = 6
    ) -> None:
        self.stat, self.tensor = stat, tensor
        self.max_steps, self.max_groups = max(2, max_steps), max(1, max_groups)
        # group -> step -> {expert: (value, tokens)}
        self.cells: dict[str, dict[int, dict[int, tuple[float, float]]]] = {}
        self._spacing: dict[str, int] = {}

    def add(self, rows: Iterable[TensorStatsRow]) -> None:
        for r in rows:
            if r.tensor != self.tensor or r.variant not in MAIN_VARIANTS:
                continue
            parsed = parse_expert_row(r.layer)
            if parsed is None:
                continue
            group, expert = parsed
            steps = self.cells.setdefault(group, {})
            step = int(r.step)
            spacing = self._spacing.get(group, 1)
            if step not in steps and steps and step % spacing:
                continue  # between the kept steps of a thinned group
            value = float(r.stats.get(self.stat, np.nan))
            steps.setdefault(step, {})[expert] = (value, float(r.stats.get("tokens", np.nan)))
            if len(steps) > self.max_steps:
                self._thin(group)

    def _thin(self, group: str) -> None:
        """Keep every other step of ``group`` (and that spacing from now on)."""
        steps = self.cells[group]
        spacing = self._spacing.get(group, 1) * 2
        self._spacing[group] = spacing
        for s in sorted(steps)[1::2]:
            del steps[s]

    def matrices(self, group: str) -> tuple[list[int], np.ndarray, np.ndarray]:
        """``(steps, statistic [E, S], load share % [E, S])`` of ``group`` (NaN where an expert had
        no row: no token that step)."""
        steps = sorted(self.cells[group])
        n = 1 + max(e for cells in self.cells[group].values() for e in cells)
        stat = np.full((n, len(steps)), np.nan)
        tokens = np.zeros((n, len(steps)))
        for j, s in enumerate(steps):
            for e, (v, t) in self.cells[group][s].items():
                stat[e, j] = v
                tokens[e, j] = t if np.isfinite(t) else 0.0
        total = tokens.sum(axis=0, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            load = np.where(total > 0, 100.0 * tokens / total, np.nan)
        return steps, stat, load

    def groups_shown(self) -> list[str]:
        """The groups whose experts' median statistic spreads most (at most ``max_groups``)."""

        def spread(group: str) -> float:
            stat = self.matrices(group)[1]
            finite = np.isfinite(stat)
            med = np.array([np.median(row[ok]) for row, ok in zip(stat, finite, strict=True) if ok.any()])
            return float(med.max() - med.min()) if med.size else -1.0

        return sorted(self.cells, key=lambda g: (-spread(g), g))[: self.max_groups]

    def figure(self) -> Figure | None:
        """The heatmaps (``None`` before any expert row); ``matplotlib.figure.Figure``, no pyplot."""
        groups = self.groups_shown()
        if not groups:
            return None
        from matplotlib.figure import Figure

        sizes = [self.matrices(g)[1].shape[0] for g in groups]
        fig = Figure(figsize=(12, 1.2 + sum(0.25 * max(n, 4) for n in sizes)), layout="constrained")
        axes = fig.subplots(len(groups), 2, squeeze=False,
                            gridspec_kw={"height_ratios": [max(n, 4) for n in sizes]})
        for (ax_s, ax_l), group in zip(axes, groups, strict=True):
            steps, stat, load = self.matrices(group)
            for ax, m, title, cmap in ((ax_s, stat, f"{self.tensor} {self.stat}", "viridis"),
                                       (ax_l, load, "load (% of the group's tokens)", "magma")):
                im = ax.imshow(np.ma.masked_invalid(m), aspect="auto", interpolation="nearest", cmap=cmap)
                ax.set_title(f"{group}: {title}", fontsize=8)
                ax.set_ylabel("expert", fontsize=7)
                ticks = _ticks(len(steps))
                ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
                ax.tick_params(axis="y", labelsize=7)
                fig.colorbar(im, ax=ax)
        return fig


def _ticks(n: int) -> Sequence[int]:
    return sorted({round(i) for i in np.linspace(0, n - 1, num=min(n, 10))})


def figure_png(fig: Figure) -> bytes:
    """``fig`` as PNG bytes (the Agg canvas; no pyplot, no global backend change)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def figure_image(fig: Figure) -> Any:
    """``fig`` as a PIL image (what ``wandb.Image`` takes)."""
    import io

    from PIL import Image

    return Image.open(io.BytesIO(figure_png(fig)))
