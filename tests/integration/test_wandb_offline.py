"""WandbTracker against real offline W&B runs, read back with ``wandb leet inspect --json``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")

from fp8track.cli import main as fp8track_main  # noqa: E402
from fp8track.monitoring import naming  # noqa: E402
from fp8track.monitoring.records import EventRecord, MetricsRecord, RunMeta, RunWriter, TensorStatsRow  # noqa: E402
from fp8track.trackers import TrackerFanout, make_trackers  # noqa: E402
from fp8track.trackers.base import StepBatch  # noqa: E402
from fp8track.trackers.replay import missed_steps  # noqa: E402
from fp8track.trackers.wandb import WandbTracker  # noqa: E402

from helpers.wandb_records import history, inspect, table_rows  # noqa: E402

pytestmark = pytest.mark.slow

STEP = "trainer/global_step"


def _batch(step: int) -> StepBatch:
    rows = [
        TensorStatsRow(
            step=step, layer=layer, tensor="gradient", stats={"underflow_pct": i + step, "mse": 0.5 * step}
        )
        for i, layer in enumerate(("fc1", "fc2"))
    ]
    events = []
    if step in (10, 20):  # same title twice within the throttle window -> one alert
        events.append(
            EventRecord(
                kind="spike",
                step=step,
                data={
                    "alert": True,
                    "title": "FP8-only spike",
                    "text": f"at {step}",
                    "level": "WARN",
                    "severity": 2.0,
                },
            )
        )
    if step == 30:
        events.append(
            EventRecord(
                kind="divergence",
                step=step,
                data={"alert": True, "title": "Divergence", "text": "loss gap", "level": "ERROR"},
            )
        )
        events.append(
            EventRecord(kind="drift", step=step, data={"layer": "fc2", "tensor": "gradient", "severity": 1.0})
        )
    metrics = {naming.metric_name(r.layer, r.tensor, "underflow_pct"): r.stats["underflow_pct"] for r in rows}
    metrics["loss"] = 4.0 - step / 100
    return StepBatch(step=step, metrics=metrics, tensor_rows=rows, events=events)


def test_offline_run_history_summaries_tables_alerts_config(tmp_path):
    tracker = WandbTracker.create(
        project="fp8track-test", dir=str(tmp_path), mode="offline", alert_wait_s=3600
    )
    fan = TrackerFanout([tracker], tmp_path / "run")
    fan.start(
        RunMeta(recipe={"name": "delayed", "margin": 0}, bf16_layers=("head",), fp8_layers=("fc1", "fc2"))
    )
    for s in (0, 10, 20, 30):
        fan.log(_batch(s))
    fan.finish()
    assert fan.failures == {"wandb": 0}
    assert "WANDB_MODE" not in os.environ

    run_dir = Path(tracker.run.dir).parent
    recs = inspect(run_dir)
    hist = history(recs)
    assert [h[STEP] for h in hist] == [0, 10, 20, 30]
    assert [h["fp8/fc2/gradient/underflow_pct"] for h in hist] == [1, 11, 21, 31]
    assert [h["loss"] for h in hist] == pytest.approx([4.0, 3.9, 3.8, 3.7])
    assert all(h[f"{naming.TABLE_TENSOR_STATS}.log_mode"] == "INCREMENTAL" for h in hist)

    metric_defs = [r["metric"] for r in recs if r["type"] == "metric"]
    fp8_def = next(m for m in metric_defs if m.get("glob_name") == "fp8/*")
    assert fp8_def["step_metric"] == STEP and fp8_def["summary"] == {"max": True, "min": True}
    summary = {}
    for r in recs:
        if r["type"] == "summary":
            summary.update(r["summary"]["update"])
    assert summary["fp8/fc1/gradient/underflow_pct"] == {"max": 30, "min": 0}

    config = next(
        r["config"]["update"]["fp8track"]
        for r in recs
        if r["type"] == "config" and "fp8track" in r["config"]["update"]
    )
    assert config["recipe"] == {"name": "delayed", "margin": 0} and config["bf16_layers"] == ["head"]

    alerts = [r["alert"] for r in recs if r["type"] == "alert"]
    assert [(a["title"], a["level"]) for a in alerts] == [("FP8-only spike", "WARN"), ("Divergence", "ERROR")]
    assert alerts[0]["text"] == "at 10"

    stats = table_rows(run_dir, naming.TABLE_TENSOR_STATS)
    assert len(stats) == 8  # every row exactly once across the increments
    assert sorted((r[0], r[1]) for r in stats) == sorted(
        (s, lay) for s in (0, 10, 20, 30) for lay in ("fc1", "fc2")
    )
    assert [r for r in stats if r[0] == 20 and r[1] == "fc1"][0][4:6] == [20.0, 10.0]
    spikes = table_rows(run_dir, naming.TABLE_SPIKE_EVENTS)
    assert sorted((r[0], r[1]) for r in spikes) == [(10, "spike"), (20, "spike"), (30, "divergence")]
    drift = table_rows(run_dir, naming.TABLE_DRIFT_EVENTS)
    assert [(r[0], r[2], r[3]) for r in drift] == [(30, "fc2", "gradient")]


def test_lightning_wandb_logger_and_sync_of_missed_steps(tmp_path):
    """Tracker found from a real WandbLogger; it breaks mid-run (run finished under it); the
    missed steps go to a fresh offline run with ``fp8track sync``."""
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(project="fp8track-test", save_dir=str(tmp_path), mode="offline")
    (tracker,) = make_trackers("auto", [logger])
    assert isinstance(tracker, WandbTracker) and tracker.run is logger.experiment

    run_dir = tmp_path / "fp8run"
    writer = RunWriter(run_dir, RunMeta(name="demo"))
    fan = TrackerFanout([tracker], run_dir)
    fan.start(writer.meta)
    with pytest.warns(RuntimeWarning, match="'wandb' failed"):
        for s in range(6):
            b = _batch(s)
            writer.write_metrics(MetricsRecord(step=s, metrics=dict(b.metrics)))
            writer.write_tensor_stats(list(b.tensor_rows))
            fan.log(b)
            if s == 2:
                tracker.flush()
                logger.experiment.finish()  # the run dies under the tracker
        fan.finish()
    writer.close()
    assert missed_steps(run_dir, "wandb") == [3, 4, 5]
    first = history(inspect(Path(logger.experiment.dir).parent))
    assert [h[STEP] for h in first] == [0, 1, 2]

    sync_dir = tmp_path / "synced"
    assert fp8track_main(["sync", str(run_dir), "--wandb-dir", str(sync_dir)]) == 0
    (new_run,) = (sync_dir / "wandb").glob("offline-run-*")
    replayed = history(inspect(new_run))
    assert [h[STEP] for h in replayed] == [0, 1, 2, 3, 4, 5]  # a new run gets every step
    assert [h["fp8/fc1/gradient/underflow_pct"] for h in replayed] == [0, 1, 2, 3, 4, 5]
    assert missed_steps(run_dir, "wandb") == []

