"""Lightning training with FP8Monitor and MLflow, checkpointing every 5 steps (one epoch).

Usage: python resume_train.py OUT_DIR full|kill|resume
  full:   20 steps without interruption.
  kill:   SIGKILLs itself after step 13 (last checkpoint: step 10), after the tracker sent step 12.
  resume: resumes from OUT_DIR/ckpt/last.ckpt into the same MLflow run, to step 20.
Writes OUT_DIR/final_state.json (the monitor's checkpointable state) when it finishes.
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from torch.utils.data import DataLoader, TensorDataset

from fp8track.lightning import FP8Monitor

out, mode = Path(sys.argv[1]), sys.argv[2]


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y) * (4.0 if self.global_step == 7 else 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(
            TensorDataset(torch.randn(20, 8, generator=g), torch.randn(20, 4, generator=g)), batch_size=4
        )


class KillAt(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if mode == "kill" and trainer.global_step == 13:
            monitor.monitor._out.sink.trackers[0].flush(60)  # the tracker had sent everything so far
            os.kill(os.getpid(), signal.SIGKILL)


run_id_file = out / "mlflow_run_id.txt"
logger = MLFlowLogger(
    experiment_name="resume", tracking_uri=f"sqlite:///{out}/mlflow.db",
    artifact_location=(out / "art").as_uri(),
    run_id=run_id_file.read_text() if mode == "resume" else None,
)  # fmt: skip
monitor = FP8Monitor(every_n_steps=2, log_dir=out / "fp8", trackers="auto")
trainer = pl.Trainer(
    accelerator="cpu", max_steps=20, logger=logger, enable_progress_bar=False, enable_model_summary=False,
    callbacks=[
        monitor, KillAt(),
        ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=5, save_last=True, save_top_k=-1),
    ],
    log_every_n_steps=1, default_root_dir=out,
)  # fmt: skip
if mode != "resume":
    run_id_file.write_text(logger.run_id)
trainer.fit(Net(), ckpt_path=str(out / "ckpt" / "last.ckpt") if mode == "resume" else None)
(out / "final_state.json").write_text(json.dumps(monitor.state_dict(), default=str))
