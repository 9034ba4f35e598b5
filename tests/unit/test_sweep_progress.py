"""The sweep's live line says what it shows: the best gap to the control (signed, + = worse), the
trial it came from, and trials with no gap (failed) leave it alone."""

from __future__ import annotations

import math

from fp8track.sweep.progress import SweepProgress


def test_best_gap_is_the_smallest_gap_not_a_metric_value() -> None:
    p = SweepProgress(4, enabled=False)
    assert p._summary().startswith("best gap - |")
    p.trial_finished(0, 0.0123, 2.0, 1)
    p.trial_finished(1, -0.0006, 4.0, 2)
    p.trial_finished(2, math.nan, 1.0, 2)  # failed: no gap
    assert p._summary().startswith("best gap -0.0006 (trial 1) | ")
    assert p.time_left_s() == (4 - 2) * (2.0 + 4.0 + 1.0) / 3
