"""A precision plugin that swaps layers in ``convert_module`` (as Lightning's
``precision="transformer-engine"`` does) leaves every swapped layer monitored."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch.utils.data import DataLoader, TensorDataset

from fp8track.execution.apply import apply_fp8
from fp8track.execution.emulated_linear import EmulatedFP8Linear
from fp8track.lightning import FP8Monitor
from fp8track.monitoring.records import RunReader

from helpers.lightning import quiet_trainer


class SwapToFP8(Precision):
    """Runs after ``Callback.setup`` and ``configure_model`` (``Strategy.setup``), like TE's plugin."""

    def convert_module(self, module):
        self.report = apply_fp8(module, "current", backend="emulated")
        return module


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.GELU(),
            torch.nn.Linear(32, 32),
            torch.nn.GELU(),
            torch.nn.Linear(32, 16),
        )
        self.head = None

    def configure_model(self):  # built after Callback.setup: selection must wait
        if self.head is None:
            self.head = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.body(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 16, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


def test_every_layer_swapped_in_convert_module_is_monitored(tmp_path):
    plugin = SwapToFP8()
    model = Net()
    mon = FP8Monitor(every_n_steps=1, log_dir=tmp_path / "fp8", trackers="none")
    trainer = quiet_trainer(tmp_path, [mon], max_steps=2, plugins=[plugin])
    trainer.fit(model)
    swapped = [n for n, m in model.named_modules() if isinstance(m, EmulatedFP8Linear)]
    assert swapped == ["body.0", "body.2", "body.4", "head"] == list(plugin.report.fp8_layers)
    # The hooks sit on the modules that ran, not on orphaned nn.Linear objects.
    assert {n: c.module for n, c in mon.monitor.captures.items()} == {
        n: model.get_submodule(n) for n in swapped
    }
    run = next((tmp_path / "fp8").rglob("meta.json")).parent
    rows = RunReader(run).tensor_stats()
    seen = {(r.step, r.layer, r.tensor) for r in rows if r.variant == "actual" and r.stats["numel"] > 0}
    assert seen == {(s, n, t) for s in (0, 1) for n in swapped for t in ("activation", "weight", "gradient")}
