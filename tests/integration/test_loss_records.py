"""The loss as the monitor records it from a real Lightning Trainer: manual optimisation whose
``training_step`` returns nothing records no loss, raises no alarm and does not stop training."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from fp8track.lightning import FP8Monitor
from fp8track.monitoring.records import RunReader

from helpers.lightning import quiet_trainer

STEPS = 30


class _Manual(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):  # returns nothing: the monitor gets no loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.net(batch[0]).pow(2).mean())
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        x = torch.randn(STEPS * 4, 16, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def test_manual_optimisation_without_a_loss_is_no_alarm_and_does_not_stop(tmp_path):
    mon = FP8Monitor(every_n_steps=5, trackers="none", log_dir=tmp_path, on_spike="stop")
    trainer = quiet_trainer(None, [mon], max_steps=STEPS)
    trainer.fit(_Manual())
    assert trainer.global_step == STEPS  # on_spike="stop" did not stop it
    reader = RunReader(mon.run_dir)
    assert reader.series("fp8/loss") == {}
    assert [e.kind for e in reader.events()] == ["run_end"]
    assert {r.step for r in reader.tensor_stats()} == set(range(0, STEPS, 5))  # statistics still recorded
