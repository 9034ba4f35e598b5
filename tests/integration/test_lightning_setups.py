"""FP8Monitor under every ordinary Trainer set-up: fit, a second fit, validate / test / predict
without fit, fast_dev_run, manual optimisation, logger=False, resume from a checkpoint, an
exception during fit. Each checks that fp8track's metrics land (run directory, and the trainer's
loggers) and that the user's own ``self.log`` metrics are untouched (fp8track writes only under
``fp8/``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from fp8track.lightning import FP8Monitor
from fp8track.monitoring.records import RunReader

from helpers.lightning import quiet_trainer

USER_OFFSET = 100.0  # the user's own "loss" metric is our loss + 100: a collision would show


class Net(pl.LightningModule):
    def __init__(self, manual: bool = False, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.automatic_optimization = not manual
        self.fail_at = fail_at
        self.raw: dict[int, float] = {}  # global step -> the loss of that optimizer step

    def _loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError(f"user code failed at step {self.global_step}")
        step = self.global_step
        loss = self._loss(batch)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.raw[step] = loss.item()
        self.log("loss", loss.detach() + USER_OFFSET, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        return self.body(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def _loader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 16, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def _trainer(tmp_path: Path, callbacks, **kw) -> pl.Trainer:
    kw.setdefault("logger", CSVLogger(tmp_path, name="csv"))
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("log_every_n_steps", 1)
    kw.setdefault("limit_val_batches", 2)
    return quiet_trainer(tmp_path, callbacks, **kw)


def _monitor(tmp_path: Path, **kw) -> FP8Monitor:
    kw.setdefault("every_n_steps", 2)
    return FP8Monitor(log_dir=str(tmp_path / "fp8"), **kw)


def _run_dirs(tmp_path: Path) -> list[Path]:
    return sorted(p.parent for p in (tmp_path / "fp8").rglob("meta.json"))


def _csv_rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _column(rows, name) -> dict[int, float]:
    return {int(r["step"]): float(r[name]) for r in rows if r.get(name) not in (None, "")}


def _check_run(run_dir: Path, model: Net, steps: range, sampled: list[int]) -> RunReader:
    """fp8/loss of every step equals the model's own loss; statistics exist at the sampled steps."""
    reader = RunReader(run_dir)
    series = reader.series()
    assert sorted(series) == list(steps)
    for s in steps:
        assert series[s] == pytest.approx(model.raw[s], rel=1e-6)
    assert sorted({r.step for r in reader.tensor_stats()}) == sampled
    return reader


def _check_user_metrics(trainer: pl.Trainer, model: Net) -> None:
    """The user's own metrics: untouched values, and no fp8track key among them."""
    last = max(model.raw)
    assert float(trainer.callback_metrics["loss"]) == pytest.approx(model.raw[last] + USER_OFFSET, rel=1e-6)
    assert not [k for k in trainer.callback_metrics if k.startswith("fp8")]


def test_fit_serves_a_csv_logger_and_leaves_the_users_loss_alone(tmp_path):
    model, mon = Net(), _monitor(tmp_path)
    trainer = _trainer(tmp_path, [mon], max_steps=6)
    trainer.fit(model)
    [run_dir] = _run_dirs(tmp_path)
    assert mon.run_dir == run_dir
    _check_run(run_dir, model, range(6), [0, 2, 4])
    _check_user_metrics(trainer, model)
    rows = _csv_rows(trainer)
    # the user's column holds only the user's values (loss + 100), at every step ...
    assert _column(rows, "loss") == pytest.approx({s: v + USER_OFFSET for s, v in model.raw.items()})
    # ... and fp8track's own columns sit beside it, under fp8/ (the loss at every optimizer step,
    # written at the sampled steps' flushes and the one at the end of training)
    assert _column(rows, "fp8/loss") == pytest.approx({s: model.raw[s] for s in range(6)})
    local = {r.step: r.metrics for r in RunReader(run_dir).metrics() if "fp8/worst/mse" in r.metrics}
    assert _column(rows, "fp8/worst/mse") == pytest.approx({s: local[s]["fp8/worst/mse"] for s in (0, 2, 4)})
    assert _column(rows, "fp8/body.0/activation/underflow_pct")


def test_a_second_fit_writes_a_second_run(tmp_path):
    mon = _monitor(tmp_path, trackers="none")
    first = Net()
    _trainer(tmp_path, [mon], max_steps=4, logger=False).fit(first)
    [first_dir] = _run_dirs(tmp_path)
    second = Net()
    trainer = _trainer(tmp_path, [mon], max_steps=3, logger=False)
    trainer.fit(second)
    [second_dir] = [d for d in _run_dirs(tmp_path) if d != first_dir]
    _check_run(first_dir, first, range(4), [0, 2])
    _check_run(second_dir, second, range(3), [0, 2])
    assert mon.run_dir == second_dir
    assert [e.kind for e in mon.events][-1] == "run_end"
    _check_user_metrics(trainer, second)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_validate_test_predict_without_fit(tmp_path, stage):
    mon = _monitor(tmp_path)
    trainer = _trainer(tmp_path, [mon])
    out = getattr(trainer, stage)(Net())
    assert out  # the user's results come back
    if stage != "predict":
        assert {"validate": "val_loss", "test": "test_loss"}[stage] in trainer.callback_metrics
    assert not [k for k in trainer.callback_metrics if k.startswith("fp8")]
    assert mon.run_dir is None and mon.events == [] and mon.summary() is None
    assert _run_dirs(tmp_path) == []  # nothing is monitored outside fit


def test_fast_dev_run(tmp_path):
    model, mon = Net(), _monitor(tmp_path)
    trainer = _trainer(tmp_path, [mon], fast_dev_run=True)
    trainer.fit(model)
    [run_dir] = _run_dirs(tmp_path)
    _check_run(run_dir, model, range(1), [0])
    _check_user_metrics(trainer, model)


def test_manual_optimisation(tmp_path):
    model, mon = Net(manual=True), _monitor(tmp_path)
    trainer = _trainer(tmp_path, [mon], max_steps=5)
    trainer.fit(model)
    [run_dir] = _run_dirs(tmp_path)
    reader = _check_run(run_dir, model, range(5), [0, 2, 4])
    grad_norms = reader.series("fp8/grad_norm")
    # the gradient norm is computed on sampled steps only (unsampled steps cost nothing)
    assert sorted(grad_norms) == [0, 2, 4] and all(g > 0 for g in grad_norms.values())
    _check_user_metrics(trainer, model)
    assert _column(_csv_rows(trainer), "fp8/loss") == pytest.approx({s: model.raw[s] for s in range(5)})


def test_logger_false(tmp_path):
    model, mon = Net(), _monitor(tmp_path)  # trackers="auto" with no logger: the run directory only
    trainer = _trainer(tmp_path, [mon], max_steps=4, logger=False)
    trainer.fit(model)
    [run_dir] = _run_dirs(tmp_path)
    _check_run(run_dir, model, range(4), [0, 2])
    _check_user_metrics(trainer, model)
    summary = mon.summary()
    assert summary["run_dir"] == str(run_dir) and summary["last_step"] == 3
    assert summary["final_loss"] == pytest.approx(model.raw[3], rel=1e-6)
    assert {w["layer"] for w in summary["worst_layers"]} == {"body.0", "body.2"}
    assert summary["spikes"] == 0 and summary["loss_gap_vs_baseline"] is None


def test_resume_from_checkpoint_appends_to_the_same_run(tmp_path):
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    mon = _monitor(tmp_path, every_n_steps=3)
    _trainer(tmp_path, [mon, ckpt_cb], max_steps=5, enable_checkpointing=True).fit(Net())
    ckpt = next((tmp_path / "ckpt").glob("*step=4.ckpt"))
    assert torch.load(ckpt, weights_only=False)["callbacks"][mon.state_key]["global_step"] == 4

    model, mon2 = Net(), _monitor(tmp_path, every_n_steps=3)
    trainer = _trainer(tmp_path, [mon2], max_steps=8, logger=CSVLogger(tmp_path, name="csv2"))
    trainer.fit(model, ckpt_path=ckpt)
    [run_dir] = _run_dirs(tmp_path)  # one run directory: the resumed run appended to it
    assert mon2.run_dir == run_dir
    reader = RunReader(run_dir)
    assert sorted(reader.series()) == list(range(8))
    assert sorted({r.step for r in reader.tensor_stats()}) == [0, 3, 6]
    _check_user_metrics(trainer, model)
    # every optimizer step's loss after the last step the first process recorded (4): a tracker
    # never gets a step twice
    assert _column(_csv_rows(trainer), "fp8/loss") == pytest.approx({s: model.raw[s] for s in (5, 6, 7)})


def test_exception_closes_locally_without_a_collective(tmp_path, monkeypatch):
    """After an exception another rank may be dead: closing must not run a collective (here the
    process group is faked as two ranks and every collective fails the test)."""
    import torch.distributed as dist

    from fp8track.monitoring import monitor as core

    collectives = []

    def forbidden(*args, **kwargs):
        collectives.append(args)
        raise AssertionError("collective after an exception")

    model, mon = Net(fail_at=3), _monitor(tmp_path, every_n_steps=10, trackers="none")
    trainer = _trainer(tmp_path, [mon], max_steps=6, logger=False)

    def fake_world_after_step_0(*_):
        return 2 if len(model.raw) > 1 else 1  # step 0 flushes alone; from then on "two ranks"

    monkeypatch.setattr(core, "_dist_world", fake_world_after_step_0)
    monkeypatch.setattr(dist, "all_reduce", forbidden)
    with pytest.raises(RuntimeError, match="user code failed at step 3"):
        trainer.fit(model)
    assert collectives == []
    [run_dir] = _run_dirs(tmp_path)
    reader = RunReader(run_dir)
    # steps 1 and 2 were pending: written from this rank's own values on the way out
    assert reader.series() == pytest.approx({s: model.raw[s] for s in range(3)})
    assert [e.kind for e in reader.events()][-1] == "run_end"
    assert mon.monitor.closed


@pytest.mark.slow
def test_mlflow_run_keeps_the_users_loss_history(tmp_path, mlflow_store):
    """In the user's MLflow run, ``loss`` holds exactly what the user logged; fp8track's loss is
    ``fp8/loss``."""
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow import MlflowClient

    uri = mlflow_store.uri
    mlf = MLFlowLogger(
        experiment_name=mlflow_store.experiment("t"),
        tracking_uri=uri,
        artifact_location=(tmp_path / "art").as_uri(),
    )
    model, mon = Net(), _monitor(tmp_path)
    _trainer(tmp_path, [mon], max_steps=4, logger=mlf).fit(model)
    client = MlflowClient(uri)
    user = sorted((m.step, m.value) for m in client.get_metric_history(mlf.run_id, "loss"))
    assert user == [(s, pytest.approx(model.raw[s] + USER_OFFSET, rel=1e-6)) for s in range(4)]
    ours = sorted((m.step, m.value) for m in client.get_metric_history(mlf.run_id, "fp8/loss"))
    # every optimizer step's loss (the unsampled ones sent with the next flush)
    assert ours == [(s, pytest.approx(model.raw[s], rel=1e-6)) for s in range(4)]
    assert not math.isnan(ours[0][1])
