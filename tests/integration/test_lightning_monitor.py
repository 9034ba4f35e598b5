"""FP8Monitor inside a real Lightning Trainer: accumulation, loss un-normalisation, errors, trackers,
on_spike. The Trainer set-ups (resume, second fit, manual optimisation, ...) are in
test_lightning_setups.py."""


import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fp8track.errors import ConfigError
from fp8track.lightning import FP8Monitor
from fp8track.monitoring.records import RunReader

from helpers.lightning import quiet_trainer


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.raw_losses: list[tuple[int, float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.raw_losses.append((self.global_step, loss.item()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 16, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _trainer(tmp_path, callbacks, **kw):
    # Lightning's defaults for checkpointing, as before the shared quiet Trainer
    kw.setdefault("enable_checkpointing", True)
    return quiet_trainer(tmp_path, callbacks, **kw)


def _run_dir(tmp_path):
    dirs = [p.parent for p in (tmp_path / "fp8").rglob("meta.json")]
    assert len(dirs) == 1
    return dirs[0]


def test_accumulation_sampling_and_unnormalised_loss(tmp_path):
    model = Net()
    mon = FP8Monitor(every_n_steps=2, log_dir=tmp_path / "fp8", trackers="none")
    _trainer(tmp_path, [mon], max_steps=6, accumulate_grad_batches=2, enable_checkpointing=False).fit(model)
    reader = RunReader(_run_dir(tmp_path))
    rows = list(reader.tensor_stats())
    assert sorted({r.step for r in rows}) == [0, 2, 4]
    # two micro-batches of 8 rows of 16 features each per sampled step
    act = [r for r in rows if r.layer == "body.0" and r.tensor == "activation"]
    assert all(r.stats["numel"] == 2 * 8 * 16 for r in act)
    # the logged loss is the mean of the two micro-batch losses, not Lightning's loss / 2
    series = reader.series("fp8/loss")
    assert sorted(series) == list(range(6))
    for step, value in series.items():
        raw = [v for s, v in model.raw_losses if s == step]
        assert len(raw) == 2
        assert value == pytest.approx(sum(raw) / 2, rel=1e-6)


def test_bad_layer_selector_fails_before_the_first_step(tmp_path):
    model = Net()
    with pytest.raises(
        ConfigError, match="'re:attention' matches no linear layer; candidates: body.0, body.2"
    ):
        _trainer(tmp_path, [FP8Monitor(layers="re:attention", trackers="none")], max_steps=2).fit(model)
    assert model.raw_losses == []


def test_constructor_validation():
    with pytest.raises(ConfigError, match="every_n_steps must be an integer >= 1, got 0"):
        FP8Monitor(every_n_steps=0)
    with pytest.raises(
        ConfigError,
        match="unknown tracker spec 'tensorboard'; valid values are: 'auto', 'none', 'wandb', 'mlflow'",
    ):
        FP8Monitor(trackers="tensorboard")
    with pytest.raises(ConfigError, match="unknown tracker 'comet'"):
        FP8Monitor(trackers=["mlflow", "comet"])
    with pytest.raises(
        ConfigError, match="unknown on_spike action 'kill'; valid values are: 'log', 'stop', 'checkpoint'"
    ):
        FP8Monitor(on_spike="kill")


@pytest.mark.slow
def test_trackers_found_in_trainer_loggers_wandb_offline_and_mlflow(tmp_path, mlflow_store):
    """FP8Monitor(trackers="auto") logs into the runs of the trainer's own WandbLogger and
    MLFlowLogger; read back with W&B's reader and MLflow's client."""
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
    from mlflow import MlflowClient

    from helpers.wandb_records import history, inspect, table_rows

    mlf = MLFlowLogger(experiment_name=mlflow_store.experiment("t"), tracking_uri=mlflow_store.uri,
                       artifact_location=(tmp_path / "art").as_uri())
    wb = WandbLogger(project="t", save_dir=str(tmp_path), mode="offline")
    mon = FP8Monitor(every_n_steps=2, log_dir=tmp_path / "fp8")
    _trainer(tmp_path, [mon], max_steps=5, logger=[mlf, wb], enable_checkpointing=False,
             log_every_n_steps=1).fit(Net())
    wb.experiment.finish()
    reader = RunReader(_run_dir(tmp_path))
    local = {r.step: r.metrics for r in reader.metrics() if "fp8/worst/mse" in r.metrics}
    assert sorted(local) == [0, 2, 4]

    client = MlflowClient(mlflow_store.uri)
    hist = client.get_metric_history(mlf.run_id, "fp8/body.0/activation/underflow_pct")
    assert {m.step: m.value for m in hist} == {
        s: local[s]["fp8/body.0/activation/underflow_pct"] for s in local
    }

    run_dir = next((tmp_path / "wandb").glob("offline-run-*"))
    rows = [h for h in history(inspect(run_dir)) if "fp8/worst/mse" in h]
    assert sorted(h["trainer/global_step"] for h in rows) == [0, 2, 4]
    assert [
        h["fp8/worst/mse"] for h in sorted(rows, key=lambda h: h["trainer/global_step"])
    ] == pytest.approx([local[s]["fp8/worst/mse"] for s in (0, 2, 4)])
    stat_rows = table_rows(run_dir, "fp8_tensor_stats")
    assert len(stat_rows) == len(list(reader.tensor_stats()))


class JumpingLoss(Net):
    """The reported loss jumps by a constant from step 100 on (gradients are unchanged)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + (5.0 if self.global_step >= 100 else 0.0)


@pytest.mark.parametrize("action", ["stop", "checkpoint"])
def test_on_spike_actions(tmp_path, action):
    mon = FP8Monitor(every_n_steps=1, log_dir=tmp_path / "fp8", trackers="none", on_spike=action,
                      config={"tensors": ["weight"]})
    trainer = _trainer(tmp_path, [mon], max_steps=130, enable_checkpointing=False)
    trainer.fit(JumpingLoss())
    opened = [
        e for e in RunReader(_run_dir(tmp_path)).events() if e.kind == "spike" and e.data["status"] == "open"
    ]
    assert opened and 100 <= opened[0].data["start_step"] <= 102
    saved = list((tmp_path / "fp8track-spikes").glob("*.ckpt"))
    if action == "stop":
        assert trainer.global_step < 110 and saved == []
    else:
        assert trainer.global_step == 130
        assert len(saved) == 1 and 100 <= torch.load(saved[0], weights_only=False)["global_step"] <= 106
