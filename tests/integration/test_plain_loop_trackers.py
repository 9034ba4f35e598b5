"""The plain ``fp8track.Monitor`` logs where the loop already logs: inside an active MLflow run
(SQLite store), the run a sweep trial names with ``MLFLOW_RUN_ID``, and an open W&B run (offline,
read back with ``wandb leet inspect --json``); ``"auto"``, names, ``"none"`` and Tracker objects,
each validated at construction (a bad one is a ConfigError before any run directory exists)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8track
from fp8track.monitoring.naming import LOSS_METRIC
from fp8track.monitoring.records import RunReader

pytestmark = pytest.mark.slow

mlflow = pytest.importorskip("mlflow")

from helpers.wandb_records import history, inspect  # noqa: E402


def train(monitor_kwargs: dict, log_dir: Path, steps: int = 6) -> tuple[Path, list[float]]:
    """A plain loop of ``steps`` optimizer steps under ``fp8track.Monitor``; returns its run
    directory and the losses the loop saw."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses = []
    with fp8track.Monitor(model, {"every_n_steps": 2}, log_dir=log_dir, **monitor_kwargs) as monitor:
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            monitor.step(loss=loss)
            opt.zero_grad()
            losses.append(loss.item())
    return monitor.run_dir, losses


def recorded_losses(run_dir: Path) -> dict[int, float]:
    return {m.step: m.metrics[LOSS_METRIC] for m in RunReader(run_dir).metrics() if LOSS_METRIC in m.metrics}


@pytest.fixture
def tracking(tmp_path):
    """A SQLite MLflow store as the process's active tracking URI (restored afterwards)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    yield mlflow.MlflowClient(uri)
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(before)


def history_of(client, run_id: str, key: str = LOSS_METRIC) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_inside_an_active_mlflow_run_the_monitor_logs_into_it(tmp_path, tracking):
    mlflow.set_experiment("plain-loop")
    with mlflow.start_run() as run:
        mlflow.log_param("lr", 0.05)  # the user's own logging, same run
        run_dir, losses = train({}, tmp_path / "runs")  # trackers="auto" (the default)
        assert tracking.get_run(run.info.run_id).info.status == "RUNNING"  # the run stays the user's
    ours = recorded_losses(run_dir)
    assert list(ours.values()) == pytest.approx(losses, rel=1e-6)
    assert history_of(tracking, run.info.run_id) == pytest.approx(ours, rel=1e-6)
    stored = tracking.get_run(run.info.run_id)
    assert stored.data.params["lr"] == "0.05" and stored.info.status == "FINISHED"
    assert any(k.startswith("fp8/0/") for k in stored.data.metrics)  # per-layer statistics too
    experiment = tracking.get_experiment_by_name("plain-loop").experiment_id
    assert len(tracking.search_runs([experiment])) == 1  # no second run was created


def test_the_names_and_a_tracker_object_resolve_to_the_open_run(tmp_path, tracking):
    from fp8track.trackers.mlflow import MLflowTracker

    other = tracking.create_run(tracking.create_experiment("mine")).info.run_id
    runs = []
    for spec in (["mlflow"], "mlflow"):
        with mlflow.start_run() as run:
            run_dir, _ = train({"trackers": spec}, tmp_path / str(len(runs)))
        runs.append(run.info.run_id)
        assert history_of(tracking, run.info.run_id) == pytest.approx(recorded_losses(run_dir), rel=1e-6)
    with mlflow.start_run() as run:
        train({"trackers": [MLflowTracker(client=tracking, run_id=other)]}, tmp_path / "c")
        train({"trackers": "none"}, tmp_path / "d")
    assert len(tracking.get_metric_history(other, LOSS_METRIC)) == 6  # c
    assert tracking.get_metric_history(run.info.run_id, LOSS_METRIC) == []  # c went elsewhere, d nowhere


def test_a_sweep_trial_run_named_by_mlflow_run_id_is_served_without_start_run(
    tmp_path, tracking, monkeypatch
):
    """``fp8track sweep`` starts each trial with MLFLOW_RUN_ID / MLFLOW_TRACKING_URI naming its run."""
    trial = tracking.create_run(tracking.create_experiment("sweep")).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", trial)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.get_tracking_uri())
    run_dir, _ = train({}, tmp_path / "runs")
    assert history_of(tracking, trial) == pytest.approx(recorded_losses(run_dir), rel=1e-6)
    assert tracking.get_run(trial).info.status == "RUNNING"  # the sweep ends its trial's run, not us


def test_an_open_wandb_run_is_served(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="plain", mode="offline", dir=str(tmp_path))
    try:
        run_dir, _ = train({}, tmp_path / "runs")
    finally:
        run.finish()
    offline = next((tmp_path / "wandb").glob("offline-run-*"))
    logged = {
        int(h["trainer/global_step"]): h[LOSS_METRIC] for h in history(inspect(offline)) if LOSS_METRIC in h
    }
    assert logged == pytest.approx(recorded_losses(run_dir), rel=1e-6) and len(logged) == 6


def test_without_an_open_run_auto_logs_to_the_run_directory_only(tmp_path, tracking):
    run_dir, losses = train({}, tmp_path / "runs")
    assert list(recorded_losses(run_dir).values()) == pytest.approx(losses, rel=1e-6)
    assert tracking.search_experiments() == [] or all(
        tracking.search_runs([e.experiment_id]) == [] for e in tracking.search_experiments()
    )


@pytest.mark.parametrize(
    "spec, must_say",
    [
        ("tensorboard", ["'tensorboard'", "'auto'", "'none'", "'mlflow'", "'wandb'"]),
        (42, ["int 42", "'auto'", "'none'", "Tracker"]),
        (["mlflow", 3], ["3", "'mlflow'", "'wandb'", "Tracker object"]),
        ("mlflow", ["no mlflow run is open", "mlflow.start_run()", "MLflowTracker("]),
        (["wandb"], ["no wandb run is open", "wandb.init(", "WandbTracker.create("]),
    ],
)
def test_a_bad_tracker_spec_is_refused_at_construction_before_any_run_dir(tmp_path, tracking, spec, must_say):
    log_dir = tmp_path / "runs"
    with pytest.raises(fp8track.ConfigError) as info:
        fp8track.Monitor(torch.nn.Linear(4, 4), log_dir=log_dir, trackers=spec)
    for fragment in must_say:
        assert fragment in str(info.value), str(info.value)
    assert not log_dir.exists()
