"""The report's table of what-if and column-wise rows: per (layer, tensor, variant) of a run, what
another recipe (``whatif=["nvfp4"]``, ``"mxfp8"``, ...) or the column-wise copy of a block recipe's
operand (``<variant>_columnwise``, TE's ``_columnwise`` statistics) would do, summarised over steps."""

from __future__ import annotations

import html
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from fp8track.numerics.nvfp4 import BLOCK_RANGE_STAT

MAIN_ROW_VARIANTS = ("actual", "shadow")
COLUMNS = ("underflow_pct", "overflow_pct", "sqnr_db", "mse", "cos", BLOCK_RANGE_STAT)
"""Statistics shown: medians over the run's steps, except the maxima ``overflow_pct`` and
``max_blockwise_dynamic_range`` (block rows only; TE's LogTensorStats reduces it by max)."""
MAX_COLUMNS = ("overflow_pct", BLOCK_RANGE_STAT)


def variant_summary(rows: Iterable[Any]) -> list[tuple[str, str, str, dict[str, float]]]:
    """``(layer, tensor, variant, {stat: value})`` for every row variant other than ``actual`` /
    ``shadow``, in first-seen order: each statistic's median over steps (:data:`MAX_COLUMNS`: the
    maximum)."""
    series: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for r in rows:
        if r.variant in MAIN_ROW_VARIANTS:
            continue
        acc = series.setdefault((r.layer, r.tensor, r.variant), {c: [] for c in COLUMNS})
        for c in COLUMNS:
            v = r.stats.get(c)
            if v is not None and not math.isnan(float(v)):
                acc[c].append(float(v))
    out = []
    for (layer, tensor, variant), acc in series.items():
        summary = {
            c: (max(vals) if c in MAX_COLUMNS else statistics.median(vals))
            for c, vals in acc.items()
            if vals
        }
        out.append((layer, tensor, variant, summary))
    return out


def variants_table(runs: Sequence[tuple[str, Iterable[Any]]]) -> str:
    """HTML table of :func:`variant_summary` for each ``(run label, tensor rows)``; a sentence when
    no run recorded such rows."""
    e = html.escape
    body = []
    for label, rows in runs:
        for layer, tensor, variant, s in variant_summary(rows):
            cells = "".join(f"<td>{_fmt(s.get(c))}</td>" for c in COLUMNS)
            keys = "".join(f"<td>{e(v)}</td>" for v in (label, layer, tensor, variant))
            body.append(f"<tr>{keys}{cells}</tr>")
    if not body:
        return ("<p>No what-if or column-wise statistics recorded "
                "(monitor option <code>whatif</code>; block recipes).</p>")
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    return (
        "<p>What another recipe would do to the same tensors (<code>whatif</code>) and the column-wise "
        "copies block recipes quantise for the backward GEMMs; medians over steps (overflow and the "
        "blockwise dynamic range, in binades: max).</p>"
        f'<table id="variants"><tr><th>run</th><th>layer</th><th>tensor</th><th>variant</th>{head}</tr>'
        + "".join(body)
        + "</table>"
    )


def _fmt(v: float | None) -> str:
    if v is None:
        return ""
    return f"{v:.4g}"
