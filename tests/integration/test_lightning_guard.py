"""The checkpoint guard in a real Lightning Trainer: a planted NaN stops training before
ModelCheckpoint writes the poisoned step; the last good checkpoint stays the latest."""

import re
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from fp8track.errors import TrainingHalted
from fp8track.execution.faults import Fault, plant
from fp8track.lightning import FP8Monitor
from fp8track.monitoring.records import RunReader

from helpers.lightning import quiet_trainer


class Net(pl.LightningModule):
    """A small regression; the loss of optimizer step ``nan_at`` (0-based) is NaN when ``poison``
    is ``"loss"``; with ``"grad"`` that step's gradient is NaN (the weights turn NaN, the loss of
    that step is still finite)."""

    def __init__(self, nan_at: int, poison: str = "loss") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        # the output of the last layer NaN, or (same value) the gradient flowing back into it
        fault = Fault("nan_output") if poison == "loss" else Fault("nan_gradient", "gradient")
        window = ((nan_at, nan_at + 1),)
        plant(self, replace(fault, windows=window), ["body.2"], clock=lambda: self.global_step)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(160, 16, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(tmp_path, net, **monitor_kw):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    monitor = FP8Monitor(every_n_steps=10, trackers="none", log_dir=str(tmp_path / "fp8"), **monitor_kw)
    # checkpoint listed first: Lightning still runs checkpoint callbacks last
    trainer = quiet_trainer(tmp_path, [ckpt, monitor], max_epochs=1, enable_checkpointing=True)
    return trainer, monitor


def _saved_steps(tmp_path):
    return sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in (tmp_path / "ckpt").glob("*.ckpt"))


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_nan_stops_before_the_poisoned_checkpoint(tmp_path, poison):
    k = 13  # optimizer step 13 (0-based) is not a sampled step (every 10)
    net = Net(nan_at=k, poison=poison)
    trainer, monitor = _fit(tmp_path, net)
    with pytest.raises(TrainingHalted, match=rf"before saving the checkpoint of step {k + 1}") as err:
        trainer.fit(net)
    # Lightning names a checkpoint after trainer.global_step, i.e. the number of optimizer steps
    # done: "step=k" holds the weights after steps 0..k-1, all good; "step=k+1" would hold step k's.
    assert _saved_steps(tmp_path) == list(range(1, k + 1))
    last = torch.load(tmp_path / "ckpt" / f"step={k}.ckpt", weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in last.values())
    why = (
        "non-finite loss (nan) at step 13"
        if poison == "loss"
        else "non-finite parameters after step: body.0.weight"
    )
    assert why in str(err.value)
    events = list(RunReader(monitor.run_dir).events())
    halt = [e for e in events if e.kind == "halt"]
    assert len(halt) == 1 and why in halt[0].data["reason"]
    if poison == "loss":  # the close flush hands the NaN loss to the analyzers too
        assert any(e.kind == "nonfinite" and e.step == k for e in events)


def test_log_mode_keeps_training_and_saving(tmp_path):
    net = Net(nan_at=13)
    trainer, monitor = _fit(tmp_path, net, on_nonfinite="log")
    trainer.fit(net)
    assert _saved_steps(tmp_path) == list(range(1, 21))  # 160 samples / 8 = 20 steps
    assert not [e for e in RunReader(monitor.run_dir).events() if e.kind == "halt"]


def test_nan_on_a_sampled_step_stops_in_the_batch_end(tmp_path):
    # step 10 is sampled: the flush itself decides, before ModelCheckpoint's on_train_batch_end
    net = Net(nan_at=10)
    trainer, monitor = _fit(tmp_path, net)
    with pytest.raises(TrainingHalted, match=r"after step 11: non-finite loss \(nan\) at step 10"):
        trainer.fit(net)
    assert _saved_steps(tmp_path) == list(range(1, 11))
