"""Monitor core on a plain PyTorch loop: sampling, micro-batch merging, names, validation."""

import math

import pytest
import torch
from torch import nn

from fp8track import Monitor, MonitorConfig
from fp8track.errors import ConfigError
from fp8track.monitoring.records import RunReader
from fp8track.numerics.stats import finalize, merge_partials, partial_stats, quant_stats

from helpers.analyzers import StatelessAnalyzer
from helpers.models import mlp


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_steps": 0}, "every_n_steps must be an integer >= 1, got 0"),
        ({"every_n_steps": 2.5}, "every_n_steps"),
        ({"tensors": ("activation", "grads")}, "'grads'.*'activation', 'weight', 'gradient'"),
        ({"scalar_stats": ("mse", "snr")}, "'snr'.*'amax'"),
        ({"whatif": ("mxfp4",)}, "'mxfp4'.*'current', 'mxfp8', 'block', 'nvfp4'"),
        ({"shadow_format": "e5m2"}, "'e5m2'.*'hybrid'"),
    ],
)
def test_config_errors_name_value_and_choices(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MonitorConfig(**kwargs)


def test_layer_selection_errors_list_candidates(tmp_path):
    with pytest.raises(ConfigError, match=r"'re:attn' matches no linear layer; candidates: 0, 2"):
        Monitor(mlp(16, 32, 4), layers="re:attn", log_dir=tmp_path)
    with pytest.raises(ConfigError, match="no linear layer to monitor"):
        Monitor(nn.Sequential(nn.ReLU()), log_dir=tmp_path)
    assert list(Monitor(mlp(16, 32, 4), layers=["2"], log_dir=tmp_path).captures) == ["2"]


def test_sampling_and_records(tmp_path):
    model = mlp(16, 32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, MonitorConfig(every_n_steps=4, steps=(5,)), log_dir=tmp_path).attach()
    inputs = {}
    for step in range(9):
        x = torch.randn(8, 16)
        inputs[step] = x
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        mon.step(loss=loss)  # before zero_grad, so the gradient norm is measured
        opt.zero_grad()
    mon.close()
    reader = RunReader(mon.run_dir)
    rows = list(reader.tensor_stats())
    assert sorted({r.step for r in rows}) == [0, 4, 5, 8]
    assert {r.variant for r in rows} == {"shadow"}  # plain nn.Linear: what FP8 would do
    assert len(reader.series("fp8/loss")) == 9
    # the first layer's activation is the raw input: its statistics are exactly quant_stats(x)
    row = next(r for r in rows if r.step == 4 and r.layer == "0" and r.tensor == "activation")
    assert row.stats == pytest.approx(quant_stats(inputs[4], "e4m3"))
    grad_row = next(r for r in rows if r.step == 4 and r.layer == "2" and r.tensor == "gradient")
    assert grad_row.stats["current_scale"] == pytest.approx(57344 / grad_row.stats["amax"])  # hybrid: e5m2
    metrics = {r.step: r.metrics for r in reader.metrics() if "fp8/worst/mse" in r.metrics}
    assert metrics[4]["fp8/0/activation/mse"] == pytest.approx(row.stats["mse"])
    assert metrics[4]["fp8/worst/mse"] == max(r.stats["mse"] for r in rows if r.step == 4)
    assert metrics[4]["fp8/worst/cos"] == min(r.stats["cos"] for r in rows if r.step == 4)
    assert math.isfinite(metrics[4]["fp8/grad_norm"])


def test_unsampled_steps_keep_only_the_loss(tmp_path):
    # No observation, no grad norm, no per-layer state on unsampled steps; the loss is still
    # recorded. The hook stays registered while attached (a compiled model guards on hooks).
    model = mlp(16, 32, 4)
    layers = [model[0], model[2]]
    mon = Monitor(model, MonitorConfig(every_n_steps=3), log_dir=tmp_path).attach()
    observed, sampled = [], []
    for step in range(7):
        assert all(len(m._forward_hooks) == 1 for m in layers)
        sampled.append(mon.sampling)
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        observed.append(all(len(cap.partials) == 3 for cap in mon.captures.values()))
        assert all(len(cap.partials) in (0, 3) for cap in mon.captures.values())
        mon.step(loss=loss, grad_norm=123.0 if step == 1 else None)
        model.zero_grad()
    mon.close()
    assert observed == sampled == [s % 3 == 0 for s in range(7)]
    reader = RunReader(mon.run_dir)
    assert len(reader.series("fp8/loss")) == 7
    gnorm_steps = [r.step for r in reader.metrics() if "fp8/grad_norm" in r.metrics]
    assert gnorm_steps == [0, 3, 6]  # the grad norm passed in on unsampled step 1 is dropped
    assert sorted({r.step for r in reader.tensor_stats()}) == [0, 3, 6]
    mon.detach()
    assert all(len(m._forward_hooks) == 0 for m in layers)


def test_micro_batches_merge_exactly(tmp_path):
    model = mlp(16, 32, 4)
    mon = Monitor(model, MonitorConfig(every_n_steps=1, tensors=("activation",)), log_dir=tmp_path).attach()
    xs = [torch.randn(4, 16) * s for s in (1.0, 100.0, 1e-3)]
    total = 0.0
    for x in xs:  # three micro-batches of one optimizer step
        loss = model(x).sum()
        loss.backward()
        total += loss.item()
    mon.step(loss=total / 3)
    mon.close()
    row = next(r for r in RunReader(mon.run_dir).tensor_stats() if r.layer == "0")
    expected = finalize(merge_partials([partial_stats(x, "e4m3") for x in xs]), "e4m3")
    assert row.stats == pytest.approx(expected)
    assert row.stats["numel"] == 3 * 4 * 16
    # each micro-batch has its own current scale; the reported scale is the smallest one
    assert row.stats["scale"] == pytest.approx(448 / xs[1].abs().max().item(), rel=1e-6)


def test_state_round_trip_keeps_pending_losses(tmp_path):
    model = mlp(16, 32, 4)
    mon = Monitor(model, MonitorConfig(every_n_steps=10), log_dir=tmp_path).attach()
    for v in (1.0, 2.0, 3.0):
        mon.step(loss=torch.tensor(v))
    state = mon.state_dict()
    assert state["global_step"] == 3 and [p[1] for p in state["pending"]] == [2.0, 3.0]
    other = Monitor(model, MonitorConfig(every_n_steps=10), log_dir=tmp_path)
    other.load_state_dict(state)
    assert other.state_dict() == state


def test_a_failing_analyzer_warns_once_and_training_goes_on(tmp_path):
    class Broken(StatelessAnalyzer):
        def observe(self, losses, rows):
            raise RuntimeError("boom")

    model = mlp(16, 32, 4)
    mon = Monitor(model, MonitorConfig(every_n_steps=1), log_dir=tmp_path, analyzers=[Broken()]).attach()
    with pytest.warns(UserWarning, match="Broken failed at step 0") as record:
        for _ in range(3):
            model(torch.randn(2, 16)).sum().backward()
            mon.step(loss=1.0)
    mon.close()
    assert sum("Broken failed" in str(w.message) for w in record) == 1
    reader = RunReader(mon.run_dir)
    assert [e.step for e in reader.events() if e.kind == "analysis_error"] == [0, 1, 2]
    assert len(reader.series("fp8/loss")) == 3


def _events_after_run(tmp_path, losses, stop_at=None):
    """Feed ``losses`` through a Monitor; optionally checkpoint at ``stop_at`` (JSON round trip)
    and continue in a fresh Monitor, as a resumed job would."""
    import json

    model = mlp(16, 32, 4)
    config = MonitorConfig(every_n_steps=7, tensors=("weight",))
    mon = Monitor(model, config, log_dir=tmp_path).attach()
    for step, loss in enumerate(losses):
        if step == stop_at:
            state = json.loads(json.dumps(mon.state_dict()))
            mon.detach()  # the job dies here; nothing of mon survives but the checkpointed state
            mon = Monitor(model, config, log_dir=tmp_path)
            mon.load_state_dict(state)
            mon.attach()
        model(torch.randn(2, 16))
        mon.step(loss=float(loss))
    mon.close()
    return [
        (e.kind, e.step, e.data.get("status"), e.data.get("peak_step"))
        for e in RunReader(mon.run_dir).events()
        if e.kind in ("spike", "nonfinite", "divergence")
    ]


def test_resume_mid_spike_gives_the_same_events(tmp_path):
    import numpy as np

    from fp8track.analysis.synthetic_loss import Curve, healthy, plant_spike

    loss = healthy(Curve(), 400, np.random.default_rng(3))
    loss = plant_spike(loss, 300, height=0.6, rise=2, decay=8.0)
    uninterrupted = _events_after_run(tmp_path / "a", loss)
    assert any(k == "spike" and 300 <= s <= 302 for k, s, _, _ in uninterrupted), uninterrupted
    resumed = _events_after_run(tmp_path / "b", loss, stop_at=305)  # inside the spike, between flushes
    assert resumed == uninterrupted


def test_evaluation_forwards_do_not_leak_into_statistics(tmp_path):
    model = mlp(16, 32, 4)
    mon = Monitor(model, MonitorConfig(every_n_steps=1, tensors=("activation",)), log_dir=tmp_path).attach()
    x = torch.randn(4, 16)
    model(x).sum().backward()
    with torch.no_grad():  # a validation pass inside the sampled step
        model(torch.randn(4, 16) * 1000)
    mon.step(loss=1.0)
    with torch.no_grad():  # and one between steps
        model(torch.randn(4, 16) * 1000)
    model(x).sum().backward()
    mon.step(loss=1.0)
    mon.close()
    rows = [r for r in RunReader(mon.run_dir).tensor_stats() if r.layer == "0"]
    assert [r.step for r in rows] == [0, 1]
    for r in rows:
        assert r.stats == pytest.approx(quant_stats(x, "e4m3"))


# --- every step's loss reaches the sink; a step without a loss records nothing; one SUM + one MAX ---


class _ListSink:
    """A StepSink keeping what it is sent (the tracker fan-out's interface)."""

    def __init__(self) -> None:
        self.batches = []

    def start(self, meta, recorded_before_resume=None) -> None:
        self.meta = meta

    def log(self, batch) -> None:
        self.batches.append(batch)

    def finish(self) -> None:
        pass


def _train(mon, model, steps, loss_at=lambda s: True):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = {}
    for step in range(steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        if loss_at(step):
            losses[step] = loss.item()
            mon.step(loss=loss)
        else:
            mon.step()
        opt.zero_grad()
    mon.close()
    return losses


def test_the_sink_gets_the_loss_of_every_step_under_its_own_step(tmp_path):
    from fp8track.monitoring.monitor import CaptureConfig
    from fp8track.monitoring.monitor import MonitorCore as Core

    sink = _ListSink()
    model = mlp(16, 32, 4)
    mon = Core(model, CaptureConfig(every_n_steps=5), log_dir=tmp_path, sink=lambda run_dir: sink).attach()
    losses = _train(mon, model, 12)
    sent = {b.step: b.metrics["fp8/loss"] for b in sink.batches if "fp8/loss" in b.metrics}
    assert sent == pytest.approx(losses, rel=1e-6)  # all 12 steps, not only 0, 5, 10
    assert RunReader(mon.run_dir).series("fp8/loss") == pytest.approx(losses, rel=1e-6)
    steps = [b.step for b in sink.batches]
    assert steps == sorted(steps)  # step-ordered trackers see increasing steps


def test_a_step_without_a_loss_records_none_and_raises_no_alarm(tmp_path):
    model = mlp(16, 32, 4)
    mon = Monitor(model, MonitorConfig(every_n_steps=3), log_dir=tmp_path).attach()
    losses = _train(mon, model, 10, loss_at=lambda s: s in (1, 4, 5))
    reader = RunReader(mon.run_dir)
    assert reader.series("fp8/loss") == pytest.approx(losses, rel=1e-6)
    kinds = [e.kind for e in reader.events()]
    assert kinds == ["run_end"], kinds  # no non-finite loss, no spike, no analysis error
    # the sampled steps without a loss still have their statistics and grad norm
    assert {r.step for r in reader.tensor_stats()} == {0, 3, 6, 9}
    assert set(reader.series("fp8/grad_norm")) == {0, 3, 6, 9}


def test_a_given_nan_loss_is_still_an_alarm(tmp_path):
    model = mlp(16, 32, 4)
    mon = Monitor(model, MonitorConfig(every_n_steps=2), log_dir=tmp_path).attach()
    for step in range(4):
        mon.step(loss=float("nan") if step == 2 else 1.0)
    mon.close()
    events = [e for e in RunReader(mon.run_dir).events() if e.kind == "nonfinite"]
    assert events and events[0].step == 2


def test_one_sum_and_one_max_collective_per_logging_step(tmp_path, monkeypatch):
    """The partials' summed fields, the losses and the squared grad norms share one SUM all-reduce;
    the partials' max fields one MAX (README, docs/sharding.md). A one-process gloo group stands in
    for the world of 2 the monitor is told it has, so the collectives really run."""
    import torch.distributed as dist

    from fp8track.monitoring import monitor as core

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        calls = []
        real = dist.all_reduce

        def counting(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
            calls.append(op)
            return real(tensor, op, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", counting)
        monkeypatch.setattr(core, "_dist_world", lambda: 2)
        model = mlp(16, 32, 4)
        mon = Monitor(model, MonitorConfig(every_n_steps=4), log_dir=tmp_path).attach()
        losses = _train(mon, model, 8)  # sampled: 0, 4; flush at close: 5, 6, 7
        assert calls == [dist.ReduceOp.SUM, dist.ReduceOp.MAX] * 2 + [dist.ReduceOp.SUM], calls
        # one process summed, divided by the 2 ranks it was told about: half of each loss
        got = RunReader(mon.run_dir).series("fp8/loss")
        assert got == pytest.approx({s: v / 2 for s, v in losses.items()}, rel=1e-6)
    finally:
        dist.destroy_process_group()
