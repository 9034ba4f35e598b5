"""The checkpoint guard under fp16 with a real ``torch.amp.GradScaler`` (CPU autocast in float16):
steps the scaler skips are ``scaler_skip`` events, never a halt; poison that reaches the loss or the
weights, and a collapsing scale, still halt.

Lightning turns ``Trainer(accelerator="cpu", precision="16-mixed")`` into ``"bf16-mixed"`` (fp16 AMP
is refused on CPU by its accelerator connector), so the Lightning tests pass the very plugin
``"16-mixed"`` builds on a GPU, ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler(...))``: the same
autocast-fp16, unscale, ``scaler.step`` / ``update`` path, on CPU.
"""

import math
import re
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from fp8track import Monitor
from fp8track.errors import ConfigError, TrainingHalted
from fp8track.execution.apply import apply_fp8
from fp8track.execution.faults import Fault, plant
from fp8track.lightning import FP8Monitor
from fp8track.monitoring.guard import CheckpointGuard
from fp8track.monitoring.records import RunReader
from fp8track.monitoring.reduce import PendingStep

from helpers.lightning import quiet_trainer

STEPS = 40


def _data(n=STEPS * 8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return x, x.sum(1, keepdim=True)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _fp16_loop(model, monitor, scaler, steps=STEPS, poison=None, close=True, monitor_before_update=False):
    """A healthy fp16 regression loop; returns, per step, the scale before and after ``update()``
    read from the scaler itself (the reference the records are checked against) and the losses.
    ``monitor_before_update``: ``monitor.step`` between ``scaler.step(opt)`` and ``scaler.update()``
    (still after the optimizer step and before ``zero_grad``, as the docs ask)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _data()
    scales, losses = [], []
    for i in range(steps):
        before = scaler.get_scale()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x[i * 8 : i * 8 + 8]).float(), y[i * 8 : i * 8 + 8])
        scaler.scale(loss).backward()
        scaler.step(opt)
        if monitor_before_update:
            monitor.step(loss=loss)
        scaler.update()
        if poison is not None:
            poison(i)
        if not monitor_before_update:
            monitor.step(loss=loss)
        opt.zero_grad()
        scales.append((before, scaler.get_scale()))
        losses.append(float(loss.detach()))
    if close:
        monitor.close()
    return scales, losses


def _events(monitor, kind):
    return [e for e in RunReader(monitor.run_dir).events() if e.kind == kind]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("every", [1, 10])
def test_plain_fp16_loop_with_skips_is_not_halted(tmp_path, fp8, every):
    model = _mlp()
    if fp8:
        apply_fp8(model, "current")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    mon = Monitor(model, {"every_n_steps": every}, trackers="none", log_dir=tmp_path, grad_scaler=scaler)
    scales, losses = _fp16_loop(model, mon, scaler)
    skipped = [i for i, (b, a) in enumerate(scales) if a < b]
    # 2**24 overflows fp16's 65504 in the backward: the first steps are skipped, halving the scale
    assert skipped[:3] == [0, 1, 2] and len(skipped) >= 8
    assert mon.guard() is None and mon.halt_reason is None
    events = _events(mon, "scaler_skip")
    assert [e.step for e in events] == skipped
    assert [e.data["scale"] for e in events] == [scales[i][1] for i in skipped]
    assert [e.data["previous_scale"] for e in events] == [scales[i][0] for i in skipped]
    assert not _events(mon, "halt")
    # a skipped step is no spike, opens no burst, and its overflowed grad norm is no metric
    assert not [e for e in RunReader(mon.run_dir).events() if e.kind in ("spike", "nonfinite", "burst")]
    metrics = {m.step: m.metrics for m in RunReader(mon.run_dir).metrics()}
    for i in skipped:
        assert "fp8/grad_norm" not in metrics.get(i, {})
    sampled = [i for i in range(STEPS) if i % every == 0 and i not in skipped]
    assert all(math.isfinite(metrics[i]["fp8/grad_norm"]) for i in sampled)
    last = STEPS - 1 - (STEPS - 1) % every  # the last sampled step
    assert metrics[last]["fp8/loss_scale"] == scales[last][1]
    assert losses[-1] < 0.5 * losses[len(skipped)]  # it trained once the scale fitted


@pytest.mark.parametrize("every", [1, 10])
def test_monitor_step_before_scaler_update_records_the_same_skips(tmp_path, every):
    # monitor.step right after scaler.step(opt), before scaler.update(): the skip is read from the
    # step's own inf checks, so the records equal those of the update-first order, and no halt
    runs = {}
    for before in (False, True):
        model = _mlp()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        log_dir = tmp_path / str(before)
        mon = Monitor(model, {"every_n_steps": every}, trackers="none", log_dir=log_dir, grad_scaler=scaler)
        scales, _ = _fp16_loop(model, mon, scaler, monitor_before_update=before)
        skipped = [i for i, (b, a) in enumerate(scales) if a < b]
        assert skipped[:3] == [0, 1, 2] and len(skipped) >= 8
        assert mon.halt_reason is None and not _events(mon, "halt")
        events = _events(mon, "scaler_skip")
        assert [e.step for e in events] == skipped
        assert [(e.data["previous_scale"], e.data["scale"]) for e in events] == [scales[i] for i in skipped]
        runs[before] = [(m.step, m.metrics) for m in RunReader(mon.run_dir).metrics()]
    assert runs[True] == runs[False]


def test_without_the_scaler_the_overflow_halts(tmp_path):
    # what the scaler argument changes: the same loop, the monitor told nothing, halts at step 0
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    mon = Monitor(model, {"every_n_steps": 1}, trackers="none", log_dir=tmp_path)
    _fp16_loop(model, mon, scaler, steps=3)
    assert mon.halt_reason.startswith("non-finite gradient norm (nan) at step 0; the loss was finite")
    assert "grad_scaler=scaler" in mon.halt_reason  # the halt names the way out


def test_a_watched_scaler_adds_no_hint_and_a_nonfinite_loss_none():
    # the hint only where no scaler is watched and the loss was finite: a scaler's own step, or a
    # non-finite loss (which no scaler explains), keeps the plain reason
    guard = CheckpointGuard("stop", "log")
    watched = PendingStep(3, torch.tensor(1.0), torch.tensor(math.inf), scale=torch.tensor(2.0**16))
    guard.after_flush(3, [watched], [1.0], [math.inf], [])
    assert guard.reason == "non-finite gradient norm (inf) at step 3"
    guard = CheckpointGuard("stop", "log")
    unwatched = PendingStep(4, torch.tensor(1.0), torch.tensor(math.nan))
    guard.after_flush(4, [unwatched], [math.inf], [math.nan], [])
    assert guard.reason == "non-finite loss (inf) at step 4"


def test_nan_weights_under_the_scaler_are_still_caught(tmp_path):
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    mon = Monitor(model, {"every_n_steps": 10}, trackers="none", log_dir=tmp_path, grad_scaler=scaler)

    def poison(i):
        if i == 25:
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan

    _fp16_loop(model, mon, scaler, steps=26, poison=poison)
    assert mon.halt_reason is None  # step 25 is not flushed by a sampled step
    assert mon.guard() == "non-finite parameters after step: 0.weight"


def test_nan_loss_under_the_scaler_halts(tmp_path):
    # the scale multiplies the loss after it is computed: a non-finite loss is never the scaler's
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    fault = replace(Fault("nan_output"), windows=((12, 13),))
    plant(model, fault, ["2"], clock=lambda: mon.global_step)
    mon = Monitor(model, {"every_n_steps": 10}, trackers="none", log_dir=tmp_path, grad_scaler=scaler)
    scales, _ = _fp16_loop(model, mon, scaler, steps=13, close=False)
    assert scales[12][1] < scales[12][0]  # the scaler skipped the NaN step (weights untouched) ...
    assert mon.halt_reason is None  # (step 12 is not flushed yet)
    assert mon.guard() == "non-finite loss (nan) at step 12"  # ... and the guard still refuses it
    mon.close()
    assert [e.data["reason"] for e in _events(mon, "halt")] == ["non-finite loss (nan) at step 12"]


def test_a_collapsing_scale_halts_with_its_history(tmp_path):
    model = _mlp()
    # every gradient overflows whatever the scale: the scaler halves it step after step
    model[2].weight.register_hook(lambda g: g * math.inf)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    mon = Monitor(model, {"every_n_steps": 5}, trackers="none", log_dir=tmp_path, grad_scaler=scaler)
    _fp16_loop(model, mon, scaler, steps=20)
    # 1 * 0.5**14 = 6.1e-5 is the first scale below the default 1e-4: step 13
    collapse = _events(mon, "scaler_collapse")
    assert len(collapse) == 1 and collapse[0].step == 13
    assert collapse[0].data["scale"] == 0.5**14 and collapse[0].data["min_scale"] == 1e-4
    assert [s for s, _ in collapse[0].data["history"]] == list(range(14))
    assert [v for _, v in collapse[0].data["history"]] == [0.5 ** (i + 1) for i in range(14)]
    assert mon.halt_reason.startswith("loss scale collapsed to 6.1e-05 at step 13")
    assert [e.step for e in _events(mon, "halt")] == [15]  # the flush of steps 11..15 (every 5)
    assert len(_events(mon, "scaler_skip")) == 20  # every step skipped, each recorded


def test_min_loss_scale_is_configurable_and_validated(tmp_path):
    model = _mlp()
    model[2].weight.register_hook(lambda g: g * math.inf)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    config = {"every_n_steps": 1, "min_loss_scale": 0.1}
    mon = Monitor(model, config, trackers="none", log_dir=tmp_path, grad_scaler=scaler)
    _fp16_loop(model, mon, scaler, steps=5)
    assert [e.step for e in _events(mon, "scaler_collapse")] == [3]  # 0.0625 < 0.1
    with pytest.raises(ConfigError, match="min_loss_scale must be a number > 0"):
        Monitor(_mlp(), {"min_loss_scale": 0}, trackers="none", log_dir=tmp_path)


def test_grad_scaler_argument_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="grad_scaler must be a torch.amp.GradScaler .* got str"):
        Monitor(_mlp(), trackers="none", log_dir=tmp_path, grad_scaler="scaler")


def test_state_dict_keeps_the_last_scale(tmp_path):
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    mon = Monitor(model, {"every_n_steps": 1}, trackers="none", log_dir=tmp_path, grad_scaler=scaler)
    scales, _ = _fp16_loop(model, mon, scaler, steps=3)
    state = mon.state_dict()
    assert state["scaler"]["last"] == scales[-1][1]
    again = Monitor(_mlp(), trackers="none", log_dir=tmp_path / "b")
    again.load_state_dict(state)
    assert again.state_dict()["scaler"] == state["scaler"]


# -- Lightning: the scaler of the precision plugin ----------------------------------------------


class Net(pl.LightningModule):
    def __init__(self, nan_at=None):
        super().__init__()
        self.body = _mlp()
        if nan_at is not None:
            window = ((nan_at, nan_at + 1),)
            fault = replace(Fault("nan_output"), windows=window)
            plant(self, fault, ["body.2"], clock=lambda: self.global_step)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data(160)), batch_size=8)


def _fit(tmp_path, net, every=10):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    monitor = FP8Monitor(every_n_steps=every, trackers="none", log_dir=str(tmp_path / "fp8"))
    trainer = quiet_trainer(
        tmp_path, [ckpt, monitor], max_epochs=1, enable_checkpointing=True, plugins=[plugin]
    )
    return trainer, monitor, scaler


def _saved_steps(tmp_path):
    return sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in (tmp_path / "ckpt").glob("*.ckpt"))


@pytest.mark.parametrize("every", [1, 10])
def test_lightning_16_mixed_trains_to_the_end(tmp_path, every):
    net = Net()
    trainer, monitor, scaler = _fit(tmp_path, net, every)
    trainer.fit(net)
    assert trainer.global_step == 20
    assert _saved_steps(tmp_path) == list(range(1, 21))  # every step's checkpoint written
    skips = [e for e in monitor.events if e.kind == "scaler_skip"]
    # 2**24 -> the scale fits fp16 after several halvings; each one a recorded skip
    assert [e.step for e in skips][:3] == [0, 1, 2]
    # no growth within 20 steps (growth_interval 2000): the last skip set the final scale
    assert skips[-1].data["scale"] == scaler.get_scale() < 2.0**24
    assert not [e for e in monitor.events if e.kind == "halt"]


def test_lightning_16_mixed_nan_loss_still_halts(tmp_path):
    k = 13
    net = Net(nan_at=k)
    trainer, monitor, _ = _fit(tmp_path, net)
    why = rf"before saving the checkpoint of step {k + 1}: non-finite loss"
    with pytest.raises(TrainingHalted, match=why):
        trainer.fit(net)
    assert _saved_steps(tmp_path) == list(range(1, k + 1))
