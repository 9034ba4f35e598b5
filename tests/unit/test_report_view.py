"""What a person sees: the report's header, its figures' labels and colour scales, the terminal
table's width, the CLI's help. Each assertion is about a number or text someone reads."""

from __future__ import annotations

import io
import math
from dataclasses import replace

import numpy as np
import pytest
from rich.console import Console

from fp8track.analysis.diagnose import Diagnosis, Finding, mismatched_diagnosis
from fp8track.analysis.loss_gap import GapJudgement
from fp8track.analysis.pairing import Mismatch
from fp8track.analysis.ranking import LayerRisk
from fp8track.cli import COMMANDS, build_parser
from fp8track.monitoring.records import TensorStatsRow
from fp8track.report.console import TABLE_WIDTH, print_diagnosis
from fp8track.report.figures import DPI, LABEL_PT, heatmap_figure, loss_figure
from fp8track.trackers.heatmap import colour_limits

from helpers.synthetic_runs import layer_rows, synthetic_pair


def _loss(onset: int | None, n: int = 200) -> GapJudgement:
    steps = tuple(range(n))
    ctl = tuple(3.0 - s / n for s in steps)
    fp8 = tuple(
        c * (1.05 if onset is not None and s >= onset else 1.0) for s, c in zip(steps, ctl, strict=True)
    )
    gap = tuple(f / c - 1 for f, c in zip(fp8, ctl, strict=True))
    return GapJudgement("paired", steps, fp8, ctl, gap, gap, 0.01, 0.02, onset is not None, onset,
                        "mid" if onset else None, 0.05, 5.0, 2.0, "high" if onset is not None else "none", 5)


def _diagnosis(loss: GapJudgement, findings: tuple[Finding, ...] | None = None) -> Diagnosis:
    f = Finding("healthy", "info", 0.9, "FP8 matches the BF16 control", "text")
    return Diagnosis("a/fp8", "a/control", findings or (f,), (), None, loss)


@pytest.mark.parametrize("onset", [5, 100, 190, 199])
def test_the_gap_onset_label_stays_inside_its_plot(onset):
    fig = loss_figure(_diagnosis(_loss(onset)))
    fig.canvas.draw()  # matplotlib's Agg canvas: the real layout
    ax = fig.axes[0]
    box = ax.get_window_extent()
    label = next(t for t in ax.texts if "gap opens" in t.get_text())
    ext = label.get_window_extent()
    assert box.x0 <= ext.x0 and ext.x1 <= box.x1 and box.y0 <= ext.y0 and ext.y1 <= box.y1, (ext, box)


def test_the_loss_figure_shades_the_steps_before_spike_detection_can_fire():
    d = _diagnosis(_loss(None, n=300))  # 300 steps: window 75, warm-up 37 accepted losses
    ax = loss_figure(d).axes[0]
    span = next(p for p in ax.patches if "warming up" in str(p.get_label()))
    assert span.get_label() == "spike detection warming up (first 37 steps)"
    x0, x1 = ax.transData.inverted().transform(span.get_window_extent())[:, 0]  # data units, any artist
    assert (x0, x1) == pytest.approx((0, 36), abs=0.01)
    assert "after the warm-up" in ax.get_title()


def test_colour_limits_leave_out_the_step_0_warm_up():
    m = np.array([[1e6, 1.0, 3.0], [-1e6, 2.0, np.nan]])
    assert colour_limits(m, [0, 10, 20]) == (1.0, 3.0)
    assert colour_limits(m, [5, 10, 20]) == (-1e6, 1e6)  # no step 0: every column counts
    assert colour_limits(m[:, :1], [0]) == (-1e6, 1e6)  # step 0 alone: it is all there is
    assert colour_limits(np.array([[np.nan, -4.0, 2.0]]), [0, 1, 2], symmetric=True) == (-4.0, 4.0)
    assert colour_limits(np.full((2, 2), 7.0), [1, 2]) == (6.5, 7.5)  # flat: a non-empty range


def test_heatmap_rows_are_readable_and_step_0_does_not_set_the_scale():
    rows = [
        TensorStatsRow(
            s, f"blocks.{i}.mlp.fc", "activation", {"underflow_pct": (99.0 if s == 0 else 1.0 + i + s / 100)}
        )
        for s in (0, 10, 20)
        for i in range(3)
    ]
    fig = heatmap_figure(rows, "underflow_pct", "underflow")
    ax = fig.axes[0]
    labels = ax.get_yticklabels()
    assert [t.get_text() for t in labels] == [f"blocks.{i}.mlp.fc/activation" for i in range(3)]
    px = labels[0].get_fontsize() * DPI / 72  # points -> pixels of the PNG, shown at its own size
    assert labels[0].get_fontsize() == LABEL_PT and px >= 10
    assert fig.get_figwidth() * DPI <= 1100  # the report's column at 1400 px: no down-scaling
    assert ax.images[0].get_clim() == pytest.approx(
        (1.1, 3.2)
    )  # steps 10 and 20 only; 99 % at step 0 is off-scale


def test_the_report_header_names_the_runs(tmp_path):
    from fp8track.analysis.diagnose import diagnose
    from fp8track.report.html import render_report

    run, ctl = synthetic_pair(tmp_path, fp8_rows=lambda rng: layer_rows(rng, planted_from=150))
    page = render_report(diagnose(run, ctl), run, ctl)
    head = page[page.index("<h1>") : page.index("</table>")]
    assert "<h1>fp8track diagnosis: fp8 vs control</h1>" in head
    assert '<b class="run-name">fp8</b> <span class="kind">delayed' in head
    assert '<b class="run-name">control</b> <span class="kind">bf16</span>' in head
    assert head.index("run-name") < head.index(str(tmp_path))  # the path comes after the name, small


def _printed(d: Diagnosis, width: int, **kw) -> list[str]:
    buf = io.StringIO()
    print_diagnosis(d, "/r/report.html", Console(file=buf, width=width, color_system=None), **kw)
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 200])
def test_the_console_table_fits_80_columns(width):
    long = Finding(
        "layer_outlier",
        "high",
        0.99,
        "Layer model.transformer.h.11.attn.c_attn (activation) stands out "
        "from step 180 with a title that goes on and on",
        "t",
        layers=("model.transformer.h.11.attn.c_attn", "model.transformer.h.10.mlp.c_fc"),
    )
    lines = _printed(
        _diagnosis(_loss(None), (long,)), width, runs=("fp8-delayed (delayed)", "bf16-control (bf16)")
    )
    table = [x for x in lines if x.startswith(("severity", "high", " ", "─"))]
    assert table and max(len(x) for x in table) <= TABLE_WIDTH
    assert lines[0] == "fp8-delayed (delayed) against the control bf16-control (bf16)"
    assert "model.transformer.h.11.attn.c_attn" in "".join(lines).replace(" ", "")


def test_a_top_ranked_layer_tied_with_others_says_so():
    # a healthy pair whose layers score within the tie margin: the top layer is no outlier
    ranking = (LayerRisk("inp", 0.46, "gradient", rank=1, tied=("out", "mid")),
               LayerRisk("out", 0.18, "weight", rank=1, tied=("inp", "mid")))
    d = replace(_diagnosis(_loss(None)), layer_ranking=ranking)
    line = next(x for x in _printed(d, 200) if x.startswith("Top-ranked layer:"))
    assert line == "Top-ranked layer: inp (gradient, risk score 0.5, tied with out, mid)"
    d = replace(d, layer_ranking=(LayerRisk("inp", 9.0, "gradient"),))
    line = next(x for x in _printed(d, 200) if x.startswith("Top-ranked layer:"))
    assert line == "Top-ranked layer: inp (gradient, risk score 9.0)"


def test_a_mismatch_prints_one_line_and_no_table():
    m = Mismatch("swapped", "the runs are swapped: pass the FP8 run first")
    d = mismatched_diagnosis(*_pair_stub(), m)
    assert d.kinds() == ["mismatched_runs"] and math.isnan(d.loss.noise)
    assert _printed(d, 80) == ["not compared: the runs are swapped: pass the FP8 run first"]


def _pair_stub():
    from fp8track.analysis.baseline import RunData

    return RunData("f", {}), RunData("c", {})


def test_cli_help_is_one_plain_line_per_command(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80 and "``" not in out
    for name, text in COMMANDS.items():
        hits = [x for x in lines if x.split()[:1] == [name]]
        assert len(hits) == 1 and hits[0].strip().endswith(text), name
    assert set(COMMANDS) == set(build_parser()._subparsers._group_actions[0].choices)  # every command listed
    for name in COMMANDS:
        with pytest.raises(SystemExit):
            build_parser().parse_args([name, "--help"])
        sub = capsys.readouterr().out
        assert "``" not in sub and max(map(len, sub.splitlines())) <= 80, name
