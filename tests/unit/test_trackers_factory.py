"""Finding trackers from Lightning loggers and resolving tracker specs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

from fp8track.errors import ConfigError
from fp8track.trackers import (
    LoggerTracker,
    logger_kind,
    make_trackers,
    mlflow_tracking_uri,
    trackers_from_loggers,
    validate_tracker_spec,
)
from fp8track.trackers.base import Tracker


class Null(Tracker):
    name = "null"

    def log(self, batch):
        pass


@pytest.mark.parametrize("bad", ["wandbb", "all", ["mlflow", "tensorboard"], [3]])
def test_unknown_specs_name_the_valid_values(bad):
    with pytest.raises(ConfigError, match=r"valid values are: .*'wandb', 'mlflow'"):
        validate_tracker_spec(bad)
    with pytest.raises(ConfigError):
        make_trackers(bad, [])


def test_none_and_explicit_objects():
    null = Null()
    assert make_trackers("none", [CSVLogger("x")]) == []
    assert make_trackers(None, []) == []
    assert make_trackers([null], []) == [null]


def test_requested_tracker_without_its_logger_fails_early(tmp_path):
    with pytest.raises(ConfigError, match=r"'wandb'.*no WandbLogger"):
        make_trackers(["wandb"], [CSVLogger(tmp_path)])


def test_auto_from_real_loggers(tmp_path, mlflow_store):
    from fp8track.trackers.mlflow import MLflowTracker

    uri, e = mlflow_store.uri, mlflow_store.experiment
    ml = MLFlowLogger(experiment_name=e("e"), tracking_uri=uri, artifact_location=str(tmp_path / "art"))
    ml2 = MLFlowLogger(experiment_name=e("e2"), tracking_uri=uri, artifact_location=str(tmp_path / "art2"))
    csv = CSVLogger(tmp_path)
    trackers = make_trackers("auto", [csv, ml, ml2], mlflow={"heatmap": False})
    # W&B and MLflow get their native views; any other logger the scalar metrics
    assert [type(t) for t in trackers] == [LoggerTracker, MLflowTracker, MLflowTracker]
    assert [t.name for t in trackers] == ["CSVLogger", "mlflow", "mlflow-1"]
    assert trackers[0].logger is csv
    trackers = trackers[1:]
    assert trackers[0].run_id == ml.run_id and trackers[1].run_id == ml2.run_id
    assert trackers[0].client is ml.experiment and trackers[0].heatmap is False
    assert not trackers[0].own_run  # Lightning owns the run and terminates it
    assert make_trackers("mlflow", [csv, ml])[0].run_id == ml.run_id
    assert [type(t) for t in trackers_from_loggers([csv, CSVLogger(tmp_path)])] == [
        LoggerTracker,
        LoggerTracker,
    ]
    assert [t.name for t in trackers_from_loggers([csv, CSVLogger(tmp_path)])] == ["CSVLogger", "CSVLogger-1"]


def test_logger_kind_from_public_attributes_only(tmp_path, mlflow_store):
    uri = mlflow_store.uri
    ml = MLFlowLogger(
        experiment_name=mlflow_store.experiment("e"),
        tracking_uri=uri,
        artifact_location=str(tmp_path / "art"),
    )

    class MyMLflow(MLFlowLogger):  # a subclass is still served natively
        pass

    assert logger_kind(ml) == "mlflow"
    assert logger_kind(MyMLflow(experiment_name=mlflow_store.experiment("e"), tracking_uri=uri)) == "mlflow"
    assert logger_kind(CSVLogger(tmp_path)) == "generic"
    assert logger_kind(object()) is None
    # the tracking URI comes from the client's public attribute (the baseline resolves mlflow:<id> with it)
    assert mlflow_tracking_uri([CSVLogger(tmp_path), ml]) == uri
    assert mlflow_tracking_uri([CSVLogger(tmp_path)]) is None


def test_generic_logger_receives_the_scalar_metrics(tmp_path):
    from fp8track.monitoring.records import StepBatch, TensorStatsRow

    got = []

    class Sink:
        def log_metrics(self, metrics, step):
            got.append((step, metrics))

    tracker = LoggerTracker(Sink())
    row = TensorStatsRow(3, "fc1", "weight", {"mse": 0.5})
    tracker.log(StepBatch(3, {"fp8/loss": 2.5, "fp8/fc1/weight/mse": 0.5, "note": "text"}, (row,), ()))
    tracker.finish()
    assert got == [(3, {"fp8/loss": 2.5, "fp8/fc1/weight/mse": 0.5})]  # scalars only, no table rows


def test_no_tracker_library_is_imported_without_its_logger(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        from lightning.pytorch.loggers import CSVLogger
        from fp8track.trackers import make_trackers
        from fp8track.trackers.fanout import TrackerFanout
        assert [t.name for t in make_trackers("auto", [CSVLogger({str(tmp_path)!r})])] == ["CSVLogger"]
        bad = [m for m in ("wandb", "mlflow", "nvdlfw_inspect") if m in sys.modules]
        assert not bad, bad
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
