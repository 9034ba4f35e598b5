"""Guarantee 1: a tracker outage never stops or stalls training and loses nothing.

* MLflow: a real ``mlflow server`` is SIGKILLed mid-run and restarted later. Training goes on
  while it is down, the adapter warns once and retries with back-off, and once the server is back
  the run holds every logged point exactly once, with no ``fp8track sync``.
* W&B: a failing ``wandb.init`` or ``run.log`` leaves training running; the missed steps are
  listed and replayable, and no table row is sent twice.
"""

from __future__ import annotations

import signal
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from fp8track import MonitorConfig
from fp8track.frontend import Monitor
from fp8track.monitoring.records import RunMeta, RunReader
from fp8track.trackers.fanout import read_missed
from fp8track.trackers.replay import sync_run

from helpers.models import mlp
from helpers.servers import MlflowServer, free_port

pytestmark = pytest.mark.slow


def _train_step(model: torch.nn.Module, monitor: Monitor, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    loss = model(x).square().mean()
    loss.backward()
    monitor.step(loss=loss)
    model.zero_grad()


def _tracker_warnings(caught: list[warnings.WarningMessage], name: str) -> list[str]:
    return [str(w.message) for w in caught if f"tracker {name!r}" in str(w.message)]


def test_mlflow_server_killed_and_restarted_heals_without_sync(tmp_path, monkeypatch):
    """Long (about 30 s): a real mlflow server started, killed and restarted while training runs."""
    mlflow = pytest.importorskip("mlflow")
    from fp8track.trackers.mlflow import MLflowTracker
    from fp8track.trackers.retry import Backoff

    # MLflow's own HTTP retries would hide the outage from the adapter for minutes: off, so the
    # adapter's back-off is what is tested.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")  # a refused connection fails at once anyway
    server = MlflowServer(tmp_path, free_port()).start()
    try:
        tracker = MLflowTracker(
            tracking_uri=server.uri,
            experiment_name="outage",
            retry=Backoff(for_s=300, initial_s=0.2, max_s=2),
            heatmap=False,
        )
        model = mlp(8, 16, 4, act=torch.nn.GELU)
        monitor = Monitor(
            model, MonitorConfig(every_n_steps=1), log_dir=tmp_path / "runs", trackers=[tracker]
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monitor.attach()
            for step in range(8):
                _train_step(model, monitor, step)
            assert tracker.flush(120)
            server.stop(signal.SIGKILL)  # the server dies mid-run
            # Training goes on while the server is down: these steps cannot reach it.
            for step in range(8, 24):
                _train_step(model, monitor, step)
            assert server.proc is not None and server.proc.poll() is not None  # still down
            server.start()
            for step in range(24, 30):
                _train_step(model, monitor, step)
            monitor.close()  # waits for the queue to drain into the healed server
        messages = _tracker_warnings(caught, "mlflow")
        assert len(messages) == 1 and "retrying with back-off" in messages[0], messages
        assert tracker.retries >= 1
        run_dir = monitor.run_dir
        assert read_missed(run_dir, "mlflow") == []  # nothing left for `fp8track sync`

        local = [r for r in RunReader(run_dir).metrics() if "fp8/loss" in r.metrics]
        client = mlflow.MlflowClient(server.uri)
        for key in ("fp8/loss", "fp8/worst/mse", "fp8/0/activation/underflow_pct"):
            history = client.get_metric_history(tracker.run_id, key)
            steps = Counter(m.step for m in history)
            expected = [r.step for r in local if key in r.metrics]
            assert len(expected) == 30
            assert sorted(steps) == expected and set(steps.values()) == {1}, (key, steps)
            assert {m.step: m.value for m in history} == pytest.approx(
                {r.step: r.metrics[key] for r in local}
            )
    finally:
        server.stop()


def _wandb_run_dir(root: Path) -> Path:
    (run,) = [p for p in (root / "wandb").glob("offline-run-*") if p.is_dir()]
    return run


def test_wandb_init_failure_leaves_training_running_and_steps_replayable(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from fp8track.trackers.wandb import WandbTracker

    from helpers.wandb_records import history, inspect

    real_init = wandb.init

    def broken_init(*a, **k):
        raise wandb.errors.CommError("could not reach api.wandb.ai")

    monkeypatch.setattr(wandb, "init", broken_init)
    tracker = WandbTracker.create(project="p", dir=str(tmp_path / "first"), mode="offline", lazy=True)
    model = mlp(8, 16, 4, act=torch.nn.GELU)
    monitor = Monitor(model, MonitorConfig(every_n_steps=2), log_dir=tmp_path / "runs", trackers=[tracker])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10):
            _train_step(model, monitor, step)
        monitor.close()
    assert len(_tracker_warnings(caught, "wandb")) == 1
    missed = read_missed(monitor.run_dir, "wandb")
    # Every batch missed: one per optimizer step (each step's loss), step 9 with the run-end event.
    assert {e["step"] for e in missed if e["what"] == "log"} == set(range(10))

    monkeypatch.setattr(wandb, "init", real_init)
    (tmp_path / "second").mkdir()
    again = WandbTracker.create(project="p", dir=str(tmp_path / "second"), mode="offline", background=False)
    assert sync_run(monitor.run_dir, again) == 10
    assert read_missed(monitor.run_dir, "wandb") == []
    got = Counter(
        h["trainer/global_step"]
        for h in history(inspect(_wandb_run_dir(tmp_path / "second")))
        if "fp8/loss" in h
    )
    local = RunReader(monitor.run_dir).series("fp8/loss")
    assert sorted(local) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert got == dict.fromkeys(range(10), 1)  # every step's loss once


def test_wandb_log_failure_never_duplicates_table_rows(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from fp8track.monitoring import naming
    from fp8track.trackers.wandb import WandbTracker

    from helpers.wandb_records import history, inspect, table_rows

    tracker = WandbTracker.create(project="p", dir=str(tmp_path), mode="offline", background=False)
    real_log = tracker.run.log
    fail_at = {4, 6}

    def flaky_log(data, *a, **k):
        if data.get("trainer/global_step") in fail_at and "fp8/loss" in data:
            raise ConnectionResetError("wandb service went away")
        return real_log(data, *a, **k)

    monkeypatch.setattr(tracker.run, "log", flaky_log)
    model = mlp(8, 16, 4, act=torch.nn.GELU)
    monitor = Monitor(
        model,
        MonitorConfig(every_n_steps=2),
        log_dir=tmp_path / "runs",
        trackers=[tracker],
        meta=RunMeta(name="flaky"),
    )
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in range(10):
            _train_step(model, monitor, step)
        monitor.close()
    missed = read_missed(monitor.run_dir, "wandb")
    assert sorted((e["step"], e["what"]) for e in missed) == [(4, "scalars"), (6, "scalars")]
    run_dir = _wandb_run_dir(tmp_path)
    rows = Counter((r[0], r[1], r[2]) for r in table_rows(run_dir, naming.TABLE_TENSOR_STATS))
    local = Counter((r.step, r.layer, r.tensor) for r in RunReader(monitor.run_dir).tensor_stats())
    assert rows == local and set(rows.values()) == {1}  # every row once, including those of steps 4 and 6
    logged = sorted(h["trainer/global_step"] for h in history(inspect(run_dir)) if "fp8/loss" in h)
    assert logged == [0, 1, 2, 3, 5, 7, 8, 9]  # 4 and 6 are the missed scalars
