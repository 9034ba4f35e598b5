"""The recommendation rule, the Pareto front and the summary table, on hand-worked trials."""

from __future__ import annotations

import math

import pytest

from fp8track.sweep.summary import TrialRow, pareto_front, recommend, summary_table, tolerance


def _row(n, recipe, spec, n_bf16, gap, state="COMPLETE", step_time=0.01):
    return TrialRow(n, state, recipe, spec, n_bf16, 9 - n_bf16, gap, step_time_s=step_time, fp8_share=(9 - n_bf16) / 9)


ROWS = [
    _row(0, "current", "none", 0, 0.080),
    _row(1, "mxfp8", "first:1", 4, 0.004),
    _row(2, "block", "auto:1", 1, 0.009),
    _row(3, "current", "auto:1", 1, 0.012),
    _row(4, "delayed:hybrid:h16:max", "auto:2", 2, 0.001),
    _row(5, "delayed:hybrid:h16:max", "none", 0, 0.0005, state="PRUNED"),
    _row(6, "fp8_input_bf16_gemm", "auto:1", 1, 0.002),
]


def test_tolerance_is_factor_times_spread_with_a_floor() -> None:
    assert tolerance(0.02) == pytest.approx(0.02)
    assert tolerance(0.02, factor=2.0) == pytest.approx(0.04)
    assert tolerance(0.001) == pytest.approx(0.01)  # floored
    assert tolerance(math.nan, floor=0.003) == pytest.approx(0.003)


def test_fewest_bf16_layers_then_fastest_recipe_within_tolerance() -> None:
    # tolerance 0.010: trial 0 (0.080) and 3 (0.012) are out; the pruned trial 5 never counts.
    # Left with one BF16 layer: block (2) and fp8_input_bf16_gemm (6): block is the faster recipe.
    rec = recommend(ROWS, spread=0.010, floor=0.001)
    assert rec.trial is not None and rec.trial.trial == 2
    assert rec.tolerance == pytest.approx(0.010)
    # A tighter tolerance (0.005) drops trial 2: among one-BF16-layer trials only 6 (0.002) is left.
    assert recommend(ROWS, spread=0.005, floor=0.001).trial.trial == 6
    # Tighter still (0.0015): only trial 4 (two BF16 layers, 0.001).
    assert recommend(ROWS, spread=0.0015, floor=0.001).trial.trial == 4


def test_no_trial_within_tolerance_names_the_closest() -> None:
    rec = recommend(ROWS[:1] + ROWS[2:4], spread=0.0, floor=0.001)
    assert rec.trial is None and rec.closest.trial == 2
    assert "no finished trial stays within 0.0010 nats" in rec.reason


def test_pareto_front() -> None:
    front = [r.trial for r in pareto_front(ROWS)]
    # 0 BF16: trial 0 (only complete one); 1 BF16: trial 6 (0.002) beats 2 and 3; 2 BF16: trial 4 (0.001);
    # 4 BF16: trial 1 (0.004) is beaten by 4 (fewer layers, smaller gap).
    assert front == [0, 6, 4]


def test_summary_table_columns_hold_one_type_and_no_nan() -> None:
    rows = ROWS + [TrialRow(7, "FAIL", "current", "last:1", 4, 5, math.nan)]
    table = summary_table(rows)
    assert table["trial"] == list(range(8))
    assert table["gap"][-1] is None
    assert {type(v) for v in table["n_bf16"]} == {int}


def test_progress_time_left_is_mean_trial_time_times_trials_left() -> None:
    from fp8track.sweep.progress import SweepProgress

    p = SweepProgress(total=5, enabled=True, done=1)
    assert p.time_left_s() is None  # unknown until a trial finished here
    p.trial_finished(1, 0.05, 10.0, done=2)
    p.trial_finished(2, 0.02, 20.0, done=3)
    p.status("trial 3")
    assert p.time_left_s() == pytest.approx(2 * 15.0)
    assert p.best == (0.02, 2)
    p.close()
