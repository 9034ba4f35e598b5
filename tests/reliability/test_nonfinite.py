"""Guarantee 4: NaN/Inf in activations, weights, gradients or the loss never raise inside hooks.
They show as ``nonfinite_pct`` and non-finite events; every other statistic is computed over the
finite elements only; a loss that is NaN for one step does not poison the spike window."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from fp8track import MonitorConfig
from fp8track.analysis.spikes import SpikeDetector
from fp8track.frontend import Monitor
from fp8track.monitoring.records import RunReader

from helpers.models import mlp


class _NanGrad(torch.autograd.Function):
    """Identity forward; backward puts NaN into column 2 of the gradient (dY of the layer before)."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return g.index_fill(1, torch.tensor([2]), math.nan)


def _finite_amax(t: torch.Tensor) -> float:
    t = t.detach().double()
    return t[torch.isfinite(t)].abs().max().item()


def test_nonfinite_tensors_are_counted_and_the_rest_measured_over_finite_elements(tmp_path):
    model = mlp(8, 16, 4, act=None)
    monitor = Monitor(model, MonitorConfig(every_n_steps=1), log_dir=tmp_path).attach()
    expected: dict[tuple[int, str, str], tuple[float, float]] = {}  # -> (nonfinite_pct, finite amax)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a warning from the hooks
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            if step == 1:  # activation of layer 0: 2 NaN and 1 +inf among 32 elements
                x[0, 0] = x[2, 5] = math.nan
                x[3, 7] = math.inf
                expected[(1, "0", "activation")] = (100 * 3 / 32, _finite_amax(x))
            if step == 2:  # weight of layer 1: one -inf among 64 elements
                model[1].weight.data[3, 3] = -math.inf
                expected[(2, "1", "weight")] = (100 * 1 / 64, _finite_amax(model[1].weight))
            h = model[0](x)
            y = model[1](h)
            if step == 3:  # gradient (dY) of layer 1: 4 NaN among 16 elements
                y = _NanGrad.apply(y)
            loss = y.square().mean()
            loss.backward()
            if step == 3:
                g = (2 * y / y.numel()).index_fill(1, torch.tensor([2]), math.nan)
                expected[(3, "1", "gradient")] = (100 * 4 / 16, _finite_amax(g))
            monitor.step(loss=loss)
            model.zero_grad()
            if step == 2:
                model[1].weight.data[3, 3] = 0.0
        monitor.close()
    rows = {(r.step, r.layer, r.tensor): r.stats for r in RunReader(monitor.run_dir).tensor_stats()}
    for key, (pct, amax) in expected.items():
        stats = rows[key]
        assert stats["nonfinite_pct"] == pytest.approx(pct), key
        assert stats["amax"] == pytest.approx(amax, rel=1e-6), key
        assert stats["numel"] == {"activation": 32, "weight": 64, "gradient": 16}[key[2]], key  # all elements
        for name in ("mse", "cos", "sqnr_db", "underflow_pct", "overflow_pct"):
            assert math.isfinite(stats[name]), (key, name, stats[name])
    # The untouched tensors of those steps stay all-finite.
    assert rows[(1, "0", "weight")]["nonfinite_pct"] == 0.0
    assert rows[(2, "0", "activation")]["nonfinite_pct"] == 0.0
    # and the run-level worst reports it
    worst = {
        r.step: r.metrics["fp8/worst/nonfinite_pct"]
        for r in RunReader(monitor.run_dir).metrics()
        if "fp8/worst/nonfinite_pct" in r.metrics
    }
    # (layer 1's input at step 1 holds the NaN/inf rows that layer 0 passed on: 3 of 4 rows)
    assert rows[(1, "1", "activation")]["nonfinite_pct"] == 75.0
    assert worst[1] == 75.0 and worst[0] == 0.0


def test_one_nan_loss_is_an_event_and_does_not_poison_the_spike_window(tmp_path):
    model = mlp(8, 16, 4, act=None)
    monitor = Monitor(model, MonitorConfig(every_n_steps=5), log_dir=tmp_path)
    losses = [2.0 + 0.01 * ((-1) ** s) + 0.001 * (s % 7) for s in range(120)]
    losses[60] = math.nan
    for loss in losses:
        monitor.step(loss=loss)
    detector = monitor.analyzers[0].spikes
    reference = SpikeDetector(detector.config)  # the same series without the NaN, up to the last flush
    for s, loss in enumerate(losses[: detector.last_step + 1]):
        if not math.isnan(loss):
            reference.update(s, loss)
    # same median and sigma (the monitor keeps losses in float32)
    assert detector.baseline(120) == pytest.approx(reference.baseline(120), rel=1e-5)
    monitor.close()
    events = list(RunReader(monitor.run_dir).events())
    nonfinite = [e for e in events if e.kind == "nonfinite"]
    assert [e.data["start_step"] for e in nonfinite if e.data.get("status") == "open"] == [60]
    assert [e for e in events if e.kind == "spike"] == []  # no spike before or after the NaN step
    assert all(math.isfinite(v) for v in RunReader(monitor.run_dir).series("fp8/loss").values())
