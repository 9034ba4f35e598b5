"""MLflowTracker against a real ``mlflow server`` on 127.0.0.1, including an outage and replay."""

from __future__ import annotations

import pytest

pytest.importorskip("mlflow")
pd = pytest.importorskip("pandas")

from mlflow import MlflowClient  # noqa: E402

from fp8track.monitoring import naming  # noqa: E402
from fp8track.monitoring.records import MetricsRecord, RunMeta, RunWriter, TensorStatsRow  # noqa: E402
from fp8track.trackers import TrackerFanout, sync_run  # noqa: E402
from fp8track.trackers.base import StepBatch  # noqa: E402
from fp8track.trackers.fanout import read_missed  # noqa: E402
from fp8track.trackers.mlflow import MLflowTracker  # noqa: E402
from fp8track.trackers.replay import missed_steps  # noqa: E402
from fp8track.trackers.retry import Backoff  # noqa: E402

from helpers.servers import free_port as _free_port  # noqa: E402
from helpers.servers import mlflow_server  # noqa: E402

pytestmark = pytest.mark.slow


def _batch(step: int) -> StepBatch:
    rows = [
        TensorStatsRow(
            step=step, layer=f"l{i}", tensor="weight", stats={"underflow_pct": float(i * step), "mse": 1e-4}
        )
        for i in range(3)
    ]
    metrics = {naming.metric_name(r.layer, "weight", "underflow_pct"): r.stats["underflow_pct"] for r in rows}
    metrics["loss"] = 1.0 / (step + 1)
    return StepBatch(step=step, metrics=metrics, tensor_rows=rows)


def test_server_logging_outage_and_replay(tmp_path, monkeypatch):
    # Fail fast while the server is down instead of MLflow's minutes of retries.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")  # a refused connection fails at once anyway
    port = _free_port()
    run_dir = tmp_path / "run"
    writer = RunWriter(run_dir, RunMeta(recipe={"name": "mxfp8"}))

    with mlflow_server(tmp_path, port) as uri:
        # No retries: this is the outage that outlasts the run (tests/reliability covers healing).
        tracker = MLflowTracker(tracking_uri=uri, experiment_name="server-test", retry=Backoff(for_s=0))
        fan = TrackerFanout([tracker], run_dir)
        fan.start(writer.meta)
        for s in range(3):
            writer.write_metrics(MetricsRecord(step=s, metrics=dict(_batch(s).metrics)))
            writer.write_tensor_stats(list(_batch(s).tensor_rows))
            fan.log(_batch(s))
        assert tracker.flush(60)
        run_id = tracker.run_id
    # server stopped: the run goes on, the tracker misses steps 3-5 and its final tables
    with pytest.warns(RuntimeWarning, match="'mlflow' failed"):
        for s in range(3, 6):
            writer.write_metrics(MetricsRecord(step=s, metrics=dict(_batch(s).metrics)))
            writer.write_tensor_stats(list(_batch(s).tensor_rows))
            fan.log(_batch(s))
        fan.finish()
    writer.close()
    missed = read_missed(run_dir, "mlflow")
    assert sorted(e["step"] for e in missed if e["what"] == "log") == [3, 4, 5]
    # steps 0-2 reached the server, but their buffered table rows were lost with the final write
    assert sorted(e["step"] for e in missed if e["what"] == "tables") == [0, 1, 2]
    assert any(e["what"] == "finish" for e in missed)

    with mlflow_server(tmp_path, port) as uri:
        client = MlflowClient(uri)
        n = sync_run(run_dir, MLflowTracker(tracking_uri=uri, run_id=run_id))
        assert n == 6
        assert missed_steps(run_dir, "mlflow") == [] and read_missed(run_dir, "mlflow") == []
        hist = client.get_metric_history(run_id, "fp8/l2/weight/underflow_pct")
        # every step exactly once: steps 0-2 were replayed without their scalars
        assert sorted((m.step, m.value) for m in hist) == [(s, 2.0 * s) for s in range(6)]
        path = client.download_artifacts(run_id, f"{naming.TABLE_TENSOR_STATS}.json", str(tmp_path / "dl"))
        table = pd.read_json(path, orient="split")
        assert sorted(zip(table.step, table.layer, strict=True)) == [
            (s, f"l{i}") for s in range(6) for i in range(3)
        ]
        run = client.get_run(run_id)
        assert run.data.params["fp8.recipe.name"] == "mxfp8"
        arts = {a.path for a in client.list_artifacts(run_id)}
        assert {f"{naming.TABLE_TENSOR_STATS}.json", "fp8_heatmap.png"} <= arts
