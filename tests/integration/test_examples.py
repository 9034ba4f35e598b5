"""The CPU examples run end to end for a few steps and their records hold what they print."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fp8track.monitoring.records import RunReader

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_loop_with_monitor(tmp_path):
    summary = _load("plain_loop").main(["--steps", "4", "--every-n-steps", "2", "--log-dir", str(tmp_path / "runs")])
    reader = RunReader(summary["run_dir"])
    assert sorted(reader.series()) == [0, 1, 2, 3]
    assert summary["final_loss"] == reader.series()[3]
    assert sorted({r.step for r in reader.tensor_stats()}) == [0, 2]
    assert reader.meta()["recipe"]["name"] == "delayed"
    assert len(summary["worst_layers"]) == 5


@pytest.mark.slow
def test_lightning_with_wandb_and_mlflow(tmp_path, capfd):
    from mlflow import MlflowClient

    out = tmp_path / "runs"
    summary = _load("lightning_wandb_mlflow").main(["--steps", "4", "--every-n-steps", "2", "--out", str(out)])
    printed = capfd.readouterr()
    assert printed.out.startswith("recipe=") and '"worst_layers"' in printed.out  # fp8track's output
    for chatter in ("GPU available", "Tip:", "wandb:", "alembic", "anonymous"):  # not the libraries'
        assert chatter not in printed.out + printed.err, chatter
    reader = RunReader(summary["run_dir"])
    assert sorted({r.step for r in reader.tensor_stats()}) == [0, 2]
    client = MlflowClient(f"sqlite:///{(out / 'mlflow.db').resolve()}")
    [run] = client.search_runs([client.get_experiment_by_name("fp8track-example").experiment_id])
    hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "fp8/loss")}
    # every optimizer step's loss (the unsampled ones sent with the next flush or at close)
    assert hist == {s: reader.series()[s] for s in range(4)}
    assert "train_loss" in run.data.metrics  # the user's own metric, beside fp8track's
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
