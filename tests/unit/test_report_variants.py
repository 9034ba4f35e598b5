"""The report's what-if / column-wise table (fp8track.report.variants): medians over steps,
overflow as its maximum, main rows left out."""

from __future__ import annotations

from fp8track.monitoring.records import TensorStatsRow
from fp8track.report.variants import variant_summary, variants_table


def _row(step: int, variant: str, under: float, over: float, tensor: str = "gradient") -> TensorStatsRow:
    stats = {"underflow_pct": under, "overflow_pct": over, "sqnr_db": 10.0 + step, "mse": 0.1, "cos": 0.99}
    return TensorStatsRow(step=step, layer="fc1", tensor=tensor, stats=stats, variant=variant)


def test_summary_medians_and_overflow_max() -> None:
    rows = [_row(s, v, under, over) for s, (under, over) in enumerate([(1.0, 0.0), (3.0, 5.0), (2.0, 1.0)])
            for v in ("shadow", "nvfp4")]
    rows.append(_row(0, "nvfp4_columnwise", 7.0, 2.0))
    out = variant_summary(rows)
    assert [(layer, t, v) for layer, t, v, _ in out] == [("fc1", "gradient", "nvfp4"),
                                                         ("fc1", "gradient", "nvfp4_columnwise")]
    s = out[0][3]
    assert s["underflow_pct"] == 2.0 and s["overflow_pct"] == 5.0 and s["sqnr_db"] == 11.0
    assert out[1][3]["underflow_pct"] == 7.0
    assert "max_blockwise_dynamic_range" not in s  # no row carried it


def test_summary_takes_the_largest_blockwise_dynamic_range() -> None:
    rows = [_row(s, "mxfp8", 1.0, 0.0) for s in range(3)]
    for r, dr in zip(rows, (3.0, 9.0, 4.0), strict=True):
        r.stats["max_blockwise_dynamic_range"] = dr
    (_, _, _, s), = variant_summary(rows)
    assert s["max_blockwise_dynamic_range"] == 9.0  # TE reduces it by max, not the median (4)
    assert "<td>9</td>" in variants_table([("run", rows)])


def test_table_lists_each_run_and_says_when_empty() -> None:
    html = variants_table([("fp8 <run>", [_row(0, "actual_columnwise", 1.0, 0.0)]),
                           ("control", [_row(0, "shadow", 1.0, 0.0)])])
    assert 'id="variants"' in html and "<td>actual_columnwise</td>" in html
    assert "fp8 &lt;run&gt;" in html and "<td>control</td>" not in html
    assert "No what-if" in variants_table([("control", [_row(0, "shadow", 1.0, 0.0)])])
