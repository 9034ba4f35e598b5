"""TrackerFanout, QueuedTracker and sync_run (``fp8track sync``), with small trackers of our own
(no W&B/MLflow needed)."""

from __future__ import annotations

import json
import threading
import time
import warnings

import pytest

from fp8track.errors import ConfigError
from fp8track.monitoring.records import EventRecord, MetricsRecord, RunMeta, RunWriter, TensorStatsRow
from fp8track.trackers import TrackerFanout
from fp8track.trackers.base import (
    EVENT_COLUMNS,
    StepBatch,
    Tracker,
    event_row,
    event_severity,
    scalar_metrics,
    tensor_stat_columns,
)
from fp8track.trackers.fanout import missed_path, read_missed
from fp8track.trackers.queued import QueuedTracker
from fp8track.trackers.replay import missed_steps, step_batches, sync_run


class Recorder(QueuedTracker):
    """Keeps what it receives; fails on the steps in ``fail_steps``."""

    def __init__(self, name="rec", fail_steps=(), **kw):
        super().__init__(**kw)
        self.name = name
        self.fail_steps = set(fail_steps)
        self.got: list[StepBatch] = []
        self.started: list[RunMeta] = []
        self.closed = 0

    def start(self, meta):
        self.started.append(meta)

    def _deliver(self, batch):
        if batch.step in self.fail_steps:
            raise ConnectionError(f"server said no at {batch.step}")
        self.got.append(batch)

    def _close(self):
        self.closed += 1


class Raising(Tracker):
    """Raises synchronously from log (a tracker without a worker)."""

    name = "raising"

    def log(self, batch):
        raise RuntimeError("boom")


def batch(step, **metrics):
    return StepBatch(step=step, metrics=metrics or {"loss": float(step)})


def test_step_batch_validates_and_freezes():
    with pytest.raises(ConfigError, match="-1"):
        StepBatch(step=-1)
    with pytest.raises(ConfigError, match="True"):
        StepBatch(step=True)
    rows = [TensorStatsRow(step=1, layer="a", tensor="weight", stats={"mse": 1.0})]
    b = StepBatch(step=1, tensor_rows=rows)
    rows.append(rows[0])
    assert len(b.tensor_rows) == 1 and isinstance(b.tensor_rows, tuple)


def test_scalar_metrics_drops_non_numbers():
    assert scalar_metrics({"a": 1, "b": True, "c": "x", "d": None, "e": 2.5}) == {"a": 1.0, "e": 2.5}


def test_event_row_and_severity():
    ev = EventRecord(kind="spike", step=7, data={"layer": "fc1", "severity": 3, "title": "t", "alert": True})
    row = event_row(ev)
    assert len(row) == len(EVENT_COLUMNS)
    assert row[:6] == [7, "spike", "fc1", "", 3.0, "t"]
    assert json.loads(row[6]) == {"alert": True, "layer": "fc1", "severity": 3, "title": "t"}
    assert event_severity(ev) == 3.0
    assert event_severity(EventRecord(kind="drift", step=1, data={"severity": "high"})) == float("-inf")


def test_tensor_stat_columns_put_fp8track_stats_first_in_fixed_order():
    rows = [
        TensorStatsRow(step=0, layer="a", tensor="weight", stats={"std": 1.0, "mse": 2.0, "amax": 3.0}),
        TensorStatsRow(step=0, layer="b", tensor="weight", stats={"l2_norm": 1.0, "amax": 3.0}),
    ]
    assert tensor_stat_columns(rows) == ["amax", "mse", "std", "l2_norm"]


def test_queued_tracker_delivers_in_order_and_finish_drains(tmp_path):
    rec = Recorder()
    fan = TrackerFanout([rec], tmp_path)
    fan.start(RunMeta(name="r"))
    for s in range(50):
        fan.log(batch(s))
    fan.finish()
    assert [b.step for b in rec.got] == list(range(50))
    assert rec.closed == 1 and rec.started[0].name == "r"
    assert not missed_path(tmp_path, "rec").exists()


def test_failing_tracker_warns_once_keeps_others_and_records_missed_steps(tmp_path):
    bad = Recorder(name="bad", fail_steps={1, 3, 4})
    good = Recorder(name="good")
    raising = Raising()
    fan = TrackerFanout([bad, raising, good], tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(6):
            fan.log(batch(s))
        fan.finish()
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len([m for m in msgs if "'bad'" in m]) == 1
    assert len([m for m in msgs if "'raising'" in m]) == 1
    assert [b.step for b in good.got] == list(range(6))
    assert missed_steps(tmp_path, "bad") == [1, 3, 4]
    assert missed_steps(tmp_path, "raising") == list(range(6))
    entry = read_missed(tmp_path, "bad")[0]
    assert entry["what"] == "log" and "server said no at 1" in entry["error"]
    assert fan.failures == {"bad": 3, "raising": 6, "good": 0}


def test_full_queue_refuses_instead_of_blocking(tmp_path):
    # Deterministic on a busy machine: events order the threads, no sleep and no timing.
    gate = threading.Event()
    picked_up = threading.Event()
    gate_timed_out: list[bool] = []

    class Stuck(Recorder):
        def _deliver(self, b):
            picked_up.set()
            # If log() blocked on the full queue, the gate would stay shut until this times out.
            gate_timed_out.append(not gate.wait(60))
            super()._deliver(b)

    t = Stuck(name="stuck", max_queue=1)
    fan = TrackerFanout([t], tmp_path)
    with pytest.warns(RuntimeWarning, match="stuck"):
        fan.log(batch(0))
        assert picked_up.wait(60)  # step 0 is in the worker, the queue is empty again
        for s in range(1, 5):
            fan.log(batch(s))  # 1 fills the queue; 2, 3, 4 are refused at once
    missed = missed_steps(tmp_path, "stuck")
    assert missed == [2, 3, 4]  # 0 is in the worker, 1 waits in the queue
    gate.set()
    fan.finish()
    assert [b.step for b in t.got] == [0, 1]
    assert gate_timed_out == [False, False]  # the training thread never waited on the worker


def test_finish_timeout_reports_inflight_and_queued_steps(tmp_path):
    gate = threading.Event()

    class Stuck(Recorder):
        def _deliver(self, b):
            gate.wait(10)

    t = Stuck(name="stuck", finish_timeout_s=0.3)
    fan = TrackerFanout([t], tmp_path)
    for s in range(3):
        fan.log(batch(s))
    with pytest.warns(RuntimeWarning, match="stuck"):
        fan.finish()  # must not raise nor hang
    gate.set()
    entries = read_missed(tmp_path, "stuck")
    assert sorted(e["step"] for e in entries if e["step"] is not None) == [0, 1, 2]
    assert any(e["what"] == "finish" and "TimeoutError" in e["error"] for e in entries)


def test_finish_gives_up_on_a_stalled_worker_and_says_so_while_it_waits(tmp_path):
    """A dead server holds the worker's request for minutes (the client's own HTTP retries): finish
    says at once that it waits, gives up after ``stall_timeout_s`` without a batch handled (not the
    whole ``finish_timeout_s``), and every step left is recorded as missed."""
    gate = threading.Event()

    class Dead(Recorder):
        FINISH_NOTICE_S = 0.2

        def _deliver(self, b):
            gate.wait(60)

    t = Dead(name="dead", finish_timeout_s=600, stall_timeout_s=1.0)
    fan = TrackerFanout([t], tmp_path)
    for s in range(3):
        fan.log(batch(s))
    start = time.monotonic()
    with pytest.warns(RuntimeWarning) as caught:
        fan.finish()
    waited = time.monotonic() - start
    gate.set()
    assert 1.0 <= waited < 10.0
    texts = [str(w.message) for w in caught]
    assert any("'dead' still has 3 batch(es) to deliver" in m for m in texts)
    assert sorted(e["step"] for e in read_missed(tmp_path, "dead") if e["step"] is not None) == [0, 1, 2]


def test_finish_waits_for_a_slow_worker_that_keeps_delivering(tmp_path):
    """Progress resets the stall clock: six batches of 0.3 s each (1.8 s in all) are delivered with
    ``stall_timeout_s=1``; nothing is missed."""

    class Slow(Recorder):
        def _deliver(self, b):
            time.sleep(0.3)
            super()._deliver(b)

    t = Slow(name="slow", stall_timeout_s=1.0)
    fan = TrackerFanout([t], tmp_path)
    for s in range(6):
        fan.log(batch(s))
    fan.finish()
    assert [b.step for b in t.got] == list(range(6))
    assert read_missed(tmp_path, "slow") == []
    with pytest.raises(ConfigError, match="stall_timeout_s"):
        Recorder(stall_timeout_s=0)


def test_duplicate_names_and_non_trackers_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="'rec'"):
        TrackerFanout([Recorder(), Recorder()], tmp_path)
    with pytest.raises(ConfigError, match="Tracker instances"):
        TrackerFanout(["wandb"], tmp_path)
    with pytest.raises(ConfigError, match="max_queue"):
        Recorder(max_queue=0)


def _write_run(run_dir, steps=5):
    w = RunWriter(run_dir, RunMeta(name="demo", recipe={"name": "delayed"}, bf16_layers=("head",)))
    for s in range(steps):
        w.write_metrics(MetricsRecord(step=s, metrics={"loss": 10.0 - s}))
        w.write_metrics(MetricsRecord(step=s, metrics={"fp8/fc1/weight/mse": s / 100}))
        w.write_tensor_stats([TensorStatsRow(step=s, layer="fc1", tensor="weight", stats={"mse": s / 100})])
    w.write_events([EventRecord(kind="spike", step=3, data={"severity": 2.0})])
    w.write_events([EventRecord(kind="finding", step=99, data={"title": "only an event"})])
    w.close()


def test_step_batches_merge_records_of_one_step(tmp_path):
    _write_run(tmp_path)
    batches = step_batches(tmp_path)
    assert sorted(batches) == [0, 1, 2, 3, 4, 99]
    assert dict(batches[2].metrics) == {"loss": 8.0, "fp8/fc1/weight/mse": 0.02}
    assert [r.stats["mse"] for r in batches[4].tensor_rows] == [0.04]
    assert [e.kind for e in batches[3].events] == ["spike"]
    assert dict(batches[99].metrics) == {} and batches[99].events[0].data["title"] == "only an event"


def test_sync_run_sends_only_missed_steps_then_clears_them(tmp_path):
    _write_run(tmp_path)
    flaky = Recorder(name="trk", fail_steps={1, 3})
    fan = TrackerFanout([flaky], tmp_path)
    with pytest.warns(RuntimeWarning):
        for b in step_batches(tmp_path).values():
            fan.log(b)
        fan.finish()
    assert missed_steps(tmp_path, "trk") == [1, 3]

    still_flaky = Recorder(name="trk", fail_steps={3})
    assert sync_run(tmp_path, still_flaky) == 1
    assert [b.step for b in still_flaky.got] == [1]
    assert still_flaky.got[0].metrics["loss"] == 9.0
    assert still_flaky.started[0].recipe == {"name": "delayed"} and list(
        still_flaky.started[0].bf16_layers
    ) == ["head"]
    assert missed_steps(tmp_path, "trk") == [3]

    fixed = Recorder(name="trk")
    assert sync_run(tmp_path, fixed) == 1
    assert [(b.step, b.metrics["fp8/fc1/weight/mse"], len(b.events)) for b in fixed.got] == [(3, 0.03, 1)]
    assert not missed_path(tmp_path, "trk").exists()
    assert sync_run(tmp_path, Recorder(name="trk")) == 0  # nothing left


def test_sync_run_all_steps(tmp_path):
    _write_run(tmp_path)
    rec = Recorder(name="fresh", max_queue=2)  # sync_run waits for a full queue instead of dropping
    assert sync_run(tmp_path, rec, only_missed=False) == 6
    assert [b.step for b in rec.got] == [0, 1, 2, 3, 4, 99]


def test_lost_tables_sync_rows_without_scalars(tmp_path):
    from fp8track.trackers.base import TablesNotWritten

    _write_run(tmp_path)

    class TablesFail(Recorder):
        def _close(self):
            for s in (0, 1):
                self._record_failure(s, TablesNotWritten(OSError("disk full")))

    fan = TrackerFanout([TablesFail(name="t")], tmp_path)
    with pytest.warns(RuntimeWarning):
        for b in step_batches(tmp_path).values():
            fan.log(b)
        fan.finish()
    assert {(e["step"], e["what"]) for e in read_missed(tmp_path, "t")} == {(0, "tables"), (1, "tables")}
    rec = Recorder(name="t")
    assert sync_run(tmp_path, rec) == 2
    assert [(b.step, dict(b.metrics), len(b.tensor_rows)) for b in rec.got] == [(0, {}, 1), (1, {}, 1)]


def test_replay_is_a_deprecated_alias_of_sync_run(tmp_path):
    import fp8track
    from fp8track.trackers import replay

    _write_run(tmp_path)
    rec = Recorder(name="fresh")
    with pytest.warns(DeprecationWarning, match="use sync_run"):
        assert replay(tmp_path, rec, only_missed=False) == 6
    assert [b.step for b in rec.got] == [0, 1, 2, 3, 4, 99]  # the same steps sync_run sends
    assert fp8track.replay is replay and fp8track.sync_run is sync_run
    assert "sync_run" in fp8track.__all__ and "replay" not in fp8track.__all__


def test_resumed_run_skips_recorded_steps_only_for_step_ordered_trackers(tmp_path):
    ordered = Recorder("ordered", background=False)
    ordered.monotonic_steps = True
    plain = Recorder("plain", background=False)
    fan = TrackerFanout([ordered, plain], tmp_path)
    fan.start(RunMeta(), recorded_before_resume=12)
    for s in range(10, 15):
        fan.log(StepBatch(step=s, metrics={"loss": float(s)}))
    fan.finish()
    assert [b.step for b in ordered.got] == [13, 14]  # W&B-like: the dead process had sent <= 12
    assert [b.step for b in plain.got] == [10, 11, 12, 13, 14]  # MLflow-like: it checks its own history
    assert read_missed(tmp_path, "ordered") == []  # skipped is not missed: sync must not resend them


def test_resumed_writer_knows_the_last_step_the_dead_process_recorded(tmp_path):
    meta = RunMeta()
    w = RunWriter.create(tmp_path, meta)
    for s in range(14):
        w.write_metrics(MetricsRecord(step=s, metrics={"loss": 1.0}))
    w.close()
    assert RunWriter.create(tmp_path, meta).recorded_before_resume is None  # not resumed
    resumed = RunWriter.create(tmp_path, meta, resume_step=10)
    assert resumed.recorded_before_resume == 13 and resumed.lines_dropped_on_resume == 4
    resumed.close()
    again = RunWriter.create(tmp_path, meta, resume_step=10)  # nothing after the checkpoint any more
    assert again.recorded_before_resume is None
