"""FP8Monitor set from LightningCLI: command-line flags and the shipped YAML config
(integrations/lightning/fp8monitor.yaml)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("jsonargparse")
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from fp8track.analysis.spikes import SpikeConfig  # noqa: E402
from fp8track.config import MonitorConfig  # noqa: E402
from fp8track.lightning import FP8Monitor  # noqa: E402
from fp8track.monitoring.records import RunReader  # noqa: E402

YAML = Path(__file__).resolve().parents[2] / "integrations" / "lightning" / "fp8monitor.yaml"


class TinyModel(pl.LightningModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


TRAINER_ARGS = ["--trainer.max_steps=4", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
                "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
                "--trainer.accelerator=cpu"]


def _cli(args: list[str]) -> LightningCLI:
    return LightningCLI(TinyModel, run=False, args=args, save_config_callback=None)


def _monitors(cli: LightningCLI) -> list[FP8Monitor]:
    return [c for c in cli.trainer.callbacks if isinstance(c, FP8Monitor)]


def test_callback_and_its_arguments_from_the_command_line(tmp_path):
    cli = _cli([*TRAINER_ARGS, f"--trainer.default_root_dir={tmp_path}",
                "--trainer.callbacks+=fp8track.FP8Monitor", "--trainer.callbacks.every_n_steps=2",
                "--trainer.callbacks.trackers=none", "--trainer.callbacks.on_spike=stop"])
    [mon] = _monitors(cli)
    assert mon.config.every_n_steps == 2 and mon.on_spike == "stop" and mon.trackers == "none"
    cli.trainer.fit(cli.model)
    reader = RunReader(mon.run_dir)
    assert mon.run_dir.parent == tmp_path / "fp8track-runs"
    assert sorted({r.step for r in reader.tensor_stats()}) == [0, 2]
    assert sorted(reader.series()) == [0, 1, 2, 3]


def test_callback_from_the_shipped_yaml_config(tmp_path):
    cli = _cli(["--config", str(YAML), *TRAINER_ARGS, f"--trainer.default_root_dir={tmp_path}"])
    [mon] = _monitors(cli)
    expected = MonitorConfig(
        every_n_steps=10,
        whatif=("mxfp8",),
        spikes=SpikeConfig(z_threshold=6.0, window=128),
    )
    assert mon.config == expected  # every value the YAML sets (the others are the defaults) arrived
    assert mon.trackers == "auto" and mon.on_spike == "log"
    cli.trainer.fit(cli.model)
    rows = list(RunReader(mon.run_dir).tensor_stats())
    assert {r.variant for r in rows} == {"shadow", "mxfp8", "mxfp8_columnwise"}
    assert {r.step for r in rows} == {0}


def test_nested_thresholds_from_the_command_line(tmp_path):
    cli = _cli(["--config", str(YAML), *TRAINER_ARGS, f"--trainer.default_root_dir={tmp_path}",
                "--trainer.callbacks.config.spikes.z_threshold=8.5",
                "--trainer.callbacks.config.drift.consecutive=4"])
    [mon] = _monitors(cli)
    assert mon.config.spikes.z_threshold == 8.5 and mon.config.drift.consecutive == 4
    assert mon.config.whatif == ("mxfp8",)  # the rest of the YAML stays
