"""bench/monitor_bench.py's amortised step cost: what a long run pays per step, sampled steps included."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def monitor_bench():
    import monitor_bench  # bench/, on pytest's pythonpath

    return monitor_bench


def test_amortised_ratio_counts_the_sampled_step_that_a_median_drops(monitor_bench):
    # Three periods of 5 steps: sampled steps (position 0) cost 3.0, the one after it 1.2, the rest
    # 1.0; one outlier (9.0) at position 3. The plain median of the 15 steps is an unsampled one (1.0).
    times = [3.0, 1.2, 1.0, 1.0, 1.0, 3.0, 1.2, 1.0, 9.0, 1.0, 3.0, 1.2, 1.0, 1.0, 1.0]
    positions = [0, 1, 2, 3, 4] * 3
    # medians per position: 3.0, 1.2, 1.0, 1.0 (the outlier dropped), 1.0 -> mean 7.2 / 5
    assert monitor_bench._amortised_ratio(times, positions) == pytest.approx(7.2 / 5)
    assert monitor_bench._amortised_ratio(times, []) == pytest.approx(1.0)  # no period: the median


def test_rounds_must_hold_whole_sampling_periods(monitor_bench):
    with pytest.raises(ValueError, match="multiple of 10.*got 15"):
        monitor_bench.sampling_costs("gpt", "bf16_control", rounds=1, per_round=15)


def test_paired_ratio_takes_each_round_over_its_own_baseline(monitor_bench):
    # The machine slows by half in rounds 2-3: the pooled ratio would mix fast and slow rounds,
    # the paired one sees 1.2 in every round but the third (1.5, an outlier the median drops).
    rounds = [1.2, 1.2, 2.25, 1.8]
    base = [1.0, 1.0, 1.5, 1.5]
    out = monitor_bench._paired("paired", rounds, base)
    assert out["paired"] == pytest.approx(1.2)  # median of 1.2, 1.2, 1.5, 1.2
    # even rounds 1.2, 1.5 -> 1.35; odd rounds 1.2, 1.2 -> 1.2; gap 0.15 / 1.2
    assert out["paired_halves_pct"] == pytest.approx(12.5)
    assert monitor_bench._paired("x", [1.1], [1.0]) == {"x": pytest.approx(1.1), "x_halves_pct": None}
