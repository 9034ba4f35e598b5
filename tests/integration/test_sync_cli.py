"""``fp8track sync`` into MLflow (real SQLite store): a second sync of the same run directory
finds the run the first one wrote (by its ``fp8track.run_id`` tag) and writes nothing twice."""

from __future__ import annotations

import json

import torch

from fp8track.cli import main
from fp8track.frontend import Monitor
from fp8track.monitoring.naming import LOSS_METRIC


def _run_dir(tmp_path, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with Monitor(model, {"every_n_steps": 2}, log_dir=tmp_path / "runs") as mon:
        for _ in range(steps):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
            opt.zero_grad()
            losses.append(loss.item())
    return mon.run_dir, losses


def _sync(capsys, *argv):
    assert main(["sync", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out)


def test_sync_twice_writes_one_mlflow_run_with_each_step_once(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    run_dir, losses = _run_dir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = _sync(capsys, run_dir, "--mlflow-uri", uri)["mlflow"]
    second = _sync(capsys, run_dir, "--mlflow-uri", uri)["mlflow"]
    assert first["steps"] == 4 and not first["existing_run"]  # 4 logging steps (every step records its loss)
    assert second == {"run_id": first["run_id"], "existing_run": True, "steps": 0, "still_missed": []}
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [first["run_id"]]
    history = client.get_metric_history(first["run_id"], LOSS_METRIC)
    assert sorted(m.step for m in history) == [0, 1, 2, 3]
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest_approx(losses)
    # --all into the found run re-sends every step; the scalars of steps it holds are not duplicated.
    again = _sync(capsys, run_dir, "--mlflow-uri", uri, "--all")["mlflow"]
    assert again["run_id"] == first["run_id"] and again["existing_run"]
    assert sorted(m.step for m in client.get_metric_history(first["run_id"], LOSS_METRIC)) == [0, 1, 2, 3]


def pytest_approx(values):
    import pytest

    return pytest.approx(values, rel=1e-6)
