"""MLflowTracker against a real MLflow store on a temporary SQLite database."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

from fp8track.monitoring import naming  # noqa: E402
from fp8track.monitoring.records import EventRecord, MetricsRecord, RunMeta, RunWriter, TensorStatsRow  # noqa: E402
from fp8track.trackers import TrackerFanout, sync_run  # noqa: E402
from fp8track.trackers.base import StepBatch  # noqa: E402
from fp8track.trackers.mlflow import HEATMAP_FILE, MLflowTracker  # noqa: E402
from fp8track.trackers.replay import missed_steps, step_batches  # noqa: E402

LAYERS = ("blocks.0.qkv", "blocks.0.proj", "head")


def load_table(client, run_id, artifact_file):
    """Read a ``log_table`` artifact back. (``MlflowClient.load_table`` searches runs through the
    process-global tracking URI, not the client's, so it is not used here.)"""
    import pandas as pd

    path = client.download_artifacts(run_id, artifact_file)
    return pd.read_json(path, orient="split")


@pytest.fixture(scope="module")
def _db(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    return uri, MlflowClient(uri), root


@pytest.fixture
def store(_db, request):
    """One SQLite database per module (creating one runs MLflow's migrations, seconds each);
    one experiment per test."""
    uri, client, root = _db
    name = request.node.name
    exp = client.create_experiment(name, artifact_location=str(root / name))
    return uri, client, exp


def _batch(step: int) -> StepBatch:
    rows = [
        TensorStatsRow(
            step=step,
            layer=layer,
            tensor="activation",
            stats={"underflow_pct": i + step / 10, "mse": 10.0 ** -(i + 1)},
        )
        for i, layer in enumerate(LAYERS)
    ]
    metrics = {naming.metric_name(r.layer, r.tensor, "underflow%"): r.stats["underflow_pct"] for r in rows}
    metrics["loss"] = 5.0 - step / 10
    events = []
    if step in (2, 4, 6):
        severity = {2: 1.5, 4: 7.0, 6: 3.0}[step]
        events.append(
            EventRecord(
                kind="spike",
                step=step,
                data={"severity": severity, "title": f"spike@{step}", "layer": "head"},
            )
        )
    return StepBatch(step=step, metrics=metrics, tensor_rows=rows, events=events)


def test_metrics_params_tags_tables_and_heatmap(store, tmp_path):
    uri, client, exp = store
    run_id = client.create_run(exp).info.run_id
    tracker = MLflowTracker(client=client, run_id=run_id)
    fan = TrackerFanout([tracker], tmp_path / "run")
    fan.start(
        RunMeta(
            recipe={"name": "delayed", "amax_history_len": 16}, bf16_layers=("head",), fp8_layers=LAYERS[:2]
        )
    )
    for s in range(8):
        fan.log(_batch(s))
    fan.finish()
    assert fan.failures == {"mlflow": 0}

    run = client.get_run(run_id)
    assert run.data.params["fp8.recipe.name"] == "delayed"
    assert run.data.params["fp8.recipe.amax_history_len"] == "16"
    assert run.data.tags["fp8.bf16_layers"] == "head" and run.data.params["fp8.n_bf16_layers"] == "1"
    assert run.data.tags["fp8.recipe"] == "delayed"
    # the most severe event (severity 7 at step 4), not the last one
    assert run.data.tags["fp8.worst_event.step"] == "4"
    assert run.data.tags["fp8.worst_event.severity"] == "7.0"
    assert run.data.tags["fp8.worst_event.title"] == "spike@4"
    assert run.info.status == "RUNNING"  # the run belongs to whoever created it

    hist = client.get_metric_history(run_id, "fp8/blocks.0.proj/activation/underflow_pct")
    assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == [
        (s, 1 + s / 10) for s in range(8)
    ]
    loss = client.get_metric_history(run_id, "loss")
    assert [m.value for m in sorted(loss, key=lambda m: m.step)] == pytest.approx(
        [5.0 - s / 10 for s in range(8)]
    )

    table = load_table(client, run_id, f"{naming.TABLE_TENSOR_STATS}.json")
    assert len(table) == 8 * len(LAYERS)
    assert list(table.columns[:6]) == ["step", "layer", "tensor", "variant", "underflow_pct", "mse"]
    row = table[(table.step == 5) & (table.layer == "head")].iloc[0]
    assert row.underflow_pct == pytest.approx(2.5) and row.mse == pytest.approx(1e-3)
    spikes = load_table(client, run_id, f"{naming.TABLE_SPIKE_EVENTS}.json")
    assert sorted(spikes.step.tolist()) == [2, 4, 6]
    assert sorted(spikes.severity.tolist()) == [1.5, 3.0, 7.0]

    arts = {a.path for a in client.list_artifacts(run_id)}
    assert HEATMAP_FILE in arts
    png = client.download_artifacts(run_id, HEATMAP_FILE, str(tmp_path / "dl"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_tables_written_in_chunks_not_every_step(store, tmp_path):
    uri, client, exp = store
    run_id = client.create_run(exp).info.run_id
    tracker = MLflowTracker(client=client, run_id=run_id, table_every_n_steps=3, heatmap=False)
    calls = []
    original = client.log_artifact

    def counting_log_artifact(run, local_path, *a, **k):  # counts real calls; the real method still runs
        calls.append((Path(local_path).name, len(json.loads(Path(local_path).read_text())["data"])))
        return original(run, local_path, *a, **k)

    client.log_artifact = counting_log_artifact
    fan = TrackerFanout([tracker], tmp_path / "run")
    for s in range(7):
        fan.log(StepBatch(step=s, tensor_rows=_batch(s).tensor_rows))
    fan.finish()
    # steps 0-2, 3-5 and the rest at finish: three writes of the whole table so far, every row once
    name = f"{naming.TABLE_TENSOR_STATS}.json"
    assert calls == [(name, 3 * 3), (name, 6 * 3), (name, 7 * 3)]
    table = load_table(client, run_id, name)
    assert sorted(table.step.tolist()) == sorted(s for s in range(7) for _ in LAYERS)
    assert table.columns.tolist() == ["step", "layer", "tensor", "variant", "underflow_pct", "mse"]
    # listed as a table, as log_table lists it
    assert {"path": name, "type": "table"} in json.loads(
        client.get_run(run_id).data.tags["mlflow.loggedArtifacts"]
    )


def test_a_second_tracker_on_the_same_run_appends_to_its_tables(store, tmp_path):
    """As ``log_table`` appends to an existing table file, a tracker logging into a run that
    already holds tables (a resumed run, a replay) keeps their rows and adds its own, once each."""
    uri, client, exp = store
    run_id = client.create_run(exp).info.run_id
    first = MLflowTracker(client=client, run_id=run_id, heatmap=False, background=False)
    for s in range(3):
        first.log(_batch(s))
    first.finish()
    second = MLflowTracker(client=client, run_id=run_id, heatmap=False, background=False)
    for s in range(3, 7):
        second.log(_batch(s))
    second.finish()
    table = load_table(client, run_id, f"{naming.TABLE_TENSOR_STATS}.json")
    assert table.step.tolist() == [s for s in range(7) for _ in LAYERS]
    assert table.mse.tolist() == pytest.approx([10.0 ** -(i + 1) for _ in range(7) for i in range(3)])
    spikes = load_table(client, run_id, f"{naming.TABLE_SPIKE_EVENTS}.json")
    assert spikes.step.tolist() == [2, 4, 6]
    listed = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert sorted(e["path"] for e in listed) == sorted(
        {f"{naming.TABLE_TENSOR_STATS}.json", f"{naming.TABLE_SPIKE_EVENTS}.json"}
    )
    assert not first._spool_dir.exists() and not second._spool_dir.exists()  # spools removed at finish


def test_columns_of_a_resumed_table_and_new_statistics_keep_their_values(store):
    """The run's existing table has a column this tracker never sees ("old_only"); a statistic the
    tracker meets only later ("sqnr_db") gets a column of its own, after it: each value stays
    under its own name."""
    uri, client, exp = store
    run_id = client.create_run(exp).info.run_id

    def batch(step: int, stats: dict[str, float]) -> StepBatch:
        return StepBatch(
            step=step, metrics={}, tensor_rows=[TensorStatsRow(step, "head", "activation", stats)], events=[]
        )

    first = MLflowTracker(client=client, run_id=run_id, heatmap=False, background=False)
    first.log(batch(0, {"mse": 1.0, "old_only": 7.0}))
    first.finish()
    second = MLflowTracker(
        client=client, run_id=run_id, heatmap=False, background=False, table_every_n_steps=1
    )
    second.log(batch(1, {"mse": 2.0}))  # the first write: the run's rows are put first
    second.log(batch(2, {"mse": 3.0, "sqnr_db": 40.0}))
    second.finish()
    table = load_table(client, run_id, f"{naming.TABLE_TENSOR_STATS}.json")
    assert table.step.tolist() == [0, 1, 2]
    assert table.mse.tolist() == [1.0, 2.0, 3.0]
    assert table.old_only.fillna(-1).tolist() == [7.0, -1, -1]
    assert table.sqnr_db.fillna(-1).tolist() == [-1, -1, 40.0]


def test_batches_over_1000_metrics_and_name_sanitising(store, tmp_path):
    uri, client, exp = store
    experiment_name = client.get_experiment(exp).name
    tracker = MLflowTracker(
        tracking_uri=uri, experiment_name=experiment_name, heatmap=False, background=False
    )
    metrics = {f"fp8/layer{i}/weight/mse": float(i) for i in range(1500)}
    metrics["fp8/odd:name%/x"] = 1.0
    metrics["fp8/nan"] = math.nan
    tracker.log(StepBatch(step=3, metrics=metrics))
    tracker.finish()
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"  # the tracker created this run, so it ends it
    assert len(run.data.metrics) == 1502
    assert run.data.metrics["fp8/layer1499/weight/mse"] == 1499.0
    assert run.data.metrics["fp8/odd_name_pct/x"] == 1.0
    assert math.isnan(run.data.metrics["fp8/nan"])


def test_failed_steps_are_replayed_into_the_same_run(store, tmp_path):
    """A tracker pointed at a run that does not exist fails every step; replay fills the real run."""
    uri, client, exp = store
    run_dir = tmp_path / "run"
    writer = RunWriter(run_dir, RunMeta(recipe={"name": "current"}))
    real_run = client.create_run(exp).info.run_id
    broken = MLflowTracker(client=client, run_id="0" * 32, heatmap=False)
    fan = TrackerFanout([broken], run_dir)
    with pytest.warns(RuntimeWarning, match="'mlflow' failed") as record:
        fan.start(writer.meta)
        for s in range(4):
            b = _batch(s)
            writer.write_metrics(MetricsRecord(step=s, metrics=dict(b.metrics)))
            writer.write_tensor_stats(list(b.tensor_rows))
            writer.write_events(list(b.events))
            fan.log(b)
        fan.finish()
    assert len([w for w in record if "'mlflow' failed" in str(w.message)]) == 1
    writer.close()
    assert missed_steps(run_dir, "mlflow") == [0, 1, 2, 3]
    assert len(step_batches(run_dir)) == 4

    n = sync_run(run_dir, MLflowTracker(client=client, run_id=real_run, heatmap=False))
    assert n == 4
    assert missed_steps(run_dir, "mlflow") == []
    hist = client.get_metric_history(real_run, "loss")
    assert sorted((m.step, m.value) for m in hist) == [(s, pytest.approx(5.0 - s / 10)) for s in range(4)]
    assert client.get_run(real_run).data.tags["fp8.worst_event.step"] == "2"
    table = load_table(client, real_run, f"{naming.TABLE_TENSOR_STATS}.json")
    assert len(table) == 4 * len(LAYERS)



@pytest.mark.slow
def test_retrying_client_outlasts_a_write_lock_held_past_mlflows_busy_timeout(tmp_path):
    """What several sweep workers do to one store: another connection holds SQLite's write lock
    for 21 s, past the 20 s MLflow waits (``PRAGMA busy_timeout``) before raising "database is
    locked"; the RetryingClient retries and the write lands once the lock is gone."""
    import sqlite3
    import threading
    import time

    from fp8track.trackers.mlflow import RetryingClient
    from fp8track.trackers.retry import Backoff

    db = tmp_path / "m.db"
    client = RetryingClient(MlflowClient(f"sqlite:///{db}"), retry=Backoff(for_s=60, initial_s=0.05, max_s=2))
    run_id = client.create_run(client.create_experiment("locked")).info.run_id
    locked = threading.Event()

    def hold(seconds):
        holder = sqlite3.connect(db, timeout=10, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        locked.set()
        time.sleep(seconds)
        holder.execute("COMMIT")
        holder.close()

    t = threading.Thread(target=hold, args=(21.0,))
    t.start()
    locked.wait(10)
    started = time.monotonic()
    client.set_tag(run_id, "attempt", "retried")
    waited = time.monotonic() - started
    t.join()
    assert client.retries >= 1 and waited >= 20.0  # MLflow gave up once; the retry waited the lock out
    assert MlflowClient(f"sqlite:///{db}").get_run(run_id).data.tags["attempt"] == "retried"


def _drift(step: int, severity: float) -> EventRecord:
    data = {"layer": "blocks.0.proj", "tensor": "activation", "direction": "overflow_risk"}
    return EventRecord("drift", step, {**data, "severity": severity})


@pytest.mark.parametrize(
    "recipe, events, worst",
    [
        # delayed scaling's amax-history fill (the first 64 steps here): its drift is the recipe
        # settling; the later, milder drift is the run's problem
        ({"name": "delayed", "amax_history_len": 64}, [_drift(20, 28.5), _drift(210, 4.0)], (210, "false")),
        # the same events under current scaling, which needs no warm-up: the worse one wins
        ({"name": "current"}, [_drift(20, 28.5), _drift(210, 4.0)], (20, "false")),
        # TE's default history (1024) when the recipe does not say; only warm-up events: tagged so
        ({"name": "delayed"}, [_drift(20, 28.5), _drift(210, 4.0)], (20, "true")),
        # a spike inside the window is no scale warm-up: severity decides
        ({"name": "delayed", "amax_history_len": 64},
         [EventRecord("spike", 30, {"severity": 40.0, "status": "open"}), _drift(210, 4.0)], (30, "false")),
    ],
    ids=["delayed-h64", "current", "delayed-default-1024", "spike-in-window"],
)
def test_worst_event_skips_the_recipes_scale_warmup(store, tmp_path, recipe, events, worst):
    uri, client, exp = store
    run_id = client.create_run(exp).info.run_id
    fan = TrackerFanout([MLflowTracker(client=client, run_id=run_id, heatmap=False)], tmp_path / "run")
    fan.start(RunMeta(recipe=recipe))
    for ev in events:
        fan.log(StepBatch(step=ev.step, metrics={"loss": 1.0}, events=[ev]))
    fan.finish()
    tags = client.get_run(run_id).data.tags
    step, in_warmup = worst
    assert (tags["fp8.worst_event.step"], tags["fp8.worst_event.in_warmup"]) == (str(step), in_warmup)
    expected = {
        20: "drift in blocks.0.proj.activation (overflow_risk) at step 20",
        210: "drift in blocks.0.proj.activation (overflow_risk) at step 210",
        30: "spike (open) at step 30",
    }[step]
    assert tags["fp8.worst_event.title"] == expected  # built when the event carries none
    assert tags["fp8.worst_event.kind"] == ("spike" if step == 30 else "drift")
