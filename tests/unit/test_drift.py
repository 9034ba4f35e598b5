"""DriftTracker excursions and the WhatIfDelayed simulation
(against fp8track.numerics.scaling.DelayedScaler)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fp8track.analysis.drift import DriftConfig, DriftTracker, WhatIfDelayed, drift_log2
from fp8track.errors import ConfigError
from fp8track.numerics.scaling import DelayedScaler


def feed(tr, drifts, layer="fc1", tensor="weight"):
    return [e for s, d in enumerate(drifts) for e in tr.update(s, layer, tensor, d)]


def test_drift_log2():
    assert drift_log2(8.0, 2.0) == 2.0
    assert drift_log2(1.0, 4.0) == -2.0
    # one definition with the statistics (numerics.scaling.drift_log2): a zero scale is -inf binades
    # off, an infinite one +inf; only a meaningless comparison is NaN
    assert drift_log2(0.0, 1.0) == -math.inf and drift_log2(math.inf, 1.0) == math.inf
    assert (
        math.isnan(drift_log2(1.0, math.inf))
        and math.isnan(drift_log2(1.0, 0.0))
        and math.isnan(drift_log2(math.nan, 1.0))
    )


def test_event_after_k_consecutive_one_per_excursion_and_rearm():
    tr = DriftTracker(DriftConfig(threshold_log2=1.0, consecutive=3))
    drifts = [0.0, 1.2, 1.5, 0.5, 1.1, 1.3, 2.5, 3.0, 1.4, 0.2, 1.0, 1.0, 1.0]
    events = feed(tr, drifts)
    # run at 1-2 broken by 0.5; run 4..8 fires at its 3rd sample (step 6); run 10..12 fires at 12
    assert [(e.step, e.start_step, e.direction) for e in events] == [
        (6, 4, "overflow_risk"),
        (12, 10, "overflow_risk"),
    ]
    assert events[0].drift_log2 == 2.5 and events[0].peak_drift_log2 == 2.5 and events[0].consecutive == 3
    assert events[0].severity == pytest.approx(2.5)
    assert tr.events == events


def test_direction_flip_starts_a_new_excursion_and_nan_is_skipped():
    tr = DriftTracker(DriftConfig(threshold_log2=1.0, consecutive=2))
    events = feed(tr, [1.5, 1.5, -2.0, math.nan, -3.0])
    assert [(e.step, e.direction, e.peak_drift_log2) for e in events] == [
        (1, "overflow_risk", 1.5),
        (4, "underflow_risk", -3.0),
    ]


def test_layers_and_tensors_are_independent():
    tr = DriftTracker(DriftConfig(consecutive=2))
    out = []
    for s in range(2):
        out += tr.update_many(s, {("a", "weight"): 2.0, ("a", "gradient"): 0.0, ("b", "weight"): -2.0})
    assert sorted((e.layer, e.tensor, e.direction) for e in out) == [
        ("a", "weight", "overflow_risk"),
        ("b", "weight", "underflow_risk"),
    ]
    rec = out[0].to_record()
    assert (
        rec.kind == "drift"
        and rec.step == 1
        and rec.data["layer"] in ("a", "b")
        and rec.data["severity"] == 2.0
    )


def test_tracker_state_round_trip_mid_excursion():
    drifts = [1.5, 1.5, 0.0, 2.0, 2.0, 2.0, 2.0, -1.0]
    ref = feed(DriftTracker(), drifts)
    a = DriftTracker()
    first = feed(a, drifts[:4])
    b = DriftTracker()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    rest = [e for s, d in enumerate(drifts[4:], start=4) for e in b.update(s, "fc1", "weight", d)]
    assert first + rest == ref and len(ref) == 1 and ref[0].start_step == 3


def test_whatif_matches_delayed_scaler_and_current_scale():
    amaxes = [2.0, 3.0, 1.0, 8.0, 0.5, 0.5, 0.5]
    w = WhatIfDelayed("hybrid", history_len=3, algo="max", margin=1)
    ref = DelayedScaler("e5m2", history_len=3, algo="max", margin=1)
    for step, a in enumerate(amaxes):
        got = w.observe(step, "fc1", "gradient", a)  # gradient -> e5m2 under hybrid
        expected_scale = float(ref.scale)
        ref.observe(torch.tensor(a))
        ref.update()
        assert got.scale == pytest.approx(expected_scale)
        assert got.current_scale == pytest.approx(57344.0 / a / 2)
        if step == 0:
            assert math.isnan(got.drift_log2)
        else:
            assert got.drift_log2 == pytest.approx(math.log2(expected_scale / (57344.0 / a / 2)))
    # hand-worked: at step 3 the history holds 3.0 and 1.0 (2.0 rolled out): scale = 57344/3/2,
    # amax 8 -> drift = log2(8/3) > 0 (overflow risk); at step 6 the 8.0 has left: drift 0
    w2 = WhatIfDelayed("hybrid", history_len=3, margin=1)
    res = [w2.observe(s, "l", "gradient", a).drift_log2 for s, a in enumerate(amaxes)]
    assert res[3] == pytest.approx(math.log2(8 / 3))
    assert res[4] == pytest.approx(math.log2(0.5 / 8))
    assert res[6] == pytest.approx(math.log2(0.5 / 8))


def test_whatif_feeds_tracker_and_round_trips():
    w = WhatIfDelayed("e4m3", history_len=2)
    tr = DriftTracker(DriftConfig(threshold_log2=1.0, consecutive=2), source="what_if")
    events = []
    for s, a in enumerate([1.0, 1.0, 8.0, 8.0, 8.0]):
        events += tr.update(s, "fc", "activation", w.observe(s, "fc", "activation", a).drift_log2)
    # step 2: scale from amax 1 vs amax 8 -> +3; step 3: history has 1 and 8 -> 0: no 2nd sample
    assert events == []
    w3 = WhatIfDelayed("e4m3", history_len=4)
    seq = [8.0, 8.0, 1.0, 1.0, 1.0, 1.0]
    ds = [w3.observe(s, "fc", "weight", a).drift_log2 for s, a in enumerate(seq)]
    assert ds[2:5] == [pytest.approx(-3.0)] * 3  # the 8.0 stays in a 4-long history: wasted range
    b = WhatIfDelayed("e4m3", history_len=4)
    b.load_state_dict(json.loads(json.dumps(w3.state_dict())))
    assert b.observe(6, "fc", "weight", 1.0) == w3.observe(6, "fc", "weight", 1.0)


def test_validation():
    with pytest.raises(ConfigError, match="threshold_log2 must be a number > 0"):
        DriftConfig(threshold_log2=0)
    with pytest.raises(ConfigError, match="consecutive must be an integer >= 1"):
        DriftConfig(consecutive=0)
    with pytest.raises(ConfigError, match="unknown amax_compute_algo 'mean'"):
        WhatIfDelayed(algo="mean")
    with pytest.raises(ConfigError, match="unknown fp8_format 'e3m4'"):
        WhatIfDelayed("e3m4")
    with pytest.raises(ConfigError, match="unknown tensor kind 'bias'"):
        WhatIfDelayed().observe(0, "fc", "bias", 1.0)
    with pytest.raises(ConfigError, match="unknown DriftConfig key"):
        DriftConfig.from_dict({"threshold": 1})


def test_batched_whatif_equals_one_delayed_scaler_per_tensor():
    """The batched what-if update must reproduce DelayedScaler (TE's rule) column by column, also
    when some tensors are missing from a step and when keys appear late."""
    import random

    import torch

    from fp8track.numerics.scaling import DelayedScaler

    rng = random.Random(7)
    keys = [("fc1", "activation"), ("fc1", "gradient"), ("fc2", "weight"), ("fc2", "gradient")]
    w = WhatIfDelayed("hybrid", history_len=5, algo="max", margin=1)
    ref = {k: DelayedScaler("e5m2" if k[1] == "gradient" else "e4m3", 5, "max", 1) for k in keys}
    seen = {k: 0 for k in keys}
    for step in range(40):
        present = [k for k in keys if rng.random() < 0.7 and (step > 10 or k[0] == "fc1")]
        amaxes = {k: rng.choice([0.0, float("inf"), 10 ** rng.uniform(-6, 4)]) for k in present}
        got = w.observe_many(step, amaxes)
        for k, a in amaxes.items():
            used = float(ref[k].scale)
            ref[k].observe(torch.tensor(a))
            ref[k].update()
            assert got[k].scale == used, (step, k)
            if seen[k] == 0:
                assert math.isnan(got[k].drift_log2)
            seen[k] += 1
    state = w.state_dict()
    clone = WhatIfDelayed("hybrid", history_len=5, algo="max", margin=1)
    clone.load_state_dict(state)
    assert clone.state_dict() == state


def test_the_worst_what_if_drift_is_logged_once_a_what_if_scale_exists():
    """The first sampled step has no what-if history: no drift exists yet, so no worst drift is logged
    (it read 0.0: 'no drift'). From the second, the worst |drift| over the rows, hand-worked: amax
    1 then 8 under a 16-long history -> scale from amax 1 vs amax 8 -> 3 binades."""
    from fp8track.analysis.analyzers import DriftAnalyzer
    from fp8track.monitoring.records import TensorStatsRow

    a = DriftAnalyzer()
    name = "fp8/worst/whatif_delayed_abs_drift_log2"
    stats = {"amax": 1.0, "scale_drift_log2": 0.0}
    first, _ = a.observe([], [TensorStatsRow(0, "fc", "activation", stats, "shadow")])
    assert name not in first and first["fp8/drift/count"] == 0.0
    second, _ = a.observe([], [TensorStatsRow(1, "fc", "activation", {**stats, "amax": 8.0}, "shadow")])
    assert second[name] == pytest.approx(3.0)
