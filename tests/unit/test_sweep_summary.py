"""The recommendation judged in its noise, the cost as the FP8 FLOP share, the Pareto plot's layout
and the summary text, on hand-worked trials."""

from __future__ import annotations

import math

import pytest

from fp8track.sweep.summary import (
    VERDICTS,
    TrialRow,
    apply_call,
    format_text,
    judge,
    pareto_figure,
    pareto_front,
    pick_finalists,
    recommend,
    signed_gap,
    summary_table,
    tolerance,
    torchao_small,
)


def _row(n, recipe, spec, share, gap, state="COMPLETE", names=()):
    return TrialRow(n, state, recipe, spec, len(names), gap, fp8_flop_share=share, bf16_names=tuple(names),
                    run_id=f"r{n}", params={"recipe": recipe, "bf16_layers": spec})


ROWS = [
    _row(0, "current", "none", 1.0, 0.080),
    _row(1, "mxfp8", "first:1", 0.90, 0.004, names=["l0", "l1", "l2", "l3"]),
    _row(2, "block", "auto:1", 0.50, 0.009, names=["head"]),      # the head is half the FLOPs
    _row(3, "current", "auto:1", 0.95, 0.002, names=["l0"]),
    _row(4, "delayed", "auto:2", 0.95, 0.001, names=["l1"]),
    _row(5, "delayed", "none", 1.0, 0.0005, state="PRUNED"),
    _row(6, "current", "auto:1", 0.95, 0.002, names=["l0"]),      # the same parameters as trial 3
]


def test_gap_sign_follows_the_goal_and_tolerance_has_a_floor() -> None:
    assert signed_gap(2.5, 2.4, "minimize") == pytest.approx(0.1)
    assert signed_gap(0.7, 0.8, "maximize") == pytest.approx(0.1)   # lower accuracy is worse
    assert tolerance(0.02, factor=2.0) == pytest.approx(0.04)
    assert tolerance(0.001) == pytest.approx(0.01) and tolerance(math.nan, floor=0.003) == pytest.approx(
        0.003
    )


def test_finalists_are_the_cheapest_within_tolerance_one_per_parameter_set() -> None:
    # tolerance 0.01: trial 0 (0.08) is out, 5 is pruned, 6 repeats 3. By FP8 FLOP share: 4 and 3
    # (0.95 each; delayed is the faster family), then 1 (0.90), then 2 (0.50).
    assert [r.trial for r in pick_finalists(ROWS, 0.01, 3)] == [4, 3, 1]
    # nothing within a tiny tolerance: the smallest gaps
    assert [r.trial for r in pick_finalists(ROWS, 0.0001, 2)] == [4, 3]


def test_judged_in_the_noise_a_negative_gap_is_no_win() -> None:
    r = ROWS[3]
    # paired gaps -0.02 and +0.01 around a control spread of 0.05: inside the band
    j = judge(r, {0: -0.02, 1: 0.01}, control_spread=0.05)
    assert (j.mean_gap, j.band, j.verdict) == (
        pytest.approx(-0.005),
        pytest.approx(0.05),
        "no measurable difference",
    )
    # the paired gaps' own spread widens the band: max(0.01, 0.3 - 0.1) = 0.2
    assert judge(r, {0: 0.1, 1: 0.3}, control_spread=0.01).band == pytest.approx(0.2)
    assert judge(r, {0: 0.30, 1: 0.28}, control_spread=0.05).verdict == VERDICTS[0]
    assert judge(r, {0: -0.30, 1: -0.28}, control_spread=0.05).verdict == VERDICTS[2]


def test_recommendation_is_the_cheapest_finalist_not_worse_and_names_its_layers() -> None:
    worse = judge(ROWS[4], {0: 0.2, 1: 0.25}, 0.01)              # cheapest but worse beyond noise
    ok = judge(ROWS[3], {0: 0.002, 1: -0.001}, 0.01)
    layers = {
        "r3": [
            {"layer": "l1", "in": 64, "out": 64, "fp8": True},
            {"layer": "head", "in": 4096, "out": 8192, "fp8": True},
            {"layer": "l0", "in": 64, "out": 64, "fp8": False},
        ]
    }
    rec = recommend([worse, ok], control_spread=0.01, layers=layers)
    assert rec.trial.trial == 3 and rec.verdict == "no measurable difference"
    assert rec.apply_call == "apply_fp8(model, \"current\", bf16_layers=['l0'], backend=\"auto\")"
    assert rec.yaml_values == {"recipe": "current", "bf16_layers": "auto:1"}
    assert rec.info and "l1" in rec.info[0] and "head" not in rec.info[0]   # only the small FP8 layer
    text = format_text(ROWS, rec)
    assert "BF16 layers: l0" in text and rec.apply_call in text and "worse than BF16" in text
    none = recommend([worse], control_spread=0.01)
    assert none.trial is None and none.closest.trial == 4 and "worse than the BF16 control" in none.reason
    assert apply_call(ROWS[0]) == 'apply_fp8(model, "current", bf16_layers="none", backend="auto")'


def test_torchao_small_layer_rule() -> None:
    """torchao/float8/float8_linear_utils.py: tensorwise skips K <= 4096 and N <= 1024; rowwise skips
    N <= 2048, K <= 1024, or N <= 4096 and K <= 2048; both skip dims not divisible by 16."""
    lay = [{"layer": "a", "in": 4096, "out": 1024, "fp8": True},   # tensorwise: small
           {"layer": "b", "in": 4096, "out": 1040, "fp8": True},   # tensorwise: big enough
           {"layer": "c", "in": 8192, "out": 1000, "fp8": True},   # 1000 % 16 != 0
           {"layer": "d", "in": 2048, "out": 4096, "fp8": True},   # rowwise: N <= 4096 and K <= 2048
           {"layer": "e", "in": 2064, "out": 4112, "fp8": True},   # rowwise: big enough
           {"layer": "f", "in": 16, "out": 16, "fp8": False}]      # BF16 already: not listed
    assert torchao_small(lay, "current") == ["a", "c"]
    assert torchao_small(lay, "mxfp8") == ["a", "b", "c", "d"]


def test_pareto_front_by_flop_share_and_the_table() -> None:
    # cheapest first: share 1.0 (trial 0, gap 0.08), 0.95 (trial 4, 0.001) beats 3, 6, 1, 2
    assert [r.trial for r in pareto_front(ROWS)] == [0, 4]
    table = summary_table(ROWS + [TrialRow(7, "FAIL", "current", "last:1", -1, math.nan)])
    assert table["trial"] == list(range(8)) and table["gap"][-1] is None


def test_pareto_plot_is_readable() -> None:
    """Legend outside the axes' data area, labelled points, pruned trials drawn; with no FLOP share
    the x axis counts layers in integers."""
    rec = recommend([judge(ROWS[3], {0: 0.002}, 0.01)], control_spread=0.01)
    fig = pareto_figure(ROWS, rec)
    ax = fig.axes[0]
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    axes_box = ax.get_window_extent()
    assert legend.x0 >= axes_box.x1  # entirely right of the axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(lab.startswith("pruned (1)") for lab in labels) and any(
        "recommended: trial 3" in lab for lab in labels
    )
    # one label per drawn point: trials 3 and 6 (same parameters, same point) share theirs
    assert sorted(t.get_text() for t in ax.texts) == [
        "0: none", "1: first:1", "2: auto:1", "3, 6: auto:1", "4: auto:2", "5: none"]
    # right edge of the legend inside the figure: nothing cut off
    assert legend.x1 <= fig.bbox.x1 + 1
    rows = [
        TrialRow(i, "COMPLETE", "current", s, n, g)
        for i, (s, n, g) in enumerate([("none", 0, 0.1), ("first:1", 4, 0.0), ("last:1", 1, 0.05)])
    ]
    fig2 = pareto_figure(rows, recommend([], 0.01))
    ax2 = fig2.axes[0]
    fig2.canvas.draw()
    ticks = [t for t in ax2.get_xticks() if ax2.get_xlim()[0] <= t <= ax2.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)


def _boxes(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    return [t.get_window_extent(renderer) for t in fig.axes[0].texts], fig.axes[0].get_window_extent(renderer)


def test_pareto_labels_never_overprint() -> None:
    """Twelve trials crowded on three FLOP shares with gaps 0.0005 apart (the sweep's usual picture):
    every label is drawn, no two labels' boxes overlap, none covers another trial's point, all
    stay inside the axes. A fixed offset (the old drawing) stacks them on each other."""
    specs = ["none", "first:1", "last:1", "first_last", "auto:1", "auto:2", "re:h\\.0\\..*", "head"]
    rows = [_row(i, ("current", "mxfp8", "delayed")[i % 3], specs[i % len(specs)], (1.0, 0.9, 0.8)[i % 3],
                 0.001 + 0.0005 * i) for i in range(12)]
    fig = pareto_figure(rows, recommend([judge(rows[0], {0: 0.001}, 0.01)], 0.01))
    boxes, axes_box = _boxes(fig)
    assert len(boxes) == 12
    assert {t.get_text().split(":")[0] for t in fig.axes[0].texts} == {str(i) for i in range(12)}
    for i, a in enumerate(boxes):
        assert axes_box.x0 - 1 <= a.x0 and a.x1 <= axes_box.x1 + 1 and axes_box.y0 - 1 <= a.y0
        assert a.y1 <= axes_box.y1 + 1
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    ax = fig.axes[0]
    for r in rows:
        px, py = ax.transData.transform((100 * r.fp8_flop_share, r.gap))
        assert not any(b.x0 < px < b.x1 and b.y0 < py < b.y1 for b in boxes), r.trial


def test_failed_trials_are_listed_with_their_reason() -> None:
    failed = TrialRow(7, "FAIL", "current", "last:1", -1, math.nan, error="exit status 1: boom\nline 2")
    rows = [*ROWS, failed]
    text = format_text(rows, recommend([], 0.01))
    assert "Failed trials:\n  trial 7: exit status 1: boom line 2" in text
    assert summary_table(rows)["error"][-1].startswith("exit status 1")


def test_summary_text_columns_fit_their_contents() -> None:
    long = _row(9, "delayed:hybrid:h1024:max:m0", "re:model\\.layers\\.(0|1)\\.mlp", 0.7, 0.01)
    text = format_text([long], recommend([], 0.01))
    assert "delayed:hybrid:h1024:max:m0" in text and "re:model\\.layers\\.(0|1)\\.mlp" in text
    lines = text.splitlines()
    assert len(lines[1]) >= len(lines[2])  # the rule spans the widest row


def test_at_equal_fp8_share_the_faster_recipe_is_cheaper() -> None:
    recipes = ["bf16", "mxfp8", "current:e4m3", "nvfp4:no_rht", "delayed:hybrid:h16:max", "blockwise"]
    rows = [_row(i, r, "none", 1.0, 0.0) for i, r in enumerate(recipes)]
    order = [r.recipe.split(":")[0] for r in sorted(rows, key=TrialRow.cost_key)]
    assert order == ["nvfp4", "delayed", "current", "mxfp8", "blockwise", "bf16"]
