"""DivergenceDetector: start-of-training and mid-training rises, control gap, non-finite, resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fp8track.analysis import synthetic_loss as sl
from fp8track.analysis.divergence import DivergenceConfig, DivergenceDetector, HalvesWindow, centred_median
from fp8track.errors import ConfigError


def run(losses, baselines=None, config=None, det=None, start=0):
    det = det or DivergenceDetector(config)
    out = []
    for i, x in enumerate(losses):
        out += det.update(start + i, float(x), None if baselines is None else baselines[i])
    return det, out


def test_halves_window_matches_numpy():
    rng = np.random.default_rng(0)
    w = HalvesWindow(20)
    xs = rng.normal(size=100)
    for i, x in enumerate(xs):
        w.append(x)
        tail = xs[max(0, i - 19) : i + 1]
        half = len(tail) // 2
        older, newer = w.medians()
        assert newer == pytest.approx(np.median(tail[len(tail) - half :])) if half else math.isnan(newer)
        assert older == pytest.approx(np.median(tail[: len(tail) - half]))
        q_old, q_new = w.quantiles(0.25)
        assert q_old == pytest.approx(np.quantile(tail[: len(tail) - half], 0.25))
        if half:
            assert q_new == pytest.approx(np.quantile(tail[len(tail) - half :], 0.25))


def test_centred_median_hand_worked():
    np.testing.assert_allclose(
        centred_median(np.array([5.0, 1.0, 3.0, 2.0, 4.0]), 3), [3.0, 3.0, 2.0, 3.0, 3.0]
    )


def test_mid_training_divergence_start_and_phase():
    rng = np.random.default_rng(1)
    x = sl.healthy(sl.Curve(noise="student_t", sigma=0.02), 5000, rng)
    x = sl.plant_divergence(x, 3000, 0.002)
    det, events = run(x)
    (e,) = events
    assert (e.reason, e.phase) == ("rise", "mid")
    assert abs(e.start_step - 3000) <= 100  # bench: median error ~30 steps, 90th percentile ~120
    assert 3000 < e.detect_step <= 3300
    assert e.magnitude >= 0.05 and e.loss_at_detect > e.loss_at_start
    rec = e.to_record()
    assert rec.kind == "divergence" and rec.step == e.detect_step
    assert rec.data["alert"] is True and rec.data["level"] == "ERROR" and "mid-training" in rec.data["text"]


def test_start_of_training_divergence():
    rng = np.random.default_rng(2)
    x = sl.healthy(sl.Curve(start=10.0, floor=9.5, sigma=0.02), 2000, rng)
    x = sl.plant_divergence(x, 50, 0.002)
    _, (e,) = run(x)
    assert (e.reason, e.phase) == ("rise", "start")
    assert e.start_step <= 120
    assert "beginning of training" in e.to_record().data["text"]


def test_late_divergence_without_progress_is_start_phase():
    # flat loss that never trained, rising after step 3000: "start" by the progress rule
    rng = np.random.default_rng(3)
    x = sl.plant_divergence(sl.healthy(sl.Curve(start=10.0, floor=10.0), 5000, rng), 3000, 0.002)
    _, (e,) = run(x)
    assert abs(e.start_step - 3000) <= 250 and e.phase == "start"


@pytest.mark.parametrize("noise", sl.NOISE_KINDS)
def test_healthy_streams_and_spikes_are_not_divergence(noise):
    rng = np.random.default_rng(4)
    for _ in range(5):
        x = sl.healthy(sl.random_curve(rng, noise), 5000, rng)
        x = sl.plant_spike(x, 2500, 1.0, rise=2, decay=20.0)  # a recovering spike is not a divergence
        assert run(x)[1] == []


def test_control_gap_start_step():
    rng = np.random.default_rng(5)
    ctl = sl.healthy(sl.Curve(sigma=0.01), 3000, rng)
    fp8 = ctl * (1 + 0.01 * rng.standard_normal(3000))
    fp8[1800:] *= 1.10  # a sustained 10% gap from step 1800
    _, events = run(fp8, baselines=ctl.tolist())
    (e,) = [e for e in events if e.reason == "gap"]  # a 10% step is also a "rise"
    assert e.phase == "mid"
    assert abs(e.start_step - 1800) <= 5
    assert 1800 < e.detect_step <= 1860
    assert 0.05 <= e.magnitude <= 0.11  # the window median at the step it first reaches the tolerance


def test_nonfinite_run_is_divergence_once():
    cfg = DivergenceConfig(nonfinite_patience=5)
    _, events = run([3.0] * 100 + [math.nan] * 30, config=cfg)
    (e,) = events
    assert (e.reason, e.start_step, e.detect_step, e.magnitude) == ("nonfinite", 100, 104, 5.0)


def test_resume_through_json_gives_identical_events():
    rng = np.random.default_rng(6)
    ctl = sl.healthy(sl.Curve(sigma=0.01), 3000, rng)
    x = sl.plant_divergence(ctl * 1.0, 2000, 0.002)
    x[1200:1400] *= 1.1
    base = ctl.tolist()
    _, ref = run(x, base)
    assert {e.reason for e in ref} == {"gap", "rise"}
    for cut in (1210, 1900, 2050, 2150):
        a, first = run(x[:cut], base[:cut])
        b = DivergenceDetector()
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        _, rest = run(x[cut:], base[cut:], det=b, start=cut)
        assert [e.to_dict() for e in first + rest] == [e.to_dict() for e in ref], cut
    fresh = DivergenceDetector()
    fresh.load_state_dict({"last_step": 7})
    with pytest.raises(ValueError, match="step 7 after 7"):
        fresh.update(7, 1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 2}, "window must be an integer >= 4"),
        ({"rise_threshold": 0.0}, "rise_threshold must be a number > 0"),
        ({"smooth": 4}, "smooth must be odd"),
        ({"min_samples": 500}, "min_samples \\(500\\) must not exceed window"),
        ({"lookback": 10}, "lookback must be an integer >= 200"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DivergenceConfig(**kwargs)
