"""Run by tests/integration/test_ddp.py as a subprocess: 2 CPU ranks (gloo) with FP8Monitor.

Lightning's "ddp" strategy re-executes this script for rank 1, so it must be a plain script.
Usage: python ddp_monitor.py OUT_DIR   (with tests/ on PYTHONPATH: helpers.subprocesses.python_env)
"""

import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from fp8track.lightning import FP8Monitor

from helpers.dist_sizes import DDP_BATCH as BATCH
from helpers.dist_sizes import DDP_D_HID as D_HID
from helpers.dist_sizes import DDP_D_IN as D_IN
from helpers.dist_sizes import DDP_D_OUT as D_OUT
from helpers.dist_sizes import DDP_N as N


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, D_IN, generator=g) * 3.0
    x[::7] *= 1e-4  # rows in the underflow range make the merged statistics non-trivial
    y = torch.randn(N, D_OUT, generator=g)
    return TensorDataset(x, y)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(D_IN, D_HID), torch.nn.GELU(), torch.nn.Linear(D_HID, D_OUT)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 0:  # the test recomputes step-0 statistics from both ranks' inputs
            torch.save(x, f"{sys.argv[1]}/rank{self.global_rank}_step0_input.pt")
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=BATCH, shuffle=False)


if __name__ == "__main__":
    out = sys.argv[1]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FP8Monitor(every_n_steps=3, log_dir=out, trackers="none", config={"whatif": ["mxfp8"]})],
        default_root_dir=out,
    )
    trainer.fit(Regressor())
    # Lightning leaves the gloo process group alive; tearing it down here avoids gloo's threads
    # aborting the interpreter at exit ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
