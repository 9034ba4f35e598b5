"""Schedules (TE debug API's fields), bursts after events, tensor dumps, the guard and the FP8 FLOP
share, on the real monitor with real layers (emulated FP8 and torchao backends, CPU)."""

import math
import warnings

import pytest
import torch

import fp8track
from fp8track import dumps
from fp8track.config import MonitorConfig
from fp8track.errors import ConfigError
from fp8track.execution.faults import Fault, plant
from fp8track.frontend import Monitor, run_summary
from fp8track.monitoring.records import EventRecord, RunReader
from fp8track.monitoring.schedule import BURST_TRIGGERS, Burst, BurstPolicy, scheduled
from fp8track.numerics.formats import get_format

# -- schedule --------------------------------------------------------------------------------------


def test_schedule_follows_te_fields():
    # TE: step % freq == 0 and start <= step <= end (inclusive); start_end_list replaces start/end.
    assert [s for s in range(40) if scheduled(s, 5, start_step=12, end_step=25)] == [15, 20, 25]
    windows = ((0, 4), (30, 35))
    assert [s for s in range(40) if scheduled(s, 2, start_end_list=windows)] == [0, 2, 4, 30, 32, 34]
    # explicit steps are sampled whatever the window says
    assert [s for s in range(40) if scheduled(s, 10, (7,), start_step=20)] == [7, 20, 30]
    cfg = MonitorConfig(every_n_steps=3, start_end_list=[[6, 9]])
    assert [s for s in range(20) if cfg.samples(s)] == [6, 9]


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"start_end_list": [[5, 2]]}, "starts after it ends"),
        ({"start_end_list": [[1, 2, 3]]}, "pairs"),
        ({"end_step": 3, "start_step": 5}, "end_step"),
        ({"burst_layers": "some"}, "'implicated', 'all'"),
        ({"burst_on": ["loss"]}, "'spike', 'nonfinite', 'divergence', 'drift'"),
        ({"burst_steps": -1}, "burst_steps"),
        ({"on_nonfinite": "explode"}, "'stop', 'log'"),
        ({"fp8_share_warn_below": 1.5}, "share"),
        ({"max_dump_bytes": 0}, "max_dump_bytes"),
    ],
)
def test_bad_settings_are_config_errors(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        MonitorConfig.from_dict(changes)


def test_burst_opens_extends_and_narrows():
    assert "drift" not in BurstPolicy().triggers  # opt-in
    b = Burst(BurstPolicy(steps=4, layers="implicated", triggers=BURST_TRIGGERS))
    drift = EventRecord("drift", 10, {"layer": "fc1", "tensor": "activation"})
    ev = b.open(10, [drift])
    assert ev is not None and (ev.data["from"], ev.data["to"], ev.data["layers"]) == (11, 14, ["fc1"])
    assert [s for s in range(9, 17) if b.wants(s, "fc1")] == [11, 12, 13, 14]
    assert not b.wants(12, "fc2")
    # a second event while it runs: extends and adds its layer
    b.open(13, [EventRecord("drift", 13, {"layer": "fc2"})])
    assert b.until == 17 and b.layers == {"fc1", "fc2"}
    # a loss event names no layer: every layer
    b.open(15, [EventRecord("spike", 14, {"status": "open"})])
    assert b.layers is None and b.wants(19, "anything") and not b.wants(20, "anything")
    # a closing record and unlisted kinds open nothing
    c = Burst(BurstPolicy(steps=4, triggers=("spike",)))
    assert c.open(5, [EventRecord("spike", 2, {"status": "closed"}), drift]) is None
    assert Burst(BurstPolicy(steps=0)).open(5, [drift]) is None
    restored = Burst(BurstPolicy())
    restored.load_state_dict(b.state_dict())
    assert restored.until == 19 and restored.layers is None


# -- the monitor: a planted intermittent outlier ---------------------------------------------------


class Planted(torch.nn.Module):
    """Four layers; ``fc3``'s input gets a large outlier on the planted steps (:func:`_train`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64)
        self.fc3, self.fc4 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.fc4(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))


def _train(tmp_path, steps=100, planted=(), recipe=None, **cfg):
    model = Planted()
    report = fp8track.apply_fp8(model, recipe, backend="emulated") if recipe else None
    fault = None
    if planted:  # one element of fc3's input: its scale follows it, the rest underflows
        windows = tuple((s, s + 1) for s in planted)
        fault = plant(model, Fault("element", windows=windows, value=300.0, element=(0, 3)), ["fc3"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = MonitorConfig.from_dict(
        {
            "every_n_steps": 10,
            "spikes": {"warmup": 20, "window": 32},
            "tensors": ["activation", "weight"],
            **cfg,
        }
    )
    g = torch.Generator().manual_seed(1)
    with Monitor(model, config, log_dir=tmp_path, apply_report=report) as mon:
        for i in range(steps):
            if fault is not None:
                fault.before_step(i)
            x = torch.randn(32, 16, generator=g)
            loss = (model(x) - x[:, :1]).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            mon.step(loss=loss)
            opt.zero_grad()
    return mon.run_dir


# Between samples (every 10): once at 63-64 (the loss spikes; the flush of 70 sees it), then again
# at 73-76, inside the burst that spike opens.
PLANTED = (63, 64, 73, 74, 75, 76)


def test_burst_samples_an_intermittent_outlier_between_samples(tmp_path):
    quiet = RunReader(_train(tmp_path / "off", planted=PLANTED, burst_steps=0))
    assert not {r.step for r in quiet.tensor_stats()} & set(PLANTED)

    run = _train(tmp_path / "on", planted=PLANTED, burst_steps=8)
    reader = RunReader(run)
    sampled = {r.step for r in reader.tensor_stats()}
    assert {73, 74, 75, 76} <= sampled  # the burst 71..78 holds the second episode
    events = list(reader.events())
    burst = [e for e in events if e.kind == "burst"]
    assert burst and burst[0].step == 70 and burst[0].data["trigger"] == "spike"
    why = {e.step: e.data for e in events if e.kind == "sampled"}
    assert set(why) >= set(range(71, 79)) and why[74]["why"] == "burst" and why[74]["trigger"] == "spike"
    # fc3's activation row of a planted step shows the outlier: amax 300, most elements underflow
    row = next(r for r in reader.tensor_stats() if (r.step, r.layer, r.tensor) == (74, "fc3", "activation"))
    assert row.stats["amax"] == pytest.approx(300.0)
    # the diagnosis' layer ranking names it from the dense window
    assert run_summary(run)["worst_layers"][0]["layer"] == "fc3"


# -- dumps -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_dump_reloads_and_recomputes_the_logged_row(tmp_path, recipe):
    # (under delayed scaling the first episode saturates at the old scale: no spike; the second does)
    run = _train(tmp_path, steps=90, planted=PLANTED, recipe=recipe, burst_steps=3, max_dumps=1)
    reader = RunReader(run)
    events = list(reader.events())
    dump_events = [e for e in events if e.kind == "dump"]
    first_burst = next(e for e in events if e.kind == "burst")
    assert len(dump_events) == 1 and dump_events[0].step == first_burst.data["from"]
    step = dump_events[0].step
    files = dumps.list_dumps(run)
    assert {f.name for f in files} == {"fc1.pt", "fc2.pt", "fc3.pt", "fc4.pt"}  # a loss event: all layers
    assert sum(f.stat().st_size for f in files) == dump_events[0].data["bytes"]
    raw = torch.load(files[2], weights_only=True)  # plain data: no code runs while loading
    assert raw["layer"] == "fc3" and raw["observations"][0]["x"].shape == (32, 64)
    rows = {
        (r.layer, r.tensor): r.stats
        for r in reader.tensor_stats()
        if r.step == step and r.variant == "actual"
    }
    for f in files:
        d = dumps.load_dump(f)
        recomputed = dumps.recompute_stats(d)
        assert set(recomputed) == {"activation", "weight"}
        for tensor, stats in recomputed.items():
            logged = rows[(d.layer, tensor)]
            for k, v in stats.items():
                assert v == logged[k] or (math.isnan(v) and math.isnan(logged[k])), (d.layer, tensor, k)
        obs = d.observations[0]
        if recipe == "delayed":  # the backend's scale is stored and the FP8 tensor is x * scale, saturated
            fmt = get_format(d.plan["formats"][obs["tensor"]])
            expect = (obs["x"].float() * obs["scale"]).clamp(-fmt.max, fmt.max).to(fmt.dtype)
            assert torch.equal(obs["q"].float(), expect.float())


def test_dumps_are_bounded_in_bytes(tmp_path):
    # fc1's activation (32x16 float32 = 2 KiB) and weight fit in 6 KiB, fc2's 64x64 weight does not
    run = _train(tmp_path, steps=80, planted=PLANTED, burst_steps=3, max_dump_bytes=6 * 1024)
    ev = next(e for e in RunReader(run).events() if e.kind == "dump")
    kept = {f.name for f in dumps.list_dumps(run)}
    assert kept and "fc2.pt" not in kept and "fc2" in ev.data["left_out"]
    assert ev.data["bytes"] <= 6 * 1024 + 4096  # torch.save's container overhead per file is small


def test_load_dump_refuses_other_files(tmp_path):
    p = tmp_path / "x.pt"
    torch.save({"a": torch.ones(2)}, p)
    with pytest.raises(ConfigError, match="not an fp8track tensor dump"):
        dumps.load_dump(p)
    with pytest.raises(ConfigError, match="no dump file"):
        dumps.load_dump(tmp_path / "missing.pt")


# -- the guard ---------------------------------------------------------------------------------------


def test_guard_sees_a_nonfinite_loss_between_samples(tmp_path):
    model = torch.nn.Linear(4, 1)
    with Monitor(model, MonitorConfig(every_n_steps=10), log_dir=tmp_path) as mon:
        for i in range(14):
            loss = model(torch.ones(2, 4)).sum() * (math.nan if i == 12 else 1.0)
            loss.backward()
            mon.step(loss=loss)
            assert (mon.guard() is None) == (i < 12)
        assert "non-finite loss (nan) at step 12" in mon.guard()
    halt = [e for e in RunReader(mon.run_dir).events() if e.kind == "halt"]
    assert len(halt) == 1 and "step 12" in halt[0].data["reason"]
    assert halt[0].step == 12  # the step it names, not the next one (13 was never trained)


def test_guard_halt_on_nonfinite_parameters_is_at_the_step_that_poisoned_them(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, MonitorConfig(every_n_steps=5), log_dir=tmp_path, trackers=[]) as mon:
        for i in range(8):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            if i == 7:  # optimizer step 7 writes a NaN weight (no sampled step flushes it)
                with torch.no_grad():
                    model.weight[0, 0] = math.nan
            mon.step(loss=1.0)
            opt.zero_grad()
            if mon.guard() is not None:
                break
    assert i == 7
    events = [(e.kind, e.step) for e in RunReader(mon.run_dir).events()]
    assert events == [("halt", 7), ("run_end", 7)]


def test_guard_sees_nonfinite_parameters_and_log_mode_ignores(tmp_path):
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model.weight[0, 1] = math.inf
    with Monitor(model, MonitorConfig(every_n_steps=10), log_dir=tmp_path) as mon:
        assert "non-finite parameters after step: weight" in mon.guard()
    model2 = torch.nn.Linear(4, 1)
    with torch.no_grad():
        model2.weight[0, 1] = math.inf
    with Monitor(model2, MonitorConfig(on_nonfinite="log"), log_dir=tmp_path) as mon:
        assert mon.guard() is None


# -- FP8 FLOP share ---------------------------------------------------------------------------------


def test_fp8_flop_share_warns_naming_refused_layers(tmp_path):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    # torchao refuses dims not divisible by 16: 16x24 and 24x16 (FLOPs 2 * 384) stay BF16, 16x32 runs
    # FP8 (512 MACs per token): share 512 / (512 + 768 + 384) = 0.31
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 24), torch.nn.Linear(24, 16))
    report = fp8track.apply_fp8(model, "current", backend="torchao")
    assert report.fp8_layers == ("0",)
    assert {n for n, _ in report.bf16_layers} == {"1", "2"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(model, MonitorConfig(every_n_steps=2), log_dir=tmp_path, apply_report=report) as mon:
            for _ in range(4):
                model(torch.randn(8, 16)).sum().backward()
                mon.step(loss=torch.tensor(1.0))
    share = 512 / (512 + 768 + 384)
    assert mon.fp8_flop_share == pytest.approx(share)
    text = [str(w.message) for w in caught if "GEMM FLOPs ran in FP8" in str(w.message)]
    assert len(text) == 1 and f"{100 * share:.1f}%" in text[0]
    assert "1 (kept in BF16: shape 32x24" in text[0] and "2 (kept in BF16: shape 24x16" in text[0]
    reader = RunReader(mon.run_dir)
    ev = next(e for e in reader.events() if e.kind == "fp8_share")
    assert ev.data["layers"] == ["1", "2"]
    metrics = {r.step: r.metrics for r in reader.metrics()}
    assert metrics[0]["fp8/fp8_flop_share"] == pytest.approx(share) == metrics[2]["fp8/fp8_flop_share"]
    assert run_summary(mon.run_dir)["fp8_flop_share"] == pytest.approx(share)


def test_share_warning_names_the_fallback_reason_under_a_lightning_holder(tmp_path):
    # apply_fp8 on a LightningModule names its layers model.fc1, model.fc2; the monitor captures
    # them by their canonical names fc1, fc2: the warning still says why each stayed in BF16
    pl = pytest.importorskip("lightning.pytorch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(self.fc1(x))

    class Holder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Net()

        def forward(self, x):
            return self.model(x)

    model = Holder()
    report = fp8track.apply_fp8(model, "current", bf16_layers="first_last")
    assert dict(report.bf16_layers) == {"model.fc1": "first:1", "model.fc2": "last:1"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(model, MonitorConfig(every_n_steps=1), log_dir=tmp_path, apply_report=report,
                     trackers=[]) as mon:
            model(torch.randn(8, 16)).sum().backward()
            mon.step(loss=torch.tensor(1.0))
    text = [str(w.message) for w in caught if "GEMM FLOPs ran in FP8" in str(w.message)]
    assert len(text) == 1
    assert "fc1 (kept in BF16: first:1)" in text[0] and "fc2 (kept in BF16: last:1)" in text[0]
    ev = next(e for e in RunReader(mon.run_dir).events() if e.kind == "fp8_share")
    assert ev.data["reasons"] == ["kept in BF16: first:1", "kept in BF16: last:1"]


def test_no_share_warning_for_a_bf16_control(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 24))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(model, MonitorConfig(every_n_steps=1), log_dir=tmp_path) as mon:
            model(torch.randn(8, 16)).sum().backward()
            mon.step(loss=torch.tensor(1.0))
    assert mon.fp8_flop_share == 0.0
    assert not [w for w in caught if "GEMM FLOPs" in str(w.message)]


# -- one tracker call per flush ---------------------------------------------------------------------


def test_a_flush_goes_to_mlflow_in_one_log_batch(tmp_path, mlflow_store):
    mlflow = pytest.importorskip("mlflow")
    from fp8track.trackers.base import Tracker
    from fp8track.trackers.mlflow import MLflowTracker

    client = mlflow.MlflowClient(tracking_uri=mlflow_store.uri)
    run_id = client.create_run(client.create_experiment(mlflow_store.experiment("coalesce"))).info.run_id
    calls = []
    original = client.log_batch

    def counting_log_batch(run, metrics=(), *a, **k):  # counts real calls; the real method runs
        calls.append(sorted({m.step for m in metrics}))
        return original(run, metrics, *a, **k)

    client.log_batch = counting_log_batch

    class PerStep(Tracker):  # a tracker that does not coalesce: one batch per step, as before
        name = "per_step"

        def __init__(self):
            self.batches = []

        def log(self, batch):
            self.batches.append((batch.step, dict(batch.metrics), batch.earlier))

    per_step = PerStep()
    mlf = MLflowTracker(client=client, run_id=run_id, heatmap=False, background=False)
    model = torch.nn.Linear(4, 2)
    losses = [1.0 + 0.5 * i for i in range(12)]
    cfg = MonitorConfig(every_n_steps=5, burst_steps=0)
    with Monitor(model, cfg, log_dir=tmp_path, trackers=[mlf, per_step]) as mon:
        for loss in losses:
            model(torch.ones(3, 4)).sum().backward()
            mon.step(loss=torch.tensor(loss))
    metric_calls = [c for c in calls if c]
    # flushes at steps 0, 5, 10 (sampled) and 11 (close): steps 1-4 ride with 5, 6-9 with 10
    assert metric_calls[:4] == [[0], [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11]]
    history = client.get_metric_history(run_id, "fp8/loss")
    assert sorted((m.step, m.value) for m in history) == list(enumerate(losses))
    steps_with_loss = [s for s, m, earlier in per_step.batches if "fp8/loss" in m]
    assert steps_with_loss == list(range(12)) and all(e == () for _, _, e in per_step.batches)
