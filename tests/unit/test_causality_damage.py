"""Cause before consequence, and destroyed tensors, on hand-made rankings and rows."""

from __future__ import annotations

import math

import pytest
import torch

from fp8track.analysis.causality import CAUSE, CONSEQUENCE, causal_order
from fp8track.analysis.damage import destroyed_layers, destroyed_on, loss_excursion
from fp8track.analysis.ranking import LayerRisk
from fp8track.monitoring.records import TensorStatsRow


def _risk(layer, score, onset, rank):
    return LayerRisk(layer, score, "gradient", rank=rank, onset=onset)


def test_a_later_larger_anomaly_is_a_consequence_not_the_headline():
    """The issue's case: the head's gradient underflow starts at step 75 (score 215.7), the planted
    attention projection at step 40 (score 2.95, below the anomaly cut but destroyed), the loss gap
    at step 52."""
    ranking = [_risk("lm_head", 215.7, 75, 1), _risk("blocks.0.attn.qkv", 2.95, 40, 2),
               _risk("blocks.1.mlp.fc", 0.4, None, 3)]
    ordered, roles = causal_order(ranking, reference=52, resolution=8, first_step=0,
                                  destroyed_onsets={"blocks.0.attn.qkv": 40})
    assert [r.layer for r in ordered] == ["blocks.0.attn.qkv", "blocks.1.mlp.fc", "lm_head"]
    assert roles["blocks.0.attn.qkv"].role == CAUSE
    assert roles["lm_head"].role == CONSEQUENCE and roles["lm_head"].downstream_of == "blocks.0.attn.qkv"
    assert "step 75" in roles["lm_head"].reason and "step 52" in roles["lm_head"].reason
    assert [r.rank for r in ordered] == [1, 2, 3]


def test_onsets_within_the_resolution_are_not_ordered_and_a_run_without_onsets_keeps_its_ranking():
    ranking = [_risk("a", 9.0, 48, 1), _risk("b", 5.0, 44, 2)]
    ordered, roles = causal_order(ranking, reference=50, resolution=8)
    assert [r.layer for r in ordered] == ["a", "b"] and {x.role for x in roles.values()} == {CAUSE}
    healthy = [_risk("a", 1.2, None, 1), _risk("b", 1.1, None, 2)]
    assert causal_order(healthy, reference=None, resolution=8) == (healthy, {})


def test_destroyed_criteria_and_layers():
    healthy = {"underflow_pct": 0.2, "overflow_pct": 0.0, "sqnr_db": 31.0, "mse": 1e-6, "amax": 1.0,
               "numel": 4096.0}
    assert destroyed_on(healthy) == ()
    assert destroyed_on({**healthy, "underflow_pct": 97.0}) == ("flushed", "drowned")  # 0.13 dB bulk
    # clipping destroys what its error destroys: 12 % clipped at 31 dB (a bounded tensor a little
    # over the range: GEMM error 0.03) is healthy; 28 % of a Gaussian clipped reads 9 dB (0.35)
    assert destroyed_on({**healthy, "overflow_pct": 12.0}) == ()
    clipped = {**healthy, "overflow_pct": 28.0, "sqnr_db": 9.0, "mse": 0.1}
    assert destroyed_on(clipped) == ("clipped",)
    # 3-10.5 dB: lost to rounding and underflow (nothing saturated: a scale far too small) is
    # damage; a few elements per thousand saturated is delayed scaling's lag behind an amax jump
    # (healthy delayed runs read 7-10 dB there at data spikes), back at its usual SQNR next step
    coarse = {**healthy, "sqnr_db": 8.0, "mse": 0.1}
    assert destroyed_on(coarse) == ("drowned",)
    assert destroyed_on({**coarse, "overflow_pct": 0.05}) == ()
    assert destroyed_on({**coarse, "sqnr_db": 2.0, "overflow_pct": 0.05}) == ("drowned",)
    rows = [TensorStatsRow(s, "fc", "activation", {**healthy, "underflow_pct": 99.0 if s >= 20 else 0.1})
            for s in range(0, 50, 5)]
    shadow = {**healthy, "underflow_pct": 99.0}
    rows += [TensorStatsRow(s, "fc", "activation", shadow, "shadow") for s in range(5)]
    (d,) = destroyed_layers(rows)
    assert (d.layer, d.onset, d.steps, d.sampled) == ("fc", 20, (20, 25, 30, 35, 40, 45), 10)
    assert d.share == pytest.approx(0.6)
    # delayed scaling's first step quantises with the initial scale 1.0 (gradients of 1e-5 flush in
    # E5M2 by construction): left out; the same flush at a later step, or at a real scale, counts
    flushed = {**healthy, "underflow_pct": 99.0, "sqnr_db": 0.04}  # a Gaussian 99 % flushed: 0.04 dB
    first = {**flushed, "scale": 1.0, "current_scale": 2.0**20}
    assert destroyed_layers([TensorStatsRow(0, "fc", "gradient", first),
                             TensorStatsRow(5, "fc", "gradient", {**healthy, "scale": 2.0**20})]) == []
    (late,) = destroyed_layers([TensorStatsRow(0, "fc", "gradient", {**healthy, "scale": 2.0**20}),
                                TensorStatsRow(5, "fc", "gradient", first)])
    assert late.steps == (5,)
    (real,) = destroyed_layers([TensorStatsRow(0, "fc", "gradient", {**flushed, "scale": 4.0,
                                                                     "current_scale": 2.0**20})])
    assert real.steps == (0,)


def test_loss_excursion_after_an_onset():
    control = {s: 3.0 for s in range(100)}
    fp8 = {s: 3.0 * (1.25 if 80 <= s < 90 else (1.08 if s >= 90 else 1.005)) for s in range(100)}
    ex = loss_excursion(fp8, control, onset=80, window=15)
    assert ex["before"] == pytest.approx(1.005) and ex["peak"] == pytest.approx(1.25)
    assert ex["rise"] == pytest.approx(1.25 / 1.005 - 1) and math.isnan(ex["after"]) is False


def test_two_layers_destroyed_on_the_same_step_are_both_causes_whatever_their_windows():
    """A layer whose statistics stand out over the whole run (``onset None``: "anomalous from the
    first sampled step") and that was destroyed once at step 15 is not destroyed "from step 0": a
    layer also destroyed from step 15 (a Llama run whose planted q_proj gradient flushed on six
    sampled steps) is no consequence of it, and the larger anomaly leads."""
    ranking = [_risk("q_proj", 302.0, 95, 1), _risk("k_proj", 13.3, None, 2), _risk("fc", 1.0, None, 3)]
    ordered, roles = causal_order(ranking, reference=None, resolution=10, first_step=0,
                                  destroyed_onsets={"q_proj": 15, "k_proj": 15})
    assert roles["q_proj"].role == CAUSE and roles["k_proj"].role == CAUSE
    assert [r.layer for r in ordered][:2] == ["q_proj", "k_proj"]
    # a layer destroyed well after another one was destroyed is still its consequence
    ordered, roles = causal_order(ranking, reference=None, resolution=10, first_step=0,
                                  destroyed_onsets={"q_proj": 60, "k_proj": 15})
    assert roles["q_proj"].role == CONSEQUENCE and roles["q_proj"].downstream_of == "k_proj"
    assert "step 60" in roles["q_proj"].reason and "step 15" in roles["q_proj"].reason


def test_a_flushed_post_relu_input_is_destroyed_against_its_nonzero_elements():
    """``underflow_pct`` counts over every element: an OPT ``fc2`` input (post-ReLU, 53 % exact zeros)
    whose nonzero elements an outlier's scale flushed (GEMM error 0.4-0.6 against float32) reads
    47 % underflow, below the 50 % flush cut, and its outlier hides the rest from the SQNR. Against
    its nonzero elements (``zero_pct``) it is flushed; a row without ``zero_pct`` reads as before."""
    from fp8track.analysis.risk_signals import bulk_sqnr_db, nonzero_underflow_pct

    row = {"amax": 999424.0, "underflow_pct": 47.06, "overflow_pct": 0.0, "mse": 0.4028, "cos": 1.0,
           "sqnr_db": 72.77, "scale": 0.0004, "current_scale": 0.0004, "nonfinite_pct": 0.0,
           "numel": 131200.0}
    assert destroyed_on(row) == ()
    relu = {**row, "zero_pct": 53.0}
    assert nonzero_underflow_pct(relu) == 100.0  # 47.06 of the 47 % nonzero: clamped
    assert destroyed_on(relu) == ("flushed", "drowned")
    assert bulk_sqnr_db(relu) <= 0.1
    # a healthy post-ReLU input: a few tenths of a percent of its nonzero elements underflow
    assert destroyed_on({**relu, "underflow_pct": 0.2, "sqnr_db": 31.0, "mse": 1e-4, "amax": 2.0,
                         "scale": 224.0, "current_scale": 224.0}) == ()
    # a tensor of zeros only: nothing to flush
    assert nonzero_underflow_pct({"underflow_pct": 0.0, "zero_pct": 100.0}) == 0.0



def test_a_one_step_saturation_behind_an_amax_jump_is_a_lag_not_a_destroyed_layer():
    """Delayed scaling, a gradient whose amax jumped 18x at step 20: 0.3 % of its elements clip
    at the stale scale and drown the rest (2 dB), and one step later the history has caught up
    (25 dB). One sampled step of saturation is the lag; a flush, or saturation on two sampled
    steps, is damage."""
    healthy = {"underflow_pct": 0.0, "overflow_pct": 0.0, "sqnr_db": 25.5, "mse": 1e-14, "amax": 7e-6,
               "numel": 131072.0, "scale": 8.3e9, "current_scale": 8.3e9}
    lag = {**healthy, "overflow_pct": 0.31, "sqnr_db": 1.97, "amax": 1.2e-4, "mse": 1e-10}
    assert destroyed_on(lag) == ("drowned",)
    rows = [TensorStatsRow(s, "k_proj", "gradient", lag if s == 20 else healthy) for s in range(1, 40)]
    (d,) = destroyed_layers(rows)
    assert d.steps == (20,) and d.lag_only
    twice = [TensorStatsRow(s, "k_proj", "gradient", lag if s in (20, 30) else healthy) for s in range(1, 40)]
    assert not destroyed_layers(twice)[0].lag_only
    flushed = {**healthy, "underflow_pct": 99.0, "overflow_pct": 0.3, "sqnr_db": 0.04}
    once_flushed = [
        TensorStatsRow(s, "k_proj", "gradient", flushed if s == 20 else healthy) for s in range(1, 40)
    ]
    assert not destroyed_layers(once_flushed)[0].lag_only
    drowned_no_clip = {**healthy, "sqnr_db": 1.0, "mse": 1e-10}
    once_drowned = [TensorStatsRow(s, "k_proj", "gradient", drowned_no_clip if s == 20 else healthy)
                    for s in range(1, 40)]
    assert not destroyed_layers(once_drowned)[0].lag_only


def _q(x, fmt, scale):
    """Reference quantisation, independent of the kernel: torch's saturating float8 cast."""
    from fp8track.numerics.formats import get_format

    f, s = get_format(fmt), torch.tensor(scale, dtype=torch.float32)
    return (x * s).clamp(-f.max, f.max).to(f.dtype).float() / s


def _gemm_error(x, qx, w):
    """Median over output rows of ``||(Q(x) - x) w|| / ||x w||``, and the Frobenius one: the worse."""
    ref, got = x @ w, qx @ w
    rows = float(((got - ref).norm(dim=1) / ref.norm(dim=1)).median())
    return max(rows, float((got - ref).norm() / ref.norm()))


@pytest.mark.parametrize(
    "case, fmt, stale, destroyed",
    [
        # a gradient spanning decades, its scale stale: 59 % flushed at 32 dB, its GEMM exact to 0.05
        ("lognormal", "e5m2", 2.0**-16, False),
        # a Gaussian 47 % flushed reads 9 dB from its energies: GEMM error 0.36
        ("gauss", "e4m3", 2.0**-16, True),
        # 28 % of a Gaussian clipped: 9 dB, GEMM error 0.35; a bounded tensor 9 % clipped: 0.03
        ("gauss_clip", "e4m3", 4.0, True),
        ("uniform_clip", "e4m3", 1.1, False),
        # two massive activations (two tokens, one channel) set the scale and flush the others: the
        # elements besides the largest read 70 dB from their energies (the other outlier), the count
        # (97 % flushed) tells
        ("massive2", "e4m3", 1.0, True),
    ],
)
def test_destroyed_means_a_destroyed_gemm_against_float32(case, fmt, stale, destroyed):
    """Ground truth from the GEMM: quantise with torch's float8 cast, multiply by a random operand and
    compare with float32. Destroyed (relative error >= 0.3, the diagnosis bench's) exactly when
    :func:`destroyed_on` says so; a healthy one reads under 0.1."""
    from fp8track.numerics.formats import get_format
    from fp8track.numerics.stats import quant_stats

    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 40, generator=g)
    if case == "lognormal":
        x = torch.sign(x) * torch.exp(4.0 * torch.randn(48, 40, generator=g)) * 1e-8
    elif case == "uniform_clip":
        x = torch.rand(48, 40, generator=g) * 2 - 1
    elif case == "massive2":
        x[:2, 7] = 1e6
    scale = float(torch.tensor(get_format(fmt).max / float(x.abs().max()) * stale, dtype=torch.float32))
    stats = quant_stats(x, fmt, scale)
    err = _gemm_error(x, _q(x, fmt, scale), torch.randn(40, 32, generator=g) / 40**0.5)
    assert (err >= 0.3) == destroyed and (destroyed or err < 0.1), err
    assert bool(destroyed_on(stats)) == destroyed, (stats, err)
