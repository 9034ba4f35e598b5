"""Guarantee 2: a Lightning training process SIGKILLed mid-run and resumed from its last
checkpoint records every logging step exactly once, locally and in MLflow, and its detectors
continue as if nothing had happened (compared with the same run never interrupted). A
half-written last JSONL line left by the kill is tolerated and reported. W&B's step axis only
increases across the kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fp8track.monitoring.records import METRICS_FILE, RunReader

SCRIPT = Path(__file__).parent / "scripts" / "resume_train.py"
pytestmark = pytest.mark.slow


def _train(out: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=out,
    )


def _run_dir(out: Path) -> Path:
    (meta,) = list((out / "fp8").rglob("meta.json"))
    return meta.parent


def test_sigkill_and_resume_logs_every_step_once_and_detectors_continue(tmp_path):
    """Long (about 30 s): three Lightning training processes (uninterrupted, killed, resumed)."""
    mlflow = pytest.importorskip("mlflow")
    ref, out = tmp_path / "uninterrupted", tmp_path / "killed"
    ref.mkdir()
    out.mkdir()
    done = _train(ref, "full")
    assert done.returncode == 0, done.stderr[-3000:]

    killed = _train(out, "kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = _run_dir(out)
    # The kill left a half-written line (a crash in the middle of a write): read, skipped, reported.
    with open(run_dir / METRICS_FILE, "ab") as f:
        f.write(b'{"step":13,"metrics":{"lo')
    reader = RunReader(run_dir)
    with pytest.warns(RuntimeWarning, match="torn_last_line"):
        before = Counter(r.step for r in reader.metrics())
    assert [p.kind for p in reader.problems] == ["torn_last_line"]
    assert max(before) == 12 and set(before.values()) == {1}

    resumed = _train(out, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _run_dir(out) == run_dir  # the resumed run appends to the same run directory

    got, want = RunReader(run_dir), RunReader(_run_dir(ref))
    loss, ref_loss = got.series("fp8/loss"), want.series("fp8/loss")
    steps = Counter(r.step for r in got.metrics() if "fp8/loss" in r.metrics)
    assert sorted(steps) == list(range(20)) and set(steps.values()) == {1}  # every step once
    assert loss == pytest.approx(ref_loss, rel=1e-5)  # the same values as without the kill
    rows = Counter((r.step, r.layer, r.tensor) for r in got.tensor_stats())
    assert rows == Counter((r.step, r.layer, r.tensor) for r in want.tensor_stats())
    assert set(rows.values()) == {1} and not got.problems  # the torn line is gone
    events = [(e.kind, e.step, e.data.get("status")) for e in got.events()]
    assert events == [(e.kind, e.step, e.data.get("status")) for e in want.events()]
    # The detectors' state at the end equals the uninterrupted run's: the spike window holds the
    # 20 losses (none twice, none missing), drift and divergence state and counters agree.
    state = json.loads((out / "final_state.json").read_text())
    ref_state = json.loads((ref / "final_state.json").read_text())
    assert state["global_step"] == ref_state["global_step"] == 20
    spikes = state["analyzers"][0]["spikes"]
    assert spikes["last_step"] == 19 and len(spikes["loss_window"]) == 20
    assert _approx_equal(state["analyzers"], ref_state["analyzers"])

    # MLflow holds each optimizer step's loss once (each flush sends the buffered steps' losses
    # under their own steps): the same points as the uninterrupted run's MLflow run.
    def history(root: Path, key: str) -> Counter[int]:
        client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
        return Counter(
            m.step for m in client.get_metric_history((root / "mlflow_run_id.txt").read_text(), key)
        )

    for key in ("fp8/loss", "fp8/worst/mse"):
        counts = history(out, key)
        assert counts == history(ref, key) and set(counts.values()) == {1}, (key, counts)
    assert sorted(history(out, "fp8/loss")) == list(range(20))
    assert sorted(history(out, "fp8/worst/mse")) == list(range(0, 20, 2))  # statistics: sampled steps only


def _approx_equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_approx_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_approx_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-5, nan_ok=True)
    return a == b


def test_resumed_run_keeps_the_wandb_step_axis_increasing(tmp_path):
    """Kill after step 12 with the last checkpoint at step 10, resume: the resumed W&B run starts
    after the last step the dead process recorded, so the two runs' steps, read in order, only
    increase and hold every logging step once; the run directory still holds every step once."""
    pytest.importorskip("wandb")
    import torch

    from fp8track import Monitor, MonitorConfig
    from fp8track.trackers.wandb import WandbTracker

    from helpers.wandb_records import history, inspect

    def train(mon, model, steps):
        for step in steps:
            torch.manual_seed(step)
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            mon.step(loss=loss)
            model.zero_grad()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    cfg = MonitorConfig(every_n_steps=2)
    dead = WandbTracker.create(mode="offline", dir=str(tmp_path / "a"), project="resume")
    mon = Monitor(model, cfg, log_dir=tmp_path / "runs", trackers=[dead]).attach()
    train(mon, model, range(10))
    checkpoint = mon.state_dict()
    train(mon, model, range(10, 13))
    dead.flush(60)  # the tracker had sent everything so far, then the process died (no close)
    dead.run.finish()

    resumed = WandbTracker.create(mode="offline", dir=str(tmp_path / "b"), project="resume")
    mon2 = Monitor(model, cfg, log_dir=tmp_path / "runs", trackers=[resumed])
    mon2.load_state_dict(checkpoint)
    mon2.attach()
    train(mon2, model, range(10, 20))
    mon2.close()

    (a,) = (tmp_path / "a" / "wandb").glob("offline-run-*")
    (b,) = (tmp_path / "b" / "wandb").glob("offline-run-*")
    steps_a = [h["trainer/global_step"] for h in history(inspect(a)) if "fp8/loss" in h]
    steps_b = [h["trainer/global_step"] for h in history(inspect(b)) if "fp8/loss" in h]
    assert steps_a == list(range(13))  # every step's loss, sent at the flushes of steps 0..12
    assert steps_b == list(range(13, 20))  # steps the dead process had sent are not sent again
    both = steps_a + steps_b
    assert both == sorted(set(both))  # strictly increasing across the kill
    reader = RunReader(mon2.run_dir)
    assert sorted(reader.series("fp8/loss")) == list(range(20))  # the local record keeps every step once

