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
